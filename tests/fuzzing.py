"""Fuzz cases for every public input and the code that feeds each one through dcp_opt.

Inputs: plan JSON, lengths files, profile JSON, CLI arguments (cases in tests/fuzz_cli.py), and
extreme inputs through the CLI (tests/fuzz_extreme.py: extreme finite values, other encodings,
bools and floats as integers, huge GPU counts, huge option values, giant plans; counted per
kind, `KIND_OF`). For each, `TARGETS[name]` is
(strategy of cases, function that runs one case). Running a case gives an `Outcome`:
"accepted" (the input was good), "rejected" (a DcpOptError with a message, or the CLI's exit
2 with one `dcp-opt: error:` line), or "unhandled" (any other exception, a traceback on
stderr, an empty message). Unhandled must never happen. tests/test_fuzz.py asserts it under
hypothesis; benchmarks/fuzz_report.py counts cases and outcomes per input.
"""

from __future__ import annotations

import json
import tempfile
import traceback
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from dcp_opt import (
    Batch,
    CostModel,
    DcpOptError,
    Group,
    MicroBatch,
    Plan,
    cluster_preset,
    ensure_valid,
    lower_bound,
    make_plan,
    model_preset,
    simulate,
    validate,
)
from dcp_opt.workloads import load_batch
from tests.fuzz_cli import cli_cases, run_cli_case
from tests.fuzz_extreme import extreme_cases, run_extreme_case
from tests.toy import toy_cost


@dataclass(frozen=True)
class Outcome:
    kind: str  # "accepted" | "rejected" | "unhandled"
    detail: str = ""


def attempt(fn, *args) -> Outcome:
    try:
        fn(*args)
    except DcpOptError as e:
        msg = str(e).strip()
        return Outcome("rejected", msg) if msg else Outcome("unhandled", "empty DcpOptError")
    except Exception as e:  # the point of fuzzing: anything else is a bug
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return Outcome("unhandled", f"{type(e).__name__} at {where}: {str(e)[:200]}")
    return Outcome("accepted")


# ---- generic JSON mutation ---------------------------------------------------------------
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2, 3, 7, 8, 10**12, 2**63, -(2**63), 10**400 // 10**380]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=12,
)


# Kinds of mutation, the structural ones weighted up: they reach deepest into the parsers.
MUTATIONS = (
    "replace",
    "replace",
    "replace",
    "delete",
    "rank",
    "rank",
    "truncate",
    "chars",
    "nan",
    "deep",
)


def _paths(d: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a node of a JSON document."""
    out = [prefix]
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@st.composite
def mutated_json(draw, base: dict, rank_keys: tuple[str, ...] = ()) -> str:
    """A valid document changed in one of many ways, as text."""
    doc = json.loads(json.dumps(base))
    how = draw(st.sampled_from(MUTATIONS))
    text = json.dumps(doc)
    if how in ("replace", "delete", "rank"):
        paths = [p for p in _paths(doc) if p]
        if how == "rank":
            paths = [p for p in paths if p[-1] in rank_keys] or paths
        path = draw(st.sampled_from(paths))
        if how == "delete":
            doc = _set(doc, path, None, delete=True)
        elif how == "rank":
            doc = _set(
                doc, path, draw(st.sampled_from([-3, -1, 0, 1, 2, 3, 5, 7, 8, 9, 64, 2**40]))
            )
        else:
            doc = _set(doc, path, draw(JSON_VALUES))
        text = json.dumps(doc)
    elif how == "truncate":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif how == "chars":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(text)))
            text = (
                text[:i]
                + draw(st.text(min_size=0, max_size=3))
                + text[i + draw(st.integers(0, 3)) :]
            )
    elif how == "nan":
        nums = [p for p in _paths(doc) if p and isinstance(_get(doc, p), (int, float))]
        if nums:
            doc = _set(doc, draw(st.sampled_from(nums)), 0.5)
        text = json.dumps(doc).replace(
            "0.5", draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-0.0"])), 1
        )
    else:  # deep nesting: a recursion bomb must be an error, not a crash
        k = draw(st.sampled_from([50, 1000, 100_000]))
        text = "[" * k + "]" * k
    return text


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


# ---- plan JSON -----------------------------------------------------------------------------
@cache
def plan_fixture() -> tuple[Plan, Batch, CostModel]:
    """A valid two-phase plan on the toy cluster (2 nodes x 4 GPUs)."""
    cost = toy_cost(2, 4, 200.0)
    batch = Batch.from_lengths([8, 2, 2, 3, 1, 6])
    phases = [
        [
            Group(0, 4, (MicroBatch((0,), 1),)),
            Group(4, 2, (MicroBatch((1, 2)), MicroBatch((3,)))),
            Group(6, 1, (MicroBatch((4,), 2),)),
        ],
        [Group(0, 8, (MicroBatch((5,)),))],
    ]
    plan = make_plan(phases, batch, cost, planner="fixture", predicted_step_time_s=1.0)
    assert validate(plan, batch, cost) == []
    return plan, batch, cost


def plan_cases() -> st.SearchStrategy[str]:
    base = plan_fixture()[0].to_dict()
    ranks = ("start_rank", "degree", "num_ranks", "recompute_layers", "sequence_ids")
    return st.one_of(
        st.just(json.dumps(base)),
        *[mutated_json(base, ranks)] * 4,
        JSON_VALUES.map(json.dumps),
        st.text(max_size=40),
    )


def run_plan_case(text: str) -> None:
    """What `dcp-opt simulate` does with a plan file: parse, validate, simulate if valid."""
    _, batch, cost = plan_fixture()
    plan = Plan.from_json(text)
    Plan.from_json(plan.to_json())  # what parses must round-trip
    if not validate(plan, batch, cost, check_fingerprint=False):
        simulate(plan, batch, cost)  # what-if mode (`--ignore-fingerprint`)
    ensure_valid(plan, batch, cost)  # a violation is a clear rejection (InvalidPlanError)
    simulate(plan, batch, cost)


# ---- lengths files -------------------------------------------------------------------------
LINE_VALUES = st.one_of(
    st.integers(-5, 5000).map(str),
    st.sampled_from(["0", "-1", "1e5", "0x10", "3.5", "nan", "inf", " ", "#x", "1_000", "+7"]),
    st.sampled_from([10**18, 2**63, 10**19, 10**100, 10**400]).map(str),
    st.just("9" * 5000),  # past Python's int-from-string digit limit
    st.tuples(*[st.integers(-1, 100)] * 3).map(lambda t: ",".join(map(str, t))),
    st.tuples(st.integers(1, 9), st.integers(1, 9)).map(lambda t: f"{t[0]},{t[1]}"),
    st.text(max_size=6),
)


@st.composite
def lengths_cases(draw) -> tuple[str, bytes]:
    """(file suffix, file bytes)."""
    suffix = draw(st.sampled_from([".txt", ".json", "", ".csv"]))
    how = draw(st.sampled_from(["lines", "bytes", "json", "empty", "huge"]))
    if how == "lines":
        text = "\n".join(draw(st.lists(LINE_VALUES, min_size=1, max_size=8)))
    elif how == "bytes":
        return suffix, draw(st.binary(max_size=64))
    elif how == "json":
        text = json.dumps(
            draw(
                st.one_of(
                    JSON_VALUES,
                    st.lists(st.integers(-3, 10**6), max_size=6),
                    st.lists(st.lists(st.integers(-1, 50), max_size=4), max_size=4),
                    st.fixed_dictionaries({"sequences": JSON_VALUES}),
                )
            )
        )
    elif how == "empty":
        text = draw(st.sampled_from(["", "\n\n", "# only a comment\n", "   ", "[]", "{}"]))
    else:
        text = draw(st.sampled_from(["1" + "0" * 300, "10" * 40, "[1e400]", "[" * 100_000]))
    return suffix, text.encode()


@cache
def _default_cost(kind: str) -> CostModel:
    model = model_preset("llama-1b" if kind == "1d" else "opensora-stdit3-xl")
    return CostModel(model, cluster_preset("h200x8"))


def run_lengths_case(case: tuple[str, bytes]) -> None:
    suffix, data = case
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"lengths{suffix}"
        p.write_bytes(data)
        batch = load_batch(p)
    lower_bound(batch, _default_cost(batch.kind))  # checks every sequence fits


# ---- profile JSON --------------------------------------------------------------------------
@cache
def profile_base() -> dict | None:
    try:
        from dcp_opt.profile_io import Profile
    except ImportError:  # profile I/O not built in this checkout
        return None
    from dcp_opt import flops_coefficients

    model = model_preset("llama-1b")
    prof = Profile(
        coefficients=flops_coefficients(model, cluster_preset("h200x8")),
        model=model,
        device={"name": "fuzz"},
        date="2026-01-01T00:00:00Z",
    )
    return prof.to_dict()


def profile_cases() -> st.SearchStrategy[str]:
    base = profile_base() or {}
    keys = ("schema_version", "num_layers", "hidden", "quad", "lin", "group_size")
    return st.one_of(
        st.just(json.dumps(base)), *[mutated_json(base, keys)] * 4, st.text(max_size=40)
    )


def run_profile_case(text: str) -> None:
    from dcp_opt.profile_io import cost_model_from_profile, load_profile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "p.profile.json"
        p.write_text(text, errors="surrogatepass")
        prof = load_profile(p)
        cost = cost_model_from_profile(p, prof.model, cluster_preset("h200x8"))
    batch = Batch.from_lengths([1, 4096, 65536])
    lower_bound(batch, cost)
    cost.microbatch_time(list(batch.sequences), 8, 0)


def _available(name: str) -> bool:
    if name == "profile_json":
        return profile_base() is not None
    if name == "cli_args":
        try:
            import dcp_opt.cli  # noqa: F401
        except ImportError:
            return False
    return True


ALL_TARGETS = {
    "plan_json": (plan_cases, run_plan_case),
    "lengths_file": (lengths_cases, run_lengths_case),
    "profile_json": (profile_cases, run_profile_case),
    "cli_args": (cli_cases, run_cli_case),
    "extreme_inputs": (extreme_cases, run_extreme_case),
}
# The kind of a case, for targets whose report counts per kind (benchmarks/fuzz_report.py).
KIND_OF = {"extreme_inputs": lambda case: case.kind}
TARGETS = {k: v for k, v in ALL_TARGETS.items() if _available(k)}
