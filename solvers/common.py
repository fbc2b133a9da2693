"""Shared tail of every planner: assemble, validate, simulate, bound -> PlanResult."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.build import make_plan
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group
from dcp_opt.result import PlanResult
from dcp_opt.simulate import simulate
from dcp_opt.validate import InvalidPlanError, validate


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
