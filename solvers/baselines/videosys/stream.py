"""The published VideoSys samplers over a stream (an epoch), in the form they run in practice.

`published_epoch(epoch, cost, method)` runs the step formation of VideoSys' sampler
(NUS-HPC-AI-Lab/VideoSys @ 4cce477, `videosys/training/datasets/open_sora/sampler.py`;
research/videosys_dcp.md sec. 2-3) over every sample of an epoch and returns its optimizer
steps (one phase of groups each), the samples it never trains, and its statistics. Settings
are the published ones by default:

- memory cap 0.7 of the device (`--alloc-memory-fraction`, train.py:499-504), applied to the
  emulated profile (solvers/baselines/videosys/profile.py) through `CostModel.usable_memory_fraction`;
- DCP-inter: max 5, min 2 micro-batches (dcp_inter.yaml); PAC: max 5, min 15
  (dcp_inter_ckpt.yaml:11-12); bucket: SP degree 4 (baseline.yaml);
- drop_last (every benchmark yaml): bucket drops each bucket's remainder and truncates the
  step list to a multiple of the group count (sampler.py:156-210); inter truncates each bucket
  to a multiple of its bs before shuffling (sampler.py:386-390) and, once a step is full,
  drops any group whose bucket cannot supply its accumulation quota together with the rest of
  that bucket (sampler.py:469-506); intra drops the fastest partial group of a step
  (sampler.py:656-666); inter and intra discard a step that cannot be filled
  (sampler.py:422-425, 613-616); buckets the profile finds infeasible are skipped;
- DCP-inter's sp-size draw compares the random number with each probability, not the
  cumulative one (sampler.py:428-438, research sec. 6.A1); intra uses torch.multinomial.
- every step ends with the gradient sync, which simulate() adds per plan (the barrier).

`drop_last=False` is the no-drop variant: no truncation, no pruning, intra runs in the
published keep_last mode, and a step that cannot be filled runs with the rest of the GPUs
idle (the published code discards it even under keep_last). Every sample is then trained.

Randomness: numpy's default_rng(seed), not torch's generator: the same distributions, other
draws.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from dcp_opt.solvers.baselines.static import DEFAULT_BUCKET_DEGREE, fitting_degree, median_clip
from dcp_opt.solvers.baselines.videosys.profile import BucketProfile, make_buckets, profile_bucket
from dcp_opt.solvers.baselines.videosys.sampler import (
    Pool,
    ga_solve,
    inter_entries,
    pick_sp,
    pop_overflow,
    rebalance_bs,
    retune,
    step_groups,
)
from dcp_opt.solvers.baselines.videosys.sampler import layout as group_layout

from dcp_opt.batch import Batch
from dcp_opt.cluster import GIB
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Group, MicroBatch

PUBLISHED_METHODS = ("bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac")
PUBLISHED_MEMORY_CAP = 0.7  # train.py:499-504 (--alloc-memory-fraction default)
MAX_GAS = 5  # dcp_inter.yaml and dcp_inter_ckpt.yaml
MIN_GAS = {"dcp_inter": 2, "dcp_inter_pac": 15}  # train.py:508-509; dcp_inter_ckpt.yaml:11-12
MODES = {"bucket": "bucket", "dcp_intra": "intra", "dcp_inter": "inter", "dcp_inter_pac": "pac"}
# bucket_config of the benchmark yamls (baseline.yaml:39-44): (resolution, frames) -> bs. The
# published code ignores these numbers (sampler.py:287-289 reads the profile's bs); Open-Sora's
# own training uses them. `published_epoch(..., bucket_sizes=yaml_bucket_sizes())` runs
# bucket parallel with them: a different baseline, for the paper-fidelity study only.
OPENSORA_YAML_BS = {
    "144p": (345, 48, 25, 12, 6),
    "240p": (128, 16, 8, 4, 2),
    "360p": (64, 7, 4, 2, 1),
    "480p": (32, 4, 2, 1, 1),
    "720p": (14, 1, 1, 1, 1),
}


def yaml_bucket_sizes() -> dict[tuple, int]:
    """OPENSORA_YAML_BS keyed by the 2D bucket key (the latent shape)."""
    from dcp_opt.workloads import FRAMES, video_shape

    return {
        video_shape(r, f): bs
        for r, sizes in OPENSORA_YAML_BS.items()
        for f, bs in zip(FRAMES, sizes, strict=True)
    }


@dataclass
class PublishedEpoch:
    """One epoch of a published sampler: optimizer steps (groups of one phase each), the ids
    of samples never trained, statistics, and the sampler's own wall time (profile excluded:
    VideoSys profiles once, offline)."""

    method: str
    drop_last: bool
    steps: list[list[Group]]
    dropped: list[int]
    planning_s: float
    stats: dict = field(default_factory=dict)


class _StreamPool(Pool):
    """The sampler's per-bucket queues, with the samples it discards recorded."""

    def __init__(self, profiles: list[BucketProfile], rng, truncate: bool):
        self.prof = profiles
        self.dropped: list[int] = []
        self.queue = []
        for p in profiles:
            ids = list(p.bucket.ids)
            r = len(ids) % p.best.bs if truncate else 0
            if r:  # data_list[:-remainder] before the shuffle (sampler.py:386-390)
                self.dropped += ids[-r:]
                ids = ids[:-r]
            self.queue.append([int(i) for i in rng.permutation(ids)])
        self.left = [len(q) for q in self.queue]

    def discard(self, b: int, n: int) -> None:
        """Drop n samples of bucket b that a group had reserved (they are exchangeable, so
        the queue's tail stands for them)."""
        if n:
            self.dropped += self.queue[b][-n:]
            del self.queue[b][-n:]

    def discard_rest(self, b: int) -> None:
        n, self.left[b] = self.left[b], 0
        self.discard(b, n)


def published_profiles(
    epoch: Batch, cost: CostModel, mode: str, memory_cap: float, degree: int | None = None
) -> tuple[list[BucketProfile], list[int]]:
    """The emulated profile at the published memory cap, and the ids of buckets it cannot
    place (VideoSys skips them: `is_valid_bucket`, sampler.py:152-156)."""
    capped = cost.with_(usable_memory_fraction=memory_cap)
    out, invalid = [], []
    for b in make_buckets(epoch, capped):
        p = profile_bucket(capped, b, mode, fixed_degree=degree, unit=GIB)
        if p is None:
            invalid += list(b.ids)
        else:
            out.append(p)
    if not out:
        raise DcpOptError(f"memory_cap: {memory_cap} leaves no bucket that fits")
    return out, invalid


# ---- bucket parallel (sampler.py:142-285) ----------------------------------------------------
def _bucket_steps(epoch, cost, rng, drop_last, memory_cap, bucket_sizes=None):
    longest = max(s.num_tokens for s in epoch.sequences)
    capped = cost.with_(usable_memory_fraction=memory_cap)
    d = fitting_degree(capped, longest, DEFAULT_BUCKET_DEGREE)
    profiles, invalid = published_profiles(epoch, cost, "bucket", memory_cap, degree=d)
    sizes = median_clip(profiles)
    if bucket_sizes is not None:  # the yaml's sizes instead of the profile's (no clipping)
        sizes = [bucket_sizes.get(p.bucket.key, s) for p, s in zip(profiles, sizes, strict=True)]
    dropped, mbs = list(invalid), []  # mbs: (bucket, ids)
    for b, (p, bs) in enumerate(zip(profiles, sizes, strict=True)):
        ids = list(p.bucket.ids)
        r = len(ids) % bs if drop_last else 0
        if r:  # data_list[:-remainder], then the shuffle (sampler.py:156-166)
            dropped += ids[-r:]
            ids = ids[:-r]
        q = [int(i) for i in rng.permutation(ids)]
        mbs += [(b, q[i : i + bs]) for i in range(0, len(q), bs)]
    order = rng.permutation(len(mbs))
    mbs = [mbs[i] for i in order]
    starts = cost.cluster.placements(d)
    per_step = len(starts)
    if drop_last and len(mbs) % per_step:
        cut = len(mbs) - len(mbs) % per_step
        dropped += [i for _, ids in mbs[cut:] for i in ids]
        mbs = mbs[:cut]
    L = cost.model.num_layers
    steps = [
        [
            Group(s, d, (MicroBatch(tuple(ids), L),))
            for s, (_, ids) in zip(starts, chunk, strict=False)
        ]
        for chunk in (mbs[i : i + per_step] for i in range(0, len(mbs), per_step))
    ]
    stats = {"degree": d, "bucket_bs": _bs_table(profiles, sizes)}
    return steps, dropped, stats


def _bs_table(profiles, sizes=None) -> dict:
    sizes = sizes or [p.best.bs for p in profiles]
    return {
        str(p.bucket.key): {"sp": p.best.sp, "bs": bs, "recompute": p.best.recompute}
        for p, bs in zip(profiles, sizes, strict=True)
    }


# ---- DCP-inter and PAC (sampler.py:370-574) --------------------------------------------------
def _prune(step, pool: _StreamPool, max_gas: int, min_gas: int) -> int:
    """sampler.py:469-506: drop every group whose bucket has fewer full batches left than its
    accumulation quota, and the rest of that bucket. Returns the GPUs freed."""
    prof = pool.prof
    gas = ga_solve([prof[b].best.time for b, _, _ in step], max_gas, min_gas)
    top = max(prof[b].best.time * g for (b, _, _), g in zip(step, gas, strict=True))
    freed, i = 0, 0
    while i < len(step):
        b, sp, n = step[i]
        p = prof[b].best
        need = (top // p.time - 1) * [g[0] for g in step].count(b)
        if pool.left[b] // p.bs < need:
            step.pop(i)
            freed += sp
            pool.discard(b, n)
            pool.discard_rest(b)
        else:
            i += 1
    return freed


def _fill(pool: _StreamPool, n_gpus: int, rng, biased: bool, on_full=None, on_add=None):
    """The shared fill loop (research sec. 2.2). Returns (groups [bucket, sp, n], filled)."""
    remaining, step = n_gpus, []
    while remaining > 0:
        avail = pool.by_sp()
        sizes = sorted(s for s in avail if s <= remaining)
        if not sizes:
            return step, False
        sp = pick_sp(sizes, [len(avail[s]) for s in sizes], rng, biased)
        cands = avail[sp]
        b = cands[int(rng.integers(len(cands)))]
        k = min(pool.prof[b].best.bs, pool.left[b])
        pool.left[b] -= k
        step.append([b, sp, k])
        remaining -= sp
        if on_add is not None:
            remaining += on_add(step)
        if on_full is not None and remaining <= 0:
            remaining += on_full(step)
    return step, True


def _unfilled(step, pool: _StreamPool, drop_last: bool) -> bool:
    """A step the fill could not complete: published discards it (True: skip it)."""
    if drop_last:
        for b, _, n in step:
            pool.discard(b, n)
        return True
    return False


def _inter_steps(pool, cost, rng, drop_last, max_gas, min_gas, biased=True):
    steps, gas_log = [], []
    on_full = (lambda st: _prune(st, pool, max_gas, min_gas)) if drop_last else None
    while pool.any_left():
        before = pool.num_left()
        step, filled = _fill(pool, cost.cluster.num_gpus, rng, biased, on_full=on_full)
        pool.check_progress(before, "dcp_inter stream")
        if not step or (not filled and _unfilled(step, pool, drop_last)):
            continue
        entries = inter_entries(step, pool, max_gas, min_gas)
        steps.append(step_groups(entries, group_layout([sp for sp, _ in entries], cost)))
        gas_log.append([len(m) for _, m in entries])
    return steps, {"gas_per_step": gas_log, "max_gas": max_gas, "min_gas": min_gas}


# ---- DCP-intra (sampler.py:576-871) ----------------------------------------------------------
def _drop_fastest_partial(step, pool: _StreamPool) -> int:
    """sampler.py:656-666: with more than one group, drop the fastest group whose batch is
    partial (a bucket's last remainder); its samples are lost. Returns the GPUs freed."""
    if len(step) < 2:
        return 0
    prof, best, t_best = pool.prof, -1, float("inf")
    for i, (b, _, n) in enumerate(step):
        p = prof[b].best
        t = p.time / p.bs * n
        if t < t_best and p.bs > n:
            best, t_best = i, t
    if best < 0:
        return 0
    b, sp, n = step.pop(best)
    pool.discard(b, n)
    return sp


def _intra_steps(pool, cost, rng, drop_last):
    n, L = cost.cluster.num_gpus, cost.model.num_layers
    max_sp = cost.cluster.gpus_per_node
    on_add = (lambda st: _drop_fastest_partial(st, pool)) if drop_last else None
    steps = []
    while pool.any_left():
        before = pool.num_left()
        step, filled = _fill(pool, n, rng, False, on_add=on_add)
        pool.check_progress(before, "dcp_intra stream")
        if not step or (not filled and _unfilled(step, pool, drop_last)):
            continue
        frozen = retune(step, pool, max_sp, keep_last=not drop_last)
        step, frozen = pop_overflow(step, frozen, pool, n)
        rebalance_bs(step, frozen, pool)
        entries = [(sp, [MicroBatch(pool.take(b, k), L)]) for b, sp, k in step]
        steps.append(step_groups(entries, group_layout([sp for _, sp, _ in step], cost)))
    return steps, {}


# ---- entry point -------------------------------------------------------------------------------
def published_epoch(
    epoch: Batch,
    cost: CostModel,
    method: str,
    *,
    seed: int = 0,
    drop_last: bool = True,
    memory_cap: float = PUBLISHED_MEMORY_CAP,
    bucket_sizes: dict[tuple, int] | None = None,
    min_gas: int | None = None,
    biased_sp_pick: bool = True,
) -> PublishedEpoch:
    """The published sampler `method` over the whole epoch (see the module docstring).
    Off the published settings, to measure each one (docs/baselines.md): bucket_sizes (bucket
    key -> bs for `bucket` instead of the profile's, e.g. yaml_bucket_sizes()); min_gas for
    inter and PAC instead of MIN_GAS; biased_sp_pick=False: inter draws sp sizes as intended."""
    if method not in PUBLISHED_METHODS:
        raise DcpOptError(f"method: {method!r} not allowed; allowed: {list(PUBLISHED_METHODS)}")
    if not 0 < memory_cap <= 1:
        raise DcpOptError(f"memory_cap: must be in (0, 1], got {memory_cap}")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    if method == "bucket":
        steps, dropped, stats = _bucket_steps(epoch, cost, rng, drop_last, memory_cap, bucket_sizes)
        return PublishedEpoch(method, drop_last, steps, dropped, time.perf_counter() - t0, stats)
    profiles, invalid = published_profiles(epoch, cost, MODES[method], memory_cap)
    t0 = time.perf_counter()
    pool = _StreamPool(profiles, rng, truncate=drop_last and method != "dcp_intra")
    pool.dropped += invalid
    if method == "dcp_intra":
        steps, stats = _intra_steps(pool, cost, rng, drop_last)
    else:
        gas = MIN_GAS[method] if min_gas is None else min_gas
        steps, stats = _inter_steps(pool, cost, rng, drop_last, MAX_GAS, gas, biased_sp_pick)
    stats["profile"] = _bs_table(profiles)
    return PublishedEpoch(method, drop_last, steps, pool.dropped, time.perf_counter() - t0, stats)
