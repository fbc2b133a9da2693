"""The CP-SAT planner: brute force on tiny instances, every fallback path, determinism across
processes, and hypothesis properties (valid, at least the bound).

Toy arithmetic (tests/toy.py): 4 GPUs of 100 bytes; T tokens at degree d with r recomputed
layers take 6T/d + 0.5 + rT/d seconds and need 9 + T/d * (30 - 8r) bytes per member.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
from functools import cache

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.cpsat import extract as cx
from dcp_opt.solvers.cpsat import model as cm
from dcp_opt.solvers.cpsat.plan import plan_cpsat
from dcp_opt.solvers.greedy.instance import Draft
from dcp_opt.solvers.greedy.plan import plan_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_opt import (
    Batch,
    CostModel,
    cluster_preset,
    lower_bound,
    model_preset,
    simulate,
    standard_batch,
    validate,
)
from dcp_opt.errors import DcpOptError
from tests import strategies as hs
from tests.toy import toy_cost


# ---- brute force over the model's plan space ----------------------------------------------
def brute_force(lengths: list[int], cost: CostModel) -> float:
    """Best step over: a phase 0 of sequences run alone on the whole cluster, then one layout
    of aligned groups (any multiset of allowed degrees that fits), every assignment of the
    other sequences to groups, every split of a group's sequences into micro-batches, each at
    the fewest recompute layers that fit. Toy sizes only (<= 6 sequences, <= 4 GPUs)."""
    n, N = len(lengths), cost.cluster.num_gpus
    L = cost.model.num_layers
    degrees = cost.cluster.allowed_degrees

    def mb_time(tokens: int, d: int) -> float:
        r = int(cost.min_recompute(tokens, d))
        f = [float(tokens) ** 2, float(tokens), 1.0]  # 1D features: sum s^2, tokens, count
        return float(cost.time(f, d, r)) if r >= 0 else float("inf")

    @cache
    def group_time(items: frozenset, d: int) -> float:
        if not items:
            return 0.0
        first = min(items)
        rest = items - {first}
        best = float("inf")
        for k in range(len(rest) + 1):  # the micro-batch holding `first`, then the others
            for mates in itertools.combinations(sorted(rest), k):
                mb = (first, *mates)
                t = mb_time(sum(lengths[i] for i in mb), d)
                best = min(best, t + group_time(rest - set(mates), d))
        return best

    layouts = [
        c
        for m in range(1, N + 1)
        for c in itertools.combinations_with_replacement(degrees, m)
        if sum(c) <= N
    ]
    best = float("inf")
    for p0 in itertools.product((False, True), repeat=n):
        head = sum(mb_time(lengths[i], N) for i in range(n) if p0[i])
        rest = [i for i in range(n) if not p0[i]]
        if not rest:
            best = min(best, head)
            continue
        for layout in layouts:
            for assign in itertools.product(range(len(layout)), repeat=len(rest)):
                loads = [
                    group_time(frozenset(i for i, g in zip(rest, assign, strict=True) if g == k), d)
                    for k, d in enumerate(layout)
                ]
                best = min(best, head + max(loads))
    assert L >= 0
    return best + cost.grad_sync_time()


TINY = [
    [1, 1, 1, 2],  # packing pays: 1+1+1 tokens share one micro-batch at d=1
    [12, 2, 2],  # the 12-token one needs d=4 (r=0) or d=2 with r=2
    [3, 5, 1, 2, 4],  # mixed: recompute at d=1 for 4 and 5 tokens
    [6, 6, 1, 1, 1, 1],  # two at d=2 without recompute, four short ones
]


@pytest.mark.parametrize("lengths", TINY)
def test_matches_brute_force_on_tiny_instances(lengths):
    cost = toy_cost()
    batch = Batch.from_lengths(lengths)
    res = plan_cpsat(batch, cost, time_limit_s=10.0, deterministic=True)
    assert res.stats["exact_model"] is True
    assert validate(res.plan, batch, cost) == []
    best = brute_force(lengths, cost)
    # The plan (best of greedy and model) and the model's own proven optimum both equal the
    # brute force; integer units round each time up by < 1/20000 of the incumbent.
    assert res.predicted_step_time_s == pytest.approx(best, rel=1e-3)
    assert res.stats["cpsat_status"] == "OPTIMAL"
    assert res.stats["model_bound_s"] == pytest.approx(best, rel=1e-3)


def test_brute_force_hand_case():
    # [12, 2, 2]: the 12-token sequence takes 18.5 s at d=4 (r=0, 99 B); the two 2-token
    # ones run on two GPUs (12.5 s each, 69 B) after it, or packed at d=4 (4 tokens:
    # 9 + 30 = 39 B; 6*4/4 + 0.5 = 6.5 s): 18.5 + 6.5 = 25 s... packed with the long one
    # at d=4 (14 tokens need r=1: 9 + 3.5*22 = 86 B): 6*14/4 + 0.5 + 14/4 = 25 s. Best 25.
    assert brute_force([12, 2, 2], toy_cost()) == pytest.approx(25.0)


# ---- fallbacks ------------------------------------------------------------------------------
def _setup():
    cost = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))
    batch = standard_batch("2d-long", 1)
    return batch, cost, plan_greedy(batch, cost)


def _assert_fallback(res, greedy, caplog, why: str, level: int = logging.WARNING):
    """A fallback returns the greedy plan and leaves one log record at `level`: WARNING for a
    fault (exception, invalid or infeasible model), INFO for the budget running out."""
    assert res.status == "fallback"
    assert why in res.message
    assert res.plan.content_hash() == greedy.plan.content_hash()
    logged = [r for r in caplog.records if r.name.endswith("cpsat") and "greedy" in r.message]
    assert [r.levelno for r in logged] == [level]


def test_solver_exception_falls_back(monkeypatch, caplog):
    batch, cost, greedy = _setup()

    def boom(self, model, *a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(cm.cp_model.CpSolver, "solve", boom)
    with caplog.at_level(logging.INFO):
        res = plan_cpsat(batch, cost, time_limit_s=1.0)
    _assert_fallback(res, greedy, caplog, "RuntimeError: injected")


def test_timeout_without_solution_falls_back(monkeypatch, caplog):
    # The budget running out before a solution is expected online: logged at INFO only.
    batch, cost, greedy = _setup()
    monkeypatch.setattr(cm.cp_model.CpSolver, "solve", lambda self, m, *a, **k: cm.cp_model.UNKNOWN)
    with caplog.at_level(logging.INFO):
        res = plan_cpsat(batch, cost, time_limit_s=1.0)
    _assert_fallback(res, greedy, caplog, "UNKNOWN without a solution", logging.INFO)


def test_infeasible_model_falls_back_with_a_warning(monkeypatch, caplog):
    # The greedy hint is a solution, so INFEASIBLE means a wrong model: a fault, WARNING.
    batch, cost, greedy = _setup()
    monkeypatch.setattr(
        cm.cp_model.CpSolver, "solve", lambda self, m, *a, **k: cm.cp_model.INFEASIBLE
    )
    with caplog.at_level(logging.INFO):
        res = plan_cpsat(batch, cost, time_limit_s=1.0)
    _assert_fallback(res, greedy, caplog, "INFEASIBLE without a solution")


def test_invalid_cpsat_plan_falls_back(monkeypatch, caplog):
    batch, cost, greedy = _setup()
    inst_holder = {}
    real = cx.extract

    def bad_extract(solver, data, v, place, cluster):
        placed, pref, own = real(solver, data, v, place, cluster)
        inst_holder["n"] = len(data.inst.ids)
        # Sequence 0 twice and a group at a misaligned rank: validate() must reject it.
        j = own.groups[0][1]
        dup = Draft([], [(3, j, [([0], 0)]), *own.groups], 0.0, ("injected",))
        return placed, pref, dup

    monkeypatch.setattr(cx, "extract", bad_extract)
    monkeypatch.setattr(cx, "draft_finish", lambda d, inst, cost: 0.0)
    with caplog.at_level(logging.INFO):
        res = plan_cpsat(batch, cost, time_limit_s=1.0)
    _assert_fallback(res, greedy, caplog, "failed validate()")
    assert validate(res.plan, batch, cost) == []


def test_cpsat_plan_out_of_memory_falls_back(monkeypatch, caplog):
    # The model's plan (forced to look best) has a micro-batch that does not fit in memory.
    from dcp_opt.solvers.cpsat import plan as cpsat

    batch, cost, greedy = _setup()
    real = cpsat.to_phases

    def misfit(draft, inst, cost):
        return None if draft.how[0].startswith("cpsat") else real(draft, inst, cost)

    monkeypatch.setattr(cpsat, "to_phases", misfit)
    monkeypatch.setattr(cx, "draft_finish", lambda d, inst, cost: 0.0)
    with caplog.at_level(logging.INFO):
        res = plan_cpsat(batch, cost, time_limit_s=1.0)
    _assert_fallback(res, greedy, caplog, "does not fit in memory")


def test_unplaceable_layout_falls_back(monkeypatch, caplog):
    batch, cost, greedy = _setup()
    monkeypatch.setattr(cx, "extract", lambda *a, **k: None)
    with caplog.at_level(logging.INFO):
        res = plan_cpsat(batch, cost, time_limit_s=1.0)
    _assert_fallback(res, greedy, caplog, "could not be placed")


def test_mixed_cluster_gets_the_greedy_plan():
    base = cluster_preset("h200x8")
    cluster = base.with_(speed_factors=(0.5,) * 4 + (1.0,) * 4, name="mixed")
    cost = CostModel(model_preset("llama-1b"), cluster)
    batch = standard_batch("1d-balanced", 0, num_gpus=8)
    res = plan_cpsat(batch, cost)
    assert res.status == "fallback" and "homogeneous" in res.message
    assert res.plan.content_hash() == plan_greedy(batch, cost).plan.content_hash()


# ---- quality and bounds ---------------------------------------------------------------------
def test_never_slower_than_greedy_or_named_incumbents():
    cost = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))
    for seed in (1, 2):
        batch = standard_batch("2d-long", seed)
        names = ("static_tuned", "dcp_inter_pac")
        res = plan_cpsat(batch, cost, time_limit_s=0.5, incumbents=names)
        assert validate(res.plan, batch, cost) == []
        others = [plan_greedy(batch, cost)] + [run_planner(n, batch, cost) for n in names]
        assert res.predicted_step_time_s <= min(o.predicted_step_time_s for o in others) + 1e-12
        assert res.lower_bound_s >= lower_bound(batch, cost).value_s


def test_improves_on_greedy_given_time():
    # 2d-long seed 2 (13 videos): greedy 1.3183 s, CP-SAT 1.3058 s (-0.95 %). Seed 1, the
    # instance this test used before, greedy now solves as well as CP-SAT (greedy_level's
    # packed overflow-first split and the tree candidate). Deterministic time, so machine
    # load cannot starve the solver.
    cost = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x32"))
    batch = standard_batch("2d-long", 2)
    greedy = plan_greedy(batch, cost)
    res = plan_cpsat(batch, cost, time_limit_s=1.5, deterministic=True)
    assert res.predicted_step_time_s < greedy.predicted_step_time_s * 0.995


# ---- determinism ----------------------------------------------------------------------------
SCRIPT = """
import sys
from dcp_opt import CostModel, cluster_preset, model_preset, standard_batch
from dcp_opt.solvers.cpsat.plan import plan_cpsat
name, model = sys.argv[1], sys.argv[2]
cost = CostModel(model_preset(model), cluster_preset("h200x32"))
res = plan_cpsat(standard_batch(name, 1), cost, time_limit_s=0.2, deterministic=True)
sys.stdout.write(res.plan.to_json())
"""


@pytest.mark.parametrize("name,model", [("2d-long", "opensora-stdit3-xl"), ("1d-long", "llama-7b")])
def test_deterministic_mode_is_byte_identical_across_processes(name, model):
    outs = [
        subprocess.run(
            [sys.executable, "-c", SCRIPT, name, model], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert outs[0] == outs[1]
    assert json.loads(outs[0])["planner"] == "cpsat"


# ---- properties -----------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(st.data())
def test_every_result_valid_and_at_least_the_bound(data):
    inst = data.draw(hs.instances(max_gpus=16, max_seqs=8))
    res = plan_cpsat(inst.batch, inst.cost, time_limit_s=0.3, deterministic=True)
    assert res.ok
    assert validate(res.plan, inst.batch, inst.cost) == []
    sim = simulate(res.plan, inst.batch, inst.cost)
    assert res.predicted_step_time_s == pytest.approx(sim.step_time_s, rel=1e-9)
    assert sim.step_time_s >= res.lower_bound_s * (1 - 1e-9)
    assert res.lower_bound_s >= lower_bound(inst.batch, inst.cost).value_s * (1 - 1e-12)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_lp_bound_is_below_every_plan(data):
    inst = data.draw(hs.instances(max_gpus=32, max_seqs=24))
    greedy = plan_greedy(inst.batch, inst.cost)
    lp = lp_bound(inst.batch, inst.cost, time_limit_s=0.1)
    assert lp.value_s >= lower_bound(inst.batch, inst.cost).value_s * (1 - 1e-12)
    assert lp.value_s <= greedy.predicted_step_time_s * (1 + 1e-9)


# ---- planning ahead (solvers/stream/async_plan.py) -------------------------------------------------
def test_async_planner_plans_ahead_in_order_and_round_trips():
    from dcp_opt.solvers.stream.async_plan import AsyncPlanner, PlannedBatch

    cost = toy_cost()
    batches = [Batch.from_lengths(x) for x in TINY[:3]]
    with AsyncPlanner(cost, "cpsat", depth=1, deterministic=True, time_limit_s=1.0) as ap:
        for k, b in enumerate(batches):
            ap.submit(k, b)
        got = [ap.result(k, timeout=60) for k in range(3)]
    for k, (b, t) in enumerate(zip(batches, got, strict=True)):
        assert t.step == k and validate(t.plan(), b, cost) == []
        direct = plan_cpsat(b, cost, time_limit_s=1.0, deterministic=True)
        assert t.plan_json == direct.plan.to_json()  # deterministic: same plan as inline
        again = PlannedBatch.from_json(t.to_json())  # what rank 0 would broadcast
        assert again.plan_json == t.plan_json and again.plan_hash == t.plan_hash


def test_async_planner_bounds_its_queue_and_reports_errors():
    import threading

    from dcp_opt.solvers.stream.async_plan import AsyncPlanner

    from dcp_opt import DcpOptError

    with pytest.raises(DcpOptError, match="planner"):
        AsyncPlanner(toy_cost(), "no-such-planner")
    gate = threading.Event()
    ap = AsyncPlanner(toy_cost(), "greedy", depth=1)

    def slow(batch, cost, **kw):
        gate.wait(10)
        if len(batch) == 1:
            raise ValueError("injected")
        return plan_greedy(batch, cost)

    ap._plan = slow
    ap.submit(0, Batch.from_lengths([1]))  # taken by the worker, which waits on the gate
    ap.submit(1, Batch.from_lengths([1, 1]))  # fills the one-slot queue
    blocked = threading.Thread(target=ap.submit, args=(2, Batch.from_lengths([2])))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # a third batch waits for room: planning stays one step ahead
    gate.set()
    blocked.join(10)
    with pytest.raises(ValueError, match="injected"):
        ap.result(0, timeout=10)
    assert ap.result(1, timeout=10).plan().num_micro_batches >= 1
    ap.close()


@pytest.mark.parametrize(
    "option, value",
    [("time_limit_s", -1.0), ("time_limit_s", float("nan")), ("seed", -1), ("num_workers", 0)],
)
def test_bad_options_are_a_clear_error(option, value):
    cost = CostModel(model_preset("llama-1b"), cluster_preset("h200x8"))
    with pytest.raises(DcpOptError, match=f"cpsat.{option}"):
        run_planner("cpsat", Batch.from_lengths([1024, 2048]), cost, **{option: value})
