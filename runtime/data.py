"""The data path: global batches from a dataset, planned ahead in the background, agreed on by
every rank, and loaded so that each rank reads only the samples its groups train.

    loader = DcpLoader(dataset, sizes, cost)          # sizes[i]: length or (F, H, W) of sample i
    for b in loader:                                  # b.plan, b.batch, b.samples (this rank's)
        execute_step(b.plan, task, model, b.samples, pool=pool, state=state, step=b.step)

- Batches: the epoch's indices (shuffled by (seed, epoch), the same order on every rank) are
  cut into global batches of `batch_size` samples or of at most `max_tokens` tokens. Sizes
  come from `sizes` (a list, or a callable index -> size) so no sample is loaded to plan.
- Planning runs in a background thread, `prefetch` batches ahead of training, with the
  optimizing planner ("cpsat") when it is built and "greedy" otherwise, through the public
  `dcp_opt.solvers.run_planner` (never solver internals).
- Agreement: `agree="broadcast"` plans on rank 0 only and broadcasts the plan JSON
  (`broadcast_object_list`, from the main thread, so it never interleaves with the training
  step's collectives); `agree="deterministic"` plans on every rank with a deterministic
  planner (greedy, or cpsat with `deterministic=True`). The executor's fingerprint check
  catches any disagreement before the step's collectives.
- Loading: a sequence id is the sample's dataset index. Each rank calls `dataset[i]` only
  for the sequences of the micro-batches of groups it belongs to, one batch ahead, in a
  loader thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.batch import Sequence as Seq
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan

AGREE_MODES = ("broadcast", "deterministic")


def _shape(i: int, size) -> tuple[int, ...]:
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
    """Sequence ids this rank trains in `plan` (every micro-batch of every group holding it),
    in execution order."""
    return [
        sid
        for _, g, _, mb in plan.micro_batches()
        if g.start_rank <= rank < g.start_rank + g.degree
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


class _PlanAhead:
    """A daemon thread that plans batches in order, at most `depth` ahead of the consumer."""

    def __init__(self, jobs: list, plan_fn: Callable, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(jobs, plan_fn), daemon=True, name="dcp-plan-ahead"
        )
        self._thread.start()

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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class DcpLoader:
    """Iterate an epoch of planned global batches (see the module docstring).

    `dataset`: anything with `__getitem__(index)`; `sizes`: a list, or a callable index ->
    length / (frames, height, width), for every index of `range(len(sizes))` or
    `range(len(dataset))`. `planner`: a name of `dcp_opt.solvers` or "auto". `rank` /
    `world_size` default to torch.distributed's (1 process when it is not initialised)."""

    def __init__(
        self,
        dataset,
        sizes: Sequence | Callable[[int], Any],
        cost: CostModel,
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        planner: str = "auto",
        planner_options: dict | None = None,
        agree: str = "broadcast",
        prefetch: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        group=None,
    ):
        if agree not in AGREE_MODES:
            raise DcpOptError(f"agree: {agree!r} not allowed; allowed: {list(AGREE_MODES)}")
        self.dataset, self.cost, self.agree, self.group = dataset, cost, agree, group
        self.rank, self.world_size = _rank_world(rank, world_size, group)
        if cost.cluster.num_gpus != self.world_size:
            raise DcpOptError(
                f"cost.cluster: {cost.cluster.num_gpus} ranks but the world has "
                f"{self.world_size}; allowed: a cluster of exactly world_size ranks"
            )
        count = len(sizes) if not callable(sizes) else len(dataset)
        get = sizes if callable(sizes) else sizes.__getitem__
        self.shapes = [_shape(i, get(i)) for i in range(count)]
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.shuffle, self.seed, self.drop_last, self.prefetch = shuffle, seed, drop_last, prefetch
        self.planner = default_planner() if planner == "auto" else planner
        self.planner_options = dict(planner_options or {})
        if agree == "deterministic" and self.planner == "cpsat":
            self.planner_options.setdefault("deterministic", True)
        self.epoch = 0
        form_batches(self.shapes, [], batch_size=batch_size, max_tokens=max_tokens)  # check

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """Dataset indices of every global batch of the current epoch (same on every rank)."""
        order = np.arange(len(self.shapes))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        return form_batches(
            self.shapes,
            order.tolist(),
            batch_size=self.batch_size,
            max_tokens=self.max_tokens,
            drop_last=self.drop_last,
        )

    def __len__(self) -> int:
        return len(self.batches())

    def make_batch(self, ids: Sequence[int]) -> Batch:
        return Batch(tuple(Seq(int(i), self.shapes[i]) for i in ids))

    def plan_batch(self, ids: Sequence[int]) -> tuple[str, dict]:
        """Plan one global batch: (plan JSON, planner summary). Raises if no valid plan."""
        result = _run_planner(self.planner, self.make_batch(ids), self.cost, self.planner_options)
        if not result.ok:
            raise DcpOptError(
                f"planner {self.planner!r}: no plan for a batch of {len(ids)} sequences "
                f"({result.status}: {result.message})"
            )
        summary = {k: v for k, v in result.summary().items() if k != "stats"}
        return result.plan.to_json(indent=None), summary

    def _plans_here(self) -> bool:
        return self.agree == "deterministic" or self.rank == 0

    def _agree(self, ahead: _PlanAhead | None) -> tuple[Plan, dict]:
        mine = None
        if ahead is not None:
            try:
                mine = ahead.get()
            except Exception as e:  # noqa: BLE001 (every rank must learn of it, not just rank 0)
                mine = ("error", f"{type(e).__name__}: {e}")
        if self.agree == "broadcast" and self.world_size > 1:
            import torch.distributed as dist

            box = [mine]
            dist.broadcast_object_list(box, src=_global_src(self.group), group=self.group)
            mine = box[0]
        text, summary = mine
        if text == "error":
            raise DcpOptError(f"data path: planning failed on the planning rank: {summary}")
        return Plan.from_json(text), summary

    def _load(self, plan: Plan) -> dict[int, Any]:
        return {sid: self.dataset[sid] for sid in local_ids(plan, self.rank)}

    def __iter__(self) -> Iterator[PlannedBatch]:
        jobs = self.batches()
        epoch = self.epoch
        ahead = _PlanAhead(jobs, self.plan_batch, self.prefetch) if self._plans_here() else None
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-load")
        try:
            pending: tuple[Plan, dict, Future] | None = None
            for k, ids in enumerate(jobs):
                if pending is None:
                    plan, summary = self._agree(ahead)
                    pending = (plan, summary, pool.submit(self._load, plan))
                plan, summary, fut = pending
                pending = None
                if k + 1 < len(jobs):  # agree on the next plan and start reading its samples
                    nxt, nsum = self._agree(ahead)
                    pending = (nxt, nsum, pool.submit(self._load, nxt))
                samples = fut.result()
                yield PlannedBatch(k, epoch, plan, self.make_batch(ids), samples, summary)
        finally:
            if ahead is not None:
                ahead.close()
            pool.shutdown(wait=True, cancel_futures=True)


def _run_planner(name: str, batch: Batch, cost: CostModel, options: dict):
    from dcp_opt.solvers import run_planner  # public entry; imported on use (OR-Tools is heavy)

    t0 = time.perf_counter()
    result = run_planner(name, batch, cost, **options)
    result.stats.setdefault("loader_wall_s", time.perf_counter() - t0)
    return result


def _rank_world(rank, world_size, group) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return (rank or 0), (world_size or 1)


def _global_src(group) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_global_rank(group, 0)
