"""Planner latency helpers: the garbage-collector pause (solvers/common.py gc_paused) always
restores the collector's state, nested, concurrent, on error, and around a real plan."""

from __future__ import annotations

import gc
import threading

import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.common import gc_paused

from dcp_opt import Batch, CostModel, cluster_preset, model_preset


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_pause_restores_state_nested_and_on_error(gc_state, enabled):
    (gc.enable if enabled else gc.disable)()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
        raise RuntimeError("planner failed")
    assert gc.isenabled() == enabled


def test_overlapping_pauses_in_threads_leave_collector_on(gc_state):
    # A enters, B enters, A leaves, B leaves: the collector must come back on only at the end
    # (a naive save/restore per call would leave it off after B).
    gc.enable()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with gc_paused():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with gc_paused():
            b_in.set()
            a_out.wait(5)
            seen.append(gc.isenabled())  # A has left, B still plans: still paused

    ts = [threading.Thread(target=f) for f in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert seen == [False]
    assert gc.isenabled()


@pytest.mark.parametrize("planner", ["greedy", "cpsat"])
def test_planning_leaves_collector_enabled(gc_state, planner):
    gc.enable()
    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x8"))
    res = run_planner(planner, Batch.from_lengths([4096, 2048, 1024, 512] * 4), cost)
    assert res.plan is not None and gc.isenabled()
