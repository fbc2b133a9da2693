"""What README.md promises, each with a test (issue 18): every documented exit code (0 success;
1 an invalid plan, no plan from the planner, bench --strict failures; 2 bad input: one line
naming the field), the usage snippet and the command-line block run as written (extracted
from README.md, so a README edit that breaks them breaks this test), the video example, and
plans byte-identical across processes for every planner.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import dcp_opt.solvers as solvers
import pytest

from dcp_opt import Batch, CostModel, Plan, cluster_preset, model_preset, standard_batch, validate
from dcp_opt.cli import main
from tests import stub_planners

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DCP_OPT = str(Path(sys.executable).parent / "dcp-opt")


def readme_block(heading: str, fence: str = "```") -> str:
    """The first fenced block after `heading` in README.md."""
    text = README.read_text()
    assert heading in text, f"README.md has no {heading!r}"
    after = text.split(heading, 1)[1]
    return after.split(fence, 1)[1].split("\n", 1)[1].split("```", 1)[0]


# ---- exit codes --------------------------------------------------------------------------------
def test_readme_documents_the_exit_codes_tested_here():
    text = " ".join(README.read_text().split())
    assert (
        "Exit codes: 0 success; 1 an invalid plan, no plan from the planner, or `bench "
        "--strict` failures; 2 bad input (one line `dcp-opt: error: <message>` naming the "
        "field, no traceback)."
    ) in text


@pytest.fixture
def stubs(monkeypatch):
    monkeypatch.setitem(sys.modules, "dcp_opt.solvers._test_stub", stub_planners)
    for name, fn in [("stub_whole", "plan_whole"), ("stub_none", "plan_none"),
                     ("stub_timeout", "plan_timeout"), ("stub_boom", "plan_boom")]:  # fmt: skip
        monkeypatch.setitem(solvers.PLANNERS, name, f"_test_stub:{fn}")


def _file(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


COMMON = ["--cluster", "h200x8", "--model", "llama-1b"]


@pytest.mark.parametrize("planner", ["stub_none", "stub_timeout"])
def test_no_plan_from_the_planner_exits_1(stubs, tmp_path, capsys, planner):
    lengths = _file(tmp_path, "l.txt", "4096\n1024\n")
    out = tmp_path / "plan.json"
    rc = main(["plan", "--lengths", lengths, *COMMON, "--planner", planner, "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"planner {planner!r} found no plan" in err
    assert not out.exists()  # nothing written on failure
    assert main(["plan", "--lengths", lengths, *COMMON, "--planner", "stub_whole"]) == 0


def test_an_invalid_plan_exits_1_in_simulate_and_show(stubs, tmp_path, capsys):
    lengths = _file(tmp_path, "l.txt", "4096\n1024\n")
    plan_path = tmp_path / "plan.json"
    main(
        ["plan", "--lengths", lengths, *COMMON, "--planner", "stub_whole", "--out", str(plan_path)]
    )
    assert main(["simulate", str(plan_path), "--lengths", lengths, *COMMON]) == 0
    doc = json.loads(plan_path.read_text())
    doc["phases"][0]["groups"][0]["micro_batches"][0]["recompute_layers"] = 99
    plan_path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["simulate", str(plan_path), "--lengths", lengths, *COMMON]) == 1
    assert "BAD_RECOMPUTE" in capsys.readouterr().err
    png = tmp_path / "plan.png"
    assert main(["show", str(plan_path), "--lengths", lengths, *COMMON, "--out", str(png)]) == 1
    assert "BAD_RECOMPUTE" in capsys.readouterr().err and not png.exists()


# Bad input of every kind, per subcommand: exit 2, one line `dcp-opt: error: <field>: ...`.
BAD_INPUT = {
    "unknown cluster": (["plan", "--lengths", "{l}", "--cluster", "nope"], "cluster: unknown preset 'nope'; allowed: "),
    "unknown model": (["plan", "--lengths", "{l}", "--model", "nope"], "model: unknown preset 'nope'; allowed: "),
    "unknown planner": (["plan", "--lengths", "{l}", "--planner", "nope"], "planner: 'nope' not allowed; allowed: "),
    "bad length": (["plan", "--lengths", "{bad}"], "bad.txt:2: expected integers, got 'abc'"),
    "empty batch": (["plan", "--lengths", "{empty}"], "lengths file empty.txt: no sequences"),
    "fits nowhere": (["plan", "--lengths", "{huge}", *COMMON], "sequence 0"),
    "malformed plan": (["simulate", "{badplan}", "--lengths", "{l}"], "plan: not valid JSON"),
    "missing plan": (["show", "{nothere}", "--lengths", "{l}", "--out", "{png}"], "nothere.json"),
    "unknown workload": (["plan", "--workload", "nope"], "workload: 'nope' not allowed; allowed: "),
    "bench planners": (["bench", "--planners", "nope", "--no-progress"], "planners: ['nope'] not allowed; allowed: "),
    "bench workloads": (["bench", "--workloads", "3d-x", "--no-progress"], "workload: '3d-x' not allowed; allowed: "),
    "whatif histogram": (["whatif", "--histogram", "{bad}"], "histogram bad.txt:1: expected"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_naming_the_field(tmp_path, capsys, case):
    files = {
        "l": _file(tmp_path, "l.txt", "100\n200\n"),
        "bad": _file(tmp_path, "bad.txt", "100\nabc\n"),
        "empty": _file(tmp_path, "empty.txt", ""),
        "huge": _file(tmp_path, "huge.txt", "100000000\n"),
        "badplan": _file(tmp_path, "badplan.json", "{"),
        "nothere": str(tmp_path / "nothere.json"),
        "png": str(tmp_path / "p.png"),
    }
    argv, named = BAD_INPUT[case]
    assert main([a.format(**files) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("dcp-opt: error: " + (named if "allowed" in named else "")), err
    assert named in lines[0], err


# Planner options out of range: exit 2 naming the option (dcp_opt.errors.check_planner_options,
# also what the Python API raises).


@pytest.mark.parametrize(
    "flag, value",
    [("--time-limit", "-1"), ("--time-limit", "nan"), ("--seed", "-1"), ("--workers", "0")],
)
def test_bad_planner_options_exit_2(tmp_path, capsys, flag, value):
    lengths = _file(tmp_path, "l.txt", "100\n200\n")
    rc = main(["plan", "--lengths", lengths, *COMMON, "--planner", "cpsat", flag, value])
    assert rc == 2 and flag.lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_exit_codes_through_the_installed_command(tmp_path):
    """The process's exit status, not only main()'s return: 0, 1 and 2."""
    lengths = _file(tmp_path, "l.txt", "4096\n1024\n")
    plan = tmp_path / "plan.json"

    def run(*argv):
        return subprocess.run([DCP_OPT, *argv], capture_output=True, text=True, timeout=120)

    ok = run("plan", "--lengths", lengths, *COMMON, "--planner", "greedy", "--out", str(plan))
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(plan.read_text())
    doc["phases"][0]["groups"] = doc["phases"][0]["groups"][1:]  # a rank now in no group
    plan.write_text(json.dumps(doc))
    invalid = run("simulate", str(plan), "--lengths", lengths, *COMMON)
    assert invalid.returncode == 1 and "RANK_UNCOVERED" in invalid.stderr
    bad = run("plan", "--lengths", lengths, "--cluster", "nope")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


# ---- the README's usage snippet and command-line block, as written -----------------------------
def test_readme_usage_snippet_runs(tmp_path):
    code = readme_block("## Usage", "```python")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, predicted, bound, gap = proc.stdout.split()
    assert status in ("feasible", "optimal")
    assert float(predicted) >= float(bound) > 0
    assert float(gap) == pytest.approx(float(predicted) / float(bound) - 1)
    # The plan it wrote is valid for the snippet's own inputs.
    cost = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert validate(plan, standard_batch("2d-short", seed=0), cost) == []


def readme_commands(names: tuple[str, ...]) -> list[list[str]]:
    """The README's `dcp-opt <name> ...` lines (continuations joined, comments dropped)."""
    block = readme_block("## Command line")
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if len(words) > 1 and words[0] == "dcp-opt" and words[1] in names:
            out.append(words)
    assert [w[1] for w in out] == list(names), out
    return out


def test_readme_command_line_block_runs(tmp_path):
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, [512, 4096, 1024, 300] * 4)))
    for words in readme_commands(("plan", "simulate", "show")):
        argv = ["--time-limit", "1"] if words[1] == "plan" else []
        proc = subprocess.run(
            [DCP_OPT, *words[1:], *argv], cwd=tmp_path, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, (words, proc.stderr[-2000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["planner"] == "cpsat"
    assert (tmp_path / "plan.png").stat().st_size > 0
    batch = Batch.from_lengths([512, 4096, 1024, 300] * 4)
    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"))
    assert validate(Plan.from_json((tmp_path / "plan.json").read_text()), batch, cost) == []


# ---- the video example -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.dist
def test_example_train_video_runs_under_torchrun():
    args = ["--steps", "2", "--num-videos", "8", "--batch-size", "4", "--planner", "greedy"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    proc = subprocess.run(
        [*cmd, "2", "examples/train_video.py", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2, proc.stdout
    for line in steps:
        m = re.search(r"predicted ([\d.]+)s measured ([\d.]+)s \| loss ([\d.]+)", line)
        assert m and float(m.group(3)) > 0, line


# ---- determinism across processes --------------------------------------------------------------
PLAN_ALL = """
import inspect, json, sys
from dcp_opt import CostModel, cluster_preset, model_preset, standard_batch
from dcp_opt.solvers import available_planners, get_planner
wanted = {"seed": 0, "deterministic": True, "num_workers": 1, "time_limit_s": 0.2}
for model, workload in (("llama-7b", "1d-short"), ("opensora-stdit3-xl", "2d-short")):
    cost = CostModel(model_preset(model), cluster_preset("h200x32"))
    batch = standard_batch(workload, seed=1)
    for name in available_planners():
        fn = get_planner(name)
        kw = {k: v for k, v in wanted.items() if k in inspect.signature(fn).parameters}
        sys.stdout.write(name + " " + json.dumps(fn(batch, cost, **kw).plan.to_json()) + "\\n")
"""


def test_every_planner_is_deterministic_across_processes():
    """Two fresh processes (different hash seeds: set and dict orders differ) plan the same
    batches with every planner: byte-identical plan JSON. Inside one process caches make a
    second run trivially equal; across processes nothing is shared."""
    outs = []
    for seed in ("1", "2"):
        env = os.environ | {"PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", PLAN_ALL], capture_output=True, text=True, timeout=600, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout)
    names = [line.split(" ", 1)[0] for line in outs[0].splitlines()]
    assert set(names) == set(solvers.available_planners()) and len(names) == 2 * len(set(names))
    for a, b in zip(outs[0].splitlines(), outs[1].splitlines(), strict=True):
        assert a == b, a.split(" ", 1)[0]
