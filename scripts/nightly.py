"""The nightly property run (issue 7): every property of tests/test_properties.py and
tests/test_fuzz.py (and the step former's, tests/test_step_former.py, and the perturbed cost
models' of tests/test_robust.py) under
HYPOTHESIS_PROFILE=nightly (10,000 examples each), one pytest process
per property so a failure names its property and the runs share the cores.

    .venv/bin/python scripts/nightly.py --jobs 2 --out nightly/          # about 4-5 CPU-hours
    .venv/bin/python scripts/nightly.py -k "cpsat or brute" --out nightly/
    .venv/bin/python scripts/nightly.py --mutation --out nightly/    # + mutation testing
    .venv/bin/python scripts/nightly.py --mutation validate cost -k nothing_else --out nightly/

Writes one log per property and `summary.json` (rc, wall seconds, examples run: hypothesis'
own statistics for a plain @given, the counts tests/test_properties.py writes to
$DCP_EXAMPLE_COUNTS for the per-planner properties), and prints a table. Exit 1 if any failed.
With --mutation (optional, never in CI) it then runs scripts/mutation.py on the named modules
(all without names) into OUT/mutation/ and adds its per-module scores to summary.json.
Run it on a checkout nobody edits meanwhile: a process that imports a module after it changed
mixes versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# files, or single properties of a file that also holds hand-made tests
FILES = (
    "tests/test_properties.py",
    "tests/test_fuzz.py",
    "tests/test_step_former.py::test_former_keeps_bounds_and_the_bound_holds",
    "tests/test_robust.py::test_perturbed_plan_is_valid_and_at_least_the_bound",
    "tests/test_robust.py::test_never_slower_than_a_simple_rule",
    "tests/test_bounds.py::test_bound_is_never_above_the_optimum_on_mixed_clusters",
)


def collect(keyword: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p"]
    cmd += ["no:cacheprovider"]
    cmd += [*FILES, *(["-k", keyword] if keyword else [])]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if "::" in line]


def run_one(test_id: str, out: Path, profile: str) -> dict:
    name = re.sub(r"[^A-Za-z0-9_]+", "_", test_id.split("::", 1)[1]).strip("_")
    counts = out / f"{name}.counts.json"
    env = dict(os.environ, HYPOTHESIS_PROFILE=profile, DCP_EXAMPLE_COUNTS=str(counts))
    cmd = [sys.executable, "-m", "pytest", test_id, "-p", "no:cacheprovider", "-v"]
    cmd += ["--hypothesis-show-statistics"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(log)
    return {
        "test": test_id,
        "rc": proc.returncode,
        "wall_s": round(time.perf_counter() - started, 1),
        "examples": examples(log, counts),
    }


def examples(log: str, counts: Path) -> int | None:
    """Passing examples: the planner properties' own counter, else hypothesis' statistics."""
    if counts.exists():
        return sum(json.loads(counts.read_text()).values()) or None
    found = [int(n) for n in re.findall(r"(\d+) passing", log)]
    return sum(found) if found else None


def mutation(modules: list[str], out: Path, jobs: int) -> dict:
    """scripts/mutation.py on `modules` (every module if empty): its summary, and its rc."""
    cmd = [sys.executable, "scripts/mutation.py", "--out", str(out), "--jobs", str(jobs)]
    cmd += ["--modules", *modules] if modules else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    print(proc.stdout, end="")
    summary = out / "summary.json"
    doc = json.loads(summary.read_text()) if summary.exists() else {}
    return {"rc": proc.returncode, "stderr": proc.stderr[-2000:], **doc}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel pytests")
    p.add_argument("--out", default="nightly", help="folder for logs and summary.json")
    p.add_argument("-k", dest="keyword", help="pytest -k expression to run a subset")
    p.add_argument("--profile", default="nightly", help="hypothesis profile (ci: a smoke run)")
    p.add_argument(
        "--mutation",
        nargs="*",
        metavar="MODULE",
        help="also run scripts/mutation.py (all: no names)",
    )
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tests = collect(args.keyword)
    if not tests and args.mutation is None:
        print("nightly: no test collected", file=sys.stderr)
        return 2
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda t: run_one(t, out, args.profile), tests))
    failed = [r for r in rows if r["rc"] != 0]
    doc = {"commit": commit, "profile": args.profile, "rows": rows, "failed": len(failed)}
    if args.mutation is not None:
        doc["mutation"] = mutation(args.mutation, out / "mutation", args.jobs)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        status = "PASS" if r["rc"] == 0 else f"FAIL rc={r['rc']}"
        print(f"{status:12} {r['wall_s']:8.1f} s {str(r['examples']):>8}  {r['test']}")
    print(
        f"{len(rows) - len(failed)}/{len(rows)} passed at {commit} ({args.profile}); logs in {out}"
    )
    broken = args.mutation is not None and doc["mutation"]["rc"] != 0
    if broken:
        print(f"mutation run failed: {doc['mutation']['stderr']}", file=sys.stderr)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
