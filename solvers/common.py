"""Shared tail of every planner: assemble, validate, simulate, bound -> PlanResult."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from dcp_opt.batch import MAX_SEQUENCES as BATCH_MAX_SEQUENCES
from dcp_opt.batch import Batch
from dcp_opt.bounds import lower_bound
from dcp_opt.build import make_plan
from dcp_opt.cost import CostModel
from dcp_opt.cost.finite import check_step_finite
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Group
from dcp_opt.result import PlanResult
from dcp_opt.simulate import simulate
from dcp_opt.validate import InvalidPlanError, validate

# The most sequences one planner call takes. Planning holds per-sequence tables at every
# degree (numpy and Python lists) for the whole batch at once, so its peak memory grows
# linearly: greedy on h200x1024 (llama-7b) peaks at 1.07 GB RSS for 1,000,000 sequences (15-34 s
# on the shared 2-core box; the batch itself 0.32 GB) and 4.8 GB for 5,000,000 (330 s; the
# issue's run: 6.9 GB, 2 min 11 s). Above the cap a batch is refused
# with how to split it: one call plans one optimizer step, and a step of more sequences is
# several steps' worth (solvers/stream/step_former.py forms steps from a stream). The cap is
# the core's (dcp_opt.batch.MAX_SEQUENCES = 2**20, ~1.1 GB of planning at the cap): one number,
# so a batch that builds is never refused by every planner. Read here as a module global, so a
# test may lower it for the planners alone.
MAX_SEQUENCES = BATCH_MAX_SEQUENCES


def check_batch_size(batch: Batch, *, where: str = "planner") -> None:
    """Refuse a batch above MAX_SEQUENCES, saying how to split it (before any table)."""
    n = len(batch)
    if n > MAX_SEQUENCES:
        parts = -(-n // MAX_SEQUENCES)
        raise DcpOptError(
            f"{where}: batch of {n} sequences is more than the {MAX_SEQUENCES} one plan takes "
            f"(planning memory grows ~1 KB per sequence: ~1 GB at the cap); split it into "
            f"{parts} batches of at most {MAX_SEQUENCES} sequences (e.g. Batch(batch.sequences[k::"
            f"{parts}]) for k in range({parts})) and plan each as its own step"
        )


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
    check_step_finite(cost, planner, sim.step_time_s, bound.value_s)  # never an inf step
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
