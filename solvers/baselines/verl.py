"""`verl_balanced`: verl's dynamic batch size over a fixed Ulysses SP degree.

As verl runs an actor update (volcengine/verl at b178a3cd56f5; the older 0d04d64 where it
differs):
- the global batch is first split over the data-parallel ranks (here the N/d SP groups) with
  Karmarkar-Karp, equal_size=True, balancing `calculate_workload` = 24576 s + s^2 (the FLOPs
  of a 7B model's dense blocks up to a constant: verl/utils/seqlen_balancing.py:27-46;
  verl/trainer/ppo/ray_trainer.py:1105, 1149); 0d04d64 balanced s;
- each DP rank then cuts its share into min(len, ceil(its tokens / max_token_len))
  micro-batches, the count made equal over DP ranks (an all-reduce MAX), and balances their
  workloads with Karmarkar-Karp, equal_size=False (`rearrange_micro_batches`,
  seqlen_balancing.py:348-402); max_token_len below the longest sequence is verl's assertion
  (seqlen_balancing.py:382-384). Its order of micro-batches (small ones at both ends, for
  pipeline bubbles) does not change a step without pipeline stages;
- max_token_len is per GPU times the Ulysses degree (ppo_max_token_len_per_gpu *
  ulysses_sequence_parallel_size in verl's fsdp workers); gradient checkpointing is on or off
  for the whole model.

Options (a verl user's settings): `max_token_len_per_gpu` (None: the most tokens a
micro-batch holds at the degree with checkpointing off, or on if the longest sequence needs
it), `balance` ("workload": 24576 s + s^2, today's verl; "tokens": s, 0d04d64),
`checkpointing` (None: off unless the longest sequence needs it), `degree` (None: every
allowed degree tried, the fastest kept; a user picks one by hand).

Deviations (docs/baselines.md, "verl_balanced"):
- Karmarkar-Karp is the largest differencing method as in verl, written here; ties may break
  in another order;
- KK balances workload, not memory: a micro-batch over the memory that verl would run out of
  memory with gets the fewest recomputed layers that fit (and one more micro-batch per DP
  rank if none does), counted in stats["oom_micro_batches"]; with fewer sequences than DP
  ranks x 1, equal_size is dropped.
"""

from __future__ import annotations

import heapq
import math
import time

from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, InfeasibleError
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


BALANCES = ("workload", "tokens")


def workload(tokens: int, balance: str) -> float:
    """What verl balances for a sequence (module doc)."""
    return float(24576 * tokens + tokens * tokens) if balance == "workload" else float(tokens)


def plan_verl_balanced(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_token_len_per_gpu: int | None = None,
    balance: str = "workload",
    checkpointing: bool | None = None,
    degree: int | None = None,
) -> PlanResult:
    """verl's dynamic batch size at a fixed Ulysses degree (module doc)."""
    t0 = time.perf_counter()
    _check(cost, max_token_len_per_gpu, balance, checkpointing, degree)
    cost.check_fits(batch)
    best, tried = None, {}
    for d in cost.cluster.allowed_degrees if degree is None else (degree,):
        at = _at_degree(batch, cost, d, max_token_len_per_gpu, balance, checkpointing)
        if at is None:
            continue
        groups, oom = at
        res = finish([groups], batch, cost, planner="verl_balanced", started=t0)
        res.stats["oom_micro_batches"] = oom
        tried[d] = res.predicted_step_time_s
        if best is None or res.predicted_step_time_s < best.predicted_step_time_s:
            best = res
    if best is None:
        raise InfeasibleError("verl_balanced: no fixed degree holds the batch")
    d = max(g.degree for g in best.plan.phases[0].groups)
    best.stats.update(
        degree=d, tried={str(k): v for k, v in tried.items()}, balance=balance,
        max_token_len_per_gpu=max_token_len_per_gpu, checkpointing=checkpointing,
    )  # fmt: skip
    return best


def _check(cost, max_token_len_per_gpu, balance, checkpointing, degree) -> None:
    m = max_token_len_per_gpu
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise DcpOptError(f"max_token_len_per_gpu: {m!r} not allowed; allowed: an integer >= 1")
    if balance not in BALANCES:
        raise DcpOptError(f"balance: {balance!r} not allowed; allowed: {list(BALANCES)}")
    if checkpointing not in (None, True, False):
        raise DcpOptError(
            f"checkpointing: {checkpointing!r} not allowed; allowed: None, True, False"
        )
    if degree is not None and degree not in cost.cluster.allowed_degrees:
        raise DcpOptError(
            f"degree: {degree!r} not allowed; allowed: {list(cost.cluster.allowed_degrees)}"
        )


def _at_degree(batch, cost, d, per_gpu, balance, checkpointing) -> tuple[list[Group], int] | None:
    """One phase: N/d groups of degree d, each its DP share in balanced micro-batches; and
    the micro-batches that needed more recompute than the setting (verl: out of memory)."""
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
    L = cost.model.num_layers
    on = longest > 0 if checkpointing is None else checkpointing  # off unless needed
    r = L if on else 0  # checkpointing on or off for the whole model
    budget = _max_tokens(cost, d, r, cap) if per_gpu is None else float(per_gpu * d)
    if budget < max(tokens):  # verl's assertion (module doc)
        return None
    starts = cost.cluster.placements(d)
    dp = len(starts)
    weights = [workload(t, balance) for t in tokens]
    shares = karmarkar_karp(weights, dp, equal_size=len(tokens) % dp == 0)
    shares = [[ids[i] for i in part] for part in shares]
    by_id = dict(zip(ids, tokens, strict=True))
    count = max(math.ceil(sum(by_id[s] for s in part) / budget) for part in shares if part)
    for extra in range(len(tokens) + 1):
        groups = [
            _micro_batches(cost, part, by_id, count + extra, d, r, cap, balance) for part in shares
        ]
        if all(g is not None for g in groups):
            oom = sum(mb.recompute_layers > r for g in groups for mb in g)
            return [
                Group(s, d, tuple(mbs)) for s, mbs in zip(starts, groups, strict=True) if mbs
            ], oom
    return None


def _max_tokens(cost: CostModel, d: int, r: int, cap: float) -> float:
    """The most tokens one micro-batch holds at degree d with r recomputed layers."""
    per = float(cost.memory(1.0, d, r)) - cost.fixed_bytes()
    return max(1.0, (cap - cost.fixed_bytes()) / per)


def _micro_batches(cost, part, by_id, count, d, r, cap, balance) -> list[MicroBatch] | None:
    """`part`'s sequences in min(count, len) KK-balanced micro-batches, each at r or at the
    fewest recomputed layers that fit; None if one does not fit at all."""
    if not part:
        return []
    k = min(count, len(part))
    out = []
    for idx in karmarkar_karp([workload(by_id[s], balance) for s in part], k, equal_size=False):
        ids = tuple(part[i] for i in idx)
        need = int(cost.min_recompute(float(sum(by_id[s] for s in ids)), d, cap))
        if need < 0:
            return None
        out.append(MicroBatch(ids, max(r, need)))
    return out
