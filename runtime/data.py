"""The data path: global batches from a dataset, planned ahead in the background, agreed on by
every rank, and loaded so that each rank reads only the samples its groups train.

    sampler = DcpBatchSampler(sizes, cost, batch_size=8)   # sizes[i]: length or (F, H, W)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_samples,
                        num_workers=2, pin_memory=True, persistent_workers=True)
    for b in sampler.planned(loader):                 # b.plan, b.batch, b.samples (this rank's)
        execute_step(b.plan, task, model, b.samples, pool=pool, state=state, step=step)

    loader = DcpLoader(dataset, sizes, cost, batch_size=8)   # the short path, same sampler
    for b in loader: ...                              # samples read in a thread of this process

- Batches: the epoch's indices (shuffled by (seed, epoch), the same order on every rank) are
  cut into global batches of `batch_size` samples or of at most `max_tokens` tokens. Sizes
  come from `sizes` (a list, or a callable index -> size) so no sample is loaded to plan.
  Batches never depend on the world size or the cost model, so a job resumed on another
  number of ranks trains the same global batches (only their plans change).
- Planning runs in a background thread, `prefetch` batches ahead of training, with the
  optimizing planner ("cpsat") when it is built and "greedy" otherwise, through the public
  `dcp_opt.solvers.run_planner` (never solver internals).
- Agreement: `agree="broadcast"` plans on rank 0 only and broadcasts the plan JSON (as bytes,
  runtime/wire.py: never pickle) from the main thread on a gloo group of its own (made by the sampler), so it never interleaves with
  the training step's collectives nor touches a GPU stream, even when a DataLoader asks for
  batches ahead; every broadcast names its (epoch, batch), checked on receipt.
  `agree="deterministic"` plans on every rank with a deterministic planner (greedy, or cpsat
  with `deterministic=True`); the pipeline planners, whose deadlines are CPU seconds, are
  refused with it (TIMED_PLANNERS). The executor's fingerprint check catches any
  disagreement before the step's collectives.
- Loading: a sequence id is the sample's dataset index. A rank reads `dataset[i]` only for
  the sequences of the micro-batches of groups it belongs to: DataLoader workers receive
  exactly those ids (the sampler yields them, in plan order, and keeps the batch's plan;
  `sampler.planned(loader)` pairs them again, since a DataLoader delivers batches in sampler
  order); DcpLoader reads them one batch ahead in a loader thread.
- State: `state_dict()` / `load_state_dict()` follow torchdata's StatefulDataLoader: the state
  of the batches handed to the training loop (not of those prefetched), loaded into the next
  iteration. It is rank-independent: (seed, epoch, batches done) plus a fingerprint of the
  epoch's batches that catches a resume on other data. No sample is ever carried over: a
  batch is a function of the epoch's order alone.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from dcp_opt.batch import Batch
from dcp_opt.batch import Sequence as Seq
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan

from .batches import (  # PlannedBatch, form_batches, local_ids: importable from here too
    PlanAhead,
    PlannedBatch,
    default_planner,
    form_batches,
    global_src,
    local_ids,
    rank_world,
    run_batch_planner,
    sample_shape,
)
from .elastic import raise_with_restart_hint
from .groups import group_timeout

AGREE_MODES = ("broadcast", "deterministic")
# Planners whose answer depends on the CPU time they get (a deadline in process time): ranks
# planning alone could disagree, so agree="deterministic" refuses them up front.
TIMED_PLANNERS = ("pp_greedy", "pp_cpsat")
STATE_VERSION = 1


@dataclass(frozen=True)
class _Agreed:
    """One batch whose plan every rank holds; `local`: this rank's sequence ids."""

    epoch: int
    index: int
    ids: list[int]
    plan: Plan
    local: list[int]
    summary: dict


def collate_samples(samples: list) -> list:
    """collate_fn for DcpBatchSampler: keep a rank's samples as a list (one entry per id, in
    the order the sampler yielded them), since sequences of different lengths do not stack."""
    return list(samples)


class DcpBatchSampler(Sampler[list[int]]):
    """Planned global batches for `torch.utils.data.DataLoader(batch_sampler=...)` (see the
    module docstring). Iterated in the main process, where the plan broadcast runs; yields,
    per global batch, this rank's sequence ids (possibly none) in plan order.

    `sizes`: a list, or a callable index -> length / (frames, height, width) with
    `num_samples`. `planner`: a name of `dcp_opt.solvers` or "auto". `rank` / `world_size`
    default to torch.distributed's (1 process when it is not initialised). `timeout_s`
    bounds the plan broadcasts (the world group's timeout when None, runtime/groups.py)."""

    def __init__(
        self,
        sizes: Sequence | Callable[[int], Any],
        cost: CostModel,
        *,
        num_samples: int | None = None,
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
        timeout_s: float | None = None,
    ):
        if agree not in AGREE_MODES:
            raise DcpOptError(f"agree: {agree!r} not allowed; allowed: {list(AGREE_MODES)}")
        self.cost, self.agree, self.group = cost, agree, group
        self.rank, self.world_size = rank_world(rank, world_size, group)
        if cost.cluster.num_gpus != self.world_size:
            raise DcpOptError(
                f"cost.cluster: {cost.cluster.num_gpus} ranks but the world has "
                f"{self.world_size}; allowed: a cluster of exactly world_size ranks"
            )
        if callable(sizes) and num_samples is None:
            raise DcpOptError("num_samples: required when sizes is a callable")
        count = num_samples if callable(sizes) else len(sizes)
        get = sizes if callable(sizes) else sizes.__getitem__
        self.shapes = [sample_shape(i, get(i)) for i in range(count)]
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.shuffle, self.seed, self.drop_last, self.prefetch = shuffle, seed, drop_last, prefetch
        self.planner = default_planner() if planner == "auto" else planner
        self.planner_options = dict(planner_options or {})
        if agree == "deterministic" and self.planner == "cpsat":
            self.planner_options.setdefault("deterministic", True)
        if agree == "deterministic" and self.planner in TIMED_PLANNERS:
            raise DcpOptError(
                f"agree: 'deterministic' with planner {self.planner!r}, whose plan depends on "
                "the CPU time it gets, so ranks planning alone could disagree; allowed: "
                "agree='broadcast' (rank 0 plans)"
            )
        form_batches(self.shapes, [], batch_size=batch_size, max_tokens=max_tokens)  # check
        self.epoch = 0
        self._position = self._next_start = 0  # batches handed out / where the next pass starts
        self._sent: deque[_Agreed] = deque()  # yielded to a DataLoader, not yet paired
        self._cache: tuple = (None, None)
        self._channel = self._make_channel(timeout_s)

    def _make_channel(self, timeout_s):
        """The plan broadcasts' own gloo group over the same ranks (a collective: every rank
        builds its sampler at the same point, like GroupPool.create)."""
        if self.agree != "broadcast" or self.world_size == 1:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise DcpOptError(
                f"agree: 'broadcast' on {self.world_size} ranks needs torch.distributed "
                "initialised first; allowed: init_process_group before, or 'deterministic'"
            )
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        try:
            return dist.new_group(ranks, backend="gloo", **group_timeout(timeout_s))
        except RuntimeError as e:  # a torchrun restart reading stale addresses
            raise_with_restart_hint(e)
            raise

    # ---- batches ------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass; the same epoch again keeps a loaded position."""
        if epoch != self.epoch:
            self.epoch, self._position, self._next_start = epoch, 0, 0

    def batches(self) -> list[list[int]]:
        """Dataset indices of every global batch of the current epoch (same on every rank)."""
        key = (self.epoch, self.seed, self.shuffle)
        if self._cache[0] != key:
            order = np.arange(len(self.shapes))
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            got = form_batches(
                self.shapes,
                order.tolist(),
                batch_size=self.batch_size,
                max_tokens=self.max_tokens,
                drop_last=self.drop_last,
            )
            self._cache = (key, got)
        return self._cache[1]

    def __len__(self) -> int:
        """Batches the next pass yields (fewer than the epoch's after a mid-epoch resume)."""
        return len(self.batches()) - self._next_start

    def make_batch(self, ids: Sequence[int]) -> Batch:
        return Batch(tuple(Seq(int(i), self.shapes[i]) for i in ids))

    def plan_batch(self, ids: Sequence[int]) -> tuple[str, dict]:
        """Plan one global batch: (plan JSON, planner summary). Raises if no valid plan."""
        result = run_batch_planner(
            self.planner, self.make_batch(ids), self.cost, self.planner_options
        )
        if not result.ok:
            raise DcpOptError(
                f"planner {self.planner!r}: no plan for a batch of {len(ids)} sequences "
                f"({result.status}: {result.message})"
            )
        summary = {k: v for k, v in result.summary().items() if k != "stats"}
        return result.plan.to_json(indent=None), summary

    # ---- agreement ----------------------------------------------------------------------
    def _plans_here(self) -> bool:
        return self.agree == "deterministic" or self.rank == 0

    def _agree(self, ahead: PlanAhead | None, epoch: int, index: int) -> tuple[Plan, dict]:
        mine = None
        if ahead is not None:
            try:
                mine = (epoch, index, *ahead.get())
            except Exception as e:  # noqa: BLE001 (every rank must learn of it, not just rank 0)
                mine = (epoch, index, "error", f"{type(e).__name__}: {e}")
        if self._channel is not None:  # JSON bytes, never pickle (runtime/wire.py)
            from .wire import broadcast_json

            mine = broadcast_json(mine, src=global_src(self.group), group=self._channel)
        got_epoch, got_index, text, summary = mine
        if (got_epoch, got_index) != (epoch, index):
            raise DcpOptError(
                f"data path: rank {self.rank} wants the plan of epoch {epoch} batch {index}, the "
                f"planning rank sent epoch {got_epoch} batch {got_index}; allowed: every rank "
                "iterates alike (same epochs, same DataLoader settings, no early break on one)"
            )
        if text == "error":
            raise DcpOptError(f"data path: planning failed on the planning rank: {summary}")
        return Plan.from_json(text), summary

    def _stream(self) -> Iterator[_Agreed]:
        """Agreed batches of the current epoch, from the resume position (main thread)."""
        epoch, start = self.epoch, self._next_start
        self._next_start, self._position = 0, start
        jobs = self.batches()[start:]
        ahead = None
        if jobs and self._plans_here():
            ahead = PlanAhead(jobs, self.plan_batch, self.prefetch)
        try:
            for k, ids in enumerate(jobs, start):
                plan, summary = self._agree(ahead, epoch, k)
                yield _Agreed(epoch, k, ids, plan, local_ids(plan, self.rank), summary)
        finally:
            if ahead is not None:
                ahead.close()

    def _deliver(self, item: _Agreed, samples: dict) -> PlannedBatch:
        """Hand a batch to the training loop: from now on the state counts it as done."""
        self._position = item.index + 1
        batch = self.make_batch(item.ids)
        return PlannedBatch(item.index, item.epoch, item.plan, batch, samples, item.summary)

    # ---- torch DataLoader ---------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        """This rank's sequence ids of each batch (what DataLoader workers load); the plan
        waits in a queue for `planned`."""
        self._sent.clear()
        for item in self._stream():
            self._sent.append(item)
            yield list(item.local)

    def planned(self, loader) -> Iterator[PlannedBatch]:
        """Iterate `loader` (a DataLoader over this sampler, collate_fn=collate_samples, in
        order) and pair each batch of samples with its plan. A loader with torch's default
        collate_fn is refused before it starts its workers (see `_check_collate`)."""
        _check_collate(loader)
        for samples in loader:
            if not self._sent:
                raise DcpOptError(
                    "planned(loader): a batch this sampler did not yield; allowed: a "
                    "DataLoader built with batch_sampler=this sampler"
                )
            item = self._sent.popleft()
            if not isinstance(samples, list) or len(samples) != len(item.local):
                raise DcpOptError(
                    f"collate_fn: gave {type(samples).__name__} for {len(item.local)} samples; "
                    "allowed: dcp_opt.runtime.data.collate_samples (one entry per id)"
                )
            yield self._deliver(item, dict(zip(item.local, samples, strict=True)))

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Rank-independent state of the batches handed to the training loop."""
        batches = self.batches()
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_done": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.shapes),
            "batching": self._batching(),
            "num_batches": len(batches),
            "batches_sha256": _fingerprint(batches),
            "planner": self.planner,
        }

    def _batching(self) -> dict:
        return {"batch_size": self.batch_size, "max_tokens": self.max_tokens,
                "drop_last": self.drop_last}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`: the next pass starts with the first batch not yet done.
        Checked before anything changes: same samples, batching and epoch's batches."""
        _check_state(state)
        here = {"num_samples": len(self.shapes), "batching": self._batching()}
        for key, value in here.items():
            if state[key] != value:
                raise DcpOptError(
                    f"loader state: {key} is {state[key]} in the checkpoint but {value} here; "
                    "allowed: the same dataset and batching as the run that saved it"
                )
        saved = (self.epoch, self.seed, self.shuffle)
        self.epoch, self.seed, self.shuffle = state["epoch"], state["seed"], state["shuffle"]
        batches = self.batches()
        got = (len(batches), _fingerprint(batches))
        if got != (state["num_batches"], state["batches_sha256"]):
            self.epoch, self.seed, self.shuffle = saved
            raise DcpOptError(
                f"loader state: epoch {state['epoch']} has {state['num_batches']} batches "
                f"(sha256 {state['batches_sha256'][:12]}) in the checkpoint but {got[0]} "
                f"(sha256 {got[1][:12]}) here; allowed: the same sample sizes"
            )
        if not 0 <= state["batches_done"] <= len(batches):
            self.epoch, self.seed, self.shuffle = saved
            raise DcpOptError(
                f"loader state: batches_done {state['batches_done']} outside 0..{len(batches)}"
            )
        self._position = self._next_start = state["batches_done"]


def _check_collate(loader) -> None:
    """torch's default_collate stacks a batch's samples into one tensor: sequences of
    different lengths fail, and in a DataLoader worker only as torch's "Trying to resize
    storage that is not resizable", which names neither the collate_fn nor this library."""
    from torch.utils.data import default_collate

    if getattr(loader, "collate_fn", None) is default_collate:
        raise DcpOptError(
            "collate_fn: the DataLoader has torch's default_collate, which stacks the samples "
            "of a batch into one tensor and fails on sequences of different lengths (in a "
            "worker: 'Trying to resize storage that is not resizable'); allowed: "
            "DataLoader(dataset, batch_sampler=sampler, "
            "collate_fn=dcp_opt.runtime.data.collate_samples) or a collate_fn of your own "
            "that returns one entry per id"
        )


def _check_state(state) -> None:
    want = {"version": int, "epoch": int, "batches_done": int, "seed": int, "shuffle": bool,
            "num_samples": int, "batching": dict, "num_batches": int, "batches_sha256": str}  # fmt: skip
    if not isinstance(state, dict):
        raise DcpOptError(f"loader state: a dict from state_dict(), got {type(state).__name__}")
    for key, kind in want.items():
        if not isinstance(state.get(key), kind):
            raise DcpOptError(
                f"loader state: {key!r} is {state.get(key)!r}; allowed: {kind.__name__} "
                "(a dict from DcpBatchSampler.state_dict())"
            )
    if state["version"] != STATE_VERSION:
        raise DcpOptError(f"loader state: version {state['version']}; allowed: {STATE_VERSION}")


def _fingerprint(batches: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(batches, separators=(",", ":")).encode()).hexdigest()


class DcpLoader:
    """The short path: a DcpBatchSampler whose samples this process reads itself, one batch
    ahead in a loader thread. `dataset`: anything with `__getitem__(index)`; `sizes`: a list,
    or a callable for every index of `range(len(dataset))`; `options`: DcpBatchSampler's."""

    def __init__(self, dataset, sizes: Sequence | Callable[[int], Any], cost: CostModel, **options):
        self.dataset = dataset
        count = len(dataset) if callable(sizes) else None
        self.sampler = DcpBatchSampler(sizes, cost, num_samples=count, **options)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def batches(self) -> list[list[int]]:
        return self.sampler.batches()

    def __len__(self) -> int:
        return len(self.sampler)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def _load(self, item: _Agreed) -> dict[int, Any]:
        return {sid: self.dataset[sid] for sid in item.local}

    def __iter__(self) -> Iterator[PlannedBatch]:
        stream = self.sampler._stream()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-load")
        try:
            nxt = next(stream, None)
            fut = pool.submit(self._load, nxt) if nxt is not None else None
            while nxt is not None:
                item, got = nxt, fut
                nxt = next(stream, None)  # agree on the next plan and start reading its samples
                fut = pool.submit(self._load, nxt) if nxt is not None else None
                yield self.sampler._deliver(item, got.result())
        finally:
            stream.close()
            pool.shutdown(wait=True, cancel_futures=True)
