"""Memory held to the charge under per-layer ZeRO-3 and tensor parallelism (issue 26): bf16
TinyLM (benchmarks/bench_memory.py's model and its committed profile), 4 gloo ranks, greedy's
plan for each layout, two steps; in the second every GPU's model-state peak (held_bytes
sampled at every FSDP2 collective and reduce-scatter buffer, per layer; after the last
micro-batch, step-level) and the bytes autograd saves in the largest micro-batch.

What runs is held to formulas written from what each GPU holds (bench_memory.per_layer_peak,
step_level_peak, tp_saved_term; docs/architecture.md, "Past the memory wall"): model states
within 1 %, saved activations within 10 %, the per-layer gathers and reduce-scatters inside
the domain within 1 % of 2 x 2 + 4 B per local parameter and micro-step. The cost model's own
figures (dcp_opt/cost: CostModel.model_state_bytes, CostModel.saved_activation_bytes) are held
to the same tolerances: model states within 1 %, saved activations within 10 %."""

from __future__ import annotations

from pathlib import Path

import pytest
from dcp_opt.runtime.testing import DistWorkers

from tests.scripts import load_script

BENCH = load_script("benchmarks/bench_memory.py")
PROFILE = Path(__file__).parent.parent / "benchmarks" / "results" / "tiny_lm_bf16.profile.json"
PER_LAYER = [{"tp": 1, "mode": "zero3", "shard_domain": s} for s in (2, 4)]
TP = [
    {"tp": 2, "mode": "zero1", "shard_domain": 0},
    {"tp": 2, "mode": "zero3", "shard_domain": 1},
    {"tp": 2, "mode": "zero3", "shard_domain": 2},
]
_ROWS: dict = {}


def name(layout: dict) -> str:
    return f"tp{layout['tp']}-{layout['mode']}-s{layout['shard_domain']}"


def job_layout(ctx, *args):
    return BENCH.job_layout(ctx, *args)  # ours: workers import this module by name


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(4, timeout_s=120.0)
    yield w
    w.close()


def rows(workers, layout: dict) -> list[dict]:
    """bench_memory.layout_rows of one layout (every GPU), run once per module."""
    key = name(layout)
    if key not in _ROWS:
        _ROWS[key] = BENCH.layout_rows(workers, [layout], str(PROFILE), job=job_layout)
    return _ROWS[key]


def check_traffic(r: dict) -> None:
    if r["shard_domain"] > 1:  # the gathers (2 x 2 B) and reduce-scatter (4 B) per micro-step
        assert abs(r["domain_bytes"] / r["domain_formula"] - 1) <= 0.01, r


@pytest.mark.parametrize("layout", PER_LAYER, ids=name)
def test_per_layer_zero3_holds_its_formula_and_saves_the_charge(workers, layout):
    """16 P / s + c (P_root + P_head) + (c + 4 + 4 / s) P_block on every GPU, within 1 %;
    saved activations within 10 % of the profiled cost model's saved term (per layer
    saves what zero1 saves: the gathered weights are not activations)."""
    for r in rows(workers, layout):
        assert abs(r["formula_error"]) <= 0.01, r
        assert abs(r["activations_error"]) <= 0.10, r
        check_traffic(r)


@pytest.mark.parametrize("layout", TP, ids=name)
def test_tp_holds_its_formula_and_saves_what_dtensor_tp_saves(workers, layout):
    """TP 2 over 2 units: step-level zero1 (the embedding's fp32 accumulator holds its own
    rows only: it held the whole vocabulary before `_grad_keeps_placement`) and per-layer
    zero3 over 1 and 2 units, within 1 % of the formula of a TP shard, and step-level within
    1 % of the cost model too; saved activations within 10 % of tp_saved_term (the gathered
    inputs of the column-parallel projections and the whole logits are not split)."""
    for r in rows(workers, layout):
        assert abs(r["formula_error"]) <= 0.01, r
        if not layout["shard_domain"]:
            assert abs(r["model_states_error"]) <= 0.01, r
        assert abs(r["tp_activations_error"]) <= 0.10, r
        assert r["peak_saved_activations"] > 0  # a micro-batch ran and was measured
        check_traffic(r)


@pytest.mark.parametrize("layout", PER_LAYER + TP, ids=name)
def test_the_cost_model_charges_what_runs(workers, layout):
    """CostModel.model_state_bytes() / t within 1 % and the activation term's saved part / t
    within 10 % on every GPU."""
    for r in rows(workers, layout):
        assert abs(r["model_states_error"]) <= 0.01, r
        assert abs(r["activations_error"]) <= 0.10, r
