"""scripts/nightly.py (the nightly property run) on one property at the dev profile: it must
collect, run, count examples and summarise (a -k that selects nothing exits 2)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(tmp_path, keyword):
    cmd = [sys.executable, "scripts/nightly.py", "--profile", "dev", "--jobs", "1"]
    cmd += ["--out", str(tmp_path), "-k", keyword]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_nightly_script_runs_counts_and_summarises(tmp_path):
    proc = run(tmp_path, "test_planner_is_deterministic_and_round_trips and bucket")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "summary.json").read_text())
    (row,) = doc["rows"]
    assert row["test"].endswith("test_planner_is_deterministic_and_round_trips[bucket]")
    assert row["rc"] == 0 and row["examples"] >= 10  # dev profile: 10 examples
    assert doc["failed"] == 0 and doc["profile"] == "dev"
    assert "1/1 passed" in proc.stdout


def test_nightly_script_says_when_nothing_is_selected(tmp_path):
    proc = run(tmp_path, "no_such_property")
    assert proc.returncode == 2 and "no test collected" in proc.stderr
