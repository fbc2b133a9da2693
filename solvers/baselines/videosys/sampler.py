"""The mechanics of VideoSys' DCP sampler (`videosys/training/datasets/open_sora/sampler.py`,
research/videosys_dcp.md sec. 2.2-2.5), shared by the one-batch methods (methods.py) and the
stream samplers (stream.py): the GA solver, the pool of profiled buckets, one step's fill,
the aligned layout, DCP-inter's chains and DCP-intra's re-tuning, pop and rebalance."""

from __future__ import annotations

import math

import numpy as np
from dcp_opt.solvers.baselines.videosys.profile import BucketProfile

from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Group, MicroBatch

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
    if not math.isfinite(horizon):  # int(inf) below: refuse the figures instead
        raise DcpOptError(
            f"ga_solve: a chain of {max_gas} micro-batches overflows float64 "
            f"({float(t.max())!r} s each); the cost model's seconds per micro-batch are too large"
        )
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
class Pool:
    """Per-bucket shuffled queues and counts of samples not yet given to a group."""

    def __init__(self, profiles: list[BucketProfile], rng: np.random.Generator):
        self.prof = profiles
        self.queue = [list(rng.permutation(p.bucket.ids)) for p in profiles]
        self.left = [len(q) for q in self.queue]

    def any_left(self) -> bool:
        return any(self.left)

    def num_left(self) -> int:
        return sum(self.left)

    def check_progress(self, before: int, where: str) -> None:
        """A step loop's exit: every step takes (or drops) a sample at least, so a loop over
        `while any_left()` runs at most num_left() steps. A step that took none would repeat
        for ever: an internal error instead."""
        if self.num_left() >= before:
            raise RuntimeError(f"{where}: a step took no sample ({before} left); a bug")

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


def pick_sp(sizes: list[int], weights: list[int], rng, biased: bool) -> int:
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


def fill_step(pool: Pool, n_gpus: int, rng, biased: bool = False) -> list[list[int]]:
    """Groups [bucket, sp, n] until the GPUs are used up or no remaining sp fits."""
    remaining, step = n_gpus, []
    while remaining > 0:
        avail = pool.by_sp()
        sizes = sorted(s for s in avail if s <= remaining)
        if not sizes:
            break  # published: discard the step; here the rest of the GPUs idle
        sp = pick_sp(sizes, [len(avail[s]) for s in sizes], rng, biased)
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


def step_groups(entries, starts) -> list[Group]:
    """entries: (sp, [micro-batch], ...) in layout order -> Groups."""
    if any(s is None for s in starts):  # cannot happen: the allowed degrees form a chain
        raise RuntimeError(
            f"videosys layout: no aligned place for degrees {[e[0] for e in entries]}"
        )
    return [Group(s, sp, tuple(mbs)) for (sp, mbs), s in zip(entries, starts, strict=True)]


def inter_entries(step, pool: Pool, max_gas: int, min_gas: int) -> list:
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


# ---- DCP-intra (sec. 2.3) --------------------------------------------------------------------
def retune(step, pool: Pool, max_sp: int, keep_last: bool) -> list[bool]:
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


def _retune_group(pool: Pool, b: int, sp0: int, n0: int, t_min: float, max_sp: int):
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


def pop_overflow(step, frozen, pool: Pool, n_gpus: int):
    """(d): largest sp first; pop the smallest groups (samples back) until they fit."""
    order = sorted(range(len(step)), key=lambda i: -step[i][1])
    step, frozen = [step[i] for i in order], [frozen[i] for i in order]
    while sum(g[1] for g in step) > n_gpus:
        b, _, n = step.pop()
        frozen.pop()
        pool.left[b] += n
    return step, frozen


def rebalance_bs(step, frozen, pool: Pool) -> None:
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
