"""Property tests: the core's invariants over random valid plans, and every planner's over
random feasible instances (1 to 64 GPUs, non-powers of two, mixed clusters, 1D and 2D).

Example counts follow the hypothesis profile (tests/conftest.py): `ci` by default,
HYPOTHESIS_PROFILE=nightly for 10,000 per property.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from dataclasses import replace

import pytest
from dcp_opt.solvers import available_planners, get_planner
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_opt import (
    Batch,
    Cluster,
    CostModel,
    Group,
    MicroBatch,
    Plan,
    Sequence,
    lower_bound,
    make_plan,
    model_preset,
    simulate,
    validate,
)
from dcp_opt.analysis.bench import json_default
from dcp_opt.result import STATUSES
from tests import strategies as hs
from tests.brute_force import brute_force
from tests.counts import EXAMPLES
from tests.toy import toy_cost

REL = 1e-9  # relative tolerance of every "at least the bound" comparison
PLANNERS = available_planners()
# Planners that search (slower per call) get smaller instances in CI.
SLOW = {"cpsat"}


def planner_options(name: str) -> dict:
    """The deterministic options a planner accepts: a fixed seed, one worker, a short limit."""
    params = inspect.signature(get_planner(name)).parameters
    wanted = {"seed": 0, "deterministic": True, "num_workers": 1, "time_limit_s": 0.2}
    return {k: v for k, v in wanted.items() if k in params}


def run(name: str, inst: hs.Instance):
    return get_planner(name)(inst.batch, inst.cost, **planner_options(name))


def sizes(name: str) -> dict:
    return {"max_gpus": 16, "max_seqs": 8} if name in SLOW else {}


NIGHTLY_EXAMPLES = 10_000


def searching_examples() -> int:
    """Examples for a property that calls a searching planner or brute force: a third of the
    profile's (at least 5) to keep CI short; the nightly profile runs all of them (issue 7:
    at least 10,000 examples per property)."""
    n = settings().max_examples
    return n if n >= NIGHTLY_EXAMPLES else max(5, n // 3)


def budgeted(name: str, prop):
    """A searching planner gets `searching_examples()`."""
    if name not in SLOW:
        return prop
    return settings(max_examples=searching_examples())(prop)


# ---- core: any valid plan ----------------------------------------------------------------
@given(st.data())
def test_instances_are_feasible_by_construction(data):
    inst = data.draw(hs.instances())
    assert 1 <= inst.cluster.num_gpus <= 64
    inst.cost.check_fits(inst.batch)  # raises InfeasibleError otherwise


@given(st.data())
def test_random_plans_are_valid(data):
    inst = data.draw(hs.instances())
    plan = data.draw(hs.valid_plans(inst, cp=True))
    assert validate(plan, inst.batch, inst.cost) == []


@given(st.data())
def test_any_valid_plan_simulates_to_at_least_the_lower_bound(data):
    # The bound is certified: no plan at all may beat it, so the tight ("dense") plans drawn
    # here -- packed micro-batches, fewest recomputed layers, balanced groups -- must not.
    inst = data.draw(hs.instances())
    plan = data.draw(hs.valid_plans(inst, cp=True))
    sim = simulate(plan, inst.batch, inst.cost)
    bound = lower_bound(inst.batch, inst.cost)
    assert sim.step_time_s >= bound.value_s * (1 - REL), (sim.step_time_s, bound)
    assert bound.value_s >= max(bound.work_s, bound.longest_s) * (1 - REL)


@given(st.data())
def test_simulation_invariants(data):
    # For any valid plan: busy + idle = finish on every rank; step = finish + gradient sync;
    # a group's micro-batches run back to back and never overlap another phase's use of the
    # same rank; every sequence runs in exactly one event; peak memory within capacity.
    inst = data.draw(hs.instances(max_seqs=12))
    plan = data.draw(hs.valid_plans(inst, cp=True))
    cost, c = inst.cost, inst.cluster
    sim = simulate(plan, inst.batch, cost)
    tol = 1e-9 * max(sim.finish_s, 1e-12)
    assert sim.step_time_s == pytest.approx(sim.finish_s + cost.grad_sync_time(), rel=REL)
    assert (sim.busy_s + sim.idle_s) == pytest.approx([sim.finish_s] * c.num_gpus, rel=REL)
    assert min(sim.idle_s) >= -tol and 0 <= sim.imbalance <= 1 + REL
    assert sorted(s for e in sim.events for s in e.sequence_ids) == sorted(
        s.id for s in inst.batch.sequences
    )
    last_end = [0.0] * c.num_gpus  # events come phase by phase, group by group, in order
    for e in sim.events:
        ranks = range(e.start_rank, e.start_rank + e.degree)
        assert e.start_s >= max(last_end[r] for r in ranks) - tol
        for r in ranks:
            last_end[r] = e.end_s
    assert max(last_end) == pytest.approx(sim.finish_s, rel=REL, abs=1e-12)
    for r in range(c.num_gpus):
        assert sim.peak_memory_bytes[r] <= c.rank_memory(r) * cost.usable_memory_fraction * (
            1 + REL
        )


@given(st.data())
def test_random_plans_round_trip_through_json(data):
    inst = data.draw(hs.instances(max_seqs=12))
    plan = data.draw(hs.valid_plans(inst, cp=True))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert again.content_hash() == plan.content_hash()
    assert Plan.from_json(plan.to_json(indent=None)) == plan


@given(st.data())
def test_dropping_or_duplicating_a_sequence_is_caught(data):
    inst = data.draw(hs.instances(max_seqs=12))
    plan = data.draw(hs.valid_plans(inst))
    p, g, k, mb = data.draw(st.sampled_from(list(plan.micro_batches())))
    victim = data.draw(st.sampled_from(mb.sequence_ids))
    dropped = tuple(s for s in mb.sequence_ids if s != victim)
    dup = mb.sequence_ids + (victim,)
    codes_drop = _codes(_swap_mb(plan, p, g, k, dropped), inst)
    codes_dup = _codes(_swap_mb(plan, p, g, k, dup), inst)
    assert "MISSING_SEQUENCE" in codes_drop or "EMPTY_MICRO_BATCH" in codes_drop
    assert "DUPLICATE_SEQUENCE" in codes_dup


def _codes(plan: Plan, inst: hs.Instance) -> set[str]:
    return {v.code for v in validate(plan, inst.batch, inst.cost)}


def _swap_mb(plan: Plan, p: int, group: Group, k: int, ids: tuple[int, ...]) -> Plan:
    mbs = list(group.micro_batches)
    mbs[k] = MicroBatch(ids, mbs[k].recompute_layers)
    new = replace(group, micro_batches=tuple(mbs))
    phases = list(plan.phases)
    phases[p] = replace(phases[p], groups=tuple(new if x is group else x for x in phases[p].groups))
    return replace(plan, phases=tuple(phases))


# ---- core: the two bound bugs these properties found, as hand-built regressions ----------
def test_lower_bound_survives_packing():
    # Toy with a per-layer kernel constant: fwd 1 s, bwd 2 s per layer -> 2*(1+2) = 6 s per
    # micro-batch, + 0.5 s overhead. One GPU, 1-token sequences: alone 6*1 + 6.5 = 12.5 s.
    # Packed all three: 6*3 + 6.5 = 24.5 s. The old bound charged the 6 s constant to every
    # sequence: 3*(12.5 - 0.5) + 0.5 = 36.5 s > 24.5 s. Marginal work is 6 s each: 18 + 0.5.
    cost = toy_cost(1, 1, 200.0)
    blocks = {"layer": replace(cost.coeffs.blocks["layer"])}
    fwd, bwd = blocks["layer"].fwd, blocks["layer"].bwd
    blocks["layer"] = replace(
        blocks["layer"], fwd=replace(fwd, const=1.0), bwd=replace(bwd, const=2.0)
    )
    cost = cost.with_(coeffs=replace(cost.coeffs, blocks=blocks))
    batch = Batch.from_lengths([1, 1, 1])
    plan = make_plan([[Group(0, 1, (MicroBatch((0, 1, 2)),))]], batch, cost, planner="hand")
    assert validate(plan, batch, cost) == []
    assert simulate(plan, batch, cost).step_time_s == pytest.approx(24.5)
    assert lower_bound(batch, cost).value_s == pytest.approx(18.5)


def test_lower_bound_survives_slow_ranks_with_communication():
    # Toy on 1 node x 2 GPUs of speed 0.5, all-to-all 1 byte/token/layer at 1 B/s. T=4 tokens
    # fit only at d=2 (zero1 states 1*(2+4+12/2) = 12 B; d=2: 12 + 2*30 = 72 <= 100; d=1:
    # 12 + 4*30 = 132 > 100). Compute 6*4/2 + 0.5 = 12.5 s, at speed 0.5 -> 25 s; comm per
    # layer 1*4/2*(1/2) = 1 s, 4 all-to-all passes (2 layers fwd+bwd) -> 4 s: 29 s in all.
    # The old bound divided comm by the speed too: (12.5 + 4)/0.5 = 33 s > 29 s.
    cost = toy_cost(1, 2, 100.0, speed_factors=(0.5, 0.5))
    cost = cost.with_(coeffs=replace(cost.coeffs, a2a_bytes_per_token_layer=1.0))
    batch = Batch.from_lengths([4])
    plan = make_plan([[Group(0, 2, (MicroBatch((0,)),))]], batch, cost, planner="hand")
    assert validate(plan, batch, cost) == []
    assert simulate(plan, batch, cost).step_time_s == pytest.approx(29.0)
    assert lower_bound(batch, cost).value_s <= 29.0


# ---- every planner -----------------------------------------------------------------------
def test_some_planner_is_available():
    assert PLANNERS, "no planner module exists in this checkout"


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_plan_is_valid_and_at_least_the_bound(name):
    @given(st.data())
    def prop(data):
        EXAMPLES[f"valid_and_at_least_the_bound[{name}]"] += 1
        inst = data.draw(hs.instances(**sizes(name)))
        res = run(name, inst)
        assert res.status in STATUSES and res.ok, (res.status, res.message)
        assert validate(res.plan, inst.batch, inst.cost) == []
        sim = simulate(res.plan, inst.batch, inst.cost)
        bound = lower_bound(inst.batch, inst.cost)
        assert res.predicted_step_time_s == pytest.approx(sim.step_time_s, rel=REL)
        assert sim.step_time_s >= bound.value_s * (1 - REL), (sim.step_time_s, bound)
        # a planner may claim a tighter bound (an LP, the solver's own), never a looser one,
        # and never one above its own plan
        assert res.lower_bound_s >= bound.value_s * (1 - REL), (res.lower_bound_s, bound)
        assert res.predicted_step_time_s >= res.lower_bound_s * (1 - REL)

    budgeted(name, prop)()


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_is_deterministic_and_round_trips(name):
    @given(st.data())
    def prop(data):
        EXAMPLES[f"deterministic_and_round_trips[{name}]"] += 1
        inst = data.draw(hs.instances(**sizes(name)))
        a, b = run(name, inst), run(name, inst)
        assert a.plan.to_json() == b.plan.to_json()
        again = Plan.from_json(a.plan.to_json())
        assert again == a.plan and again.to_json() == a.plan.to_json()
        assert validate(again, inst.batch, inst.cost) == []
        text = json.dumps(a.summary(), default=json_default)  # numpy stats as the CLI writes
        assert json.loads(text)["planner"] == a.planner

    budgeted(name, prop)()


# greedy is a heuristic: monotonicity in memory is not guaranteed (regression example below).
MONOTONE_IN_MEMORY = [p for p in ("cpsat",) if p in PLANNERS]
MEMORY_NOISE = 1e-6


@pytest.mark.parametrize("name", MONOTONE_IN_MEMORY)
def test_more_memory_never_predicts_slower(name):
    # Doubling every GPU's memory keeps every old plan feasible (the fingerprint aside), so the
    # optimum cannot get slower: a plan the planner proves optimal for the larger memory is no
    # slower than its plan for the smaller one. Under the 0.2 s budget a plan that is only
    # "feasible" (or the greedy fallback) carries no such claim: one nightly example (pinned
    # below) found a 0.18 % slower feasible plan with twice the memory, equal at 5 s.
    key = f"more_memory_never_predicts_slower[{name}]"

    @given(st.data())
    def prop(data):
        EXAMPLES[key] += 1
        inst = data.draw(hs.instances(**sizes(name)))
        small_t = run(name, inst).predicted_step_time_s
        big = run(name, hs.Instance(doubled_memory(inst.cost), inst.batch))
        if big.status == "optimal":  # up to its integer units (see solvers/cpsat/plan.py)
            EXAMPLES[f"{key} optimal"] += 1
            slack = big.stats["optimal_within_s"]
            assert big.predicted_step_time_s <= small_t * (1 + MEMORY_NOISE) + slack, (big, small_t)

    before = EXAMPLES[key], EXAMPLES[f"{key} optimal"]
    budgeted(name, prop)()
    ran, proved = EXAMPLES[key] - before[0], EXAMPLES[f"{key} optimal"] - before[1]
    # Not vacuous: on these tiny instances CP-SAT proves most larger-memory plans optimal
    # (~2/3 of 300 random ones at 0.2 s).
    assert proved >= ran // 4, (proved, ran)


def doubled_memory(cost):
    c = cost.cluster
    mems = None if c.memory_per_rank is None else [2 * m for m in c.memory_per_rank]
    return cost.with_(cluster=c.with_(memory_bytes=2 * c.memory_bytes, memory_per_rank=mems))


# ---- brute force on tiny instances -------------------------------------------------------
@st.composite
def tiny_instances(draw, num_nodes: int, gpus_per_node: int) -> hs.Instance:
    cost = draw(hs.flops_costs(mixed=False)) if draw(st.booleans()) else draw(hs.toy_costs())
    cluster = cost.cluster.with_(num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    cost = hs.with_headroom(cost.with_(cluster=cluster))
    return hs.Instance(cost, draw(hs.batches_for(cost, max_seqs=4, tiny_ok=False)))


TINY_SHAPES = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (1, 3), (3, 1)]


@pytest.mark.parametrize("shape", TINY_SHAPES)
@settings(max_examples=searching_examples())
@given(data=st.data())
def test_brute_force_is_a_valid_plan_above_the_bound(shape, data):
    inst = data.draw(tiny_instances(*shape))
    t, plan = brute_force(inst.batch, inst.cost)
    assert validate(plan, inst.batch, inst.cost) == []
    assert simulate(plan, inst.batch, inst.cost).step_time_s == pytest.approx(t, rel=REL)
    assert t >= lower_bound(inst.batch, inst.cost).value_s * (1 - REL)
    for name in PLANNERS:
        # a bound a planner claims (an LP, CP-SAT's own) is certified only if no valid plan
        # beats it: the best single-phase plan is one. cpsat at "optimal" must match or beat
        # that plan (its search space contains every single-phase plan) up to the rounding
        # of its integer time units (stats["optimal_within_s"]; nightly found 0.5 unit).
        res = run(name, inst)
        assert res.lower_bound_s <= t * (1 + REL), (name, res.lower_bound_s, t)
        if name == "cpsat" and res.status == "optimal":  # up to its integer units
            slack = res.stats["optimal_within_s"]
            assert res.predicted_step_time_s <= t * (1 + 1e-6) + slack, (res, t)


@pytest.mark.parametrize(
    "small, big",
    [((1, 1), (1, 2)), ((1, 2), (1, 4)), ((1, 1), (2, 1)), ((2, 1), (4, 1)), ((1, 2), (2, 2))],
)
@settings(max_examples=searching_examples())
@given(data=st.data())
def test_more_gpus_never_predict_a_slower_optimum(small, big, data):
    # Every single-phase layout of the small cluster is a layout of the big one's first ranks
    # (same node size, allowed degrees a superset, more ranks only shrink zero-sharded model
    # states), so the best finish time cannot grow. Gradient sync is left out: it does grow
    # with the world size, by design of the cost model.
    inst = data.draw(tiny_instances(*small))
    c = inst.cluster
    big_cost = inst.cost.with_(cluster=c.with_(num_nodes=big[0], gpus_per_node=big[1]))
    t_small, _ = brute_force(inst.batch, inst.cost)
    t_big, _ = brute_force(inst.batch, big_cost)
    f_small = t_small - inst.cost.grad_sync_time()
    f_big = t_big - big_cost.grad_sync_time()
    assert f_big <= f_small * (1 + REL), (f_big, f_small)


@given(st.data())
def test_memory_margin_is_what_validate_enforces(data):
    # The safety margin is CostModel.usable_memory_fraction. Under any margin, validate flags
    # OUT_OF_MEMORY exactly when some micro-batch needs more than margin x its group's memory.
    inst = data.draw(hs.instances(max_seqs=12))
    plan = data.draw(hs.valid_plans(inst))
    frac = data.draw(st.floats(0.05, 1.0))
    cost = inst.cost.with_(usable_memory_fraction=frac)
    c = cost.cluster
    over = any(
        float(
            cost.memory(
                sum(inst.batch.by_id[s].num_tokens for s in mb.sequence_ids),
                g.degree,
                mb.recompute_layers,
            )
        )
        > frac * c.group_memory(g.start_rank, g.degree) * (1 + 1e-9)
        for _, g, _, mb in plan.micro_batches()
    )
    codes = {v.code for v in validate(plan, inst.batch, cost, check_fingerprint=False)}
    assert ("OUT_OF_MEMORY" in codes) == over


# ---- known planner weaknesses, pinned (found by the properties above; reported to the lead) --
def _llama7b_3x4(memory_bytes: float) -> CostModel:
    c = Cluster("hyp3x4", 3, 4, memory_bytes, 1e14, 100e9, 12.5e9)
    return CostModel(model_preset("llama-7b"), c, usable_memory_fraction=0.7)


@pytest.mark.parametrize("name", [p for p in ("greedy",) if p in PLANNERS])
def test_greedy_more_memory_pinned(name):
    # Found by hypothesis: doubling memory (219 -> 439 GB per GPU) changed greedy's chosen
    # candidate and its predicted step grew 47.81 s -> 49.31 s (+3.1 %); cpsat predicts
    # 47.81 s for both. Fixed by the 1.01 target in greedy's grid (ba102f1). Greedy stays a
    # heuristic whose monotonicity in memory is not guaranteed: no property asserts it.
    batch = Batch.from_lengths([8192, 114126, *[1] * 10, 32768, 1, 65536])
    small = run(name, hs.Instance(_llama7b_3x4(219342857142.85715), batch))
    big = run(name, hs.Instance(_llama7b_3x4(2 * 219342857142.85715), batch))
    assert big.predicted_step_time_s <= small.predicted_step_time_s * (1 + MEMORY_NOISE)


@pytest.mark.parametrize("name", [p for p in ("cpsat",) if p in PLANNERS])
def test_cpsat_optimal_is_no_slower_than_brute_force_pinned(name):
    # Open-Sora on 1 node x 2 GPUs (51 GB, 70 % usable, no optimizer sharding). Best
    # single-phase plan: both sequences in one micro-batch at degree 2 with 1 recomputed layer
    # (one 4 ms overhead saved, one layer's forward added): 0.58194 s. cpsat says "optimal" at
    # 0.58502 s (two micro-batches, no recompute) before its full slot model: packing that
    # needed more recompute than either sequence alone was outside its model. Fixed since.
    c = Cluster("hyp1x2", 1, 2, 51e9, 1e14, 100e9, 12.5e9)
    cost = CostModel(
        model_preset("opensora-stdit3-xl"),
        c,
        optimizer_sharding="none",
        usable_memory_fraction=0.7,
    )
    batch = Batch((Sequence(0, (1, 1, 54)), Sequence(1, (10, 20, 42))))
    t, _ = brute_force(batch, cost)
    res = run(name, hs.Instance(cost, batch))
    assert res.status == "optimal"
    assert res.predicted_step_time_s <= t * (1 + 1e-6), (res.predicted_step_time_s, t)


@pytest.mark.parametrize("name", [p for p in ("cpsat",) if p in PLANNERS])
def test_cpsat_optimal_within_its_units_pinned(name):
    # Found by the nightly brute-force property: Llama 7B, one node of 2 GPUs, sequences of 1
    # and 131072 tokens. Best: both in one micro-batch at degree 2 recomputing 30 layers,
    # 284.9118 s. cpsat keeps the greedy's 284.9190 s (the 1-token sequence in a phase of
    # its own) and proves it "optimal": the 7 ms are half of one integer unit (the incumbent's
    # finish / 20000), below what its model resolves. "optimal" holds up to
    # stats["optimal_within_s"].
    c = Cluster("hyp1x1", 1, 2, 268542857142.85715, 1e14, 100e9, 12.5e9)
    cost = CostModel(
        model_preset("llama-7b"), c, optimizer_sharding="none", usable_memory_fraction=0.7
    )
    batch = Batch((Sequence(0, (1,)), Sequence(1, (131072,))))
    t, _ = brute_force(batch, cost)
    res = run(name, hs.Instance(cost, batch))
    assert res.status in ("optimal", "feasible")
    assert res.predicted_step_time_s <= t * (1 + 1e-6) + res.stats["optimal_within_s"]
    assert res.stats["optimal_within_s"] < 1e-3 * t


LP = importlib.util.find_spec("dcp_opt.solvers.bounds.lp") is not None


@pytest.mark.parametrize("dense", [True, False])
@given(data=st.data())
def test_lp_bound_is_below_any_valid_plan(dense, data):
    # cpsat reports max(analytic, LP) as its bound; it is certified only if no valid plan
    # (here: tight random plans, many tiny sequences included) beats it
    assert LP, "solvers/bounds/lp.py is missing"
    from dcp_opt.solvers.bounds.lp import lp_bound

    inst = data.draw(hs.instances())
    plan = data.draw(hs.valid_plans(inst, dense=dense, cp=True))
    sim = simulate(plan, inst.batch, inst.cost)
    bound = lp_bound(inst.batch, inst.cost, upper_s=sim.step_time_s, time_limit_s=10.0)
    assert sim.step_time_s >= bound.value_s * (1 - REL), (sim.step_time_s, bound)
