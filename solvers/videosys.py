"""DCP-intra, DCP-inter and DCP-inter+PAC: the published profile forced into a fixed batch.

This is NOT the published method as it runs. The published sampler
(`videosys/training/datasets/open_sora/sampler.py`, research/videosys_dcp.md sec. 2.2-2.5)
plans a whole epoch and forms its own optimizer steps, each holding however many samples its
fill and GA solver choose (PAC: 6.6-24.7M tokens per step, p10-p90 over the 2D workloads of
`dcp-opt bench --stream`, benchmarks/results/stream.json). Given one
standard 2M-token batch (32 GPUs x 64K) it forms **zero** steps: with drop_last (every
benchmark yaml) inter and PAC truncate each bucket to a multiple of its profiled bs, which
empties nearly every bucket of such a batch, and a step whose groups cannot fill all the GPUs
is discarded (sampler.py:386-390, 422-425, 613-616); measured with
solvers/videosys_stream.py on seeds 0-2 of every standard workload at the published 0.7 cap:
0 steps for every 2D workload and every method, 0 for inter and PAC on every 1D workload too.
The published form over an epoch is solvers/videosys_stream.py (`dcp-opt bench --stream`).

Here, for the one-batch bench, the published per-bucket profile and step rules are applied to
one global batch with no sample dropped, and each published step becomes one Phase of one
plan (the group layout changes between phases; gradients are still synchronised once, after
the last phase). Published settings this changes (docs/baselines.md measures each):
memory cap 0.9 instead of 0.7; drop_last off; PAC's min accumulation 2 instead of 15; one
optimizer step per batch instead of one per sampler step; the unbiased sp-size draw for inter.
Randomness (per-bucket shuffle, sp-size and bucket choice) comes from
`numpy.random.default_rng(seed)`.

Where faithfulness and the no-drop rule clash (every sequence is trained exactly once):

1. Bucket tails. Inter truncates every bucket to a multiple of its bs and intra drops the
   fastest partial group of a step (both under drop_last, which every benchmark yaml sets).
   We run the master code path as with drop_last off: tails stay, as partial micro-batches,
   where the fill put them. An earlier revision (01cc02b) had a `keep_last` mode for this;
   `plan_dcp_intra(keep_last=True)` adds its rule (the target t_min is taken over groups whose
   bucket still has samples, and last batches faster than it are left alone and ignored by
   step e), which stops a 1-sample tail from setting the pace of its step.
2. Partially filled steps. When no remaining bucket's sp fits the free GPUs the published code
   discards the step's samples; we run the step with the rest of the GPUs idle.
3. Inter's GA pruning (drop a group whose bucket cannot supply its GA quota, and the rest of
   that bucket; drop_last only) is skipped; the chain ends when the bucket runs out (the
   published realised-gas behaviour, sec. 6.A7).
4. One global batch is small against the profile: a bucket's memory-bound bs often exceeds its
   count in the batch, so the first phase takes whole buckets, and inter has nothing left to
   chain (its plan is then one phase of whole buckets, mostly at sp=1). The published
   algorithm would form no step from such a batch at all (see above); we do not rescale the
   profile.
5. Intra's pop (sec. 2.3 d) returns the popped groups' samples to the pool (as published); if
   the pops leave fewer than N GPUs busy (only on non-power-of-two clusters) the rest idle.
6. PAC's min_gas 15 (dcp_inter_ckpt.yaml) is a per-optimizer-step rule; applied to every phase
   of one batch it only unbalances the first phase, so the default is dcp_inter's 2 (see
   `plan_dcp_inter_pac`).

Other adaptations: SP degrees and widening steps come from `cluster.allowed_degrees` (so 24 =
3x8 and 6 = 1x6 work; the published powers of two break there, sec. 6.A6); groups are laid out
largest first on aligned ranks (sampler.py:510-512), which the divisibility chain of the
allowed degrees makes always valid. The sp-size draw is the intended one (weighted by bucket
count, as intra's `torch.multinomial`); `biased_sp_pick=True` reproduces inter's buggy loop
(sec. 6.A1). Memory: same capacity as every other planner, not VideoSys' 70% cap.
"""

from __future__ import annotations

import math
import time

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cluster import GIB
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult

from .common import finish
from .videosys_profile import BucketProfile, emulate_profile

OVERSHOOT_PENALTY = 1.2  # sampler.py:328-368: running past the target costs 20% more
RETUNE_TOLERANCE = 0.1  # intra stops widening within 10% of t_min (sampler.py:740)


# ---- the GA solver (_calculate_grad_accumulation_num) ----------------------------------------
def ga_solve(times, max_gas: int = 5, min_gas: int = 1) -> list[int]:
    """Micro-batch counts per group, exactly as `_calculate_grad_accumulation_num`.

    Targets tau = j * t_o for every group o and j with tau <= H = max_gas * max(t); each group
    takes the g in 1..floor(H/t_i) minimising penalty(g t_i, tau) (overshoot x1.2, first g on
    ties); the target with the strictly smallest summed penalty wins (first in loop order).
    Then, if max(g) < min_gas, every g is scaled by ceil(min_gas / max(g)).
    The exhaustive inner loop is replaced by its closed form (the penalty is convex in g, so
    the best g is next to tau / t_i), vectorised over all targets; sums keep the loop's order.
    """
    t = np.asarray(times, dtype=float)
    if t.size == 0:
        return []
    if max_gas < 1 or min_gas < 1 or np.any(t <= 0):
        raise ValueError(f"ga_solve: need times > 0, max_gas >= 1, min_gas >= 1; got {times}")
    horizon = float(t.max()) * max_gas
    gmax = np.array([_max_mult(x, horizon) for x in t])
    taus = np.concatenate(
        [x * np.arange(1, g + 1, dtype=float) for x, g in zip(t, gmax, strict=True)]
    )
    base = np.floor(taus[:, None] / t[None, :])
    best_g = np.zeros((len(taus), len(t)), dtype=int)
    best_s = np.full((len(taus), len(t)), np.inf)
    for off in (-1, 0, 1, 2):  # candidates around tau / t_i, ascending (first g wins ties)
        g = np.clip(base + off, 1, gmax[None, :]).astype(int)
        x = g * t[None, :]
        s = np.where(x > taus[:, None], OVERSHOOT_PENALTY * (x - taus[:, None]), taus[:, None] - x)
        better = (s < best_s) | ((s == best_s) & (g < best_g))
        best_g = np.where(better, g, best_g)
        best_s = np.where(better, s, best_s)
    total = np.zeros(len(taus))
    for i in range(len(t)):  # sequential, as the published sum
        total += best_s[:, i]
    gas = [int(v) for v in best_g[int(np.argmin(total))]]
    if max(gas) < min_gas:
        k = math.ceil(min_gas / max(gas))
        gas = [g * k for g in gas]
    return gas


def _max_mult(t: float, horizon: float) -> int:
    g = int(horizon / t)
    while g > 1 and t * g > horizon:
        g -= 1
    return max(g, 1)


# ---- shared state: the sample pool and the step fill (sec. 2.2) ------------------------------
class _Pool:
    """Per-bucket shuffled queues and counts of samples not yet given to a group."""

    def __init__(self, profiles: list[BucketProfile], rng: np.random.Generator):
        self.prof = profiles
        self.queue = [list(rng.permutation(p.bucket.ids)) for p in profiles]
        self.left = [len(q) for q in self.queue]

    def any_left(self) -> bool:
        return any(self.left)

    def by_sp(self) -> dict[int, list[int]]:
        """Profiled sp -> buckets (in bucket order) that still have samples."""
        out: dict[int, list[int]] = {}
        for b, p in enumerate(self.prof):
            if self.left[b] > 0:
                out.setdefault(p.best.sp, []).append(b)
        return out

    def take(self, b: int, n: int) -> tuple[int, ...]:
        ids, self.queue[b] = self.queue[b][:n], self.queue[b][n:]
        return tuple(int(i) for i in ids)


def _pick_sp(sizes: list[int], weights: list[int], rng, biased: bool) -> int:
    if not biased:
        p = np.asarray(weights, dtype=float)
        return sizes[int(rng.choice(len(sizes), p=p / p.sum()))]
    val, total = rng.random(), sum(weights)
    for s, w in zip(
        sizes, weights, strict=True
    ):  # sampler.py:428-438 compares with each probability
        if val < w / total:
            return s
    return sizes[-1]


def fill_step(pool: _Pool, n_gpus: int, rng, biased: bool = False) -> list[list[int]]:
    """Groups [bucket, sp, n] until the GPUs are used up or no remaining sp fits."""
    remaining, step = n_gpus, []
    while remaining > 0:
        avail = pool.by_sp()
        sizes = sorted(s for s in avail if s <= remaining)
        if not sizes:
            break  # published: discard the step; here the rest of the GPUs idle
        sp = _pick_sp(sizes, [len(avail[s]) for s in sizes], rng, biased)
        cands = avail[sp]
        b = cands[int(rng.integers(len(cands)))]
        n = min(pool.prof[b].best.bs, pool.left[b])
        pool.left[b] -= n
        step.append([b, sp, n])
        remaining -= sp
    return step


def layout(degrees: list[int], cost: CostModel) -> list[int | None]:
    """Start rank of each group, largest first on the first free aligned placement."""
    n = cost.cluster.num_gpus
    free = np.ones(n, dtype=bool)
    starts: list[int | None] = [None] * len(degrees)
    for i in sorted(range(len(degrees)), key=lambda i: -degrees[i]):
        d = degrees[i]
        for s in cost.cluster.placements(d):
            if free[s : s + d].all():
                free[s : s + d] = False
                starts[i] = s
                break
    return starts


def _groups(entries, starts) -> list[Group]:
    """entries: (sp, [micro-batch], ...) in layout order -> Groups."""
    if any(s is None for s in starts):  # cannot happen: the allowed degrees form a chain
        raise RuntimeError(
            f"videosys layout: no aligned place for degrees {[e[0] for e in entries]}"
        )
    return [Group(s, sp, tuple(mbs)) for (sp, mbs), s in zip(entries, starts, strict=True)]


# ---- DCP-inter (sec. 2.4) --------------------------------------------------------------------
def _inter_phases(
    pool: _Pool, cost: CostModel, rng, max_gas: int, min_gas: int, biased: bool
) -> tuple[list[list[Group]], list[list[int]]]:
    phases, gas_log = [], []
    n = cost.cluster.num_gpus
    while pool.any_left():
        step = fill_step(pool, n, rng, biased)
        entries = inter_entries(step, pool, max_gas, min_gas)
        starts = layout([sp for sp, _ in entries], cost)
        phases.append(_groups(entries, starts))
        gas_log.append([len(m) for _, m in entries])
    return phases, gas_log


def inter_entries(step, pool: _Pool, max_gas: int, min_gas: int) -> list:
    """One published DCP-inter step: its groups widest first, each one's micro-step count from
    ga_solve, and its micro-batches chained from the group's bucket -> [(sp, [MicroBatch])]."""
    step.sort(key=lambda g: -g[1])  # sampler.py:510-512, stable
    gas = ga_solve([pool.prof[b].best.time for b, _, _ in step], max_gas, min_gas)
    entries = []
    for (b, sp, first), g in zip(step, gas, strict=True):
        p = pool.prof[b].best
        sizes = [first]
        while len(sizes) < g and pool.left[b] > 0:  # chain stops when the bucket runs out
            k = min(p.bs, pool.left[b])
            pool.left[b] -= k
            sizes.append(k)
        entries.append((sp, [MicroBatch(pool.take(b, k), p.recompute) for k in sizes]))
    return entries


def _plan_inter(batch, cost, name, mode, seed, max_gas, min_gas, biased, unit) -> PlanResult:
    t0 = time.perf_counter()
    cost.check_fits(batch)
    rng = np.random.default_rng(seed)
    profiles = emulate_profile(batch, cost, mode, unit=unit)
    pool = _Pool(profiles, rng)
    phases, gas_log = _inter_phases(pool, cost, rng, max_gas, min_gas, biased)
    stats = {
        "num_steps": len(phases),
        "gas_per_step": gas_log,
        "max_gas": max_gas,
        "min_gas": min_gas,
        "profile": _profile_stats(profiles),
    }
    return finish(phases, batch, cost, planner=name, started=t0, stats=stats)


def _profile_stats(profiles: list[BucketProfile]) -> list[dict]:
    return [
        {
            "bucket": list(p.bucket.key),
            "count": len(p.bucket.ids),
            "sp": p.best.sp,
            "bs": p.best.bs,
            "time_s": p.best.time,
            "recompute": p.best.recompute,
        }
        for p in profiles
    ]


def plan_dcp_inter(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_gas: int = 5,
    min_gas: int = 2,
    biased_sp_pick: bool = False,
) -> PlanResult:
    """DCP-inter: profiled (sp, bs) per bucket at full recompute; per step the GA solver picks
    each group's chain length (dcp_inter.yaml: max 5, min 2)."""
    return _plan_inter(
        batch, cost, "dcp_inter", "inter", seed, max_gas, min_gas, biased_sp_pick, GIB
    )


def plan_dcp_inter_pac(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_gas: int = 5,
    min_gas: int = 2,
    biased_sp_pick: bool = False,
    memory_unit: float = GIB,
) -> PlanResult:
    """DCP-inter with pyramid activation checkpointing: the profile picks (sp, bs, recompute)
    per bucket by the GiB knapsack (sec. 1.8), then as dcp_inter.

    min_gas: dcp_inter_ckpt.yaml sets max 5, min 15: each optimizer step's longest chain has
    at least 15 micro-batches. Here the optimizer step is the whole plan and a phase is only
    part of it, so the yaml's rule is a statement about the batch size, not one a phase
    should enforce: applied per phase it scales every chain of the first phase by up to 15x,
    the chains then run dry unevenly and the step is 1.0-1.5x slower (median over the
    standard workloads on h200x32). We therefore use dcp_inter's min 2; pass min_gas=15 for
    the yaml value."""
    return _plan_inter(
        batch, cost, "dcp_inter_pac", "pac", seed, max_gas, min_gas, biased_sp_pick, memory_unit
    )


# ---- DCP-intra (sec. 2.3) --------------------------------------------------------------------
def _retune(step, pool: _Pool, max_sp: int, keep_last: bool) -> list[bool]:
    """(b)+(c): move every group towards the fastest group by shrinking bs / widening sp; the
    target's bucket is left alone. Returns the groups frozen by `keep_last` (last batches
    faster than the target, which is then taken over groups whose bucket has samples left):
    their capacity is their own time, so step (e) ignores them."""
    prof = pool.prof
    times = [prof[b].per_sp[sp].unit * n for b, sp, n in step]
    live = list(range(len(step)))
    if keep_last:
        live = [i for i, (b, _, _) in enumerate(step) if pool.left[b] > 0]
        if not live:
            return [True] * len(step)  # only last batches: keep_last leaves them all
    i_min = min(live, key=lambda i: times[i])
    t_min, b_min = times[i_min], step[i_min][0]
    frozen = [
        keep_last and pool.left[b] == 0 and times[i] < t_min for i, (b, _, _) in enumerate(step)
    ]
    for i, (b, sp0, n0) in enumerate(step):
        if b != b_min and not frozen[i]:
            step[i] = _retune_group(pool, b, sp0, n0, t_min, max_sp)
    return frozen


def _retune_group(pool: _Pool, b: int, sp0: int, n0: int, t_min: float, max_sp: int):
    """Widen sp (never narrow, up to the node) and pick bs closest to t_min; 10% early stop."""
    per_sp = pool.prof[b].per_sp
    best = None
    for sp in sorted(d for d in per_sp if sp0 <= d <= max(max_sp, sp0)):
        pt = per_sp[sp]
        cap = min(pt.bs, n0 + pool.left[b])
        bs = min(max(round(t_min / pt.unit), 1), cap)
        dev = abs(bs * pt.unit - t_min)
        if best is None or dev < best[0]:
            best = (dev, sp, bs)
        if dev <= RETUNE_TOLERANCE * t_min:
            break
    _, sp, bs = best
    pool.left[b] += n0 - bs
    return [b, sp, bs]


def _pop_overflow(step, frozen, pool: _Pool, n_gpus: int):
    """(d): largest sp first; pop the smallest groups (samples back) until they fit."""
    order = sorted(range(len(step)), key=lambda i: -step[i][1])
    step, frozen = [step[i] for i in order], [frozen[i] for i in order]
    while sum(g[1] for g in step) > n_gpus:
        b, _, n = step.pop()
        frozen.pop()
        pool.left[b] += n
    return step, frozen


def _rebalance_bs(step, frozen, pool: _Pool) -> None:
    """(e) "rebalance bs only": grow the faster groups up to the smallest group capacity
    (capacity = time at min(memory bs, bs + samples left)); slower groups stay."""
    prof = pool.prof
    caps = [
        prof[b].per_sp[sp].unit * min(prof[b].per_sp[sp].bs, n + pool.left[b])
        for (b, sp, n), f in zip(step, frozen, strict=True)
        if not f
    ]
    if not caps:
        return
    cap = min(caps)
    for g in step:
        b, sp, n = g
        pt = prof[b].per_sp[sp]
        if pt.unit * n >= cap:
            continue
        inc = min(int((cap - pt.unit * n) // pt.unit), pt.bs - n, pool.left[b])
        if inc > 0:
            pool.left[b] -= inc
            g[2] = n + inc


def plan_dcp_intra(
    batch: Batch, cost: CostModel, *, seed: int = 0, keep_last: bool = False
) -> PlanResult:
    """DCP-intra: per step, random buckets at their profiled (sp, bs); then every group is
    re-tuned towards the fastest one (shrink bs, widen sp up to the node), overflowing groups
    are popped, and faster groups regain samples. One micro-batch per group, full recompute."""
    t0 = time.perf_counter()
    cost.check_fits(batch)
    rng = np.random.default_rng(seed)
    profiles = emulate_profile(batch, cost, "intra")
    pool = _Pool(profiles, rng)
    n, L = cost.cluster.num_gpus, cost.model.num_layers
    max_sp = cost.cluster.gpus_per_node
    phases = []
    while pool.any_left():
        step = fill_step(pool, n, rng)
        frozen = _retune(step, pool, max_sp, keep_last)
        step, frozen = _pop_overflow(step, frozen, pool, n)
        _rebalance_bs(step, frozen, pool)
        starts = layout([sp for _, sp, _ in step], cost)
        entries = [(sp, [MicroBatch(pool.take(b, k), L)]) for b, sp, k in step]
        phases.append(_groups(entries, starts))
    stats = {"num_steps": len(phases), "profile": _profile_stats(profiles)}
    return finish(phases, batch, cost, planner="dcp_intra", started=t0, stats=stats)
