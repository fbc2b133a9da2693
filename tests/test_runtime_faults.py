"""Faults never hang: a plan mismatch fails on every rank before any step collective, and a
rank that raises or dies mid-step makes every rank fail within a bounded time (process-group
timeouts, here 5 s)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from dcp_opt.runtime import (
    LMTask,
    MicroBatchOutOfMemoryError,
    PlanMismatchError,
    SPState,
    execute_step,
    parallelize,
)
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch
from dcp_opt.plan import Group, MicroBatch, Plan
from tests.test_runtime_equiv import cost_for, make_data, make_model, make_plan

TIMEOUT_S = 5.0
BATCH = Batch.from_lengths([6, 4, 9])


def plan_for(order: tuple[int, ...]) -> Plan:
    """World 2: one degree-2 group running one micro-batch per sequence, in `order`."""
    mbs = tuple(MicroBatch((s,), 0) for s in order)
    return make_plan([[Group(0, 2, mbs)]], BATCH, cost_for("1d", 2), planner="hand")


@dataclass(frozen=True)
class FailingTask:
    """LMTask that fails on `rank` at its micro-batch number `at` (after earlier ones ran
    their collectives), by raising or by killing the process."""

    rank: int
    at: int
    how: str

    def run(self, model, samples, state, **kw):
        if state.sp.rank == self.rank and samples[0][0] == self.at:
            if self.how == "exit":
                os._exit(3)
            raise RuntimeError("injected failure")
        return LMTask().run(model, samples, state, **kw)


def job_step(ctx, plans: dict, task):
    model = make_model("1d", 3)
    state = SPState()
    parallelize(model, state)
    plan = Plan.from_json(plans[ctx.rank])
    try:
        execute_step(
            plan, task, model, make_data("1d", BATCH, 3), pool=ctx.pool, state=state, step=0
        )
    except PlanMismatchError as e:
        # No backward ran anywhere: the check precedes every step collective.
        return "mismatch", str(e), all(p.grad is None for p in model.parameters())
    return "ok", None, None


@pytest.fixture
def workers():
    w = DistWorkers(2, timeout_s=TIMEOUT_S)
    yield w
    w.close()


def test_plan_mismatch_fails_every_rank_before_any_collective(workers):
    a, b = plan_for((0, 1, 2)).to_json(), plan_for((2, 1, 0)).to_json()
    results = workers.run(job_step, {0: a, 1: b}, LMTask())
    for status, message, untouched in results:
        assert status == "mismatch"
        assert "ranks [0]" in message and "ranks [1]" in message
        assert untouched
    # The group is still in step: a matching plan runs right after on the same processes.
    assert [r[0] for r in workers.run(job_step, {0: a, 1: a}, LMTask())] == ["ok", "ok"]


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_rank_failing_mid_step_fails_every_rank(workers, how):
    plan = plan_for((0, 1, 2)).to_json()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker failure"):
        workers.run(job_step, {0: plan, 1: plan}, FailingTask(1, 1, how), wait_s=60.0)
    elapsed = time.monotonic() - started
    # Rank 1 fails at its second micro-batch; rank 0 is then inside an all-to-all with it and
    # must fail too (peer gone or the 5 s group timeout), not hang.
    assert sorted(workers.errors) == [0, 1]
    assert elapsed < 6 * TIMEOUT_S
    if how == "raise":
        assert "injected failure" in workers.errors[1]
    else:
        assert "exited with code 3" in workers.errors[1]


@dataclass(frozen=True)
class OOMTask:
    """LMTask whose micro-batch holding sequence `at` runs out of memory on every rank: as
    torch.OutOfMemoryError, or as the plain RuntimeError some allocators raise."""

    at: int
    plain: bool = False

    def run(self, model, samples, state, **kw):
        if any(sid == self.at for sid, _ in samples):
            if self.plain:
                raise RuntimeError("HIP error: Out Of Memory while allocating 2.00 GiB")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return LMTask().run(model, samples, state, **kw)


def job_oom(ctx, plan_json: str, task):
    model = make_model("1d", 3)
    state = SPState()
    parallelize(model, state)
    try:
        execute_step(
            Plan.from_json(plan_json), task, model, make_data("1d", BATCH, 3),
            pool=ctx.pool, state=state, step=0,
        )  # fmt: skip
    except MicroBatchOutOfMemoryError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("plain", [False, True], ids=["OutOfMemoryError", "RuntimeError"])
def test_out_of_memory_names_the_plan_entry(workers, plain):
    # Micro-batches run in order (0, 2, 1): sequence 2 is micro-batch 1 of the degree-2 group.
    plan = plan_for((0, 2, 1)).to_json()
    for rank, message in enumerate(workers.run(job_oom, plan, OOMTask(2, plain))):
        assert message.startswith(f"rank {rank}: out of memory in phase 0, group ranks 0..1 ")
        assert "phase 0, group ranks 0..1 (degree 2), micro-batch 1" in message
        assert "sequences [2], recompute_layers 0" in message
        assert "usable_memory_fraction" in message
        cause = "RuntimeError: HIP error" if plain else "OutOfMemoryError: CUDA out of memory"
        assert cause in message


def test_other_errors_are_not_reported_as_out_of_memory(workers):
    plan = plan_for((0, 2, 1)).to_json()
    with pytest.raises(RuntimeError, match="worker failure"):
        workers.run(job_oom, plan, FailOnRank(0, 2), wait_s=60.0)
    assert "injected failure" in workers.errors[0]
    assert "MicroBatchOutOfMemoryError" not in workers.errors[0]


# ---- failures elsewhere: during the gradient sum, in a later phase, away from rank 0 ------
@dataclass(frozen=True)
class FailOnRank:
    """LMTask that fails on global rank `rank` at the micro-batch holding sequence `at`."""

    rank: int
    at: int
    how: str = "raise"

    def run(self, model, samples, state, **kw):
        if dist.get_rank() == self.rank and any(sid == self.at for sid, _ in samples):
            if self.how == "exit":
                os._exit(3)
            raise RuntimeError("injected failure")
        return LMTask().run(model, samples, state, **kw)


def job_fail_in_sum(ctx, plan_json: str, rank: int, at_call: int, how: str):
    """One step with one bucket per parameter; `rank` fails at its all-reduce number
    `at_call` of the gradient sum (earlier buckets were summed by every rank)."""
    real, calls = dist.all_reduce, [0]

    def failing(*a, **k):
        calls[0] += 1
        if ctx.rank == rank and calls[0] == at_call:
            if how == "exit":
                os._exit(3)
            raise RuntimeError("injected failure in the gradient sum")
        return real(*a, **k)

    model = make_model("1d", 3)
    state = SPState()
    parallelize(model, state)
    dist.all_reduce = failing
    try:
        execute_step(
            Plan.from_json(plan_json), LMTask(), model, make_data("1d", BATCH, 3),
            pool=ctx.pool, state=state, step=0, bucket_bytes=1,
        )  # fmt: skip
    finally:
        dist.all_reduce = real
    return calls[0]


def assert_every_rank_fails(workers, world, elapsed, failing_rank, how, injected):
    """Every rank reports an error (none hangs, none claims success) within the bound; the
    failing rank names the injected failure, the others a collective that lost its peer."""
    assert sorted(workers.errors) == list(range(world)), workers.errors
    assert elapsed < 6 * TIMEOUT_S
    if how == "raise":
        assert injected in workers.errors[failing_rank]
    else:
        assert "exited with code 3" in workers.errors[failing_rank]
    for r, message in workers.errors.items():
        if r != failing_rank:
            # gloo's own words: "Timed out waiting 5000ms for recv ..." or a closed peer
            assert "execute_step" in message, message
            assert re.search(r"Timed out|[Cc]onnection|peer", message), message


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_rank_failing_in_the_gradient_sum_fails_every_rank(workers, how):
    plan = plan_for((0, 1, 2)).to_json()
    buckets = len(list(make_model("1d", 3).parameters()))  # one per parameter
    assert workers.run(job_fail_in_sum, plan, -1, 0, how) == [buckets, buckets]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker failure"):
        workers.run(job_fail_in_sum, plan, 1, 3, how, wait_s=60.0)
    elapsed = time.monotonic() - started
    assert_every_rank_fails(workers, 2, elapsed, 1, how, "injected failure in the gradient sum")


def test_rank_failing_in_a_later_phase_fails_every_rank(workers):
    # Phase 0 runs sequence 0 on both ranks; phase 1 runs 1 then 2; rank 1 fails at 2.
    cost = cost_for("1d", 2)
    phases = [[Group(0, 2, (MicroBatch((0,), 0),))]]
    phases.append([Group(0, 2, (MicroBatch((1,), 0), MicroBatch((2,), 1)))])
    plan = make_plan(phases, BATCH, cost, planner="hand").to_json()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="worker failure"):
        workers.run(job_step, {0: plan, 1: plan}, FailOnRank(1, 2), wait_s=60.0)
    elapsed = time.monotonic() - started
    assert_every_rank_fails(workers, 2, elapsed, 1, "raise", "injected failure")


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_rank_failing_in_a_group_without_rank_0_fails_every_rank(how):
    # World 4: ranks 0..1 run sequence 0 and wait in the gradient sum; ranks 2..3 run 1 then
    # 2, and rank 3 fails at 2 while rank 2 waits in its all-to-all.
    plan = make_plan(
        [[Group(0, 2, (MicroBatch((0,), 0),)), Group(2, 2, (MicroBatch((1,), 0), MicroBatch((2,), 0)))]],
        BATCH, cost_for("1d", 4), planner="hand",
    ).to_json()  # fmt: skip
    workers = DistWorkers(4, timeout_s=TIMEOUT_S)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="worker failure"):
            workers.run(job_step, dict.fromkeys(range(4), plan), FailOnRank(3, 2, how), wait_s=60.0)
        elapsed = time.monotonic() - started
        assert_every_rank_fails(workers, 4, elapsed, 3, how, "injected failure")
    finally:
        workers.close()
