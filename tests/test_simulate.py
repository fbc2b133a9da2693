"""simulate() against a reference simulator written here from the plan's semantics
(dcp_opt/plan.py docstring): a group starts a phase when all its members are free (no barrier),
runs its micro-batches back to back, each costing CostModel.microbatch_time on that group
(its node span and slowest member's speed) and CostModel.memory; after the last phase every
rank joins the gradient sync. One micro-batch at a time, plain Python: nothing shared with
simulate()'s vectorised per-phase path but the cost model itself. Also the per-kind path a
cost-model subclass takes, and SimResult.summary() by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_opt import Batch, CostModel, Group, MicroBatch, make_plan, simulate
from tests import strategies as hs
from tests.toy import toy_cost

REL = 1e-9


def reference(plan, batch, cost):
    c, by_id = cost.cluster, batch.by_id
    n = c.num_gpus
    ready, busy = [0.0] * n, [0.0] * n
    peak = [cost.fixed_bytes()] * n
    events, comm, rec = [], 0.0, 0.0
    for p, phase in enumerate(plan.phases):
        for g in phase.groups:
            ranks = list(g.ranks)
            t = start = max(ready[r] for r in ranks)
            for k, mb in enumerate(g.micro_batches):
                seqs = [by_id[s] for s in mb.sequence_ids]
                tb = cost.microbatch_time(
                    seqs, g.degree, mb.recompute_layers,
                    spans_nodes=c.spans_nodes(g.start_rank, g.degree),
                    speed=c.group_speed(g.start_rank, g.degree),
                )  # fmt: skip
                mem = float(
                    cost.memory(sum(s.num_tokens for s in seqs), g.degree, mb.recompute_layers)
                )
                events.append(
                    (p, g.start_rank, g.degree, k, mb.sequence_ids, mb.recompute_layers, t,
                     tb.total_s, mem)
                )  # fmt: skip
                t += tb.total_s
                comm += tb.comm_s * g.degree
                rec += tb.recompute_s * g.degree
                for r in ranks:
                    peak[r] = max(peak[r], mem)
            for r in ranks:
                busy[r] += t - start
                ready[r] = t
    finish = max(ready)
    return {
        "finish": finish, "sync": cost.grad_sync_time(), "busy": busy, "peak": peak,
        "events": events, "comm": comm, "rec": rec,
    }  # fmt: skip


def check_against_reference(plan, batch, cost):
    sim, want = simulate(plan, batch, cost), reference(plan, batch, cost)
    got_events = sorted(
        (e.phase, e.start_rank, e.degree, e.index, e.sequence_ids, e.recompute_layers, e.start_s,
         e.end_s - e.start_s, e.memory_bytes)
        for e in sim.events
    )  # fmt: skip
    assert len(got_events) == len(want["events"])
    kinds = {(g.start_rank, p): g.kind for p, ph in enumerate(plan.phases) for g in ph.groups}
    assert all(e.kind == kinds[e.start_rank, e.phase] for e in sim.events)
    for got, exp in zip(got_events, sorted(want["events"]), strict=True):
        assert got[:6] == exp[:6]
        assert got[6:] == pytest.approx(exp[6:], rel=REL, abs=1e-12)
    assert sim.finish_s == pytest.approx(want["finish"], rel=REL)
    assert sim.grad_sync_s == want["sync"]
    assert sim.step_time_s == pytest.approx(want["finish"] + want["sync"], rel=REL)
    assert sim.busy_s.tolist() == pytest.approx(want["busy"], rel=REL, abs=1e-12)
    assert sim.idle_s.tolist() == pytest.approx(
        [want["finish"] - b for b in want["busy"]], rel=REL, abs=1e-9 * want["finish"]
    )
    assert sim.peak_memory_bytes.tolist() == pytest.approx(want["peak"], rel=REL)
    assert sim.comm_s == pytest.approx(want["comm"], rel=REL, abs=1e-12)
    assert sim.recompute_s == pytest.approx(want["rec"], rel=REL, abs=1e-12)
    totals = simulate(plan, batch, cost, events=False)
    assert totals.events == () and totals.step_time_s == sim.step_time_s
    return sim


class PerDegreeCost(CostModel):
    """A subclass that reprices time_parts (as recalibrate.RecalibratedCostModel does): the
    simulator must then call the cost model once per kind of group."""

    def time_parts(self, feats, d, recompute_layers, **kw):
        return super().time_parts(feats, d, recompute_layers, **kw)


@given(inst=hs.instances(max_gpus=16, max_seqs=10), data=st.data())
def test_simulate_is_the_reference_on_random_plans(inst, data):
    plan = data.draw(hs.valid_plans(inst))
    check_against_reference(plan, inst.batch, inst.cost)
    sub = PerDegreeCost(**{f: getattr(inst.cost, f) for f in ("model", "cluster", "coeffs")})
    sub = sub.with_(
        **{f: getattr(inst.cost, f) for f in ("optimizer_sharding", "usable_memory_fraction",
                                              "grad_reduce_bytes_per_param")}
    )  # fmt: skip
    assert not sub.takes_degree_vectors
    check_against_reference(plan, inst.batch, sub)


def comm_cost() -> CostModel:
    """The toy with 4 bytes of all-to-all per token and layer at 1 byte/s and no latency:
    one layer's forward at degree d sends 4 * T/d * (d-1)/d bytes, as many seconds."""
    from dataclasses import replace

    cost = toy_cost()
    return cost.with_(coeffs=replace(cost.coeffs, a2a_bytes_per_token_layer=4.0))


def test_comm_recompute_and_summary_by_hand():
    cost = comm_cost()
    batch = Batch.from_lengths([8, 4, 2])
    # Phase 0 idle (no micro-batch anywhere). Phase 1: ranks 0..1 run 8 tokens with 1
    # recomputed layer: compute 6*8/2 + 0.5 = 24.5, recompute 4, comm (2*2 + 1) * 4*4*1/2 = 40
    # -> 68.5 s; ranks 2..3 run 4 tokens, 12.5 + (2*2) * 4*2*1/2 = 28.5 s, then 2 tokens,
    # 6.5 + (2*2) * 4*1*1/2 = 14.5 s -> 43 s. Memory: 9 + 4*(30-8) = 97 and 9 + 2*30 = 69.
    plan = make_plan(
        [[], [Group(0, 2, (MicroBatch((0,), 1),)),
              Group(2, 2, (MicroBatch((1,)), MicroBatch((2,))))]],
        batch, cost, planner="hand",
    )  # fmt: skip
    sim = check_against_reference(plan, batch, cost)
    assert [(e.start_s, e.end_s) for e in sim.events] == [(0.0, 68.5), (0.0, 28.5), (28.5, 43.0)]
    assert sim.step_time_s == 68.5 and sim.busy_s.tolist() == [68.5, 68.5, 43.0, 43.0]
    assert sim.comm_s == 2 * 40 + 2 * (16 + 8)  # GPU-seconds: per member times members
    assert sim.recompute_s == 2 * 4.0
    busy = 2 * 68.5 + 2 * 43.0
    assert sim.summary() == {
        "step_time_s": 68.5,
        "finish_s": 68.5,
        "grad_sync_s": 0.0,
        "imbalance": (2 * 25.5) / (4 * 68.5),
        "comm_share": 128 / busy,
        "recompute_share": 8 / busy,
        "peak_memory_gb": 97 / 1e9,
        "num_micro_batches": 3,
        # zero1 on 4 GPUs, 1 parameter: all-gather 3/4 x 2 B, reduce-scatter 3/4 x 4 B at
        # 1 B/s (the toy charges neither in grad_sync_s, nor a closing micro-step)
        "collectives": {"param_all_gather": 1.5, "grad_reduce_scatter": 3.0},
        "collectives_s": 4.5,
        "closing_step_s": 0.0,
        "padding_s": 0.0,  # no zero3 shard domain: nothing padded
    }


def test_an_empty_simulation_summary_divides_by_nothing():
    cost = toy_cost()
    batch = Batch.from_lengths([1])
    plan = make_plan([[Group(0, 1, (MicroBatch((0,)),))]], batch, cost, planner="hand")
    sim = simulate(plan, batch, cost)
    idle = type(sim)(0.0, 0.0, 0.0, np.zeros(4), np.zeros(4), np.zeros(4), (), 0.0, 0.0)
    assert (idle.imbalance, idle.comm_share) == (0.0, 0.0)
    assert idle.summary()["recompute_share"] == 0.0
    assert sim.imbalance == pytest.approx(3 / 4)  # three of four ranks idle the whole step


@pytest.mark.parametrize(
    "nodes, per, seconds",
    [(1, 4, 4.5 / 2.0), (2, 2, 4.5 / 0.5), (1, 2, 3.0 / 2.0), (1, 1, 0.0)],
    ids=["one node: NVLink rate", "two nodes: NIC rate", "two GPUs", "one GPU: none"],
)
def test_step_collectives_are_timed_at_the_sync_rate(nodes, per, seconds):
    # The toy has 1 parameter under zero1: all-gather 3/4 * 2 B of weights, reduce-scatter
    # 3/4 * 4 B of gradients on 4 GPUs: 4.5 bytes, at 2 B/s in a node, 0.5 B/s across.
    cost = toy_cost(nodes, per)
    cost = cost.with_(cluster=cost.cluster.with_(intra_node_bw=2.0, inter_node_bw=0.5))
    batch = Batch.from_lengths([1])
    plan = make_plan([[Group(0, 1, (MicroBatch((0,)),))]], batch, cost, planner="hand")
    sim = simulate(plan, batch, cost)
    assert sim.collectives == cost.step_collectives()
    if nodes * per == 4:
        assert sum(sim.collectives.values()) == pytest.approx(4.5)
    assert sim.collectives_s == pytest.approx(seconds)


def test_idle_ranks_between_busy_groups_and_a_second_batch():
    # Phase 0: rank 0 busy, rank 1 idle, ranks 2..3 busy; phase 1: ranks 0..1 together (one
    # member free long before the other), rank 2 idle, rank 3 alone. Idle groups between
    # busy ones: the per-rank clocks must stay aligned with the ranks.
    cost = comm_cost()
    batch = Batch.from_lengths([2, 4, 3, 5])
    plan = make_plan(
        [[Group(0, 1, (MicroBatch((0,)),)), Group(2, 2, (MicroBatch((1,), 2),))],
         [Group(0, 2, (MicroBatch((2,)),)), Group(2, 1), Group(3, 1, (MicroBatch((3,)),))]],
        batch, cost, planner="hand",
    )  # fmt: skip
    check_against_reference(plan, batch, cost)
    # The same cost model, another batch with the same ids: no cached row of the first.
    other = Batch.from_lengths([9, 1, 1, 1])
    plan = make_plan(
        [[Group(0, 4, (MicroBatch((0, 1, 2, 3)),))]], other, cost, planner="hand"
    )  # fmt: skip
    check_against_reference(plan, other, cost)


def test_shares_of_a_step_shorter_than_a_second():
    # Speed 100: 1 token with 1 recomputed layer at degree 1 takes (6 + 0.5 + 1) / 100 s.
    cost = toy_cost(1, 1, speed_factors=(100.0,))
    batch = Batch.from_lengths([1])
    plan = make_plan([[Group(0, 1, (MicroBatch((0,), 1),))]], batch, cost, planner="hand")
    summary = simulate(plan, batch, cost).summary()
    assert summary["step_time_s"] == pytest.approx(0.075)
    assert summary["recompute_share"] == pytest.approx(0.01 / 0.075)
