"""The VideoSys profile stage, emulated with the CostModel instead of a GPU.

VideoSys (NUS-HPC-AI-Lab/VideoSys, `videosys/core/dcp/profiler.py`; research/videosys_dcp.md
sec. 1.6-1.9) runs two layers of the model for every (bucket, SP degree, power-of-two batch
size) until memory runs out, extrapolates to full depth and keeps per bucket the setting with
the most samples per GPU-second, `bs / (sp * T)`. Here the same search reads time and memory
from the CostModel:

- time of a micro-batch of `bs` copies of the bucket's shape = `cost.time(bs * features, sp, r)`
  (features are additive, so this is the packed micro-batch the runtime would run);
- memory = `cost.memory(bs * tokens, sp, r)` against `cost.capacity` (the smallest over the
  aligned placements of `sp`), the capacity every planner of dcp_opt uses. VideoSys caps at
  70% of the device; we do not, because the baselines are compared on algorithm, not on
  safety margin;
- recompute: full (r = num_layers) as VideoSys checkpoints every block, except PAC (sec. 1.8).

Buckets: 2D, one bucket per exact shape (the 25 Open-Sora buckets); 1D, power-of-two length
bins [2^k, 2^(k+1)), profiled at the bin's longest length present (so every member fits).

SP degrees: VideoSys sweeps powers of two up to the node size and goes across nodes only when
nothing fits inside one. Its power-of-two group sizes break on other world sizes (sec. 6.A6);
we sweep `cluster.allowed_degrees` instead (powers of two dividing the node, the node, whole
nodes), which reduces to the published grid on power-of-two clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cluster import GIB
from dcp_opt.cost import CostModel

MODES = ("intra", "inter", "pac", "bucket")
MEMORY_TOLERANCE = 1e-9  # as validate(): a sequence exactly at capacity fits


@dataclass(frozen=True)
class Bucket:
    """Sequences sharing one profile entry, in arrival (batch) order."""

    key: tuple
    ids: tuple[int, ...]
    feat: np.ndarray  # features of the profiled (representative) sequence
    tokens: int


@dataclass(frozen=True)
class Point:
    """One profiled setting: `bs` sequences of a bucket on `sp` GPUs, `recompute` layers."""

    sp: int
    bs: int
    time: float  # seconds of one micro-batch of bs sequences
    recompute: int

    @property
    def unit(self) -> float:
        """Seconds per sample: VideoSys models time as linear in bs (sampler.py:644, 720)."""
        return self.time / self.bs

    @property
    def throughput(self) -> float:
        """Samples per GPU-second, the profile's selection criterion (profiler.py:687)."""
        return self.bs / (self.sp * self.time)


@dataclass(frozen=True)
class BucketProfile:
    bucket: Bucket
    best: Point
    per_sp: dict[int, Point]  # largest power-of-two bs at each swept sp (intra's detail table)


def bucket_key(seq) -> tuple:
    if seq.kind == "2d":
        return tuple(seq.shape)
    return (int(seq.num_tokens).bit_length() - 1,)  # floor(log2(length))


def make_buckets(batch: Batch, cost: CostModel) -> list[Bucket]:
    """Buckets in order of first arrival; the representative is the largest member."""
    feats = cost.batch_features(batch)
    members: dict[tuple, list[int]] = {}
    for i, s in enumerate(batch.sequences):
        members.setdefault(bucket_key(s), []).append(i)
    out = []
    for key, idx in members.items():
        rep = max(idx, key=lambda i: batch.sequences[i].num_tokens)
        out.append(
            Bucket(
                key,
                tuple(batch.sequences[i].id for i in idx),
                feats[rep],
                batch.sequences[rep].num_tokens,
            )
        )
    return out


def profile_capacity(cost: CostModel, d: int) -> float:
    """Capacity a group of degree d has wherever it lands (the weakest placement)."""
    return min(cost.capacity(s, d) for s in cost.cluster.placements(d))


def fits(need: float, cap: float) -> bool:
    """The memory test of validate(): a relative tolerance of 1e-9."""
    return float(need) <= cap * (1 + MEMORY_TOLERANCE)


def max_batch(cost: CostModel, tokens: int, d: int, r: int, cap: float) -> int:
    """Largest bs with memory(bs * tokens, d, r) <= cap (0 if not even one fits)."""
    fixed = cost.fixed_bytes()
    one = float(cost.memory(tokens, d, r)) - fixed
    if not fits(fixed + one, cap):
        return 0
    bs = max(1, int(min((cap * (1 + MEMORY_TOLERANCE) - fixed) / one, MAX_BATCH)))
    steps = 0
    while bs > 1 and not fits(cost.memory(bs * tokens, d, r), cap):
        # floating-point edge only: one or two steps down; halving past a few keeps the
        # loop logarithmic in bs whatever the rounding (a provable exit)
        bs = bs - 1 if steps < 8 else bs // 2
        steps += 1
    return bs


# The largest batch a profile point holds (2**31 samples): memory so large that more fit is
# the same as this many (no bucket has more), and the figures priced at it stay finite.
MAX_BATCH = 2**31


def pow2_floor(n: int) -> int:
    return 1 << (int(n).bit_length() - 1) if n >= 1 else 0


def pac_recompute(cost: CostModel, tokens: float, d: int, cap: float, unit: float = GIB) -> int:
    """PAC knapsack (profiler.py:579-622) for one (sp, bs) point, with our single per-micro-batch
    `recompute_layers`: the spare memory at full checkpointing, floored to whole GiB, buys
    non-checkpointed layers, each charged its full activation footprint rounded up to GiB
    (the published, conservative weight). The value (forward time saved) grows with the
    count, so the knapsack keeps the most layers that fit: recompute = L - that count."""
    L = cost.model.num_layers
    budget = math.floor((cap - float(cost.memory(tokens, d, L))) / unit)
    act = tokens / d * cost.coeffs.act_bytes_per_token_layer
    if budget < 0:
        return L
    if act <= 0:
        return 0
    n = min(L, int(budget * unit / act))
    while n > 0 and math.ceil(n * act / unit) > budget:
        n -= 1
    r = L - n
    while r < L and not fits(cost.memory(tokens, d, r), cap):
        r += 1  # our memory model charges less than the knapsack; never exceed capacity
    return r


def sweep_degrees(cost: CostModel, fixed: int | None) -> tuple[list[int], list[int]]:
    """(inside a node, across nodes) degrees of the sweep; only `fixed` for the baseline."""
    if fixed is not None:
        return [fixed], []
    c = cost.cluster
    inside = [d for d in c.allowed_degrees if d <= c.gpus_per_node]
    return inside, [d for d in c.allowed_degrees if d > c.gpus_per_node]


def _points(cost: CostModel, b: Bucket, d: int, mode: str, unit: float) -> list[Point]:
    """Feasible power-of-two points of one bucket at one degree, as the mode keeps them."""
    L = cost.model.num_layers
    cap = profile_capacity(cost, d)
    top = pow2_floor(max_batch(cost, b.tokens, d, L, cap))
    if top == 0:
        return []
    sizes = [top] if mode in ("intra", "bucket") else [1 << k for k in range(top.bit_length())]
    rec = [pac_recompute(cost, s * b.tokens, d, cap, unit) if mode == "pac" else L for s in sizes]
    feats = np.array(sizes, dtype=float)[:, None] * b.feat[None, :]
    times = cost.time(feats, d, np.array(rec))
    return [Point(d, s, float(t), r) for s, t, r in zip(sizes, times, rec, strict=True)]


def profile_bucket(
    cost: CostModel, b: Bucket, mode: str, *, fixed_degree: int | None = None, unit: float = GIB
) -> BucketProfile | None:
    """The state machine of profiler.py:498-764 in closed form (None: fits nowhere)."""
    inside, across = sweep_degrees(cost, fixed_degree)
    cands: list[Point] = []
    per_sp: dict[int, Point] = {}
    for d in inside + across:
        if d in across and cands:
            break  # cross-node SP only as a fallback (sec. 1.6)
        pts = _points(cost, b, d, mode, unit)
        if pts:
            per_sp[d] = max(pts, key=lambda p: p.bs)
            cands += pts
    if not cands:
        return None
    best = max(cands, key=lambda p: p.throughput)  # first maximum, in sweep order
    return BucketProfile(b, best, per_sp)


def emulate_profile(
    batch: Batch,
    cost: CostModel,
    mode: str,
    *,
    fixed_degree: int | None = None,
    unit: float = GIB,
) -> list[BucketProfile]:
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} not allowed; allowed: {list(MODES)}")
    out = []
    for b in make_buckets(batch, cost):
        p = profile_bucket(cost, b, mode, fixed_degree=fixed_degree, unit=unit)
        if p is None:
            # cannot happen after check_fits unless memory differs per rank: fall back to
            # the largest degree, where VideoSys would also end its sweep.
            d = max(cost.cluster.allowed_degrees)
            p = profile_bucket(cost, b, mode, fixed_degree=d, unit=unit)
        if p is None:
            raise ValueError(f"bucket {b.key}: fits at no degree on the weakest placement")
        out.append(p)
    return out
