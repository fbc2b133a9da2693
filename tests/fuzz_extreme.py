"""Extreme-input fuzz cases for tests/fuzzing.py (issue 29): the kinds of input that crashed,
hung, ran away in memory, printed millions of lines or silently coerced before, each through
the `dcp-opt` command line.

Kinds (ExtremeCase.kind):
- extreme_finite   a numeric field of a cluster, model, plan or profile file set to an extreme
                   finite value (1e-300, 5e-324, 1e308, 2**63, a 400-digit integer, -0.0)
- encodings        a plan, lengths, model, cluster, profile or histogram file in UTF-16,
                   UTF-32 (with their byte-order marks), Latin-1, or random bytes
- bools_floats     an integer of a lengths, shapes, ids, model, cluster or plan file given as
                   true/false or a float (1.9, 2.0, 0.7): must be refused, never coerced
- huge_gpus        presets h200xN, gb200-nvl72xN and cluster files with a huge GPU count
- huge_options     option values far past any sane size (tokens per GPU, batches, epoch
                   batches, dpi, seed, workers, GPU counts, step sizes, budgets)
- giant_plans      plans with 10^4-10^5 groups, phases, micro-batches or sequence ids

A case is mishandled (tests/fuzzing.py's "unhandled") if the command raises, prints a
traceback, exits 3 (internal error) or with another code than 0/1/2, exits 0 on a case that
must be refused, prints more than MAX_STDERR_LINES lines, or runs longer than CASE_TIMEOUT_S
or past MEMORY_HEADROOM_BYTES of new address space (a MemoryError is an internal error)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import resource
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from dcp_opt import DcpOptError

KINDS = ("extreme_finite", "encodings", "bools_floats", "huge_gpus", "huge_options", "giant_plans")
CASE_TIMEOUT_S = 30
MAX_STDERR_LINES = 60
MEMORY_HEADROOM_BYTES = 3 << 30

CLUSTER = {"num_nodes": 2, "gpus_per_node": 4, "memory_bytes": 80e9, "peak_flops": 312e12,
           "intra_node_bw": 300e9, "inter_node_bw": 25e9, "intra_node_latency_s": 5e-6,
           "inter_node_latency_s": 2e-5}  # fmt: skip
MODEL = {"name": "fz", "kind": "1d", "num_layers": 2, "hidden": 256, "num_heads": 8,
         "ffn_hidden": 512, "vocab_size": 1000, "dtype_bytes": 2}  # fmt: skip
LENGTHS = "4096\n65536\n128\n"
EXTREME = [1e-300, 5e-324, 1e308, -1e308, 2**63, 10**400, -0.0, 0.0, 1e-9, 1e30, 1e31]
NOT_INTS = [True, False, 1.9, 2.0, 0.7, 1e3]


@dataclass(frozen=True)
class ExtremeCase:
    kind: str
    argv: tuple[str, ...]  # "{name}" stands for the path of files[name]
    files: dict[str, bytes] = field(default_factory=dict)
    must_refuse: bool = False

    def __repr__(self) -> str:
        sizes = {k: len(v) for k, v in self.files.items()}
        return (
            f"ExtremeCase({self.kind}, {list(self.argv)}, files={sizes}, refuse={self.must_refuse})"
        )


@dataclass(frozen=True)
class _Base:
    """A plan of the fuzz cluster for LENGTHS on llama-1b, as JSON (made once)."""

    plan: dict


_BASE: list[_Base] = []


def base_plan() -> dict:
    if not _BASE:
        from dcp_opt.solvers import get_planner

        from dcp_opt import Batch, CostModel, cluster_preset, model_preset

        cluster = cluster_preset("h200x8")
        batch = Batch.from_lengths([int(x) for x in LENGTHS.split()])
        cost = CostModel(model_preset("llama-1b"), cluster)
        _BASE.append(_Base(get_planner("greedy")(batch, cost).plan.to_dict()))
    return json.loads(json.dumps(_BASE[0].plan))


PLAN_INPUTS = ("--lengths", "{lengths}", "--cluster", "h200x8", "--model", "llama-1b")
PLAN_CMD = ("plan", "--lengths", "{lengths}", "--model", "llama-1b")


def _dump(doc) -> bytes:
    return json.dumps(doc).encode()


def _numeric_paths(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _numeric_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _numeric_paths(v, (*prefix, i))
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield prefix


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _profile_doc() -> dict:
    from tests.fuzzing import profile_base

    return json.loads(json.dumps(profile_base()))


@st.composite
def extreme_finite(draw) -> ExtremeCase:
    target = draw(st.sampled_from(["cluster", "model", "plan", "profile"]))
    value = draw(st.sampled_from(EXTREME))
    files = {"lengths": LENGTHS.encode()}
    if target == "cluster":
        doc = dict(CLUSTER)
        key = draw(st.sampled_from(sorted(doc)))
        doc[key] = value
        files["cluster"] = _dump(doc)
        argv = ("plan", "--lengths", "{lengths}", "--cluster", "{cluster}", "--model", "llama-1b")
    elif target == "model":
        doc = dict(MODEL, num_params=1e8)
        key = draw(st.sampled_from(sorted(k for k, v in doc.items() if not isinstance(v, str))))
        doc[key] = value
        files["model"] = _dump(doc)
        argv = ("plan", "--lengths", "{lengths}", "--cluster", "h200x8", "--model", "{model}")
    elif target == "plan":
        doc = base_plan()
        path = draw(st.sampled_from(list(_numeric_paths(doc))))
        _set(doc, path, value)
        files["plan"] = _dump(doc)
        argv = ("simulate", "{plan}", *PLAN_INPUTS)
    else:
        doc = _profile_doc()
        path = draw(st.sampled_from(list(_numeric_paths(doc["coefficients"]))))
        _set(doc["coefficients"], path, value)
        files["profile"] = _dump(doc)
        argv = ("plan", "--lengths", "{lengths}", "--cluster", "h200x8", "--profile", "{profile}")
    return ExtremeCase("extreme_finite", argv, files)


_ENCODINGS = {
    "utf-16": lambda t: t.encode("utf-16"),
    "utf-16-le-no-bom": lambda t: t.encode("utf-16-le"),
    "utf-32": lambda t: t.encode("utf-32"),
    "latin-1": lambda t: (t + "# caf\xe9\n" if not t.lstrip().startswith(("{", "[")) else
                          t.replace('"', '"\xe9', 1)).encode("latin-1"),
}  # fmt: skip


@st.composite
def encodings(draw) -> ExtremeCase:
    what = draw(st.sampled_from(["plan", "lengths", "model", "cluster", "profile", "histogram"]))
    how = draw(st.sampled_from([*_ENCODINGS, "random"]))
    text = {
        "plan": lambda: json.dumps(base_plan()),
        "lengths": lambda: LENGTHS,
        "model": lambda: json.dumps(MODEL),
        "cluster": lambda: json.dumps(CLUSTER),
        "profile": lambda: json.dumps(_profile_doc()),
        "histogram": lambda: "length,count\n512,10\n4096,2\n",
    }[what]()
    data = draw(st.binary(min_size=1, max_size=64)) if how == "random" else _ENCODINGS[how](text)
    files = {"lengths": LENGTHS.encode(), what: data}
    argv = {
        "plan": ("simulate", "{plan}", *PLAN_INPUTS),
        "lengths": ("plan", "--lengths", "{lengths}", "--cluster", "h200x8", "--model", "llama-1b"),
        "model": ("plan", "--lengths", "{lengths}", "--cluster", "h200x8", "--model", "{model}"),
        "cluster": ("plan", "--lengths", "{lengths}", "--cluster", "{cluster}", "--model",
                    "llama-1b"),
        "profile": ("plan", "--lengths", "{lengths}", "--cluster", "h200x8", "--profile",
                    "{profile}"),
        "histogram": ("whatif", "--histogram", "{histogram}", "--cluster", "h200x8", "--batches",
                      "1", "--sweep-batches", "1", "--planners", "bucket", "--gpus", "8",
                      "--inter-bw-scale", "1", "--tokens-per-gpu", "4096", "--no-progress"),
    }[what]  # fmt: skip
    # UTF-16 and UTF-32 (with or without a mark) and Latin-1 files are never read as text
    return ExtremeCase("encodings", argv, files, must_refuse=how != "random")


@st.composite
def bools_floats(draw) -> ExtremeCase:
    what = draw(st.sampled_from(["lengths", "shapes", "ids", "model", "cluster", "plan"]))
    bad = draw(st.sampled_from(NOT_INTS))
    files: dict[str, bytes] = {}
    argv: tuple[str, ...] = PLAN_CMD
    if what == "lengths":
        doc = [4096, 128, 65536]
        doc[draw(st.integers(0, 2))] = bad
        files["lengths"] = _dump(doc)
    elif what == "shapes":
        doc = [[1, 9, 16], [15, 15, 27]]
        doc[draw(st.integers(0, 1))][draw(st.integers(0, 2))] = bad
        files["lengths"] = _dump(doc)
        argv = ("plan", "--lengths", "{lengths}", "--model", "opensora-stdit3-xl")
    elif what == "ids":
        doc = {"sequences": [{"id": 0, "shape": [4096]}, {"id": 1, "shape": [128]}]}
        seq = doc["sequences"][draw(st.integers(0, 1))]
        seq[draw(st.sampled_from(["id", "shape"]))] = bad if draw(st.booleans()) else [bad]
        files["lengths"] = _dump(doc)
    elif what == "model":
        doc = dict(MODEL)
        doc[draw(st.sampled_from([k for k, v in MODEL.items() if isinstance(v, int)]))] = bad
        files["model"] = _dump(doc)
        argv = ("plan", "--lengths", "{lengths}", "--cluster", "h200x8", "--model", "{model}")
    elif what == "cluster":
        doc = dict(CLUSTER)
        doc[draw(st.sampled_from(["num_nodes", "gpus_per_node"]))] = bad
        files["cluster"] = _dump(doc)
        argv = ("plan", "--lengths", "{lengths}", "--cluster", "{cluster}", "--model", "llama-1b")
    else:
        doc = base_plan()
        ints = [p for p in _numeric_paths(doc) if isinstance(_get(doc, p), int)]
        _set(doc, draw(st.sampled_from(ints)), bad)
        files["plan"] = _dump(doc)
        argv = ("simulate", "{plan}", *PLAN_INPUTS)
    files.setdefault("lengths", LENGTHS.encode())
    # 2.0 and 1e3 are floats in JSON: as integers they are refused too (never coerced)
    return ExtremeCase("bools_floats", argv, files, must_refuse=True)


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def huge_gpus(draw) -> ExtremeCase:
    n = draw(st.sampled_from([65537, 10**5, 10**6, 10**9, 10**18, 10**30, 10**400]))
    how = draw(st.sampled_from(["h200", "gb200", "file_nodes", "file_per_node"]))
    files = {"lengths": LENGTHS.encode()}
    if how == "h200":
        cluster = f"h200x{n * 8}"
    elif how == "gb200":
        cluster = f"gb200-nvl72x{n}"
    else:
        doc = dict(CLUSTER)
        doc["num_nodes" if how == "file_nodes" else "gpus_per_node"] = n
        files["cluster"] = _dump(doc)
        cluster = "{cluster}"
    cmd = draw(st.sampled_from(["plan", "workload", "bench", "whatif"]))
    argv = {
        "plan": ("plan", "--lengths", "{lengths}", "--cluster", cluster, "--model", "llama-1b"),
        "workload": ("plan", "--workload", "1d-short", "--cluster", cluster),
        "bench": ("bench", "--cluster", cluster, "--batches", "1", "--workloads", "1d-short",
                  "--planners", "bucket", "--no-progress"),
        "whatif": ("whatif", "--lengths", "{lengths}", "--cluster", cluster, "--batches", "1",
                   "--sweep-batches", "1", "--planners", "bucket", "--no-progress"),
    }[cmd]  # fmt: skip
    return ExtremeCase("huge_gpus", argv, files, must_refuse=True)


HUGE = ["10000000000000", str(2**64), str(10**30), "9" * 400]
_OPTIONS = {
    "--tokens-per-gpu": ("plan", "--workload", "1d-short", "--cluster", "h200x8"),
    "--seed": ("plan", *PLAN_INPUTS[:2], "--cluster", "h200x8", "--planner", "cpsat"),
    "--workers": ("plan", *PLAN_INPUTS, "--planner", "cpsat"),
    "--dpi": ("show", "{plan}", *PLAN_INPUTS, "--out", "{out}.png"),
    "--batches": ("bench", "--cluster", "h200x8", "--workloads", "1d-short", "--planners",
                  "bucket", "--no-progress"),
    "--epoch-batches": ("bench", "--stream", "--quick", "--cluster", "h200x8", "--workloads",
                        "1d-short", "--no-progress"),
    "--step-sizes": ("bench", "--stream", "--quick", "--cluster", "h200x8", "--workloads",
                     "1d-short", "--no-progress"),
    "--former-k": ("bench", "--stream", "--quick", "--cluster", "h200x8", "--workloads",
                   "1d-short", "--no-progress"),
    "--gpus": ("whatif", "--lengths", "{lengths}", "--cluster", "h200x8", "--batches", "1",
               "--sweep-batches", "1", "--planners", "bucket", "--no-progress"),
    "--sweep-batches": ("whatif", "--lengths", "{lengths}", "--cluster", "h200x8", "--batches",
                        "1", "--planners", "bucket", "--no-progress"),
}  # fmt: skip


@st.composite
def huge_options(draw) -> ExtremeCase:
    opt = draw(st.sampled_from(sorted(_OPTIONS)))
    value = draw(st.sampled_from(HUGE))
    if opt == "--gpus":
        value = f"8,{value}"
    files = {"lengths": LENGTHS.encode(), "plan": _dump(base_plan())}
    return ExtremeCase("huge_options", (*_OPTIONS[opt], opt, value), files, must_refuse=True)


@st.composite
def giant_plans(draw) -> ExtremeCase:
    doc = base_plan()
    n = draw(st.sampled_from([10**4, 10**5]))
    how = draw(st.sampled_from(["groups", "phases", "micro_batches", "ids", "ranks"]))
    idle = {"start_rank": 0, "degree": 1, "kind": "ulysses", "micro_batches": []}
    if how == "groups":  # n overlapping groups in one phase
        doc["phases"].append({"groups": [idle] * n})
    elif how == "phases":  # n phases, each leaving 7 ranks uncovered
        doc["phases"] += [{"groups": [idle]}] * n
    elif how == "micro_batches":
        g = doc["phases"][0]["groups"][0]
        g["micro_batches"] += [{"sequence_ids": [0], "recompute_layers": 0}] * n
    elif how == "ids":
        mb = doc["phases"][0]["groups"][0]["micro_batches"][0]
        mb["sequence_ids"] = list(range(n))
    else:
        doc["num_ranks"] = n
    argv = ("simulate", "{plan}", *PLAN_INPUTS)
    return ExtremeCase("giant_plans", argv, {"lengths": LENGTHS.encode(), "plan": _dump(doc)}, True)


def extreme_cases() -> st.SearchStrategy[ExtremeCase]:
    return st.one_of(
        extreme_finite(), encodings(), bools_floats(), huge_gpus(), huge_options(), giant_plans()
    )


class _Timeout(BaseException):  # not an Exception: main() must not report it as its own error
    pass


@contextlib.contextmanager
def _bounded(seconds: int, headroom: int):
    """SIGALRM after `seconds`; the address space capped `headroom` bytes above its size now."""

    def alarm(signum, frame):
        raise _Timeout(f"ran past {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
        cap = size + headroom
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
    except (OSError, ValueError):
        soft = None
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        if soft is not None:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_extreme_case(case: ExtremeCase) -> None:
    """Run `case` through main(); raise DcpOptError for a clear refusal, AssertionError for a
    mishandled case (tests/fuzzing.py counts both)."""
    from dcp_opt.cli import main

    with tempfile.TemporaryDirectory(prefix="dcp_extreme_") as d:
        paths = {}
        for name, data in case.files.items():
            paths[name] = str(Path(d) / f"{name}.json" if name != "lengths" else Path(d) / name)
            Path(paths[name]).write_bytes(data)
        paths["out"] = str(Path(d) / "out")
        argv = [a.format(**paths) if "{" in a else a for a in case.argv]
        out, err = io.StringIO(), io.StringIO()
        started = time.perf_counter()
        try:
            with (
                _bounded(CASE_TIMEOUT_S, MEMORY_HEADROOM_BYTES),
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
            ):
                try:
                    rc = main(argv)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 2
        except _Timeout as e:
            raise AssertionError(f"{case.kind}: {e}") from None
        wall = time.perf_counter() - started
    text = err.getvalue()
    lines = [x for x in text.splitlines() if x.strip()]
    if "Traceback" in text or rc == 3:
        raise AssertionError(f"{case.kind}: internal error / traceback: {text[-300:]}")
    if rc not in (0, 1, 2):
        raise AssertionError(f"{case.kind}: exit code {rc!r}")
    if len(lines) > MAX_STDERR_LINES:
        raise AssertionError(f"{case.kind}: {len(lines)} lines on stderr")
    if case.must_refuse and rc == 0:
        raise AssertionError(f"{case.kind}: accepted a case that must be refused: {argv}")
    if not math.isfinite(wall) or wall > CASE_TIMEOUT_S:
        raise AssertionError(f"{case.kind}: took {wall:.1f} s")
    if rc == 2:
        if not lines or not lines[-1].startswith("dcp-opt: error:"):
            raise AssertionError(f"{case.kind}: exit 2 without an error line: {text[-300:]!r}")
        raise DcpOptError(lines[-1])
    if rc == 1:
        raise DcpOptError(lines[0] if lines else "exit 1")  # an invalid plan: refused
