"""scripts/mutation.py (the nightly mutation run) without running mutmut: its test selections
exist (a renamed test file would break the nightly run silently), its equivalent-mutant list
names modules it mutates, and its score is killed / (mutants - listed equivalents)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load():
    spec = importlib.util.spec_from_file_location("mutation", ROOT / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_module_and_test_selection_exists():
    m = load()
    assert set(m.MODULES) >= {"validate", "bounds", "simulate", "cost", "common", "tasks"}
    for mod in m.MODULES.values():
        assert m.source_of(mod.path).is_file(), mod.path
        files = [t for t in mod.tests if t.startswith("tests/")]
        assert files and all((ROOT / f.split("::")[0]).exists() for f in files), mod.tests
    config = m.mutmut_config(m.MODULES["validate"])
    assert 'only_mutate = ["dcp_opt/validate.py"]' in config


def test_equivalent_list_names_mutated_modules_with_reasons():
    m = load()
    doc = json.loads(m.EQUIVALENT.read_text())
    paths = {mod.path for mod in m.MODULES.values()}
    for path, entries in doc.items():
        if path.startswith("_"):
            continue
        assert path in paths, path
        assert all(name.startswith("x") and "__mutmut_" in name for name in entries)
        assert all(len(reason) > 20 for reason in entries.values())


def test_score_is_killed_over_non_equivalent():
    m = load()
    status = {
        "dcp_opt.bounds.x_f__mutmut_1": "killed",
        "dcp_opt.bounds.x_f__mutmut_2": "timeout",
        "dcp_opt.bounds.x_f__mutmut_3": "survived",
        "dcp_opt.bounds.x_f__mutmut_4": "survived",
    }
    row = m.summarise("bounds", m.MODULES["bounds"], status, {"x_f__mutmut_4": "same"})
    assert (row["killed"], row["survived"], row["equivalent"]) == (2, 1, 1)
    assert row["score"] == round(2 / 3, 4) and row["survivors"] == ["x_f__mutmut_3"]
