"""One typed result per solve (scipy OptimizeResult style): never None, always a status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan import Plan

STATUSES = ("optimal", "feasible", "fallback", "infeasible")


@dataclass(frozen=True)
class PlanResult:
    status: str
    plan: Plan | None
    predicted_step_time_s: float
    lower_bound_s: float
    wall_time_s: float
    planner: str
    message: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """Relative gap to the lower bound: predicted / bound - 1."""
        if self.lower_bound_s <= 0 or self.plan is None:
            return float("inf")
        return self.predicted_step_time_s / self.lower_bound_s - 1.0

    @property
    def ok(self) -> bool:
        return self.plan is not None and self.status != "infeasible"

    def summary(self) -> dict:
        return {
            "planner": self.planner,
            "status": self.status,
            "message": self.message,
            "predicted_step_time_s": self.predicted_step_time_s,
            "lower_bound_s": self.lower_bound_s,
            "gap": self.gap,
            "wall_time_s": self.wall_time_s,
            "stats": self.stats,
        }
