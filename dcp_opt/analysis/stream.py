"""`dcp-opt bench --stream`: throughput over an epoch (a stream of data), each method in the
form it runs in practice, at matched training semantics.

The one-batch bench (dcp_opt.analysis.bench) forces every method into one fixed 2M-token batch. The
published VideoSys methods form their own optimizer steps over a whole epoch instead, so that
framing misjudges them (the published sampler forms no step at all from one such batch). Here:

- an epoch is `num_batches` x `tokens_per_batch` tokens of a workload, drawn with one seed
  (`stream_epoch`); `2d-videosys` is VideoSys' benchmark dataset itself (100,000 images and
  2,000 videos, research/videosys_dcp.md sec. 5.1);
- published methods (bucket, dcp_intra, dcp_inter, dcp_inter_pac) run their sampler over the
  epoch as published (solvers/baselines/videosys/stream.py: memory cap 0.7, PAC's minimum accumulation
  15, drop_last), each also as a no-drop variant (`<method>/nodrop`);
- the project's planners run at fixed global batch sizes: the epoch is cut in data order into
  steps of `target` tokens (`<planner>@<size>`), and with the step former when it is built
  (`<planner>+former@<size>`: samples may move up to K steps, tokens per step within +-e);
  greedy runs at every size, cpsat (short budget) only at `cpsat_sizes` (2M) in data order;
  the sizes are `step_sizes` plus the median step of published bucket and PAC;
- on the 1D workloads, the text frameworks' baselines megatron_dynamic_cp and verl_balanced
  run on the same data-order steps (`<framework>@<size>`: both take a fixed global batch),
  with greedy beside them (`greedy+cp@<size>`), on a cost model offering ulysses, cp and
  ring, Megatron on ring groups, verl on Ulysses (dcp_opt/analysis/stream_frameworks.py);
- every step is one optimizer step: simulate() of its plan, which ends with the gradient sync
  (the barrier). The epoch time is the sum over steps. Each step is planned once per cost
  model (dcp_opt/analysis/stream_steps.py, StepCache).

The rows and ratios are computed in dcp_opt/analysis/stream_figures.py, the tables drawn by
dcp_opt/analysis/stream_display.py.

JSON (`--json OUT`, STREAM_SCHEMA = "dcp-opt-stream/1"):

    schema, config (cluster, num_gpus, workloads, num_batches, tokens_per_batch, seed,
        step_sizes, planners, cpsat_sizes, cpsat_budget_s, memory_cap, former_max_shift,
        former_tolerance, former_budget_per_step_s, frameworks, cp_planner,
        framework_sizes, models),
        total_wall_time_s, notes (the step former's refusals)
    epochs      one row per workload: workload, num_sequences, num_tokens, wall_time_s
    methods     one row per (workload, method):
        workload, method, family ("published" | "project" | "framework"), planner,
        drop_last, step_former, target_tokens (null for published), sp_kinds (the cost
        model's SP kinds: ["ulysses"], or ["ulysses", "cp", "ring"] for the framework rows
        and greedy+cp), num_steps, trained_tokens,
        dropped_tokens, dropped_share, epoch_time_s, tokens_per_s,
        step_tokens {median, p10, p90}, step_time_s {median, p10, p90},
        planning_s (all steps), planning_ms_per_step (median), bound_s, gap_to_bound
        (epoch time / stream lower bound - 1; null when a published sampler forms no step;
        for +former rows the bound of any reassignment of the samples to as many steps),
        steps_bound_s, gap_to_steps_bound (the bound of the row's own steps as fixed: for
        +former rows the steps it formed, elsewhere bound_s itself),
        speedup_vs_bucket, speedup_vs_pac (tokens/s over published bucket / dcp_inter_pac,
        drop_last)
    matched     per workload and published median step size (of bucket and of PAC): the
        project's best planner without / with the step former at that size, its tokens/s
        over published PAC and bucket (vs_pac, vs_bucket), its gap to the stream bound, and
        the stream bound's tokens/s over them (bound_vs_pac, bound_vs_bucket: what no plan
        of those steps can beat)
    fidelity    per 2D workload: published intra / inter / PAC tokens/s over published
        bucket next to the paper's ratio for that cluster size (PAPER_RATIOS)
    frameworks  per 1D workload and step size: greedy+cp's tokens/s over each framework
        (vs_megatron_dynamic_cp, vs_verl_balanced) and over Ulysses-only greedy
        (vs_greedy), with the frameworks' and greedy+cp's gaps to the stream bound
        (dcp_opt.analysis.stream_frameworks.framework_table)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..batch import Batch, Sequence
from ..cost import CostModel
from ..errors import DcpOptError
from ..inputs import load_cluster
from ..model import model_preset
from ..video3d import PUBLISHED_MIXES, published_mix
from ..workloads import (
    DISTRIBUTIONS,
    TEXT_CLIP,
    TEXT_MEDIANS,
    TEXT_SIGMA,
    VIDEO_3D_WORKLOADS,
    Workload,
    bucket_probabilities,
    video_buckets,
    video_shape,
)
from .stream_figures import (  # noqa: F401 (re-exported: the figures of a run)
    PAPER_RATIOS,
    fidelity_rows,
    fill_speedups,
    matched_rows,
    method_row,
)
from .stream_frameworks import FRAMEWORKS, count_runs, framework_runs, framework_table
from .stream_steps import (  # noqa: F401 (re-exported)
    EpochRun,
    StepCache,
    former_steps,
    run_fixed,
    run_published,
    time_published_steps,
)

STREAM_SCHEMA = "dcp-opt-stream/1"
DEFAULT_MODELS = {"2d": "opensora-stdit3-xl", "1d": "llama-7b", "3d": "opensora2-11b"}
MILLION = 1 << 20
DEFAULT_TOKENS_PER_BATCH = 2 * MILLION  # the one-batch bench's 32 GPUs x 64K
STREAM_WORKLOADS = tuple(f"{k}-{d}" for k in ("2d", "1d") for d in DISTRIBUTIONS) + ("2d-videosys",)
# Full-attention video DiTs (kind 3d; asked for by name, not in the default run)
STREAM_3D_WORKLOADS = VIDEO_3D_WORKLOADS
PUBLISHED = ("bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac")
# VideoSys' benchmark dataset (datasets.py:229-446; counts from its Zipf formula, research
# sec. 5.1): (resolution, frames) -> samples. 1 frame = an image.
VIDEOSYS_COUNTS = {
    ("144p", 1): 39003, ("240p", 1): 24562, ("360p", 1): 16454, ("480p", 1): 11556,
    ("720p", 1): 8425, ("144p", 51): 592, ("240p", 51): 373, ("144p", 102): 250,
    ("360p", 51): 176, ("240p", 102): 128, ("480p", 51): 96, ("144p", 204): 74,
    ("360p", 102): 58, ("720p", 51): 47, ("240p", 204): 38, ("480p", 102): 31,
    ("144p", 408): 26, ("360p", 204): 22, ("720p", 102): 19, ("240p", 408): 16,
    ("480p", 204): 14, ("360p", 408): 12, ("720p", 204): 11, ("480p", 408): 9,
    ("720p", 408): 8,
}  # fmt: skip


@dataclass(frozen=True)
class StreamConfig:
    cluster: str = "h200x32"
    workloads: tuple[str, ...] = STREAM_WORKLOADS
    num_batches: int = 250
    tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH
    seed: int = 0
    step_sizes: tuple[int, ...] = (2 * MILLION, 8 * MILLION, 16 * MILLION)
    planners: tuple[str, ...] = ("greedy", "cpsat")
    cpsat_sizes: tuple[int, ...] = (2 * MILLION,)  # cpsat only here: greedy elsewhere
    cpsat_budget_s: float = 0.05
    published: tuple[str, ...] = PUBLISHED
    nodrop: bool = True
    memory_cap: float = 0.7
    former_max_shift: int = 2
    former_tolerance: float = 0.05
    # the former's search budget per step (its own default is 0.05 s, 250 s over the default
    # run's sizes); the stream's StepCache makes each of its plans of a data-order step free
    former_budget_per_step_s: float = 0.02
    # 1D only (dcp_opt.analysis.stream_frameworks): the text frameworks and the project's
    # planner on a cost model with the three SP kinds, at framework_sizes (None: every size)
    frameworks: tuple[str, ...] = FRAMEWORKS
    cp_planner: str | None = "greedy"
    framework_sizes: tuple[int, ...] | None = (2 * MILLION,)
    # the frameworks' settings tuned on the first steps (stream_frameworks.tuned_setting)
    framework_tune_steps: int = 2
    models: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))

    def __post_init__(self) -> None:
        allowed = STREAM_WORKLOADS + STREAM_3D_WORKLOADS
        for w in self.workloads:
            if w not in allowed:
                raise DcpOptError(f"workload: {w!r} not allowed; allowed: {allowed}")
        if self.num_batches < 1 or self.tokens_per_batch < 1:
            raise DcpOptError("batches, tokens_per_batch: must be >= 1")
        if any(s < 1 for s in self.step_sizes):
            raise DcpOptError(f"step_sizes: must be >= 1 token, got {self.step_sizes}")
        unknown = [p for p in self.published if p not in PUBLISHED]
        if unknown:
            raise DcpOptError(f"published: {unknown} not allowed; allowed: {list(PUBLISHED)}")
        if self.former_budget_per_step_s < 0:
            raise DcpOptError(
                f"former_budget_per_step_s: must be seconds >= 0, got {self.former_budget_per_step_s}"
            )
        if self.framework_tune_steps < 0:
            raise DcpOptError(
                f"framework_tune_steps: must be >= 0, got {self.framework_tune_steps}"
            )
        if self.framework_sizes is not None and any(s < 1 for s in self.framework_sizes):
            raise DcpOptError(f"framework_sizes: must be >= 1 token, got {self.framework_sizes}")
        both = [p for p in self.planners if p in FRAMEWORKS]
        if both:
            raise DcpOptError(
                f"planners: {both} are framework baselines; they run on the 1D workloads as "
                f"`frameworks` (allowed planners: the project's, e.g. greedy, cpsat)"
            )
        unknown = [p for p in self.frameworks if p not in FRAMEWORKS]
        if unknown:
            raise DcpOptError(f"frameworks: {unknown} not allowed; allowed: {list(FRAMEWORKS)}")


# --quick (CI): small epochs, one step size, greedy only; 2d-videosys is left out because
# it is always the whole published dataset (102,000 samples), whatever num_batches says.
QUICK = {
    "num_batches": 8,
    "step_sizes": (2 * MILLION,),
    "planners": ("greedy",),
    "workloads": STREAM_WORKLOADS[:-1],
}


# ---- the epoch ---------------------------------------------------------------------------------
def stream_epoch(name: str, seed: int, num_batches: int, tokens_per_batch: int) -> Batch:
    """An epoch in data order: ids 0..n-1. Standard workloads draw sequences until
    num_batches x tokens_per_batch tokens; `2d-videosys` is VideoSys' dataset, shuffled."""
    rng = np.random.default_rng(seed)
    if name == "2d-videosys":
        shapes = [video_shape(r, f) for (r, f), n in VIDEOSYS_COUNTS.items() for _ in range(n)]
        order = rng.permutation(len(shapes))
        return Batch(tuple(Sequence(i, shapes[j]) for i, j in enumerate(order)))
    w = Workload.parse(name)
    budget = num_batches * tokens_per_batch
    shapes: list[tuple[int, ...]] = []
    total = 0
    while total < budget:  # vectorised draws, chunk by chunk, until the budget is reached
        chunk = _draw(w, rng, 4096)
        tokens = np.cumsum([math.prod(s) for s in chunk]) + total
        n = int(np.searchsorted(tokens, budget)) + 1  # the last one may cross the budget
        shapes += chunk[:n]
        total = int(tokens[min(n, len(chunk)) - 1])
    return Batch(tuple(Sequence(i, s) for i, s in enumerate(shapes)))


def _draw(w: Workload, rng: np.random.Generator, n: int) -> list[tuple[int, ...]]:
    """n shapes from the distributions of Workload.sample_shape (REFERENCE.md sec. 4), drawn
    as one array: the one-batch bench's per-sample draws take ~9 s for a 2D epoch."""
    if w.kind == "3d" and w.distribution in PUBLISHED_MIXES:
        shapes, p = published_mix(w.distribution)
        return [shapes[i] for i in rng.choice(len(shapes), size=n, p=p)]
    if w.kind in ("2d", "3d"):
        buckets = video_buckets(w.kind)
        idx = rng.choice(len(buckets), size=n, p=bucket_probabilities(w.distribution))
        return [buckets[i][2] for i in idx]
    x = rng.lognormal(math.log(TEXT_MEDIANS[w.distribution]), TEXT_SIGMA, size=n)
    return [(int(v),) for v in np.clip(np.round(x), *TEXT_CLIP)]


def data_order_steps(epoch: Batch, target_tokens: int) -> list[list[int]]:
    """Fixed-size steps in data order (solvers/stream/step_former.py: target +- half a sample)."""
    from dcp_opt.solvers.stream.step_former import data_order_steps as steps_of

    return steps_of(list(epoch.sequences), target_tokens)


# ---- the project's planners and the whole bench ----------------------------------------------------
def _size_label(tokens: int) -> str:
    return f"{tokens / MILLION:.3g}M"


def _targets(config: StreamConfig, rows: list[dict]) -> dict[int, str]:
    """Step sizes of the project's planners: the configured ones and the published medians."""
    out = {int(s): _size_label(s) for s in config.step_sizes}
    for r in rows:
        if r["method"] in ("bucket", "dcp_inter_pac") and r["step_tokens"]["median"]:
            t = int(round(r["step_tokens"]["median"]))
            out.setdefault(t, f"{_size_label(t)}={r['method']}-median")
    return out


def _project_runs(config, workload, epoch, cost, targets, notes, on_done):
    """The project's planners at every target size in data order, then with the step former
    (greedy only: cpsat in data order only, for time); one StepCache for all of them, so the
    former's proxy reuses the data-order plans and its own plans serve the +former rows."""
    out = []
    if not config.planners:
        return out
    cache = StepCache(epoch, cost)

    def run(planner, name, steps, shift, bound, target, former):
        opts = {"time_limit_s": config.cpsat_budget_s} if planner == "cpsat" else {}
        r = run_fixed(epoch, cost, planner, steps, opts, shift, bound=bound, cache=cache)
        out.append(
            method_row(
                workload, name, r, epoch, family="project", planner=planner, drop_last=False,
                step_former=former, target_tokens=target, sp_kinds=list(cost.sp_kinds),
                setting=None,
            )
        )  # fmt: skip
        on_done(workload, name)
        return r.bound_s

    k, e = config.former_max_shift, config.former_tolerance
    for target, label in targets.items():
        bound = "compute"  # one stream bound per set of steps, shared by the planners
        for planner in config.planners:
            if planner != "cpsat" or target in config.cpsat_sizes:
                steps = data_order_steps(epoch, target)
                bound = run(planner, f"{planner}@{label}", steps, 0, bound, target, False)
        cheap = [p for p in config.planners if p != "cpsat"]
        if not cheap:
            continue
        try:
            budget = config.former_budget_per_step_s * len(data_order_steps(epoch, target))
            former = former_steps(epoch, cost, target, k, e, cache=cache, budget_s=budget)
        except DcpOptError as err:  # the bounds (K, e) admit no steps: say so, run without
            notes.append(f"{workload} @{label}: step former refused: {err}")
            continue
        bound = "compute"
        for planner in cheap:
            bound = run(planner, f"{planner}+former@{label}", former, k, bound, target, True)
    return out


def run_workload(config, workload, cost, on_done=lambda w, m: None, notes=None) -> tuple:
    t0 = time.perf_counter()
    epoch = stream_epoch(workload, config.seed, config.num_batches, config.tokens_per_batch)
    return _run_epoch(config, workload, epoch, cost, on_done, notes, t0)


def _run_epoch(config, workload, epoch, cost, on_done, notes, t0) -> tuple:
    """Every method of `config` over `epoch` (data order) on `cost`: (epoch info, rows)."""
    cost.check_fits(epoch)
    rows = []
    for method in config.published:
        for drop in (True, False) if config.nodrop else (True,):
            try:
                run = run_published(
                    epoch, cost, method, seed=config.seed, drop_last=drop,
                    memory_cap=config.memory_cap,
                )  # fmt: skip
            except DcpOptError as err:  # e.g. its fixed SP degree holds no longest sample
                if notes is not None:
                    notes.append(f"{workload}: published {method} cannot run here: {err}")
                break
            name = method if drop else f"{method}/nodrop"
            rows.append(
                method_row(
                    workload, name, run, epoch, family="published", planner=method,
                    drop_last=drop, step_former=False, target_tokens=None,
                    sp_kinds=list(cost.sp_kinds), setting=None,
                )
            )  # fmt: skip
            on_done(workload, name)
    targets = _targets(config, rows)
    rows += _project_runs(config, workload, epoch, cost, targets, notes or [], on_done)
    rows += framework_runs(
        config, workload, epoch, cost, targets,
        steps_of=data_order_steps, run_fixed=run_fixed, cache_of=StepCache, on_done=on_done,
    )  # fmt: skip
    fill_speedups(rows)
    info = {
        "workload": workload,
        "num_sequences": len(epoch),
        "num_tokens": epoch.num_tokens,
        "wall_time_s": time.perf_counter() - t0,
    }
    return info, rows


def _num_runs(config: StreamConfig, num_2d: int, num_1d: int) -> int:
    """Rows a run adds (for the progress bar)."""
    cheap = [p for p in config.planners if p != "cpsat"]  # + the 2 published median sizes
    per_workload = (
        len(config.published) * (2 if config.nodrop else 1)
        + len(cheap) * (len(config.step_sizes) + 2) * 2
        + ("cpsat" in config.planners) * len(config.cpsat_sizes)
    )
    frameworks = num_1d * count_runs(config, len(config.step_sizes) + 2)
    return per_workload * (num_2d + num_1d) + frameworks


def run_stream(
    config: StreamConfig,
    *,
    make_cost: Callable | None = None,
    on_start: Callable[[int], None] = lambda total: None,
    on_done: Callable[[str, str], None] = lambda workload, method: None,
) -> dict:
    started = time.perf_counter()
    cluster = load_cluster(config.cluster)
    make_cost = make_cost or (lambda m, c: CostModel(m, c))
    kinds = ["1d", "2d"] + (["3d"] if any(w[:2] == "3d" for w in config.workloads) else [])
    models = {**DEFAULT_MODELS, **config.models}
    costs = {k: make_cost(model_preset(models[k]), cluster) for k in kinds}
    n_1d = sum(w.startswith("1d") for w in config.workloads)
    on_start(_num_runs(config, len(config.workloads) - n_1d, n_1d))
    epochs, rows, notes = [], [], []
    for w in config.workloads:
        info, rs = run_workload(config, w, costs[w[:2]], on_done, notes)
        epochs.append(info)
        rows += rs
    return _document(config, cluster, costs, started, epochs, rows, notes)


def run_stream_epoch(
    epoch: Batch,
    config: StreamConfig | None = None,
    *,
    name: str = "epoch",
    make_cost: Callable | None = None,
    on_start: Callable[[int], None] = lambda total: None,
    on_done: Callable[[str, str], None] = lambda workload, method: None,
) -> dict:
    """The stream bench on your own epoch: `epoch`'s sequences in their order are the data
    order (a lengths file as read, or draws from your histogram). The project's planners run
    at fixed steps in data order (and with the step former); on 2D data the published VideoSys
    samplers run over it as published (they bucket by frames and resolution, so they need 2D
    shapes); on 1D data the text frameworks' baselines run instead (megatron_dynamic_cp,
    verl_balanced, beside greedy+cp). `config`'s workloads, num_batches and tokens_per_batch
    are not used (the epoch is given); its cluster, models, sizes and planners are. The
    document is run_stream's, with one workload named "<kind>:<name>" and no fidelity rows
    (the paper's ratios are for its own data).

        from dcp_opt.analysis.stream import StreamConfig, run_stream_epoch
        doc = run_stream_epoch(load_batch("lengths.txt"), StreamConfig(cluster="h200x8"))
    """
    started = time.perf_counter()
    config = config or StreamConfig()
    kind = epoch.kind
    # ids 0..n-1 in data order, as stream_epoch makes them (the steps are cut by position)
    epoch = Batch(tuple(Sequence(i, s.shape) for i, s in enumerate(epoch.sequences)))
    cfg = replace(
        config,
        workloads=(),
        published=config.published if kind == "2d" else (),
        frameworks=config.frameworks if kind == "1d" else (),
    )
    cluster = load_cluster(cfg.cluster)
    make_cost = make_cost or (lambda m, c: CostModel(m, c))
    costs = {kind: make_cost(model_preset(cfg.models[kind]), cluster)}
    on_start(_num_runs(cfg, kind == "2d", kind == "1d"))
    notes: list[str] = []
    workload = f"{kind}:{name}"
    info, rows = _run_epoch(cfg, workload, epoch, costs[kind], on_done, notes, started)
    if kind == "1d":
        notes.append(
            f"{workload}: the published VideoSys samplers bucket by frames and resolution "
            "(2D shapes): on 1D data the text frameworks' baselines run instead"
        )
    doc = _document(cfg, cluster, costs, started, [info], rows, notes)
    doc["config"].update(epoch=name, num_batches=None, tokens_per_batch=None)
    doc["fidelity"] = []
    return doc


def _document(config, cluster, costs, started, epochs, rows, notes) -> dict:
    cfg = asdict(config)
    cfg.update(num_gpus=cluster.num_gpus, models={k: c.model.name for k, c in costs.items()})
    return {
        "schema": STREAM_SCHEMA,
        "config": cfg,
        "total_wall_time_s": time.perf_counter() - started,
        "notes": notes,
        "epochs": epochs,
        "methods": rows,
        "matched": matched_rows(rows),
        "fidelity": fidelity_rows(rows, cluster.num_gpus),
        "frameworks": framework_table(rows),
    }
