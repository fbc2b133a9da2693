"""Global batches and their plans, below the data path (runtime/data.py): an epoch's order cut
into batches (by count or token budget), the sequence ids a rank trains in a plan, and the
thread that plans batches ahead of training. Nothing here depends on the world size except
`local_ids`, which reads the plan."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan


def sample_shape(i: int, size) -> tuple[int, ...]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        shape = (int(size),)
    elif isinstance(size, (tuple, list)) and len(size) in (1, 3):
        shape = tuple(int(x) for x in size)
    else:
        raise DcpOptError(
            f"sizes[{i}]: {size!r} not allowed; allowed: a length (int) or (frames, height, width)"
        )
    if min(shape) < 1:
        raise DcpOptError(f"sizes[{i}]: {size!r} must be >= 1 in every entry")
    return shape


def form_batches(
    shapes: Sequence[tuple[int, ...]],
    order: Sequence[int],
    *,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    drop_last: bool = False,
) -> list[list[int]]:
    """Cut `order` (dataset indices) into global batches: `batch_size` samples each, or as
    many samples as fit in `max_tokens` (a sample larger than the budget forms a batch alone).
    `drop_last` drops a short final batch of the fixed-count mode."""
    if (batch_size is None) == (max_tokens is None):
        raise DcpOptError("batch_size / max_tokens: give exactly one of them")
    if batch_size is not None:
        if batch_size < 1:
            raise DcpOptError(f"batch_size: must be >= 1, got {batch_size}")
        out = [list(order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
        if drop_last and out and len(out[-1]) < batch_size:
            out.pop()
        return out
    if max_tokens < 1:
        raise DcpOptError(f"max_tokens: must be >= 1, got {max_tokens}")
    out, cur, used = [], [], 0
    for i in order:
        n = int(np.prod(shapes[i]))
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(int(i))
        used += n
    if cur:
        out.append(cur)
    return out


def local_ids(plan: Plan, rank: int) -> list[int]:
    """Sequence ids global rank `rank` trains in `plan` (every micro-batch of every group
    holding its unit), in execution order. A plan rank is a unit: with tensor parallelism
    GPU `u t + j` is TP rank j of unit u, and with a pipeline every stage's copy of unit u
    reads u's micro-batches (docs/plan-format.md, the rank map)."""
    unit = rank // plan.tensor_parallel
    if plan.pipeline is not None:  # stage s holds units [s n, (s + 1) n) of the world
        unit %= plan.num_ranks
    return [
        sid
        for _, g, _, mb in plan.micro_batches()
        if g.start_rank <= unit < g.start_rank + g.degree
        for sid in mb.sequence_ids
    ]


def default_planner() -> str:
    """The optimizing planner ("cpsat") when it is built in this checkout, else "greedy"."""
    from dcp_opt.solvers import available_planners  # public entry; imports no planner

    return "cpsat" if "cpsat" in available_planners() else "greedy"


@dataclass(frozen=True)
class PlannedBatch:
    """One global batch as this rank sees it. `samples` holds only this rank's samples, keyed
    by sequence id (= dataset index); `planning` is the planner's summary (rank 0 in
    broadcast mode shares it with every rank)."""

    step: int
    epoch: int
    plan: Plan
    batch: Batch
    samples: dict[int, Any]
    planning: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One line: planner, phases, groups as degree x micro-batches, recompute used."""
        phases = []
        for ph in self.plan.phases:
            busy = [g for g in ph.groups if g.micro_batches]
            phases.append(" ".join(f"d{g.degree}x{len(g.micro_batches)}" for g in busy))
        rec = max((mb.recompute_layers for *_, mb in self.plan.micro_batches()), default=0)
        return (
            f"{self.plan.planner}: {len(self.batch)} seqs, {self.batch.num_tokens} tokens, "
            f"phases [{' | '.join(phases)}], max recompute {rec}"
        )


class PlanAhead:
    """A daemon thread that plans batches in order, at most `depth` ahead of the consumer.

    Closed at interpreter exit too (`_close_all`, an atexit hook): a loop that ends while it
    still holds a loader iterator (`it = iter(loader); next(it)`, a `break`) leaves the thread
    alive, and a daemon thread frozen inside CP-SAT's C++ search while the interpreter
    finalises makes OR-Tools' worker threads call std::terminate ("terminate called without
    an active exception", SIGABRT: torchrun reports the finished job as failed). The hook
    stops the thread and waits for the plan it is making (one planner call: cpsat's
    `time_limit_s`, 0.2 s by default; at most 60 s, so a planner that never returns cannot
    hold the exit)."""

    _live: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, jobs: list, plan_fn: Callable, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(jobs, plan_fn), daemon=True, name="dcp-plan-ahead"
        )
        self._thread.start()
        PlanAhead._live.add(self)

    def _run(self, jobs, plan_fn):
        for job in jobs:
            try:
                item = ("ok", plan_fn(job))
            except Exception as e:  # noqa: BLE001 (re-raised in the consumer's thread)
                item = ("error", e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[0] == "error":
                return

    def get(self):
        status, value = self._queue.get()
        if status == "error":
            raise value
        return value

    def close(self, timeout_s: float | None = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        PlanAhead._live.discard(self)


@atexit.register
def _close_all() -> None:
    """Stop every plan-ahead thread still running and wait for it (see PlanAhead)."""
    for ahead in list(PlanAhead._live):
        ahead.close(timeout_s=60.0)


def run_batch_planner(name: str, batch: Batch, cost: CostModel, options: dict):
    from dcp_opt.solvers import run_planner  # public entry; imported on use (OR-Tools is heavy)

    t0 = time.perf_counter()
    result = run_planner(name, batch, cost, **options)
    result.stats.setdefault("loader_wall_s", time.perf_counter() - t0)
    return result


def rank_world(rank, world_size, group) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return (rank or 0), (world_size or 1)


def global_src(group) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)
