"""Hypothesis strategies shared by every property and fuzz test.

Everything drawn here is feasible by construction: a cluster's memory is raised until the
model states fit with room to spare, and every sequence is clipped to what fits on the
largest SP degree with every layer recomputed (the CostModel's own `min_recompute`), so
`cost.check_fits(batch)` always passes. Infeasible instances are separate, explicit tests.

- `clusters()`: 1 to 64 GPUs, non-powers of two (1x6, 3x8, 3x4, 5x1, ...), and mixed
  clusters (per-rank memory and speed factors, some slower than 1).
- `models()`: the presets plus small 1D, 2D and 3D ModelSpec variants (heads that do not divide
  the degree, gated or plain MLPs, with or without vocabulary / captions).
- `instances()`: an `Instance(cost, batch)` ready for any planner.
- `valid_plans(inst)`: random valid plans on aligned group layouts, one or more phases,
  packed micro-batches with a random recompute choice at or above the fewest that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from hypothesis import strategies as st

from dcp_opt import (
    MODEL_PRESETS,
    Batch,
    Cluster,
    CostModel,
    Group,
    MicroBatch,
    ModelSpec,
    Plan,
    Sequence,
    make_plan,
)
from dcp_opt.cluster import GB
from dcp_opt.cost import SHARDING_MODES
from dcp_opt.perturb import RANGES, perturb
from tests.toy import toy_cost

# (num_nodes, gpus_per_node): named shapes that must always be in the mix.
NAMED_LAYOUTS = ((1, 1), (1, 6), (3, 8), (3, 4), (1, 8), (4, 8), (8, 8), (5, 1), (2, 3), (7, 2))
NODE_SIZES = (1, 2, 3, 4, 6, 8)


# Strategy objects are cached: building a fresh one per draw (inside loops over sequences)
# costs more than the draw itself and made the CI profile several times slower.
@lru_cache(maxsize=4096)
def ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


BOOLS = st.booleans()


def pick(draw, options):
    """One of `options` (a sequence), shrinking towards the first."""
    return options[draw(ints(0, len(options) - 1))]


@dataclass(frozen=True)
class Instance:
    """A cost model (cluster + model + coefficients) and a batch that fits on it."""

    cost: CostModel
    batch: Batch

    @property
    def cluster(self) -> Cluster:
        return self.cost.cluster

    def __repr__(self) -> str:  # short enough to read in a failing example
        c, m = self.cost.cluster, self.cost.model
        mixed = "" if c.homogeneous else f" speeds={c.speed_factors} mem={c.memory_per_rank}"
        return (
            f"Instance(cluster={c.num_nodes}x{c.gpus_per_node} mem={c.memory_bytes:.4g}{mixed}, "
            f"model={m.name}/{m.kind}/L{m.num_layers}/h{m.hidden}/H{m.num_heads}, "
            f"sharding={self.cost.optimizer_sharding}, frac={self.cost.usable_memory_fraction}, "
            f"shapes={[s.shape for s in self.batch.sequences]})"
        )


# ---- clusters ----------------------------------------------------------------------------
@st.composite
def layouts(draw, max_gpus: int = 64) -> tuple[int, int]:
    named = [x for x in NAMED_LAYOUTS if x[0] * x[1] <= max_gpus]
    per = draw(st.sampled_from(NODE_SIZES))
    free = st.tuples(st.integers(1, max(1, max_gpus // per)), st.just(per))
    return draw(st.one_of(st.sampled_from(named), free))


@st.composite
def clusters(draw, max_gpus: int = 64, mixed: bool | None = None) -> Cluster:
    nodes, per = draw(layouts(max_gpus))
    n = nodes * per
    mem = draw(st.sampled_from([16, 40, 80, 141])) * GB
    peak = draw(st.sampled_from([1e14, 312e12, 989e12]))
    intra = draw(st.sampled_from([100, 300, 450])) * GB
    inter = draw(st.sampled_from([12.5, 25, 50])) * GB
    is_mixed = draw(BOOLS) if mixed is None else mixed
    speeds = mems = None
    if is_mixed:
        if draw(BOOLS):
            # one speed for every rank (a uniformly slow or fast cluster) or one per rank
            one = draw(st.sampled_from([None, 0.4, 0.7, 1.3]))
            speeds = (
                (one,) * n if one else tuple(pick(draw, (0.4, 0.7, 1.0, 1.3)) for _ in range(n))
            )
        if draw(BOOLS):
            mems = tuple(pick(draw, (0.5, 0.75, 1.0)) * mem for _ in range(n))
    return Cluster(
        f"hyp{nodes}x{per}",
        nodes,
        per,
        mem,
        peak,
        intra,
        inter,
        speed_factors=speeds,
        memory_per_rank=mems,
    )


# ---- models ------------------------------------------------------------------------------
@st.composite
def small_models(draw, kind: str | None = None) -> ModelSpec:
    kind = kind or draw(st.sampled_from(["1d", "2d", "3d"]))
    heads = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16, 32]))
    hidden = heads * draw(st.sampled_from([8, 64, 128]))
    ffn = hidden * draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 12))
    if kind == "1d":
        return ModelSpec(
            "small-1d",
            "1d",
            layers,
            hidden,
            heads,
            ffn,
            vocab_size=draw(st.sampled_from([0, 1000, 32000])),
            gated_mlp=draw(BOOLS),
            causal=draw(BOOLS),
            # grouped-query attention: any divisor of the heads, or multi-head (None)
            num_kv_heads=draw(
                st.sampled_from([None] + [k for k in range(1, heads + 1) if heads % k == 0])
            ),
        )
    if kind == "3d":  # a full-attention video DiT, joint (MMDiT) or cross text (issue 27)
        mode = draw(st.sampled_from(["joint", "cross"]))
        single = draw(st.integers(0, layers)) if mode == "joint" else 0
        return ModelSpec("small-3d", "3d", layers, hidden, heads, ffn, causal=False,
                         text_tokens=draw(st.sampled_from([0, 16, 512])), text_mode=mode,
                         single_layers=single)  # fmt: skip
    return ModelSpec(
        "small-2d",
        "2d",
        layers,
        hidden,
        heads,
        ffn,
        text_tokens=draw(st.sampled_from([0, 16, 300])),
        causal=False,
    )


def models(kind: str | None = None) -> st.SearchStrategy[ModelSpec]:
    presets = [m for m in MODEL_PRESETS.values() if kind is None or m.kind == kind]
    return st.one_of(st.sampled_from(presets), small_models(kind))


# ---- cost models -------------------------------------------------------------------------
def _raise_memory(cluster: Cluster, need: float) -> Cluster:
    """Scale memory (and per-rank memory) so that the smallest rank holds at least `need`."""
    low = min(cluster.rank_memory(r) for r in range(cluster.num_gpus))
    if low >= need:
        return cluster
    k = need / low
    per = None if cluster.memory_per_rank is None else [m * k for m in cluster.memory_per_rank]
    return cluster.with_(memory_bytes=cluster.memory_bytes * k, memory_per_rank=per)


@st.composite
def toy_costs(draw, max_gpus: int = 64) -> CostModel:
    """The hand-arithmetic toy (tests/toy.py) on a drawn layout and memory."""
    nodes, per = draw(layouts(max_gpus))
    return toy_cost(nodes, per, float(draw(st.integers(40, 2000))))


# the SP kinds a 1D cost model may offer: Ulysses alone, with cp, with ring, with both
SP_KIND_SETS = (("ulysses",), ("ulysses", "cp"), ("ulysses", "ring"), ("ulysses", "cp", "ring"))


@st.composite
def flops_costs(draw, max_gpus: int = 64, kind: str | None = None, mixed=None) -> CostModel:
    model = draw(models(kind))
    cluster = draw(clusters(max_gpus, mixed))
    sharding = draw(st.sampled_from(SHARDING_MODES))
    frac = draw(st.sampled_from([0.7, 0.9, 1.0]))
    cost = CostModel(model, cluster, optimizer_sharding=sharding, usable_memory_fraction=frac)
    if model.kind == "1d":  # planners may give groups any offered SP kind (dcp_opt/cost/)
        kinds = draw(st.sampled_from(SP_KIND_SETS))
        cost = cost if kinds == ("ulysses",) else cost.with_(sp_kinds=kinds)
    return with_headroom(cost, draw(st.sampled_from([1.05, 1.5, 3.0])))


def with_headroom(cost: CostModel, headroom: float = 1.5) -> CostModel:
    """Raise memory until the model states take at most 1/headroom of usable memory."""
    need = cost.fixed_bytes() * headroom / cost.usable_memory_fraction
    return cost.with_(cluster=_raise_memory(cost.cluster, need))


def cost_models(max_gpus: int = 64, kind: str | None = None, mixed=None):
    toys = toy_costs(max_gpus) if kind in (None, "1d") else st.nothing()
    return st.one_of(flops_costs(max_gpus, kind, mixed), toys)


@st.composite
def perturbed_costs(draw, max_gpus: int = 64, kind: str | None = None, mixed=None) -> CostModel:
    """A cost model of `cost_models()` moved by the knobs of dcp_opt.perturb (issue 19), each
    on in two draws of three at a value within its range, then memory raised for headroom
    again (a 16 GB reserve on a small toy cluster would leave no room otherwise)."""
    base = draw(cost_models(max_gpus, kind, mixed))
    knobs = {
        k: draw(st.floats(lo, hi, allow_nan=False))
        for k, (lo, hi, _) in RANGES.items()
        if draw(ints(0, 2))
    }
    return with_headroom(perturb(base, **knobs), draw(st.sampled_from([1.05, 1.5, 3.0])))


@st.composite
def perturbed_instances(draw, max_gpus: int = 64, max_seqs: int = 24, kind=None, mixed=None):
    cost = draw(perturbed_costs(max_gpus, kind, mixed))
    return Instance(cost, draw(batches_for(cost, max_seqs)))


# ---- batches -----------------------------------------------------------------------------
def fit_capacity(cost: CostModel) -> tuple[int, float]:
    """(largest degree, best capacity at it): where check_fits tries every sequence."""
    dmax = max(cost.cluster.allowed_degrees)
    return dmax, max(cost.capacity(s, dmax) for s in cost.cluster.placements(dmax))


def max_fit_tokens(cost: CostModel, limit: int = 2**40) -> int:
    """Largest token count that fits at the largest degree with every layer recomputed
    (0 if none); found by bisection on the CostModel's own `min_recompute`."""
    dmax, cap = fit_capacity(cost)
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(cost.min_recompute(mid, dmax, cap)) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return lo


def log_int(draw, low: int, high: int) -> int:
    """An integer spread over orders of magnitude (a bit width first, then a value)."""
    high = max(low, high)
    bits = draw(ints(low.bit_length() - 1, high.bit_length() - 1))
    return draw(ints(max(low, 2**bits), min(high, 2 ** (bits + 1) - 1)))


def _clip_shape(shape: list[int], max_tokens: int) -> tuple[int, ...]:
    """Halve the largest dimension until the shape fits (1x1x1 = 1 token always fits)."""
    while math.prod(shape) > max_tokens:
        i = shape.index(max(shape))
        shape[i] = max(1, shape[i] // 2)
    return tuple(shape)


@st.composite
def batches_for(
    draw, cost: CostModel, max_seqs: int = 24, max_len: int = 2**18, tiny_ok: bool = True
) -> Batch:
    """Up to `max_seqs` sequences, each clipped to fit; one batch in four is many tiny
    sequences (up to 5x `max_seqs`, at most 64 tokens), where per-micro-batch constants
    dominate and packing matters."""
    cap = min(max_fit_tokens(cost), max_len)
    assert cap >= 1, "strategy bug: memory not raised enough for one token"
    tiny = tiny_ok and draw(ints(0, 3)) == 0
    n = draw(ints(1, 5 * max_seqs if tiny else max_seqs))
    cap = min(cap, 64) if tiny else cap
    seqs = []
    for i in range(n):
        if cost.model.kind == "1d":
            seqs.append(Sequence(i, (log_int(draw, 1, cap),)))
        else:
            f = draw(ints(1, 4 if tiny else 64))
            h, w = draw(ints(1, 48)), draw(ints(1, 80))
            seqs.append(Sequence(i, _clip_shape([f, h, w], cap)))
    ids = draw(st.permutations(range(n))) if draw(BOOLS) else range(n)
    return Batch(tuple(Sequence(j, s.shape) for j, s in zip(ids, seqs, strict=True)))


@st.composite
def instances(draw, max_gpus: int = 64, max_seqs: int = 24, kind=None, mixed=None) -> Instance:
    cost = draw(cost_models(max_gpus, kind, mixed))
    return Instance(cost, draw(batches_for(cost, max_seqs)))


# ---- plans -------------------------------------------------------------------------------
def _fits(cost: CostModel, tokens: int, start: int, d: int, kind: str = "ulysses") -> int:
    """Fewest recomputed layers for `tokens` on the group at (start, d); -1 if none."""
    return int(cost.min_recompute(tokens, d, cost.capacity(start, d), kind=kind))


@st.composite
def group_layouts(draw, cluster: Cluster) -> list[tuple[int, int]]:
    """A random partition of the ranks into aligned groups of allowed degrees, left to right.
    Degree 1 always exists, so the walk never gets stuck."""
    out, r, n, g = [], 0, cluster.num_gpus, cluster.gpus_per_node
    while r < n:
        ok = [
            d
            for d in cluster.allowed_degrees
            if r % d == 0 and r + d <= n and (d > g or not cluster.spans_nodes(r, d))
        ]
        d = pick(draw, ok)
        out.append((r, d))
        r += d
    return out


@st.composite
def valid_plans(draw, inst: Instance, dense: bool | None = None, cp: bool = False) -> Plan:
    """One to three phases on random layouts (one when dense); sequences that fit none of
    their phase's groups go to one or two last phases, each one group of the largest degree
    at its roomiest placement (always feasible).

    `dense` plans are the tight ones a good planner makes (they are what tests a lower bound):
    each sequence goes to the fitting group with the least work so far, micro-batches are
    packed as full as memory allows, and recompute is the fewest that fits. Otherwise the
    group, the packing and the recompute choice are all drawn. `cp`: where the cost model
    offers cp or ring, some groups are of those kinds (the bounds' tests; simulate's
    reference is Ulysses')."""
    cost, batch = inst.cost, inst.batch
    L = cost.model.num_layers
    dense = draw(BOOLS) if dense is None else dense
    layouts = [draw(group_layouts(cost.cluster)) for _ in range(1 if dense else draw(ints(1, 3)))]
    dmax, _ = fit_capacity(cost)
    best = max(cost.cluster.placements(dmax), key=lambda s: cost.capacity(s, dmax))
    # groups are keyed (phase, start, degree)
    assigned = {(p, *g): [] for p, layout in enumerate(layouts) for g in layout}
    load = dict.fromkeys(assigned, 0.0)
    late: list[int] = []
    for s in sorted(batch.sequences, key=lambda s: -s.num_tokens):
        p = draw(ints(0, len(layouts) - 1))
        fits = [k for k in assigned if k[0] == p and _fits(cost, s.num_tokens, *k[1:]) >= 0]
        if not fits:
            late.append(s.id)
            continue
        k = min(fits, key=lambda k: (load[k], k)) if dense else pick(draw, fits)
        assigned[k].append(s.id)
        load[k] += s.num_tokens / k[2] / cost.cluster.group_speed(*k[1:])
    phases = [
        [
            _group(draw, cost, batch, st_, d, ids, L, dense, cp)
            for (q, st_, d), ids in assigned.items()
            if q == p
        ]
        for p in range(len(layouts))
    ]
    n_late_phases = draw(ints(1, 2)) if late else 0
    for k in range(n_late_phases):
        late_ids = late[k::n_late_phases]
        phases.append([_group(draw, cost, batch, best, dmax, late_ids, L, dense, cp)])
    return make_plan(phases, batch, cost, planner="hyp", normalizer_kind=draw(_kinds()))


def _kinds():
    return st.sampled_from([None, "tokens", "samples"])


def _group(draw, cost, batch, start, d, ids, L, dense, cp=False) -> Group:
    """Pack `ids` (in a drawn order) into micro-batches that fit at full recompute, then give
    each micro-batch a recompute choice between its minimum and L."""
    order = list(ids) if dense or not ids else draw(st.permutations(ids))
    mbs: list[list[int]] = []
    tokens: list[int] = []
    for sid in order:
        t = batch.by_id[sid].num_tokens
        pack = dense or draw(BOOLS)
        if mbs and pack and _fits(cost, tokens[-1] + t, start, d) >= 0:
            mbs[-1].append(sid)
            tokens[-1] += t
        else:
            mbs.append([sid])
            tokens.append(t)
    # a cost model offering cp or ring: some groups are of those kinds where every
    # micro-batch fits its memory (cp's gathered K/V and ring's buffers may need more
    # recompute than Ulysses), so bounds meet cp and ring plans too
    kind = "ulysses"
    other = [k for k in cost.sp_kinds[1:] if all(_fits(cost, t, start, d, k) >= 0 for t in tokens)]
    if cp and other and draw(BOOLS):
        kind = draw(st.sampled_from(other))
    out = []
    for ids_, t in zip(mbs, tokens, strict=True):
        r0 = _fits(cost, t, start, d, kind)
        out.append(MicroBatch(tuple(ids_), r0 if dense else draw(ints(r0, L))))
    return Group(start, d, tuple(out), kind=kind)


def rel_excess(value: float, bound: float) -> float:
    """How far `value` falls below `bound`, relative (<= 0 when value >= bound)."""
    return (bound - value) / max(abs(bound), 1e-300)


__all__ = [
    "Instance",
    "clusters",
    "models",
    "cost_models",
    "batches_for",
    "instances",
    "valid_plans",
    "group_layouts",
    "max_fit_tokens",
    "with_headroom",
    "fit_capacity",
    "rel_excess",
]
