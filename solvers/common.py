"""Shared tail of every planner: assemble, validate, simulate, bound -> PlanResult."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.build import make_plan
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group
from dcp_opt.result import PlanResult
from dcp_opt.simulate import simulate
from dcp_opt.validate import InvalidPlanError, validate

_gc_lock = threading.Lock()
_gc_pause = {"depth": 0, "was_enabled": False}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a plan is made. A planner allocates tens of
    thousands of small objects; a full collection triggered mid-plan walks every object of the
    process (torch, OR-Tools), 60-100 ms of a 1024 x 8192 plan on the 2-core box. Reference
    counting still frees the planner's objects; the collector resumes at exit. Nested and
    concurrent planners share one pause: the last to leave restores the state found by the
    first (a collector the caller had disabled stays disabled)."""
    with _gc_lock:
        if _gc_pause["depth"] == 0:
            _gc_pause["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_pause["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pause["depth"] -= 1
            if _gc_pause["depth"] == 0 and _gc_pause["was_enabled"]:
                # Collect the youngest generation now (a few ms: only objects made while
                # paused) so the allocation counter restarts: otherwise the first allocation
                # after enable() starts a collection that may cascade into a full one (60+ ms
                # at 2048 sequences) inside the planner's budget.
                gc.collect(0)
                gc.enable()


def finish(
    phases: Iterable[Iterable[Group]],
    batch: Batch,
    cost: CostModel,
    *,
    planner: str,
    started: float,
    status: str = "feasible",
    message: str = "",
    stats: dict | None = None,
    normalizer_kind: str | None = None,
    check: bool = True,
) -> PlanResult:
    """Build the plan, check it independently, and report its predicted time and gap.

    Raises InvalidPlanError if the planner produced an invalid plan (a bug, not user error).
    """
    plan = make_plan(phases, batch, cost, planner=planner, normalizer_kind=normalizer_kind)
    if check:
        violations = validate(plan, batch, cost)
        if violations:
            raise InvalidPlanError(violations)
    sim = simulate(plan, batch, cost, events=False)  # totals only: no timeline
    plan = replace(plan, predicted_step_time_s=sim.step_time_s, meta={"imbalance": sim.imbalance})
    bound = lower_bound(batch, cost)
    return PlanResult(
        status,
        plan,
        sim.step_time_s,
        bound.value_s,
        time.perf_counter() - started,
        planner,
        message,
        dict(stats or {}),
    )
