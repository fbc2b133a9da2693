"""`dcp-opt bench`: every planner on every standard workload, over seeded batches.

Framing: every method is judged on one fixed global batch (2M tokens by default) per
optimizer step. For the VideoSys baselines (bucket, dcp_intra, dcp_inter, dcp_inter_pac) this
is "the published profile forced into a fixed batch", not the published method: it changes the
memory cap (0.9, published 0.7), drop_last (off, published on), PAC's minimum accumulation (2,
published 15) and the step formation (the published sampler forms its own steps over an
epoch, and none at all from one 2M-token batch). Their published form, and the project's
planners at matched tokens per step, are in dcp_opt.analysis.stream (`dcp-opt bench --stream`);
docs/baselines.md lists every deviation and its measured effect.

For each workload (REFERENCE.md sec. 4; 2D workloads use `opensora-stdit3-xl`, 1D ones
`llama-7b` unless told otherwise), each seed, and each planner, the bench plans the batch,
checks the plan with validate() (independent of the planner), simulates it, and records the
figures below. A planner that raises, returns no plan, or returns an invalid plan is recorded
as an error for that batch; the bench never stops for it.

Speedups are taken per batch (reference step time / planner step time) and the median over
the batches where both plans are valid is reported, so one odd batch cannot skew a ratio of
medians. The gap is measured against the tightest certified bound known for the batch: the
analytic `lower_bound()` or any valid planner's own `lower_bound_s` (CP-SAT reports one).

JSON written by `--json OUT` (`BENCH_SCHEMA` = "dcp-opt-bench/1"):

    schema                   "dcp-opt-bench/1"
    framing                  what the figures are (one fixed batch per step; see above)
    config                   cluster, num_gpus, workloads, planners, num_batches, seeds,
                             models ({"1d": name, "2d": name}), tokens_per_gpu,
                             planner_options
    skipped_planners         requested planners not built in this checkout
    total_wall_time_s        the whole bench
    summary                  one row per (workload, planner):
        workload, model, planner
        num_batches            batches attempted
        num_valid              plans that passed validate() and simulate to their reported time
        num_errors             batches where the planner raised or returned no / an invalid plan
        all_valid              num_valid == num_batches
        median_step_time_s     predicted step time (simulate())
        median_lower_bound_s   tightest bound of the batches
        median_gap             step time / tightest bound - 1
        median_imbalance       idle share of GPU-time before the gradient sync
        median_speedup_vs_bucket, median_speedup_vs_static_tuned
                               median of per-batch ratios; null if the reference has no
                               valid plan on any shared batch
        min_speedup_vs_bucket, min_speedup_vs_static_tuned   the worst batch
        median_wall_time_s, max_wall_time_s                  planner call, end to end
        errors                 distinct error messages (at most 3)
    batches                  one row per (workload, seed, planner):
        workload, planner, seed, num_sequences, num_tokens, status, valid, violations
        (codes), step_time_s, lower_bound_s (tightest for the batch), planner_bound_s (the
        planner's own claim), gap, imbalance, comm_share, wall_time_s, speedup_vs_bucket,
        speedup_vs_static_tuned, error
    warnings                 e.g. a valid plan faster than a planner's claimed bound
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..batch import Batch
from ..bounds import lower_bound
from ..cluster import Cluster
from ..cost import CostModel
from ..errors import DcpOptError, check_planner_options
from ..inputs import load_cluster
from ..model import ModelSpec, model_preset
from ..simulate import simulate
from ..validate import validate
from ..workloads import DEFAULT_TOKENS_PER_GPU, STANDARD_WORKLOADS, Workload, standard_batch
from .bench_display import ONE_BATCH_FRAMING

BENCH_SCHEMA = "dcp-opt-bench/1"
DEFAULT_MODELS = {"2d": "opensora-stdit3-xl", "1d": "llama-7b", "3d": "opensora2-11b"}
REFERENCES = ("bucket", "static_tuned")
DEFAULT_NUM_BATCHES = 5
# Option names a planner may take, tried in order (planners are written by several people).
OPTION_ALIASES = {
    "time_limit_s": ("time_limit_s", "time_limit", "budget_s"),
    "seed": ("seed",),
    "num_workers": ("num_workers", "workers"),
}


@dataclass(frozen=True)
class BenchConfig:
    cluster: str = "h200x32"
    workloads: tuple[str, ...] = tuple(w.name for w in STANDARD_WORKLOADS)
    planners: tuple[str, ...] | None = None  # None: every planner built in this checkout
    num_batches: int = DEFAULT_NUM_BATCHES
    first_seed: int = 0
    models: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))
    tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU
    planner_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_batches < 1:
            raise DcpOptError(f"batches: must be >= 1, got {self.num_batches}")
        if not self.workloads:
            raise DcpOptError("workloads: give at least one")
        for w in self.workloads:
            Workload.parse(w)  # names the bad workload
        for kind in DEFAULT_MODELS:
            model = model_preset(self.models.get(kind, DEFAULT_MODELS[kind]))
            if model.kind != kind:
                raise DcpOptError(f"model-{kind}: {model.name!r} is a {model.kind} model")

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(range(self.first_seed, self.first_seed + self.num_batches))


@dataclass(frozen=True)
class BenchRecord:
    """One planner on one batch."""

    workload: str
    planner: str
    seed: int
    num_sequences: int
    num_tokens: int
    status: str = "error"
    valid: bool = False
    violations: tuple[str, ...] = ()
    step_time_s: float | None = None
    lower_bound_s: float | None = None  # the tightest known for the batch
    planner_bound_s: float | None = None  # the planner's own claim
    gap: float | None = None
    imbalance: float | None = None
    comm_share: float | None = None
    wall_time_s: float | None = None
    speedup_vs_bucket: float | None = None
    speedup_vs_static_tuned: float | None = None
    error: str = ""


# ---- planner calls ---------------------------------------------------------------------------
def planner_kwargs(fn: Callable, **wanted: Any) -> tuple[dict[str, Any], list[str]]:
    """Map canonical options (OPTION_ALIASES keys) onto the names `fn` accepts.

    Returns (kwargs, ignored canonical names). None values are dropped.
    """
    check_planner_options(**{k: wanted.get(k) for k in OPTION_ALIASES})
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out, ignored = {}, []
    for canon, value in wanted.items():
        if value is None:
            continue
        names = [a for a in OPTION_ALIASES.get(canon, (canon,)) if a in params]
        if names:
            out[names[0]] = value
        elif var_kw:
            out[canon] = value
        else:
            ignored.append(canon)
    return out, ignored


def select_planners(requested: Iterable[str] | None) -> tuple[list[str], list[str]]:
    """(planners to run, requested planners not built here). Unknown names are an error."""
    from dcp_opt.solvers import PLANNERS, available_planners

    built = available_planners()
    if requested is None:
        return built, []
    unknown = [p for p in requested if p not in PLANNERS]
    if unknown:
        raise DcpOptError(f"planners: {unknown} not allowed; allowed: {list(PLANNERS)}")
    return [p for p in requested if p in built], [p for p in requested if p not in built]


def default_cost(model: ModelSpec, cluster: Cluster) -> CostModel:
    return CostModel(model, cluster)


def json_default(x: Any) -> Any:
    """For json.dumps: numpy scalars and arrays from planner statistics, else their repr."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, tuple)):
        return list(x)
    return repr(x)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def run_one(
    name: str, batch: Batch, cost: CostModel, base: BenchRecord, options: dict
) -> BenchRecord:
    """Plan one batch with one planner; every failure becomes an error record."""
    from dcp_opt.solvers import get_planner

    started = time.perf_counter()
    try:
        fn = get_planner(name)
        kwargs, _ = planner_kwargs(fn, **options)
        res = fn(batch, cost, **kwargs)
    except Exception as e:  # a planner bug must not stop the bench
        return replace(base, wall_time_s=time.perf_counter() - started, error=_error_text(e))
    wall = time.perf_counter() - started
    if res.plan is None or not res.ok:
        msg = res.message or "no plan"
        return replace(base, status=res.status, wall_time_s=wall, error=f"{res.status}: {msg}")
    violations = validate(res.plan, batch, cost)
    sim = simulate(res.plan, batch, cost)
    consistent = abs(sim.step_time_s - res.predicted_step_time_s) <= 1e-6 * sim.step_time_s
    error = ""
    if violations:
        error = f"invalid plan: {'; '.join(str(v) for v in violations[:2])}"
    elif not consistent:
        error = (
            f"reported step time {res.predicted_step_time_s:.6g} s != "
            f"simulated {sim.step_time_s:.6g} s"
        )
    return replace(
        base,
        status=res.status,
        valid=not error,
        violations=tuple(sorted({v.code for v in violations})),
        step_time_s=sim.step_time_s,
        planner_bound_s=res.lower_bound_s,
        imbalance=sim.imbalance,
        comm_share=sim.comm_share,
        wall_time_s=wall,
        error=error,
    )


# ---- one batch, all planners -------------------------------------------------------------------
def bench_batch(
    workload: str,
    seed: int,
    batch: Batch,
    cost: CostModel,
    planners: list[str],
    options: dict,
    on_done: Callable[[str, str], None] = lambda workload, planner: None,
) -> tuple[list[BenchRecord], list[str]]:
    """Records of every planner on one batch, with gaps and speedups filled in."""
    base = BenchRecord(workload, "", seed, len(batch), batch.num_tokens)
    try:
        analytic = lower_bound(batch, cost).value_s
    except DcpOptError as e:  # the batch itself cannot be planned: an error for everyone
        recs = [replace(base, planner=p, error=_error_text(e)) for p in planners]
        for p in planners:
            on_done(workload, p)
        return recs, []
    recs = []
    for p in planners:
        recs.append(run_one(p, batch, cost, replace(base, planner=p), options))
        on_done(workload, p)
    return _fill_relative(recs, analytic)


def _fill_relative(recs: list[BenchRecord], analytic: float) -> tuple[list[BenchRecord], list]:
    valid = [r for r in recs if r.valid]
    bound = max([analytic] + [r.planner_bound_s for r in valid if r.planner_bound_s])
    warnings = []
    best = min((r.step_time_s for r in valid), default=None)
    if best is not None and best < bound * (1 - 1e-9):
        claimed = [r.planner for r in valid if (r.planner_bound_s or 0) > best * (1 + 1e-9)]
        warnings.append(
            f"{recs[0].workload} seed {recs[0].seed}: a valid plan takes {best:.6g} s, below "
            f"the bound claimed by {claimed}; those bounds are ignored"
        )
        bound = analytic
    ref = {r.planner: r.step_time_s for r in valid if r.planner in REFERENCES}
    out = []
    for r in recs:
        if not r.valid:
            out.append(replace(r, lower_bound_s=bound))
            continue
        out.append(
            replace(
                r,
                lower_bound_s=bound,
                gap=r.step_time_s / bound - 1.0,
                speedup_vs_bucket=_ratio(ref.get("bucket"), r.step_time_s),
                speedup_vs_static_tuned=_ratio(ref.get("static_tuned"), r.step_time_s),
            )
        )
    return out, warnings


def _ratio(ref: float | None, t: float) -> float | None:
    return None if ref is None else ref / t


# ---- the whole bench ---------------------------------------------------------------------------
def run_bench(
    config: BenchConfig,
    *,
    make_cost: Callable[[ModelSpec, Cluster], CostModel] = default_cost,
    on_start: Callable[[int], None] = lambda total: None,
    on_done: Callable[[str, str], None] = lambda workload, planner: None,
) -> dict:
    """Run the bench; returns the JSON document described in the module docstring.

    `make_cost` builds the cost model (perturb constants here for a sensitivity study);
    `on_start(total)` and `on_done(workload, planner)` drive a progress display.
    """
    started = time.perf_counter()
    cluster = load_cluster(config.cluster)  # a preset name or a Cluster JSON file
    planners, skipped = select_planners(config.planners)
    _import_planners(planners)
    kinds = ["1d", "2d"]  # 3d (full-attention video DiTs) only when a workload asks for it
    kinds += ["3d"] if any(Workload.parse(w).kind == "3d" for w in config.workloads) else []
    models_of = {**DEFAULT_MODELS, **config.models}
    costs = {k: make_cost(model_preset(models_of[k]), cluster) for k in kinds}
    on_start(len(config.workloads) * len(config.seeds) * len(planners))
    records: list[BenchRecord] = []
    warnings: list[str] = []
    for w in config.workloads:
        cost = costs[Workload.parse(w).kind]
        for seed in config.seeds:
            batch = standard_batch(
                w, seed, num_gpus=cluster.num_gpus, tokens_per_gpu=config.tokens_per_gpu
            )
            recs, warn = bench_batch(
                w,
                seed,
                batch,
                cost,
                planners,
                config.planner_options,
                on_done=on_done,
            )
            records += recs
            warnings += warn
    # the models the cost models hold: make_cost may swap the preset (a user's file, a profile)
    models = {k: c.model.name for k, c in costs.items()}
    return {
        "schema": BENCH_SCHEMA,
        "framing": ONE_BATCH_FRAMING,
        "config": {**_config_dict(config, cluster, planners), "models": models},
        "skipped_planners": skipped,
        "total_wall_time_s": time.perf_counter() - started,
        "summary": summarize(records, models),
        "batches": [_record_dict(r) for r in records],
        "warnings": warnings,
    }


def _import_planners(planners: list[str]) -> None:
    """Import every planner's module before the timed calls, so a planner's wall time is
    planning, not importing its solver (OR-Tools and scipy take ~2 s once). A planner that
    fails to import is left to run_one, which records the error per batch."""
    from dcp_opt.solvers import get_planner

    for p in planners:
        try:
            get_planner(p)
        except Exception:  # noqa: BLE001, S112 (recorded by run_one)
            continue


def _config_dict(config: BenchConfig, cluster: Cluster, planners: list[str]) -> dict:
    d = asdict(config)
    d.update(
        workloads=list(config.workloads),
        planners=planners,
        seeds=list(config.seeds),
        num_gpus=cluster.num_gpus,
    )
    d.pop("first_seed")
    return d


def _record_dict(r: BenchRecord) -> dict:
    d = asdict(r)
    d["violations"] = list(r.violations)
    return d


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(records: list[BenchRecord], models: dict[str, str]) -> list[dict]:
    """One row per (workload, planner), in first-seen order."""
    keys = list(dict.fromkeys((r.workload, r.planner) for r in records))
    rows = []
    for w, p in keys:
        rs = [r for r in records if r.workload == w and r.planner == p]
        ok = [r for r in rs if r.valid]
        walls = [r.wall_time_s for r in rs if r.wall_time_s is not None]
        row = {
            "workload": w,
            "model": models[Workload.parse(w).kind],
            "planner": p,
            "num_batches": len(rs),
            "num_valid": len(ok),
            "num_errors": len(rs) - len(ok),
            "all_valid": len(ok) == len(rs),
            "median_step_time_s": _median([r.step_time_s for r in ok]),
            "median_lower_bound_s": _median([r.lower_bound_s for r in rs]),
            "median_gap": _median([r.gap for r in ok]),
            "median_imbalance": _median([r.imbalance for r in ok]),
            "median_wall_time_s": _median(walls),
            "max_wall_time_s": max(walls) if walls else None,
            "errors": list(dict.fromkeys(r.error for r in rs if r.error))[:3],
        }
        for ref in REFERENCES:
            xs = [getattr(r, f"speedup_vs_{ref}") for r in ok]
            xs = [x for x in xs if x is not None]
            row[f"median_speedup_vs_{ref}"] = _median(xs)
            row[f"min_speedup_vs_{ref}"] = min(xs) if xs else None
        rows.append(row)
    return rows
