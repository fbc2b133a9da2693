"""`verl_balanced`: verl's dynamic batch size over a fixed Ulysses SP degree.

As verl runs an actor update (volcengine/verl at 0d04d64, verl/utils/seqlen_balancing.py):
- the global batch is first split over the data-parallel ranks (here the N/d SP groups) with
  Karmarkar-Karp, equal_size=True (ray_trainer's `_balance_batch` calls
  get_seqlen_balanced_partitions(..., k_partitions=dp, equal_size=True));
- each DP rank then cuts its share into ceil(its tokens / max_token_len) micro-batches, the
  count made equal over DP ranks (an all-reduce MAX), and balances them with Karmarkar-Karp,
  equal_size=False (`rearrange_micro_batches`, lines 203-232 there);
- max_token_len is per GPU times the Ulysses degree (ppo_max_token_len_per_gpu *
  ulysses_sequence_parallel_size in verl's fsdp workers); gradient checkpointing is on or off
  for the whole model.

Deviations (docs/baselines.md, "verl_balanced"):
- the degree is tuned: every allowed degree is tried and the fastest predicted kept (a user
  picks one by hand); max_token_len is the most tokens a micro-batch holds at that degree
  with checkpointing off, or with every layer recomputed if the longest sequence needs it;
- Karmarkar-Karp is the largest differencing method as in verl, written here; ties may break
  in another order;
- KK balances tokens, not memory: a micro-batch over the memory that verl would run out of
  memory with gets the fewest recomputed layers that fit (and one more micro-batch per DP
  rank if none does); with fewer sequences than DP ranks x 1, equal_size is dropped;
- newer verl balances 24576 * s + s^2 instead of s (REFERENCE.md sec. 3); the stored
  version balances s, which this follows.
"""

from __future__ import annotations

import heapq
import math
import time

from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import InfeasibleError
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult


def karmarkar_karp(values: list[float], k: int, *, equal_size: bool) -> list[list[int]]:
    """Indices of `values` in k parts of near-equal sums by largest differencing (Karmarkar &
    Karp 1982): every item (or, with equal_size, every k consecutive items in sorted order)
    is a state of k sets; the two states of largest spread merge, the largest set of one with
    the smallest of the other, until one state is left."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    heap: list = []
    step = k if equal_size else 1
    for a in range(0, len(order), step):
        sets = [(values[i], [i]) for i in order[a : a + step]]
        sets += [(0.0, []) for _ in range(k - len(sets))]
        _push(heap, sets, len(heap))
    count = len(heap)
    while len(heap) > 1:
        _, _, s0 = heapq.heappop(heap)
        _, _, s1 = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(s0, reversed(s1), strict=True)]
        count += 1
        _push(heap, merged, count)
    return [sorted(items) for _, items in heap[0][2]]


def _push(heap: list, sets: list, tie: int) -> None:
    sets = sorted(sets, key=lambda s: -s[0])
    heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), tie, sets))


def plan_verl_balanced(batch: Batch, cost: CostModel, *, seed: int = 0) -> PlanResult:
    """verl's dynamic batch size at the best fixed Ulysses degree (module doc)."""
    t0 = time.perf_counter()
    cost.check_fits(batch)
    best, tried = None, {}
    for d in cost.cluster.allowed_degrees:
        groups = _at_degree(batch, cost, d)
        if groups is None:
            continue
        res = finish([groups], batch, cost, planner="verl_balanced", started=t0)
        tried[d] = res.predicted_step_time_s
        if best is None or res.predicted_step_time_s < best.predicted_step_time_s:
            best = res
    if best is None:
        raise InfeasibleError("verl_balanced: no fixed degree holds the batch")
    degree = max(g.degree for g in best.plan.phases[0].groups)
    best.stats.update(degree=degree, tried={str(k): v for k, v in tried.items()})
    return best


def _at_degree(batch: Batch, cost: CostModel, d: int) -> list[Group] | None:
    """One phase: N/d groups of degree d, each its DP share in balanced micro-batches."""
    tokens = [s.num_tokens for s in batch.sequences]
    ids = [s.id for s in batch.sequences]
    cap = (
        cost.capacity(0, d)
        if cost.cluster.memory_per_rank is None
        else min(cost.capacity(s, d) for s in cost.cluster.placements(d))
    )
    longest = int(cost.min_recompute(max(tokens), d, cap))
    if longest < 0:
        return None
    r = 0 if longest == 0 else cost.model.num_layers  # checkpointing off, or on everywhere
    budget = _max_tokens(cost, d, r, cap)
    starts = cost.cluster.placements(d)
    dp = len(starts)
    shares = karmarkar_karp(tokens, dp, equal_size=len(tokens) % dp == 0)
    shares = [[ids[i] for i in part] for part in shares]
    by_id = dict(zip(ids, tokens, strict=True))
    count = max(math.ceil(sum(by_id[s] for s in part) / budget) for part in shares if part)
    for extra in range(len(tokens) + 1):
        groups = [_micro_batches(cost, part, by_id, count + extra, d, r, cap) for part in shares]
        if all(g is not None for g in groups):
            return [Group(s, d, tuple(mbs)) for s, mbs in zip(starts, groups, strict=True) if mbs]
    return None


def _max_tokens(cost: CostModel, d: int, r: int, cap: float) -> float:
    """The most tokens one micro-batch holds at degree d with r recomputed layers."""
    per = float(cost.memory(1.0, d, r)) - cost.fixed_bytes()
    return max(1.0, (cap - cost.fixed_bytes()) / per)


def _micro_batches(cost, part, by_id, count, d, r, cap) -> list[MicroBatch] | None:
    """`part`'s sequences in min(count, len) KK-balanced micro-batches, each at r or at the
    fewest recomputed layers that fit; None if one does not fit at all."""
    if not part:
        return []
    k = min(count, len(part))
    out = []
    for idx in karmarkar_karp([by_id[s] for s in part], k, equal_size=False):
        ids = tuple(part[i] for i in idx)
        need = int(cost.min_recompute(float(sum(by_id[s] for s in ids)), d, cap))
        if need < 0:
            return None
        out.append(MicroBatch(ids, max(r, need)))
    return out
