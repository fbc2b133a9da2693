"""CLI-argument fuzz cases for tests/fuzzing.py: every subcommand of `dcp-opt`, with values
drawn from pools of good and bad ones, fixture files good and bad, and junk tokens.
`--model`, `--cluster` and `--profile` also get JSON files: good ones, hand-made bad ones, and
a good one mutated at random (tests/fuzzing.py's `mutated_json`)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import tempfile
from functools import cache
from pathlib import Path

from hypothesis import strategies as st

from dcp_opt import CostModel, DcpOptError, cluster_preset, model_preset
from dcp_opt.workloads import load_batch

# ---- CLI arguments -------------------------------------------------------------------------
VALUE_POOLS: dict[str, list[str]] = {
    "--cluster": ["h200x8", "h200x24", "a100x16", "nope", "h200x7", "h200x0", "h200x-8", ""],
    "--model": ["llama-1b", "llama-7b", "opensora-stdit3-xl", "gpt-17", ""],
    "--planner": ["bucket", "greedy", "static_tuned", "nope", ""],
    "--planners": ["bucket", "bucket,greedy", "nope", "", ","],
    "--workload": ["1d-short", "2d-long", "3d-short", "1d", ""],
    "--workloads": ["1d-short", "2d-short", "bogus", ","],
    "--tokens-per-gpu": ["1024", "1", "0", "-5", "x", "1e3"],
    "--seed": ["0", "1", "-5", "x", str(2**70)],
    "--batches": ["1", "0", "-1", "x"],
    "--time-limit": ["0.5", "0", "-1", "nan", "inf", "x"],
    "--workers": ["1", "0", "-2", "x"],
    "--optimizer-sharding": ["zero1", "zero3", "zero9"],
    "--dpi": ["50", "0", "-1", "x"],
    "--sweep-batches": ["1", "0", "-1", "x"],
    "--gpus": ["8", "8,16", "0", "-8", "7", "x", ","],
    "--inter-bw-scale": ["1", "0.5", "0", "-1", "nan", "x"],
}
# `dcp-opt profile` with valid arguments measures the device for minutes: every profile case
# ends with one of these bad arguments (argparse keeps the last value of a repeated flag).
PROFILE_BAD = (
    ("--layers", "0"),
    ("--hidden", "-8"),
    ("--heads", "3"),
    ("--ffn", "0"),
    ("--threads", "0"),
    ("--device", "tpu"),
    ("--target", "nope"),
    ("--dtype", "int8"),
    ("--layers", "x"),
)
# The cheap settings every whatif case starts from (a case may override any of them).
WHATIF_BASE = ["--no-progress", "--cluster", "h200x8", "--batches", "1", "--sweep-batches", "1"]
WHATIF_BASE += ["--planners", "bucket", "--gpus", "8", "--inter-bw-scale", "1"]
WHATIF_BASE += ["--tokens-per-gpu", "4096"]
COMMANDS = {
    "plan": [
        "--lengths",
        "--workload",
        "--cluster",
        "--model",
        "--profile",
        "--planner",
        "--seed",
        "--tokens-per-gpu",
        "--time-limit",
        "--workers",
        "--optimizer-sharding",
        "--out",
        "--json",
    ],
    "simulate": [
        "PLAN",
        "--lengths",
        "--workload",
        "--cluster",
        "--model",
        "--profile",
        "--json",
        "--ignore-fingerprint",
        "--tokens-per-gpu",
    ],
    "bench": [
        "--cluster",
        "--workloads",
        "--planners",
        "--batches",
        "--seed",
        "--json",
        "--time-limit",
        "--strict",
        "--profile",
        "--model-1d",
        "--model-2d",
        "--model-3d",
    ],
    "show": [
        "PLAN",
        "--lengths",
        "--cluster",
        "--model",
        "--profile",
        "--out",
        "--dpi",
        "--ignore-fingerprint",
    ],
    "whatif": [
        "--lengths",
        "--histogram",
        "--cluster",
        "--model",
        "--profile",
        "--batches",
        "--sweep-batches",
        "--gpus",
        "--inter-bw-scale",
        "--planners",
        "--tokens-per-gpu",
        "--seed",
        "--json",
        "--plot",
    ],
    "profile": ["-o", "--force", "--quick"],
}
FLAGS = ("--ignore-fingerprint", "--strict", "--no-progress", "--force", "--quick")
# Options that take a model, cluster or profile file; which good document each starts from.
SPEC_FLAGS = {
    "--model": "model",
    "--model-1d": "model",
    "--model-2d": "model",
    "--model-3d": "model",
    "--cluster": "cluster",
    "--profile": "profile",
}
# The good documents: a small model and cluster, and a profile of llama-1b.
FUZZ_MODEL = {**model_preset("llama-1b").to_dict(), "name": "fuzz-lm", "num_layers": 4}
FUZZ_CLUSTER = {**cluster_preset("h200x8").to_dict(), "name": "fuzz-2x4", "num_nodes": 2}
FUZZ_CLUSTER["gpus_per_node"] = 4
# Bad files every spec flag may get: broken JSON, wrong shapes, wrong types, a bomb.
BAD_SPECS = {
    "truncated": '{"kind": "1d", "num_layers": 2',
    "list": "[1, 2]",
    "bomb": "[" * 100_000 + "]" * 100_000,
    "wrong_types": json.dumps({**FUZZ_MODEL, "hidden": "big", "memory_bytes": "80GB"}),
    "huge_cluster": json.dumps({**FUZZ_CLUSTER, "num_nodes": 2**40}),
    "empty": "",
}


def spec_docs() -> dict[str, dict]:
    from tests.fuzzing import profile_base  # (fuzzing imports this module)

    return {"model": FUZZ_MODEL, "cluster": FUZZ_CLUSTER, "profile": profile_base() or {}}


def _spec_file(text: str) -> str:
    """`text` in a file of the fixture folder, named by its hash (a case replays the same)."""
    d = Path(cli_files()["dir"]).parent / "specs"
    d.mkdir(exist_ok=True)
    p = d / f"{hashlib.sha256(text.encode(errors='surrogatepass')).hexdigest()[:16]}.json"
    if not p.exists():
        p.write_text(text, errors="surrogatepass")
    return str(p)


@st.composite
def spec_value(draw, opt: str) -> str:
    """A preset name, a good file of any kind (the wrong kind is an error too), a bad file,
    or the good document of this kind mutated."""
    from tests.fuzzing import mutated_json

    docs = spec_docs()
    how = draw(st.sampled_from(["preset", "good", "bad", "mutated", "mutated"]))
    if how == "preset" and opt in VALUE_POOLS:
        return draw(st.sampled_from(VALUE_POOLS[opt]))
    if how == "good":
        return _spec_file(json.dumps(docs[draw(st.sampled_from(sorted(docs)))]))
    if how == "bad":
        return _spec_file(BAD_SPECS[draw(st.sampled_from(sorted(BAD_SPECS)))])
    return _spec_file(draw(mutated_json(docs[SPEC_FLAGS[opt]])))


@cache
def cli_files() -> dict[str, str]:
    """Fixture files the CLI cases point at: a good batch and plan for it, a fuzzed plan,
    bad lengths, a directory (unwritable as a file), and a path that does not exist."""
    d = Path(tempfile.mkdtemp(prefix="dcp_fuzz_"))
    lengths = d / "lengths.txt"
    lengths.write_text("4096\n65536\n128\n")
    from dcp_opt.solvers import get_planner

    batch = load_batch(lengths)
    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x8"))
    plan = get_planner("bucket")(batch, cost, seed=0).plan
    (d / "plan.json").write_text(plan.to_json())
    (d / "bad_plan.json").write_text(plan.to_json()[:50])
    (d / "bad_lengths.txt").write_text("12\n-3\n")
    (d / "out").mkdir()
    (d / "hist.csv").write_text("128,5\n4096,2\n65536,1\n")
    (d / "bad_hist.csv").write_text("128,5\n4096,-2\n")
    return {
        "hist": str(d / "hist.csv"),
        "bad_hist": str(d / "bad_hist.csv"),
        "lengths": str(lengths),
        "plan": str(d / "plan.json"),
        "bad_plan": str(d / "bad_plan.json"),
        "bad_lengths": str(d / "bad_lengths.txt"),
        "dir": str(d / "out"),
        "missing": str(d / "missing.txt"),
        "out_file": str(d / "out" / "result.json"),
        "png": str(d / "out" / "plan.png"),
    }


@st.composite
def cli_cases(draw) -> list[str]:
    files = cli_files()
    cmd = draw(st.sampled_from([*COMMANDS, "nope", ""]))
    argv = [cmd] if cmd else []
    # bench and plan default to big workloads: keep them small unless the case drops it
    if cmd == "bench":
        argv += ["--no-progress", "--tokens-per-gpu", "1024", "--batches", "1"]
        argv += ["--workloads", "1d-short", "--planners", "bucket"]
    if cmd in ("plan", "simulate", "show") and draw(st.booleans()):
        argv += ["--tokens-per-gpu", "1024"]
    if cmd == "whatif":
        argv += WHATIF_BASE
    options = COMMANDS.get(cmd, [])
    chosen = draw(st.lists(st.sampled_from(options), max_size=5, unique=True)) if options else []
    # Mostly give the required arguments too, so that cases get past argparse into the library.
    if cmd in ("simulate", "show") and "PLAN" not in chosen and draw(st.integers(0, 3)):
        chosen.append("PLAN")
    no_source = not {"--lengths", "--workload", "--histogram"} & set(chosen)
    if cmd in ("plan", "simulate", "show") and no_source and draw(st.integers(0, 3)):
        chosen.append(draw(st.sampled_from(["--lengths", "--workload"])))
    if cmd == "whatif" and no_source and draw(st.integers(0, 3)):
        chosen.append(draw(st.sampled_from(["--lengths", "--histogram"])))
    if cmd == "profile" and "-o" not in chosen and draw(st.integers(0, 3)):
        chosen.append("-o")
    if cmd == "show" and "--out" not in chosen and draw(st.integers(0, 3)):
        chosen.append("--out")
    for opt in chosen:
        if opt == "PLAN":
            argv.insert(1, files[draw(st.sampled_from(["plan", "bad_plan", "missing", "dir"]))])
        elif opt in FLAGS:
            argv.append(opt)
        elif opt == "--lengths":
            argv += [
                opt,
                files[draw(st.sampled_from(["lengths", "bad_lengths", "missing", "dir"]))],
            ]
        elif opt == "--histogram":
            argv += [opt, files[draw(st.sampled_from(["hist", "bad_hist", "lengths", "missing"]))]]
        elif opt in ("--out", "--json", "--plot", "-o"):
            key = draw(st.sampled_from(["out_file", "dir", "png"]))
            argv += [opt, files[key]]
        elif opt in SPEC_FLAGS:
            argv += [opt, draw(spec_value(opt))]
        else:
            argv += [opt, draw(st.sampled_from(VALUE_POOLS[opt]))]
    if cmd == "profile":
        argv += list(draw(st.sampled_from(PROFILE_BAD)))
    if draw(st.integers(0, 4)) == 0:  # junk: an unknown flag, a stray word, a lone flag
        junk = draw(st.sampled_from(["--nope", "stray", "--cluster", "-x", "--", "--help"]))
        argv.insert(draw(st.integers(0, len(argv))), junk)
    return argv


def run_cli_case(argv: list[str]) -> None:
    """main(argv) must return 0/1/2 or exit via argparse; exit 2 comes with one error line."""
    from dcp_opt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse --help (0) or a usage error
            rc = e.code if isinstance(e.code, int) else 2
    text = err.getvalue()
    if "Traceback" in text or rc == 3:  # 3: an internal error (a bug), never a clear refusal
        raise AssertionError(f"traceback or internal error on stderr: {text[-300:]}")
    if rc not in (0, 1, 2):
        raise AssertionError(f"exit code {rc!r}")
    if rc == 2:
        lines = [x for x in text.splitlines() if x.strip()]
        if not lines or not any(x.startswith(("dcp-opt: error:", "usage:")) for x in lines):
            raise AssertionError(f"exit 2 without an error line: {text[-300:]!r}")
        raise DcpOptError(lines[-1])  # counted as a clear rejection
