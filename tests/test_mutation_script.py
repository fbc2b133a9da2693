"""scripts/mutation.py (the nightly mutation run) without running mutmut: its test selections
exist (a renamed test file would break the nightly run silently), its equivalent-mutant list
names modules it mutates, and its score is killed / (mutants - listed equivalents)."""

import json
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def load():
    return load_script("scripts/mutation.py")


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
        for e in entries:
            assert e["function"].startswith("x") and "__mutmut_" not in e["function"]
            assert e["change"].startswith("-") and " | +" in e["change"]
            assert len(e["reason"]) > 20


SOURCE = """
def x_f__mutmut_orig(a, b):
    c = a + b
    return c

def x_f__mutmut_1(a, b):
    c = a - b
    return c

def x_f__mutmut_2(
    a, b
):
    c = a + b
    return None
"""


def test_a_mutants_change_is_read_from_the_trampolined_source():
    m = load()
    assert m.mutant_change(SOURCE, "pkg.mod.x_f__mutmut_1") == "-c = a + b | +c = a - b"
    assert m.mutant_change(SOURCE, "pkg.mod.x_f__mutmut_2") == "-return c | +return None"


def test_score_is_killed_over_non_equivalent():
    m = load()
    status = {
        "pkg.mod.x_f__mutmut_1": "survived",
        "pkg.mod.x_f__mutmut_2": "survived",
        "pkg.mod.x_f__mutmut_3": "killed",
        "pkg.mod.x_f__mutmut_4": "timeout",
    }
    same = [{"function": "x_f", "change": "-return c | +return None", "reason": "r" * 30}]
    row = m.summarise(m.MODULES["bounds"], status, SOURCE, same)
    assert (row["killed"], row["survived"], row["equivalent"]) == (2, 1, 1)
    assert row["score"] == round(2 / 3, 4)
    assert row["survivors"] == [
        {"function": "x_f", "change": "-c = a + b | +c = a - b", "mutant": "x_f__mutmut_1"}
    ]


def test_a_mutated_default_is_a_change_and_layout_is_not():
    m = load()
    source = (
        'def x_g__mutmut_orig(a, kind="u"):\n    return a\n\n'
        'def x_g__mutmut_1(a, kind="XXuXX"):\n    return a\n\n'
        'def x_g__mutmut_2(\n    a,\n    kind="u",\n):\n    return a\n'
    )
    assert m.mutant_change(source, "pkg.x_g__mutmut_1") == (
        '-def f(a, kind="u"): | +def f(a, kind="XXuXX"):'
    )
    assert m.mutant_change(source, "pkg.x_g__mutmut_2") == ""
