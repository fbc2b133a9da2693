"""What-if analysis: predicted speedups for a user's own length distribution, before any GPU.

    dist = LengthDistribution.from_histogram("lengths.csv")   # or .from_lengths(FILE)
    doc = run_whatif(dist, WhatIfConfig(cluster="h200x32", model="llama-7b"))
    dcp-opt whatif --histogram lengths.csv --json out.json --plot out.png

From the distribution alone it samples global batches the way the standard workloads do
(sequences drawn i.i.d. until a token budget of GPUs x 64K tokens is reached; REFERENCE.md
sec. 4), plans each with every built planner, checks each plan with validate() and predicts
it with simulate(). It reports, per planner, the speedup over bucket parallel per batch
(median, p10, p90 over batches) and the peak memory against the capacity; for the best
planner, which SP degrees it uses (share of GPU-time, of sequences, and the token range sent
to each degree); and how the speedups change with the GPU count (the token budget scales
with it: weak scaling, as the paper's experiments) and with the inter-node bandwidth.

Input formats (`--histogram` CSV `length,count` or `frames,height,width,count`, `--lengths`
batch files): see dcp_opt.histogram.

JSON document (`WHATIF_SCHEMA` = "dcp-opt-whatif/1"):

    schema, config (cluster, num_gpus, model, num_batches, sweep_batches, tokens_per_gpu,
        gpus, inter_bw_scales, planners, time_limit_s, seed, sp_kinds), distribution (source, kind,
        num_bins, mean/p50/p90/max tokens, token_histogram {edges, sequence_share,
        token_share} over powers of two), wall_time_s, best_planner, warnings
    planners   one row per planner on the base cluster: planner, num_batches, num_valid,
               errors, median_step_time_s, median_tokens_per_s, speedup {median, p10, p90,
               min, max} over batches (null without a valid bucket plan),
               speedup_per_batch (the batches where both plans are valid), peak_memory_gb
               {median, max} (the fullest rank), capacity_gb, fixed_memory_gb (model states and
               reserve, on every rank), min_headroom (1 - max peak /
               capacity), recompute_share (median share of busy time spent recomputing)
    degrees    for the best planner, one row per SP degree used: degree, gpu_time_share,
               sequence_share, token_share, min/median/max_tokens (per sequence sent
               there; short ones may ride along, packed, with long ones), recompute_fraction
               (token-weighted share of layers recomputed)
    sweep_gpus       one row per GPU count: num_gpus, cluster, speedup {planner: {median,
                     p10, p90} or null}, note (e.g. a bin that does not fit)
    sweep_inter_bw   one row per scale: scale, inter_node_bw_gbps, speedup, note
    kind_map   only when the cost model offers cp or ring (`sp_kinds`, `--sp-kinds ulysses,cp`):
               where each SP kind wins over length x degree for the distribution's lengths,
               and the best planner's GPU-time share per kind (dcp_opt.analysis.kind_map)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..batch import Batch, Sequence
from ..bounds import lower_bound
from ..cluster import GB, Cluster
from ..cost import SHARDING_MODES, CostModel
from ..errors import DcpOptError
from ..histogram import LengthDistribution
from ..model import model_preset
from ..simulate import SimResult, simulate
from ..topology.presets import cluster_preset
from ..validate import validate
from ..workloads import DEFAULT_TOKENS_PER_GPU
from .bench import DEFAULT_MODELS, planner_kwargs
from .kind_map import whatif_kind_map

WHATIF_SCHEMA = "dcp-opt-whatif/1"
REFERENCE = "bucket"
# Planners the sweeps rerun (besides the best one): the reference and the published method.
SWEEP_BASELINES = ("bucket", "dcp_inter_pac")


# ---- configuration -----------------------------------------------------------------------------
@dataclass(frozen=True)
class WhatIfConfig:
    cluster: str = "h200x32"
    model: str | None = None  # None: llama-7b for text, opensora-stdit3-xl for video
    num_batches: int = 5
    sweep_batches: int = 2  # batches per sweep point (the sweeps rerun the planners)
    gpus: tuple[int, ...] = (8, 16, 32, 64)
    inter_bw_scales: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU
    planners: tuple[str, ...] | None = None  # None: every planner built in this checkout
    time_limit_s: float | None = 1.0  # per solve, for planners that take a budget (cpsat)
    seed: int = 0
    optimizer_sharding: str = "zero1"
    sp_kinds: tuple[str, ...] | None = None  # None: the cost model's (a preset: Ulysses only)

    def __post_init__(self) -> None:
        for name in ("num_batches", "sweep_batches", "tokens_per_gpu"):
            if getattr(self, name) < 1:
                raise DcpOptError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.seed, int) or self.seed < 0:  # numpy's generators need >= 0
            raise DcpOptError(f"seed: must be an integer >= 0, got {self.seed}")
        if any(not isinstance(n, int) or n < 1 for n in self.gpus):
            raise DcpOptError(f"gpus: every entry must be an integer >= 1, got {list(self.gpus)}")
        if any(not s > 0 for s in self.inter_bw_scales):
            raise DcpOptError(
                f"inter_bw_scales: every entry must be > 0, got {list(self.inter_bw_scales)}"
            )
        if self.optimizer_sharding not in SHARDING_MODES:
            raise DcpOptError(
                f"optimizer_sharding: {self.optimizer_sharding!r} not allowed; "
                f"allowed: {list(SHARDING_MODES)}"
            )
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise DcpOptError(f"time_limit_s: must be > 0, got {self.time_limit_s}")


def base_cost(dist: LengthDistribution, config: WhatIfConfig) -> CostModel:
    model = model_preset(config.model or DEFAULT_MODELS[dist.kind])
    if model.input_kind != dist.kind:
        raise DcpOptError(
            f"model: {model.name!r} is a {model.kind} model but {dist.source} holds "
            f"{dist.kind} shapes"
        )
    return CostModel(
        model, cluster_preset(config.cluster), optimizer_sharding=config.optimizer_sharding
    )


def scaled_cluster(base: Cluster, num_gpus: int) -> Cluster:
    """The same GPUs and links with `num_gpus` of them: whole nodes, or part of one node.
    For an h200 preset this equals cluster_preset(f"h200x{num_gpus}")."""
    if num_gpus == base.num_gpus:
        return base
    if not base.homogeneous:
        raise DcpOptError(f"gpus: cluster {base.name!r} is mixed; its GPU count cannot change")
    g = base.gpus_per_node
    if num_gpus > g and num_gpus % g:
        raise DcpOptError(
            f"gpus: {num_gpus} not allowed on {base.name!r}; give <= {g} or a multiple of {g} "
            "(GPUs per node)"
        )
    nodes, per = (1, num_gpus) if num_gpus <= g else (num_gpus // g, g)
    stem = base.name.rstrip("0123456789")
    name = f"{stem}{num_gpus}" if stem.endswith("x") else f"{base.name}@{num_gpus}"
    return base.with_(name=name, num_nodes=nodes, gpus_per_node=per, degrees=None)


def check_bins(dist: LengthDistribution, cost: CostModel) -> None:
    """DcpOptError naming the first bin that fits nowhere on this cluster."""
    bins = Batch(tuple(Sequence(i, s) for i, s in enumerate(dist.shapes)))
    try:
        cost.check_fits(bins)
    except DcpOptError as e:
        shape = dist.shapes[getattr(e, "sequence_id", 0) or 0]
        msg = str(e).split(" cannot fit: ", 1)[-1]
        raise DcpOptError(
            f"{dist.source}: bin {shape} cannot fit on {cost.cluster.name} with "
            f"{cost.model.name}: {msg}"
        ) from None


# ---- one batch, every planner ------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """One planner on one batch; `sim` is None when it gave no valid plan."""

    planner: str
    step_time_s: float | None
    wall_time_s: float
    sim: SimResult | None = None
    error: str = ""


def run_planners(batch: Batch, cost: CostModel, planners, options: dict) -> dict[str, Outcome]:
    from dcp_opt.solvers import get_planner

    out = {}
    for name in planners:
        started = time.perf_counter()
        try:
            fn = get_planner(name)
            res = fn(batch, cost, **planner_kwargs(fn, **options)[0])
        except Exception as e:  # a planner bug is recorded, the analysis goes on
            out[name] = Outcome(name, None, time.perf_counter() - started, error=_short(e))
            continue
        wall = time.perf_counter() - started
        if not res.ok:
            out[name] = Outcome(name, None, wall, error=f"{res.status}: {res.message or 'no plan'}")
            continue
        bad = validate(res.plan, batch, cost)
        if bad:
            out[name] = Outcome(name, None, wall, error=f"invalid plan: {bad[0]}")
            continue
        sim = simulate(res.plan, batch, cost)
        out[name] = Outcome(name, sim.step_time_s, wall, sim)
    return out


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:200]


def spread(xs: list[float]) -> dict | None:
    """Median, p10, p90, min, max (numpy's linear interpolation); None for no values."""
    if not xs:
        return None
    a = np.asarray(xs, dtype=float)
    q = np.percentile(a, [50, 10, 90])
    return {
        "median": float(q[0]),
        "p10": float(q[1]),
        "p90": float(q[2]),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def speedups(runs: list[tuple[Batch, dict[str, Outcome]]], planner: str) -> list[float]:
    """Per batch: bucket's step time / this planner's, where both gave a valid plan."""
    out = []
    for _, res in runs:
        ref, own = res.get(REFERENCE), res.get(planner)
        if ref and own and ref.step_time_s and own.step_time_s:
            out.append(ref.step_time_s / own.step_time_s)
    return out


# ---- figures over batches ----------------------------------------------------------------------
def planner_row(name: str, runs: list[tuple[Batch, dict[str, Outcome]]], cost: CostModel) -> dict:
    ok = [(b, r[name]) for b, r in runs if r[name].sim is not None]
    peaks = [float(o.sim.peak_memory_bytes.max()) / GB for _, o in ok]
    cap = cost.capacity() / GB
    busy = [max(float(o.sim.busy_s.sum()), 1e-30) for _, o in ok]
    return {
        "planner": name,
        "num_batches": len(runs),
        "num_valid": len(ok),
        "errors": list(dict.fromkeys(r[name].error for _, r in runs if r[name].error))[:3],
        "median_step_time_s": _median([o.step_time_s for _, o in ok]),
        "median_tokens_per_s": _median([b.num_tokens / o.step_time_s for b, o in ok]),
        "median_wall_time_s": _median([r[name].wall_time_s for _, r in runs]),
        "speedup": spread(speedups(runs, name)),
        "speedup_per_batch": speedups(runs, name),
        "peak_memory_gb": {"median": _median(peaks), "max": max(peaks)} if peaks else None,
        "capacity_gb": cap,
        "fixed_memory_gb": cost.fixed_bytes() / GB,
        "min_headroom": 1.0 - max(peaks) / cap if peaks else None,
        "recompute_share": _median(
            [o.sim.recompute_s / t for (_, o), t in zip(ok, busy, strict=True)]
        ),
    }


def _median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def best_planner(rows: list[dict]) -> str | None:
    """The non-reference planner with the highest median speedup among those valid on every
    batch (else on some batch); by median step time if bucket never gave a plan."""
    cands = [r for r in rows if r["planner"] != REFERENCE and r["num_valid"]]
    full = [r for r in cands if r["num_valid"] == r["num_batches"]] or cands
    if not full:
        return None
    if all(r["speedup"] for r in full):
        return max(full, key=lambda r: r["speedup"]["median"])["planner"]
    return min(full, key=lambda r: r["median_step_time_s"])["planner"]


def degree_rows(runs: list[tuple[Batch, Outcome]], cost: CostModel) -> list[dict]:
    """Which degrees a planner's plans use, summed over batches (events of simulate())."""
    agg: dict[int, dict] = {}
    num_layers = cost.model.num_layers
    for batch, o in runs:
        if o.sim is None:
            continue
        for e in o.sim.events:
            tok = [batch.by_id[s].num_tokens for s in e.sequence_ids]
            a = agg.setdefault(
                e.degree,
                {"gpu_s": 0.0, "seqs": 0, "tokens": 0.0, "rec": 0.0, "each": []},
            )
            a["gpu_s"] += (e.end_s - e.start_s) * e.degree
            a["seqs"] += len(tok)
            a["tokens"] += sum(tok)
            a["rec"] += sum(tok) * e.recompute_layers / num_layers
            a["each"] += tok
    totals = {k: sum(a[k] for a in agg.values()) or 1.0 for k in ("gpu_s", "seqs", "tokens")}
    return [
        {
            "degree": d,
            "gpu_time_share": a["gpu_s"] / totals["gpu_s"],
            "sequence_share": a["seqs"] / totals["seqs"],
            "token_share": a["tokens"] / totals["tokens"],
            "min_tokens": min(a["each"]),
            "median_tokens": float(np.median(a["each"])),
            "max_tokens": max(a["each"]),
            "recompute_fraction": a["rec"] / max(a["tokens"], 1.0),
        }
        for d, a in sorted(agg.items())
    ]


# ---- sweeps ------------------------------------------------------------------------------------
def sweep_point(
    dist: LengthDistribution,
    cost: CostModel,
    planners: list[str],
    config: WhatIfConfig,
    reuse: list[tuple[Batch, dict[str, Outcome]]] | None = None,
) -> tuple[dict, str]:
    """({planner: speedup spread or None}, note) for one cluster variant."""
    try:
        check_bins(dist, cost)
    except DcpOptError as e:
        return {p: None for p in planners if p != REFERENCE}, str(e).split(": ", 1)[-1]
    if reuse is None:
        budget = cost.cluster.num_gpus * config.tokens_per_gpu
        options = {"time_limit_s": config.time_limit_s, "seed": config.seed}
        reuse = []
        for i in range(config.sweep_batches):
            batch = dist.sample_batch(config.seed + i, budget)
            reuse.append((batch, run_planners(batch, cost, planners, options)))
    stats = {p: spread(speedups(reuse, p)) for p in planners if p != REFERENCE}
    failed = sorted({p for _, r in reuse for p in planners if r[p].error})
    return stats, (f"no valid plan on some batch: {', '.join(failed)}" if failed else "")


def _sweeps(dist, base: CostModel, runs, planners, config: WhatIfConfig, progress):
    reuse = [(b, {p: r[p] for p in planners}) for b, r in runs[: config.sweep_batches]]
    gpus, bws = [], []
    for n in config.gpus:
        cost = base.with_(cluster=scaled_cluster(base.cluster, n))
        same = n == base.cluster.num_gpus and len(runs) >= config.sweep_batches
        stats, note = sweep_point(dist, cost, planners, config, reuse if same else None)
        gpus.append({"num_gpus": n, "cluster": cost.cluster.name, "speedup": stats, "note": note})
        progress(f"sweep: {n} GPUs")
    bw0 = base.cluster.inter_node_bw
    for s in config.inter_bw_scales:
        cluster = base.cluster.with_(inter_node_bw=bw0 * s)
        if cluster.topology is not None and s != 1:  # its network links carry what inter_bw did
            cluster = cluster.with_(topology=cluster.topology.scaled(s))
        cost = base.with_(cluster=cluster)
        same = s == 1.0 and len(runs) >= config.sweep_batches
        stats, note = sweep_point(dist, cost, planners, config, reuse if same else None)
        if base.cluster.num_nodes == 1:
            note = "one node: no inter-node traffic" + (f"; {note}" if note else "")
        if base.cluster.topology is not None:
            note = f"topology: every network link x{s:g}" + (f"; {note}" if note else "")
        bws.append({"scale": s, "inter_node_bw_gbps": bw0 * s / GB, "speedup": stats, "note": note})
        progress(f"sweep: inter-node bandwidth x{s:g}")
    return gpus, bws


# ---- the whole analysis ------------------------------------------------------------------------
def check_sample_size(dist: LengthDistribution, token_budget: int, field: str = "tokens") -> None:
    """Refuse a draw of `token_budget` tokens that would hold more than MAX_SEQUENCES
    sequences on average, before drawing (the draw itself would take the memory)."""
    from ..batch import MAX_SEQUENCES

    expected = token_budget / dist.summary()["mean_tokens"]
    if expected > MAX_SEQUENCES:
        raise DcpOptError(
            f"{field}: {token_budget:,} tokens drawn from {dist.source} hold about "
            f"{expected:,.0f} sequences; at most {MAX_SEQUENCES:,} per batch: give fewer "
            "tokens (--tokens-per-gpu, --gpus, --epoch-batches)"
        )


def run_whatif(
    dist: LengthDistribution,
    config: WhatIfConfig = WhatIfConfig(),
    *,
    cost: CostModel | None = None,
    progress=lambda message: None,
) -> dict:
    """The what-if document (module docstring). `cost` replaces the preset cost model of
    config.cluster / config.model (e.g. a profiled one); `progress(message)` reports steps."""
    from .bench import select_planners

    started = time.perf_counter()
    base = cost or base_cost(dist, config)
    if config.sp_kinds is not None:
        base = base.with_(sp_kinds=tuple(config.sp_kinds))
    planners, skipped = select_planners(config.planners)
    if REFERENCE not in planners:
        raise DcpOptError(f"planners: must include {REFERENCE!r} (the reference), got {planners}")
    for n in config.gpus:
        scaled_cluster(base.cluster, n)  # a bad GPU count fails before any planning
    check_bins(dist, base)
    options = {"time_limit_s": config.time_limit_s, "seed": config.seed}
    budget = base.cluster.num_gpus * config.tokens_per_gpu
    check_sample_size(dist, max(base.cluster.num_gpus, *config.gpus) * config.tokens_per_gpu)
    runs = []
    for i in range(config.num_batches):
        batch = dist.sample_batch(config.seed + i, budget)
        lower_bound(batch, base)  # cached for the planners
        runs.append((batch, run_planners(batch, base, planners, options)))
        progress(f"batch {i + 1}/{config.num_batches}")
    rows = [planner_row(p, runs, base) for p in planners]
    best = best_planner(rows)
    sweep_names = [p for p in SWEEP_BASELINES if p in planners]
    sweep_names += [best] if best and best not in sweep_names else []
    gpus, bws = _sweeps(dist, base, runs, sweep_names, config, progress)
    warnings = [f"not built in this checkout, skipped: {', '.join(skipped)}"] if skipped else []
    warnings += [
        f"{r['planner']}: {r['num_batches'] - r['num_valid']} batch(es) without a valid "
        f"plan: {r['errors'][0]}"
        for r in rows
        if r["errors"]
    ]
    return {
        "schema": WHATIF_SCHEMA,
        "config": {
            **asdict(replace(config, planners=tuple(planners))),
            "cluster": base.cluster.name,
            "num_gpus": base.cluster.num_gpus,
            "model": base.model.name,
            "sp_kinds": list(base.sp_kinds),
        },
        "distribution": {**dist.summary(), "token_histogram": dist.token_histogram()},
        "wall_time_s": time.perf_counter() - started,
        "best_planner": best,
        "planners": rows,
        "degrees": degree_rows([(b, r[best]) for b, r in runs], base) if best else [],
        "sweep_gpus": gpus,
        "sweep_inter_bw": bws,
        "warnings": warnings,
        **whatif_kind_map(dist, base, [r[best] for _, r in runs] if best else []),
    }
