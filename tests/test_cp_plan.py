"""Plans whose groups carry an SP kind (schema version 2): JSON, validate, simulate."""

from __future__ import annotations

import json

import pytest

from dcp_opt import cluster_preset
from dcp_opt.batch import Batch
from dcp_opt.build import make_plan
from dcp_opt.cost import CostModel
from dcp_opt.errors import PlanFormatError
from dcp_opt.model import model_preset
from dcp_opt.plan import BASE_SCHEMA_VERSION, Group, MicroBatch, Plan
from dcp_opt.simulate import simulate
from dcp_opt.validate import validate

# Written by dcp_opt at 55ae256 (schema version 1, before groups had a kind)
V1_PLAN = (
    '{"fingerprint": "abc", "loss_normalizer": 600.0, "meta": {}, "normalizer_kind": '
    '"tokens", "num_ranks": 4, "phases": [{"groups": [{"degree": 2, "micro_batches": '
    '[{"recompute_layers": 0, "sequence_ids": [0, 1]}], "start_rank": 0}, {"degree": 2, '
    '"micro_batches": [{"recompute_layers": 1, "sequence_ids": [2]}], "start_rank": 2}]}], '
    '"planner": "greedy", "predicted_step_time_s": 0.5, "schema_version": 1}'
)

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200x8"), sp_kinds=("ulysses", "cp"))
BATCH = Batch.from_lengths([60000, 30000, 20000, 8000])


def _mb(sid: int, d: int, kind: str) -> MicroBatch:
    """Sequence `sid` alone, with the fewest recomputed layers that fit at (d, kind)."""
    r = int(COST.min_recompute(BATCH.by_id[sid].num_tokens, d, kind=kind))
    assert r >= 0
    return MicroBatch((sid,), r)


def _mixed_plan() -> Plan:
    groups = [
        Group(0, 4, (_mb(0, 4, "cp"),), "cp"),
        Group(4, 2, (_mb(1, 2, "ulysses"), _mb(3, 2, "ulysses")), "ulysses"),
        Group(6, 2, (_mb(2, 2, "cp"),), "cp"),
    ]
    return make_plan([groups], BATCH, COST, planner="hand")


def test_version_1_plan_loads_as_ulysses_and_writes_version_2():
    plan = Plan.from_json(V1_PLAN)
    assert [g.kind for g in plan.phases[0].groups] == ["ulysses", "ulysses"]
    assert plan.phases[0].groups[1].micro_batches == (MicroBatch((2,), 1),)
    d = json.loads(plan.to_json())
    assert d["schema_version"] == BASE_SCHEMA_VERSION == 2
    assert [g["kind"] for g in d["phases"][0]["groups"]] == ["ulysses", "ulysses"]


def test_kind_round_trips_and_bad_kind_is_one_line():
    plan = _mixed_plan()
    again = Plan.from_json(plan.to_json())
    assert [g.kind for g in again.phases[0].groups] == ["cp", "ulysses", "cp"]
    assert again.content_hash() == plan.content_hash()
    d = plan.to_dict()
    d["phases"][0]["groups"][0]["kind"] = "star"
    with pytest.raises(PlanFormatError, match=r"groups\[0\]\.kind: 'star' not allowed"):
        Plan.from_dict(d)
    d["schema_version"] = 5
    with pytest.raises(PlanFormatError, match="schema_version: 5 not supported"):
        Plan.from_dict(d)


def test_mixed_plan_validates_and_simulates_each_group_at_its_kind():
    plan = _mixed_plan()
    assert validate(plan, BATCH, COST) == []
    res = simulate(plan, BATCH, COST)
    by_ids = {e.sequence_ids: e for e in res.events}
    for (sid,), kind, d in (((0,), "cp", 4), ((1,), "ulysses", 2), ((2,), "cp", 2)):
        seq, e = BATCH.by_id[sid], by_ids[(sid,)]
        r = e.recompute_layers
        want = COST.microbatch_time([seq], d, r, spans_nodes=False, kind=kind)
        assert e.kind == kind
        got = (e.compute_s, e.recompute_s, e.comm_s)
        assert got == pytest.approx((want.compute_s, want.recompute_s, want.comm_s), rel=1e-12)
        assert e.memory_bytes == pytest.approx(float(COST.memory(seq.num_tokens, d, r, kind)))
    # the same plan all-Ulysses is priced differently: the kind is read
    ulysses = _retyped(plan, "ulysses")
    assert simulate(ulysses, BATCH, COST).step_time_s != res.step_time_s


def test_validate_reads_the_kind():
    # cp's gathered K/V: a micro-batch that fits under Ulysses is over the capacity under cp
    d, tokens = 8, 100_000  # r = 9 layers under Ulysses, 12 under cp (min_recompute)
    batch = Batch.from_lengths([tokens])
    r = int(COST.min_recompute(tokens, d))
    assert float(COST.memory(tokens, d, r, "cp")) > COST.capacity(0, d)
    groups = [Group(0, d, (MicroBatch((0,), r),), "ulysses")]
    plan = make_plan([groups], batch, COST, planner="hand")
    assert validate(plan, batch, COST) == []
    codes = [v.code for v in validate(_retyped(plan, "cp"), batch, COST)]
    assert codes == ["OUT_OF_MEMORY"]
    # cp where the cost model offers only Ulysses (its bounds hold over Ulysses plans only),
    # and on a 2D model (never offered)
    ulysses_only = COST.with_(sp_kinds=("ulysses",))
    plan_u = make_plan([groups], batch, ulysses_only, planner="hand")
    bad = validate(_retyped(plan_u, "cp"), batch, ulysses_only)
    assert [str(v) for v in bad] == [
        "BAD_KIND: phase 0 group 0 (ranks 0..7): kind 'cp'; allowed ['ulysses']"
    ]
    dit = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x8"))
    vb = Batch.from_shapes([(8, 16, 16)])
    vplan = make_plan([[Group(0, 2, (MicroBatch((0,), 0),), "cp")]], vb, dit, planner="h")
    assert [v.code for v in validate(vplan, vb, dit)] == ["BAD_KIND"]


def _retyped(plan: Plan, kind: str) -> Plan:
    from dataclasses import replace

    phases = tuple(
        replace(ph, groups=tuple(replace(g, kind=kind) for g in ph.groups)) for ph in plan.phases
    )
    return replace(plan, phases=phases)
