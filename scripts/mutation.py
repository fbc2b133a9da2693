"""Mutation testing (issue 18), nightly and never in CI: mutmut's mutants of the core, the
solvers' common finish path and the runtime, each module against a targeted fast test
selection; writes a JSON summary of killed / survived / score per module.

    .venv/bin/python scripts/mutation.py --out mutation/                      # every module
    .venv/bin/python scripts/mutation.py --modules validate bounds --out mutation/
    .venv/bin/python scripts/mutation.py --modules executor --sample 40 --out mutation/
    .venv/bin/python scripts/mutation.py --modules cost --recheck tests/test_cost.py --out mutation/
    .venv/bin/python scripts/mutation.py --modules tasks executor --at HEAD --out mutation/

Each module is mutated in its own staged copy of the tree (dcp_opt/ with runtime/ and solvers/
nested, as the installed package sees them, plus tests/), so the working tree is never
touched. In-process modules run under `mutmut run` (one fork per mutant, only the tests that
reach the mutated function). The runtime's executor and tasks are checked in two stages: a
fast in-process stage (`mutmut run` on their `fast_tests`, whose ranks are threads of torch's
threaded process group, tests/local_world.py), then only that stage's survivors go to the
slow selection, gloo worker processes that mutmut's coverage cannot see: one pytest per
survivor with MUTANT_UNDER_TEST set, which the workers inherit. `--sample N` runs the slow
selection alone on a seeded sample of N mutants (the earlier method); `--fast-only` stops
after the fast stage. `--at REV` stages a committed revision (git archive) instead of the
working tree, so a run measures a commit while others edit the tree.

Score = killed / (mutants - equivalent); scripts/mutation_equivalent.json names the mutants
shown equivalent or harmless, each with its reason (listed in docs/guarantees.md). A timeout
counts as killed (the mutant made the tests hang, which they caught).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "scripts" / "mutation_equivalent.json"
# Where the installed package maps each staged folder from (pyproject's package-dir).
NESTED = {"dcp_opt/runtime": "runtime", "dcp_opt/solvers": "solvers"}


@dataclass(frozen=True)
class Module:
    path: str  # as the package sees it: dcp_opt/...
    tests: tuple[str, ...]  # pytest arguments: the targeted selection, fastest killers first
    in_process: bool = True
    # runtime modules: the in-process selection mutmut runs first (every mutant)
    fast_tests: tuple[str, ...] = ()


COST_TESTS = (
    "tests/test_cost_hand.py",
    "tests/test_cost_hand_checks.py",
    "tests/test_cost.py",
    "tests/test_core.py",
    "tests/test_bounds.py",
    "tests/test_validate.py",
    "tests/test_simulate.py",
    "tests/test_profile_io.py",
    "tests/test_cp_cost.py",
    "tests/test_topology.py",
)

MODULES = {
    "validate": Module(
        "dcp_opt/validate.py",
        (
            "tests/test_validate.py",
            "tests/test_core.py",
            "tests/test_cp_plan.py",
            "tests/test_topology.py",
        ),
    ),
    "bounds": Module("dcp_opt/bounds.py", ("tests/test_bounds.py", "tests/test_core.py")),
    "simulate": Module(
        "dcp_opt/simulate.py",
        (
            "tests/test_simulate.py",
            "tests/test_core.py",
            "tests/test_bounds.py",
            "tests/test_cp_plan.py",
            "tests/test_topology.py",
        ),
    ),
    # the cost model by concern (issue 24): one entry a file, the same selection for each
    **{
        name: Module(f"dcp_opt/cost/{part}.py", COST_TESTS)
        for name, part in (
            ("cost", "compute"),
            ("cost_memory", "memory"),
            ("cost_comm", "comm"),
            ("cost_features", "features"),
            ("cost_phase", "phase"),
            ("cost_model", "model"),
        )
    },
    "tree_bound": Module(
        "dcp_opt/solvers/bounds/tree.py", ("tests/test_tree_bound.py", "tests/test_bounds_rank.py")
    ),
    "common": Module(
        "dcp_opt/solvers/common.py",
        ("tests/test_common.py", "tests/test_greedy.py", "tests/test_baselines.py"),
    ),
    "tasks": Module(
        "dcp_opt/runtime/tasks.py",
        (
            "tests/test_runtime_equiv.py",
            "tests/test_runtime_volume.py",
            "-k",
            "(planner_plans and world2) or volume or reference_loss",
        ),
        in_process=False,
        fast_tests=(
            "tests/test_executor_local.py",
            "tests/test_runtime_equiv.py::test_task_reference_loss_is_the_definition",
        ),
    ),
    "executor": Module(
        "dcp_opt/runtime/executor.py",
        (
            "tests/test_runtime_equiv.py",
            "-k",
            "((planner_plans or buckets or report or sum_gradients) and world2) or bucket_bytes "
            "or faults",
            "tests/test_runtime_faults.py",
        ),
        in_process=False,
        fast_tests=("tests/test_executor_local.py",),
    ),
}
# mutmut's exit codes (mutmut/stats.py status_by_exit_code); SIGXCPU (its CPU-time limit)
# is a timeout too
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 36: "timeout"}
STATUS.update(dict.fromkeys((-24, 24, 152, 255), "timeout"))


def source_of(path: str) -> Path:
    """Where a staged path (dcp_opt/runtime/tasks.py) lives in the repository."""
    for inside, outside in NESTED.items():
        if path.startswith(inside + "/"):
            return ROOT / outside / path.removeprefix(inside + "/")
    return ROOT / path


def stage(where: Path, rev: str | None = None) -> None:
    """A copy of the package as installed (runtime/ and solvers/ inside dcp_opt/) and tests,
    from the working tree or, with `rev`, from that commit (git archive)."""
    if where.exists():
        shutil.rmtree(where)
    root = ROOT
    if rev is not None:
        root = where.parent / f".{where.name}-{rev}"
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", rev, "dcp_opt", "runtime", "solvers", "tests", "benchmarks/results"],
            cwd=ROOT, capture_output=True, check=True,
        )  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "dcp_opt", where / "dcp_opt", ignore=ignore)
    for inside, outside in NESTED.items():
        shutil.copytree(root / outside, where / inside, ignore=ignore)
    shutil.copytree(root / "tests", where / "tests", ignore=ignore)
    # tests read stored results (e.g. test_profile_io loads fidelity.profile.json), from the
    # staged tree and from mutmut's copy of it
    for base in (where, where / "mutants"):
        shutil.copytree(root / "benchmarks" / "results", base / "benchmarks" / "results")
    if rev is not None:
        shutil.rmtree(root)


def mutmut_config(mod: Module) -> str:
    tests = ", ".join(json.dumps(t) for t in mod.tests)
    return (
        "[tool.mutmut]\n"
        'source_paths = ["dcp_opt"]\n'
        f"only_mutate = [{json.dumps(mod.path)}]\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
        "use_git_change_detection = false\n\n"
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
    )


def run_mutmut(where: Path, mod: Module, jobs: int) -> dict[str, str]:
    """mutant name -> status, from mutmut's own results file."""
    (where / "pyproject.toml").write_text(mutmut_config(mod))
    cmd = [str(Path(sys.executable).parent / "mutmut"), "run", "--max-children", str(jobs)]
    # one torch thread: forked children never inherit a busy OpenMP pool, and the machine's
    # cores go to parallel mutants instead
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = subprocess.run(cmd, cwd=where, capture_output=True, text=True, check=False, env=env)
    (where / "mutmut.log").write_text(log.stdout[-20000:] + log.stderr[-20000:])
    meta = where / "mutants" / (mod.path + ".meta")
    if not meta.exists():
        raise RuntimeError(f"mutmut produced no results for {mod.path}; see {where}/mutmut.log")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    if log.returncode != 0 or all(c is None for c in codes.values()):
        tail = (log.stdout + log.stderr)[-1500:]
        raise RuntimeError(f"mutmut run failed on {mod.path} (rc {log.returncode}):\n{tail}")
    return {name: STATUS.get(code, f"exit {code}") for name, code in codes.items()}


def recheck(where: Path, mod: Module, jobs: int) -> dict[str, str]:
    """An earlier mutmut run's survivors against the tests as they are now (a test written to
    kill them): the current tests/ replace the staged copy, one pytest per survivor with
    MUTANT_UNDER_TEST set, in mutmut's own mutated tree. Updates mutmut's results file."""
    meta_path = where / "mutants" / (mod.path + ".meta")
    meta = json.loads(meta_path.read_text())
    codes = meta["exit_code_by_key"]
    tree = where / "mutants"
    shutil.rmtree(tree / "tests")
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    if _pytest(tree, mod, "") != 0:  # the staged code is older than today's tests
        raise RuntimeError(f"{mod.path}: the recheck tests fail without any mutant; rerun it")
    survivors = [n for n, c in codes.items() if c in (0, 33)]  # survived, or reached by none
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        again = list(pool.map(lambda n: _pytest(tree, mod, n), survivors))
    for name, code in zip(survivors, again, strict=True):
        codes[name] = 1 if code not in (0, 5) else code
    meta_path.write_text(json.dumps(meta))
    return {name: STATUS.get(code, f"exit {code}") for name, code in codes.items()}


def run_subprocess(where: Path, mod: Module, jobs: int, sample: int | None) -> dict[str, str]:
    """Runtime modules: mutmut's trampolined module, one pytest per mutant (see docstring)."""
    os.chdir(where)  # mutmut reads its configuration from the current folder
    (where / "pyproject.toml").write_text(mutmut_config(mod))
    from mutmut.mutation.file_mutation import mutate_file_contents

    src = where / mod.path
    mutated = mutate_file_contents(mod.path, src.read_text())
    src.write_text(mutated.code)
    module = mod.path.removesuffix(".py").replace("/", ".")
    names = [f"{module}.{n}" for n in mutated.mutant_names]
    if sample is not None and sample < len(names):
        names = sorted(random.Random(0).sample(names, sample))
    if _pytest(where, mod, "") != 0:
        raise RuntimeError(f"{mod.path}: the selected tests fail without any mutant")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        codes = list(pool.map(lambda n: _pytest(where, mod, n), names))
    return {n: STATUS.get(c, "killed") for n, c in zip(names, codes, strict=True)}


def run_two_stage(
    where: Path, mod: Module, jobs: int, fast_only: bool, equivalent: list
) -> tuple[dict, dict]:
    """Runtime modules, every mutant: mutmut in-process on `fast_tests`, then one pytest each
    on the slow selection, in mutmut's own mutated tree, for what that stage left: survivors,
    mutants no fast test reached and abnormal exits (a crash is rerun, not counted), except
    survivors scripts/mutation_equivalent.json already lists. Returns (status by mutant,
    per-stage counts and wall times); the status is also written to `where`/status.json
    (what --recheck reruns)."""
    started = time.perf_counter()
    status = run_mutmut(where, replace(mod, tests=mod.fast_tests), jobs)
    fast_s = time.perf_counter() - started
    source = (where / "mutants" / mod.path).read_text()
    listed = {(e["function"], e["change"]) for e in equivalent}
    left = [
        n
        for n, s in status.items()
        if s not in ("killed", "timeout")
        and not (s == "survived" and (_function(n), mutant_change(source, n)) in listed)
    ]
    stages = {
        "fast": {
            "tests": list(mod.fast_tests),
            "mutants": len(status),
            "killed": sum(s in ("killed", "timeout") for s in status.values()),
            "wall_s": round(fast_s, 1),
        }
    }
    if not fast_only and left:
        status.update(_rerun(where / "mutants", mod, jobs, left))
        stages["slow"] = {
            "tests": list(mod.tests),
            "mutants": len(left),
            "killed": sum(status[n] in ("killed", "timeout") for n in left),
            "wall_s": round(time.perf_counter() - started - fast_s, 1),
        }
    (where / "status.json").write_text(json.dumps(status, indent=0) + "\n")
    return status, stages


def _rerun(tree: Path, mod: Module, jobs: int, names: list[str]) -> dict[str, str]:
    """One pytest of `mod.tests` per mutant (MUTANT_UNDER_TEST) in a trampolined tree."""
    if _pytest(tree, mod, "") != 0:
        raise RuntimeError(f"{mod.path}: {list(mod.tests)} fail without any mutant")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        codes = list(pool.map(lambda n: _pytest(tree, mod, n), names))
    return {n: STATUS.get(c, "killed") for n, c in zip(names, codes, strict=True)}


def recheck_runtime(where: Path, mod: Module, jobs: int, equivalent: list) -> dict[str, str]:
    """A two-stage run's survivors (its status.json), except those listed equivalent, rerun
    against today's tests (`mod.tests`: e.g. a test written to kill them) in its mutated
    tree; updates status.json."""
    path = where / "status.json"
    status = json.loads(path.read_text())
    tree = where / "mutants"
    shutil.rmtree(tree / "tests")
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    source = (tree / mod.path).read_text()
    listed = {(e["function"], e["change"]) for e in equivalent}
    left = [
        n
        for n, s in status.items()
        if s == "survived" and (_function(n), mutant_change(source, n)) not in listed
    ]
    if left:
        again = _rerun(tree, mod, jobs, left)
        status.update({n: s for n, s in again.items() if s in ("killed", "timeout")})
    path.write_text(json.dumps(status, indent=0) + "\n")
    return status


def _pytest(where: Path, mod: Module, mutant: str, timeout_s: float = 600.0) -> int:
    env = dict(os.environ, MUTANT_UNDER_TEST=mutant, PY_IGNORE_IMPORTMISMATCH="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mod.tests]
    try:
        proc = subprocess.run(cmd, cwd=where, env=env, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 36
    return proc.returncode


def summarise(mod: Module, status: dict[str, str], source: str, equivalent: list) -> dict:
    """Counts and score; a survivor is equivalent when scripts/mutation_equivalent.json lists
    its function and its change (the lines it alters), not its number, which shifts as soon
    as the function changes."""
    listed = {(e["function"], e["change"]) for e in equivalent}
    killed = sum(s in ("killed", "timeout") for s in status.values())
    survivors = sorted(n for n, s in status.items() if s == "survived")
    changes = {n: (_function(n), mutant_change(source, n)) for n in survivors}
    eq = [n for n in survivors if changes[n] in listed]
    other = {n: s for n, s in status.items() if s not in ("killed", "timeout", "survived")}
    counted = len(status) - len(eq)
    return {
        "module": mod.path,
        "tests": list(mod.tests),
        "mutants": len(status),
        "killed": killed,
        "equivalent": len(eq),
        "survived": len(survivors) - len(eq),
        "other": other,
        "score": round(killed / counted, 4) if counted else None,
        "survivors": [
            {"function": changes[n][0], "change": changes[n][1], "mutant": _key(n)}
            for n in survivors
            if n not in eq
        ],
    }


def _key(name: str) -> str:
    """A mutant's name without its module path: x_<function>__mutmut_<n>."""
    return name.rsplit(".", 1)[-1]


def _function(name: str) -> str:
    return _key(name).split("__mutmut_")[0]


def mutant_change(source: str, name: str) -> str:
    """The lines a mutant alters, `-old | +new` (stripped), from mutmut's trampolined module,
    which holds every mutant and the original (`<function>__mutmut_orig`) as functions. The
    signature counts (a mutated default is a change), with the function's name left out."""
    old, new = _text(source, _function(name) + "__mutmut_orig"), _text(source, _key(name))
    diff = difflib.unified_diff(old, new, lineterm="", n=0)
    lines = [
        d for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")) and d[1:].strip()
    ]
    return " | ".join(d[0] + d[1:].strip() for d in lines)


def _text(source: str, name: str) -> list[str]:
    """A function's signature, as one line with the function's name replaced by `f` (mutants
    differ by name, and a signature's line breaks are layout), then its body."""
    m = re.search(rf"^( *)def {re.escape(name)}\(", source, re.M)
    if m is None:
        return []
    indent, lines = len(m.group(1)), source[m.start() :].splitlines()
    # the body starts after the signature's last line (a def may span several lines)
    first = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":")) + 1
    sig = " ".join(line.strip() for line in lines[:first]).replace(f"def {name}(", "def f(", 1)
    sig = re.sub(r",?\s*\)", ")", re.sub(r"\(\s+", "(", sig))
    out = [sig]
    for line in lines[first:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    return out


def _short(rev: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", nargs="+", choices=sorted(MODULES), default=sorted(MODULES))
    p.add_argument("--out", default="mutation", help="folder for staged trees and summary.json")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--sample", type=int, help="runtime modules: run this many mutants, seeded")
    p.add_argument(
        "--fast-only",
        action="store_true",
        help="runtime modules: the in-process stage only (its survivors count as survived)",
    )
    p.add_argument(
        "--at", metavar="REV", help="stage this git revision instead of the working tree"
    )
    p.add_argument(
        "--recheck",
        nargs="*",
        metavar="TEST",
        help="rerun an earlier run's survivors (in --out) against today's tests: these (e.g. "
        "the file written to kill them) or the module's selection (runtime modules: the fast "
        "stage's; needs the status.json of a two-stage run)",
    )
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    all_equivalent = json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}
    summary_path = out / "summary.json"
    doc = json.loads(summary_path.read_text()) if summary_path.exists() else {"modules": {}}
    if args.recheck is None:
        doc["commit"] = _short(args.at or "HEAD")
    for name in args.modules:
        mod, where, started = MODULES[name], out / name, time.perf_counter()
        stages, two_stage = None, not mod.in_process and args.sample is None
        equivalent = all_equivalent.get(mod.path, [])
        if args.recheck is not None and mod.in_process:
            tests = tuple(args.recheck) or mod.tests
            status = recheck(where, replace(mod, tests=tests), args.jobs)
        elif args.recheck is not None and (where / "status.json").exists():
            tests = tuple(args.recheck) or mod.fast_tests
            status = recheck_runtime(where, replace(mod, tests=tests), args.jobs, equivalent)
            stages, two_stage = doc["modules"].get(name, {}).get("stages"), True
        elif mod.in_process:
            stage(where, args.at)
            status = run_mutmut(where, mod, args.jobs)
        elif two_stage:
            stage(where, args.at)
            status, stages = run_two_stage(where, mod, args.jobs, args.fast_only, equivalent)
        else:
            stage(where, args.at)
            status = run_subprocess(where, mod, args.jobs, args.sample)
        trampolined = mod.in_process or two_stage
        source = (where / ("mutants" if trampolined else "") / mod.path).read_text()
        row = summarise(mod, status, source, equivalent)
        row["wall_s"] = round(time.perf_counter() - started, 1)
        row["sampled"] = None if mod.in_process else args.sample
        if stages is not None:
            row["stages"] = stages
        if args.at is not None:
            row["commit"] = _short(args.at)
        if args.recheck is not None and not mod.in_process:
            # the mutants are the earlier run's: keep its commit and time, add the recheck's
            before = doc["modules"].get(name, {})
            row.update({k: before[k] for k in ("commit", "wall_s") if k in before})
            row["recheck"] = {
                "tests": list(args.recheck) or "both stages",
                "tests_commit": _short("HEAD"),
                "wall_s": round(time.perf_counter() - started, 1),
            }
        doc["modules"][name] = row
        summary_path.write_text(json.dumps(doc, indent=1) + "\n")
        print(
            f"{name:9} {row['killed']:5} killed {row['survived']:4} survived "
            f"{row['equivalent']:4} equivalent  score {row['score']}  ({row['wall_s']} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
