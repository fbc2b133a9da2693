"""The planners' shared finish path (solvers/common.py) on a hand plan of the toy cost model
(tests/toy.py): what every PlanResult carries, checked against simulate() and lower_bound()
called here, and the garbage-collector pause every planner runs under."""

from __future__ import annotations

import gc
import time

import pytest
from dcp_opt.solvers.common import finish, gc_paused

from dcp_opt import Batch, Group, MicroBatch, lower_bound, simulate
from dcp_opt.validate import InvalidPlanError
from tests.toy import toy_cost

GROUPS = [[Group(0, 2, (MicroBatch((0,), 1),)), Group(2, 1, (MicroBatch((1,)), MicroBatch((2,))))]]


def test_finish_reports_the_simulated_plan_and_the_bound():
    cost, batch = toy_cost(), Batch.from_lengths([8, 2, 2])
    stats = {"nodes": 3}
    started = time.perf_counter()
    res = finish(GROUPS, batch, cost, planner="hand", started=started, stats=stats,
                 normalizer_kind="samples")  # fmt: skip
    sim = simulate(res.plan, batch, cost)
    assert (res.status, res.message, res.planner, res.ok) == ("feasible", "", "hand", True)
    assert res.plan.planner == "hand" and res.plan.normalizer_kind == "samples"
    assert res.plan.loss_normalizer == 3.0
    # toy arithmetic: ranks 0..1 28.5 s (tests/test_core.py::test_simulate_tiny_plan)
    assert res.predicted_step_time_s == sim.step_time_s == pytest.approx(28.5)
    assert res.plan.predicted_step_time_s == res.predicted_step_time_s
    assert res.plan.meta == {"imbalance": pytest.approx(sim.imbalance)}
    assert res.lower_bound_s == lower_bound(batch, cost).value_s
    assert 0 <= res.wall_time_s <= time.perf_counter() - started
    assert res.stats == stats and res.stats is not stats


def test_finish_passes_status_and_message_through():
    cost, batch = toy_cost(), Batch.from_lengths([8, 2, 2])
    res = finish(GROUPS, batch, cost, planner="p", started=time.perf_counter(),
                 status="optimal", message="proved")  # fmt: skip
    assert (res.status, res.message, res.plan.normalizer_kind) == ("optimal", "proved", "tokens")


def test_finish_refuses_an_invalid_plan_unless_told_not_to_check():
    cost, batch = toy_cost(), Batch.from_lengths([8, 2, 2])
    missing = [[Group(0, 2, (MicroBatch((0,), 1),))]]  # sequences 1 and 2 dropped
    with pytest.raises(InvalidPlanError, match="MISSING_SEQUENCE") as e:
        finish(missing, batch, cost, planner="bad", started=time.perf_counter())
    assert [v.code for v in e.value.violations] == ["MISSING_SEQUENCE"]
    res = finish(missing, batch, cost, planner="bad", started=time.perf_counter(), check=False)
    assert res.plan.sequence_ids() == [0]


def test_gc_paused_nests_and_restores_the_collector():
    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer pause still holds
        assert gc.isenabled()
        gc.disable()  # a collector the caller disabled stays disabled
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
