"""Static baselines: bucket parallel (as published in VideoSys), the tuned static degree, and
packed parallel (described in the DCP paper, never implemented in its code).

Memory: every planner here uses the capacity every other dcp_opt planner uses
(`cost.capacity`, the weakest aligned placement of a degree), not VideoSys' 70% cap: the
baselines are compared on algorithm, not on safety margin.

Where `bucket` departs from the published code (research/videosys_dcp.md sec. 1.9 and 3):

- the published sampler drops each bucket's remainder and truncates the step list to a multiple
  of the group count; here nothing is dropped: the remainder of a bucket is a last, partial
  micro-batch and groups simply end up with different micro-batch counts;
- the published sampler shuffles its micro-batch list; here micro-batches are dealt round-robin
  in arrival order (the order in which they fill up, tails last), `shuffle=True` shuffles
  them with the seed as published;
- each published step (one micro-batch per group, then a gradient all-reduce) becomes a
  position in the group's micro-batch chain; the layout never changes, so one phase holds
  them all and gradients sync once;
- the fixed degree 4 must exist on the cluster and hold the longest sequence with every layer
  recomputed; otherwise the next degree that does is used (recorded in `stats`);
- the "keep the previous bs if it had 2x the throughput" rule (profiler.py:738) never fires
  with a cost model whose time is affine in bs, so it is omitted.
"""

from __future__ import annotations

import math
import time

import numpy as np
from dcp_opt.solvers.baselines.videosys.profile import (
    BucketProfile,
    emulate_profile,
    max_batch,
    profile_capacity,
)
from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult


# ---- helpers -----------------------------------------------------------------------------------
def fitting_degree(cost: CostModel, tokens: int, wanted: int) -> int:
    """Smallest allowed degree >= `wanted` (or the largest allowed below it, when `wanted` is
    not allowed) at which `tokens` fit with every layer recomputed."""
    allowed = cost.cluster.allowed_degrees
    below = [d for d in allowed if d <= wanted]
    start = max(below) if below else allowed[0]
    L = cost.model.num_layers
    for d in allowed:
        if d >= start and max_batch(cost, tokens, d, L, profile_capacity(cost, d)) >= 1:
            return d
    raise DcpOptError(f"degree: no allowed degree >= {start} holds {tokens} tokens")


# The published bucket-parallel SP degree (VideoSys baseline.yaml: sp_size 4).
DEFAULT_BUCKET_DEGREE = 4


def lpt(times: np.ndarray, speeds: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    """Longest processing time first: each item to the group where it finishes earliest."""
    load = np.zeros(len(speeds))
    assign: list[list[int]] = [[] for _ in speeds]
    for i in np.argsort(-times, kind="stable"):
        k = int(np.argmin(load + times[i] / speeds))
        load[k] += times[i] / speeds[k]
        assign[k].append(int(i))
    return assign, load


def group_speeds(cost: CostModel, d: int) -> tuple[tuple[int, ...], np.ndarray]:
    starts = cost.cluster.placements(d)
    return starts, np.array([cost.cluster.group_speed(s, d) for s in starts])


# ---- bucket ------------------------------------------------------------------------------------
def median_clip(profiles: list[BucketProfile]) -> list[int]:
    """Sec. 1.9: buckets slower than the median time get bs' = max(1, floor(bs * m / T))."""
    m = float(np.median([p.best.time for p in profiles]))
    return [
        max(1, math.floor(p.best.bs * m / p.best.time)) if p.best.time > m else p.best.bs
        for p in profiles
    ]


def arrival_micro_batches(batch: Batch, profiles, sizes) -> list[list[int]]:
    """Micro-batches in the order they fill up while the batch streams in; tails last."""
    where = {sid: k for k, p in enumerate(profiles) for sid in p.bucket.ids}
    open_: list[list[int]] = [[] for _ in profiles]
    out = []
    for s in batch.sequences:
        k = where[s.id]
        open_[k].append(s.id)
        if len(open_[k]) == sizes[k]:
            out.append(open_[k])
            open_[k] = []
    return out + [mb for mb in open_ if mb]


def plan_bucket(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    degree: int = DEFAULT_BUCKET_DEGREE,
    shuffle: bool = False,
) -> PlanResult:
    """Bucket parallel: one SP degree, per-bucket power-of-two bs from memory at full
    recompute, median clipping, micro-batches dealt round-robin to the N/degree groups."""
    t0 = time.perf_counter()
    cost.check_fits(batch)
    longest = max(s.num_tokens for s in batch.sequences)
    d = fitting_degree(cost, longest, degree)
    profiles = emulate_profile(batch, cost, "bucket", fixed_degree=d)
    sizes = median_clip(profiles)
    mbs = arrival_micro_batches(batch, profiles, sizes)
    if shuffle:
        mbs = [mbs[i] for i in np.random.default_rng(seed).permutation(len(mbs))]
    L = cost.model.num_layers
    starts = cost.cluster.placements(d)
    chains: list[list[MicroBatch]] = [[] for _ in starts]
    for i, ids in enumerate(mbs):
        chains[i % len(starts)].append(MicroBatch(tuple(ids), L))
    groups = [Group(s, d, tuple(c)) for s, c in zip(starts, chains, strict=True) if c]
    stats = {
        "degree": d,
        "requested_degree": degree,
        "num_micro_batches": len(mbs),
        "bucket_bs": {
            str(p.bucket.key): (p.best.bs, b) for p, b in zip(profiles, sizes, strict=True)
        },
    }
    return finish([groups], batch, cost, planner="bucket", started=t0, stats=stats)


# ---- static_tuned -------------------------------------------------------------------------------
def _static_at(cost: CostModel, feats, tokens, d: int):
    """(makespan, groups) of one micro-batch per sequence at its fewest recompute, LPT."""
    r = cost.min_recompute(tokens, d, profile_capacity(cost, d))
    if np.any(r < 0):
        return None
    times = cost.time(feats, d, r)
    starts, speeds = group_speeds(cost, d)
    assign, load = lpt(times, speeds)
    return float(load.max()), starts, assign, r


def plan_static_tuned(batch: Batch, cost: CostModel, *, seed: int = 0) -> PlanResult:
    """The static baseline a careful user would tune: the one SP degree (tried: every allowed
    degree) with the best predicted step, each sequence its own micro-batch at the fewest
    recomputed layers that fit, longest first onto the N/d groups. No packing."""
    t0 = time.perf_counter()
    cost.check_fits(batch)
    feats = cost.batch_features(batch)
    tokens = feats[:, -2]
    ids = [s.id for s in batch.sequences]
    best, tried = None, {}
    for d in cost.cluster.allowed_degrees:
        res = _static_at(cost, feats, tokens, d)
        if res is None:
            continue
        tried[d] = res[0]
        if best is None or res[0] < best[1][0]:
            best = (d, res)
    if best is None:  # only on mixed-memory clusters: the weakest placement is too small
        raise DcpOptError("static_tuned: no degree holds every sequence on all its placements")
    d, (_, starts, assign, r) = best
    groups = [
        Group(s, d, tuple(MicroBatch((ids[i],), int(r[i])) for i in items))
        for s, items in zip(starts, assign, strict=True)
        if items
    ]
    stats = {"degree": d, "makespan_by_degree": tried}
    return finish([groups], batch, cost, planner="static_tuned", started=t0, stats=stats)


# ---- packed -------------------------------------------------------------------------------------
def first_fit_decreasing(tokens: np.ndarray, capacity: float) -> list[list[int]]:
    """Bins of at most `capacity` tokens (an item larger than that gets a bin of its own)."""
    rem = np.zeros(0)
    bins: list[list[int]] = []
    for i in np.argsort(-tokens, kind="stable"):
        fit = np.nonzero(rem >= tokens[i])[0]
        if fit.size:
            k = int(fit[0])
            rem[k] -= tokens[i]
            bins[k].append(int(i))
        else:
            rem = np.append(rem, capacity - tokens[i])
            bins.append([int(i)])
    return bins


def plan_packed(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    degree: int | None = None,
    token_target: int | str = "balanced",
) -> PlanResult:
    """Packed parallel: one SP degree (default 4 as bucket's published setting, widened while the
    longest sequence does not fit), sequences concatenated first-fit-decreasing into
    micro-batches of equal tokens (the paper's packed baseline: every group gets about the same
    number of tokens),
    sequences concatenated first-fit-decreasing into micro-batches of about `token_target`
    tokens, each at the fewest recomputed layers that fit, then longest first onto the groups.

    token_target: "balanced" (default) = total tokens / number of groups, capped by memory;
    "memory" = the most tokens that fit at that degree with every layer recomputed; or a
    number of tokens."""
    t0 = time.perf_counter()
    cost.check_fits(batch)
    feats = cost.batch_features(batch)
    tokens = feats[:, -2]
    d = fitting_degree(cost, int(tokens.max()), degree or DEFAULT_BUCKET_DEGREE)
    L = cost.model.num_layers
    cap = profile_capacity(cost, d)
    starts, speeds = group_speeds(cost, d)
    mem_tokens = max_batch(cost, 1, d, L, cap)
    if token_target == "memory":
        target = mem_tokens
    elif token_target == "balanced":
        target = min(mem_tokens, math.ceil(tokens.sum() / len(starts)))
    elif isinstance(token_target, (int, float)) and token_target >= 1:
        target = min(mem_tokens, int(token_target))
    else:
        raise DcpOptError(
            f"token_target: {token_target!r} not allowed; allowed: 'memory', 'balanced' or a "
            "number of tokens >= 1"
        )
    bins = first_fit_decreasing(tokens, target)
    bin_tokens = np.array([tokens[b].sum() for b in bins])
    # fewest that fit; an item alone at the token cap may round to -1 at the byte boundary
    r = np.where((r := cost.min_recompute(bin_tokens, d, cap)) < 0, L, r)
    times = cost.time(np.stack([feats[b].sum(axis=0) for b in bins]), d, r)
    assign, _ = lpt(times, speeds)
    ids = [s.id for s in batch.sequences]
    groups = [
        Group(s, d, tuple(MicroBatch(tuple(ids[i] for i in bins[k]), int(r[k])) for k in items))
        for s, items in zip(starts, assign, strict=True)
        if items
    ]
    stats = {"degree": d, "token_target": int(target), "num_micro_batches": len(bins)}
    return finish([groups], batch, cost, planner="packed", started=t0, stats=stats)
