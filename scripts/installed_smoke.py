"""The first hour as a user (issue 28), for CI: run from OUTSIDE the repository by an
interpreter where dcp_opt is installed NOT editable (scripts/check_installed.sh makes one).

1. `import dcp_opt` comes from that interpreter's site-packages, not from the checkout;
2. every `dcp-opt` verb once (`plan`, `simulate`, `show`, `bench --batches 1`,
   `bench --stream --quick`, `whatif`, `profile --help`, `--version`, `python -m dcp_opt
   --help`), small enough for CI, each with a time limit;
3. README.md's Python snippets (the ```python blocks): a snippet whose names are all its own
   runs whole; one that uses names the reader supplies (a model, a dataset, a torchrun world)
   runs its imports and is compiled.

    python scripts/installed_smoke.py --repo /path/to/checkout   # prints one line per check
"""

from __future__ import annotations

import argparse
import ast
import builtins
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LENGTHS = "4096\n65536\n128\n2048\n16384\n"
COMMON = ["--lengths", "lengths.txt", "--cluster", "h200x8", "--model", "llama-1b"]
VERBS: list[tuple[str, list[str]]] = [
    ("--version", ["--version"]),
    ("plan", ["plan", *COMMON, "--out", "plan.json", "--json", "summary.json"]),
    ("simulate", ["simulate", "plan.json", *COMMON]),
    # a workload read from the package data (dcp_opt/data: the wheel must ship it)
    ("plan --workload 1d-wlbllm", ["plan", "--workload", "1d-wlbllm", "--cluster", "h200x8",
                                   "--model", "llama-1b", "--tokens-per-gpu", "8192"]),
    ("show", ["show", "plan.json", *COMMON, "--out", "plan.png"]),
    # a pipeline plan (solvers/pipeline: the wheel must ship window.py and steps.py), at a
    # fixed layer split, then simulate reading its schema 3 or 4
    ("plan --pp 2 --pp-layers", ["plan", "--workload", "1d-wlbllm", "--cluster", "h200x8",
                                 "--model", "llama-1b", "--tokens-per-gpu", "8192", "--pp", "2",
                                 "--pp-layers", "8,8", "--out", "pp.json"]),
    ("simulate pp.json", ["simulate", "pp.json", "--workload", "1d-wlbllm", "--cluster",
                          "h200x8", "--model", "llama-1b", "--tokens-per-gpu", "8192"]),
    # every planner on every standard workload, one batch each, on one node
    ("bench --batches 1", ["bench", "--batches", "1", "--cluster", "h200x8", "--no-progress",
                           "--tokens-per-gpu", "8192", "--time-limit", "0.5"]),
    ("bench --stream --quick", ["bench", "--stream", "--quick", "--cluster", "h200x8",
                                "--workloads", "2d-short,1d-short", "--epoch-batches", "1",
                                "--no-progress"]),
    ("bench --stream --quick --lengths", ["bench", "--stream", "--quick", "--lengths",
                                          "lengths.txt", "--cluster", "h200x8", "--no-progress"]),
    ("whatif", ["whatif", "--lengths", "lengths.txt", "--cluster", "h200x8", "--model",
                "llama-1b", "--batches", "1", "--sweep-batches", "1", "--gpus", "8",
                "--inter-bw-scale", "1", "--planners", "bucket,greedy", "--no-progress"]),
    ("profile --help", ["profile", "--help"]),
]  # fmt: skip
TIMEOUT_S = 300


def python_snippets(readme: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", readme, re.S | re.M)]


def free_names(code: str) -> list[str]:
    """Names a snippet reads but neither assigns, imports nor gets from builtins."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
            bound.add(getattr(node, "name", None) or node.arg)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(used - bound)


def imports_of(code: str) -> str:
    tree = ast.parse(code)
    return "\n".join(
        ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
    )


def _run(argv: list[str], cwd: Path, what: str) -> None:
    started = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - started
    if r.returncode != 0:
        sys.exit(f"FAIL {what}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    print(f"ok   {what} ({wall:.1f} s)", flush=True)


def check_install(repo: Path) -> None:
    import dcp_opt

    where = Path(dcp_opt.__file__).resolve()
    if repo in where.parents:
        sys.exit(f"FAIL import dcp_opt: {where} is the checkout, not an installed copy")
    if "site-packages" not in where.parts:
        sys.exit(f"FAIL import dcp_opt: {where} is not in site-packages")
    print(f"ok   import dcp_opt from {where.parent}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, required=True, help="the checkout (README.md)")
    p.add_argument("--only", choices=["verbs", "snippets"], default=None)
    args = p.parse_args(argv)
    repo = args.repo.resolve()
    work = Path(tempfile.mkdtemp(prefix="dcp_smoke_"))
    if repo == work or repo in work.parents:
        sys.exit("FAIL: the work folder is inside the checkout")
    (work / "lengths.txt").write_text(LENGTHS)
    exe = Path(sys.executable).parent / "dcp-opt"
    if args.only != "snippets":
        check_install(repo)
        for what, words in VERBS:
            _run([str(exe), *words], work, what)
        _run([sys.executable, "-m", "dcp_opt", "--help"], work, "python -m dcp_opt --help")
    if args.only != "verbs":
        run_snippets(repo, work)
    return 0


def run_snippets(repo: Path, work: Path) -> None:
    snippets = python_snippets((repo / "README.md").read_text())
    if not snippets:
        sys.exit("FAIL README.md: no ```python snippets found")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    for i, code in enumerate(snippets, 1):
        missing = free_names(code)
        script = work / f"readme_snippet_{i}.py"
        if missing:  # the reader's own objects: run the imports, compile the rest
            compile(code, f"README snippet {i}", "exec")
            script.write_text(imports_of(code) + "\n")
            what = f"README snippet {i}: imports (it uses the reader's {', '.join(missing)})"
        else:
            script.write_text(code)
            what = f"README snippet {i}: whole"
        r = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
        if r.returncode != 0:
            sys.exit(f"FAIL {what}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        print(f"ok   {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
