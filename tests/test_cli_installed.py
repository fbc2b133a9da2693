"""The CI step that installs dcp_opt as a user does (scripts/check_installed.sh, run by .ci/run):
its pieces, fast. The full step (wheel, fresh venv, every verb) runs in CI, not here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _smoke():
    spec = importlib.util.spec_from_file_location(
        "installed_smoke", ROOT / "scripts/installed_smoke.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ci_runs_the_installed_package_check():
    run = (ROOT / ".ci/run").read_text()
    assert "bash scripts/test.sh" in run and "bash scripts/check_installed.sh" in run
    script = (ROOT / "scripts/check_installed.sh").read_text()
    assert "pip wheel" in script and "python3 -m venv" in script and "-e " not in script
    assert 'cd "$work"' in script  # the verbs run outside the checkout


def test_every_cli_verb_is_in_the_smoke_run():
    verbs = {what.split()[0] for what, _ in _smoke().VERBS}
    assert {"plan", "simulate", "show", "bench", "whatif", "profile", "--version"} <= verbs
    whats = [what for what, _ in _smoke().VERBS]
    assert "bench --batches 1" in whats and "bench --stream --quick" in whats


def test_readme_snippets_are_found_and_the_usage_one_runs_whole():
    smoke = _smoke()
    snippets = smoke.python_snippets((ROOT / "README.md").read_text())
    assert len(snippets) >= 2
    assert "run_planner" in snippets[0] and smoke.free_names(snippets[0]) == []
    # the training loop uses the reader's own objects (a dataset, an optimizer): its imports
    # run, the rest compiles
    assert smoke.free_names(snippets[1])


def test_free_names():
    free = _smoke().free_names("import os\nx = 1\ndef f(a):\n    return a + x + y\nprint(os, z)\n")
    assert free == ["y", "z"]


def test_readme_snippets_run_from_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _smoke().run_snippets(ROOT, tmp_path)  # exits (SystemExit) on a failing snippet
    assert (tmp_path / "plan.json").exists()  # the usage snippet writes it
