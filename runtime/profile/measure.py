"""Measure a model's blocks on this device and fit the cost model's coefficients.

For every block type, over a grid of micro-batch shapes, with recompute off and on:

- time: forward and backward separately; `warmup` untimed runs, then the median of
  `repeats`. CPU: `time.perf_counter`; CUDA: `torch.cuda.Event` pairs (device time, no host
  overhead), synchronised once per repeat.
- memory, in one extra untimed run: the bytes of every tensor autograd saves for backward,
  counted by `torch.autograd.graph.saved_tensors_hooks` (each storage once, parameters
  excluded). That is exactly the activation memory the cost model's `act_bytes_per_token`
  means, on any device. It does not see transient buffers freed inside an op; on CUDA the
  allocator's `max_memory_allocated` (peak over forward + backward, minus the baseline) is
  recorded beside it. With recompute on, the checkpoint keeps only the block input, so the
  saved bytes plus the input's bytes are `ckpt_bytes_per_token`.

Fitting (dcp_opt.fit) gives per-layer coefficients; the CostModel multiplies them by the
full model's depth (the extrapolation: one layer measured, L layers predicted, as the
published profiler extrapolates two layers linearly). Measured points are cached in a JSON
file keyed by what was measured, so a re-run only measures new points.

Runtime calibration (`calibrate_runtime`): where the runtime's executor can run the model at
world W, a short real run on synthetic micro-batches measures what isolated blocks do not see
(other ranks' load, per-micro-batch framework work, the all-to-all as the runtime pays it,
the per-step gradient sum) and stores it as the profile's `runtime` section
(dcp_opt.profile_io.RuntimeCalibration), which cost_model_from_profile applies.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from dcp_opt.profile_io import Profile, utc_now

from .blocks import BlockUnderTest, HeadUnderTest, ProfileTarget
from .clocks import CpuClock, CudaClock, SavedBytes, default_clock  # noqa: F401
from .fit import (  # noqa: F401  (public API)
    fit_points,
    fit_runtime_calibration,
    measure_all_to_all,
)


@dataclass(frozen=True)
class Grid:
    """Micro-batch shapes to measure. 1D: `pack` sequences of each length (total tokens
    <= max_tokens), packing is what separates the per-sequence term from the constant.
    2D: `frames` x `spatial` (height, width) videos, one or `pack_2d` per micro-batch."""

    lengths: tuple[int, ...] = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    pack: tuple[int, ...] = (1, 2, 4)
    max_tokens: int = 2048
    frames: tuple[int, ...] = (1, 2, 4, 8, 16)
    spatial: tuple[tuple[int, int], ...] = ((4, 4), (8, 8), (12, 12))
    pack_2d: tuple[int, ...] = (1, 2)
    max_tokens_2d: int = 2304

    def points(self, kind: str) -> list[tuple[tuple[int, ...], ...]]:
        out = []
        if kind == "1d":
            for n in self.lengths:
                out += [((n,),) * k for k in self.pack if n * k <= self.max_tokens]
        else:
            for f in self.frames:
                for h, w in self.spatial:
                    out += [
                        ((f, h, w),) * k
                        for k in self.pack_2d
                        if f * h * w * k <= self.max_tokens_2d
                    ]
        return out

    def head_tokens(self) -> list[int]:
        return sorted({n * k for n in self.lengths for k in self.pack if n * k <= self.max_tokens})


@dataclass(frozen=True)
class ProfileConfig:
    grid: Grid = field(default_factory=Grid)
    warmup: int = 1
    repeats: int = 3
    passes: int = 2  # sweeps over the grid; a slow spell of a shared machine hits every point
    min_time_s: float = 0.05  # per point and pass: small points repeat until this is timed
    num_threads: int | None = 1  # pin intra-op threads: CPU timing noise drops a lot
    holdout_fraction: float = 0.25
    seed: int = 0
    reserved_bytes: float | None = None  # None: 0 on CPU, 2 GB on CUDA (not measured here)


@dataclass(frozen=True)
class Point:
    """One measured micro-batch of one block (or of the head: block == "head").

    Times are the median of every timed sample (all passes together)."""

    block: str
    shapes: tuple[tuple[int, ...], ...]
    recompute: bool
    fwd_samples: tuple[float, ...]
    bwd_samples: tuple[float, ...]
    saved_bytes: float  # saved-for-backward bytes (+ the kept input when recompute)
    peak_bytes: float | None = None  # CUDA allocator peak over fwd+bwd minus baseline

    @property
    def fwd_s(self) -> float:
        return statistics.median(self.fwd_samples)

    @property
    def bwd_s(self) -> float:
        return statistics.median(self.bwd_samples)

    @property
    def tokens(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def merged(self, other: Point) -> Point:
        return replace(
            self,
            fwd_samples=self.fwd_samples + other.fwd_samples,
            bwd_samples=self.bwd_samples + other.bwd_samples,
        )


# ---- one point -------------------------------------------------------------------------------
def _block_forward(block: BlockUnderTest, inputs: list[tuple], recompute: bool):
    if not recompute:
        return block.forward(inputs)
    return [
        checkpoint(lambda *a: block.forward([a])[0], *args, use_reentrant=False) for args in inputs
    ]


MAX_REPEATS = 64


def _time_runs(run_once, clock, *, warmup: int, repeats: int, min_time_s: float):
    """(fwd samples, bwd samples): `warmup` untimed runs, then at least `repeats` timed ones
    and more until `min_time_s` of forward + backward is timed (as timeit's autorange), so
    millisecond-sized points get enough samples for a stable median."""
    fwd, bwd = [], []
    for _ in range(warmup):
        run_once()
    while len(fwd) < MAX_REPEATS and (len(fwd) < repeats or sum(fwd) + sum(bwd) < min_time_s):
        a, b, c, d = run_once()
        fwd.append(clock.seconds(a, b))
        bwd.append(clock.seconds(c, d))
    return tuple(fwd), tuple(bwd)


def measure_block(
    block: BlockUnderTest,
    shapes,
    *,
    recompute: bool,
    clock,
    warmup: int,
    repeats: int,
    dtype,
    min_time_s: float = 0.0,
) -> Point:
    params = list(block.module.parameters())
    dev = clock.device

    def run_once():
        inputs = block.make_inputs(shapes, dtype=dtype, device=dev)
        a = clock.mark()
        outs = _block_forward(block, inputs, recompute)
        b = clock.mark()
        grads = [torch.ones_like(o) for o in outs]
        c = clock.mark()
        torch.autograd.backward(outs, grads)
        d = clock.mark()
        block.module.zero_grad(set_to_none=True)
        return a, b, c, d

    fwd, bwd = _time_runs(run_once, clock, warmup=warmup, repeats=repeats, min_time_s=min_time_s)
    inputs = block.make_inputs(shapes, dtype=dtype, device=dev)
    with clock.memory_run() as box:
        with SavedBytes(params) as saved:  # what the forward keeps for backward
            outs = _block_forward(block, inputs, recompute)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    block.module.zero_grad(set_to_none=True)
    if recompute:  # the checkpoint keeps its inputs (counted once if the hook saw them)
        for args in inputs:
            saved.include(args[0])
    return Point(
        block.block_type,
        tuple(tuple(int(v) for v in s) for s in shapes),
        recompute,
        fwd,
        bwd,
        float(saved.total),
        None if box is None else box["peak"],
    )


def measure_head(
    head: HeadUnderTest,
    num_tokens: int,
    *,
    clock,
    warmup: int,
    repeats: int,
    dtype,
    min_time_s: float = 0.0,
) -> Point:
    params = list(head.module.parameters())

    def run_once():
        inputs = head.make_inputs(num_tokens, dtype=dtype, device=clock.device)
        a = clock.mark()
        loss = head.loss(inputs)
        b = clock.mark()
        loss.backward()
        c = clock.mark()
        head.module.zero_grad(set_to_none=True)
        return a, b, b, c

    fwd, bwd = _time_runs(run_once, clock, warmup=warmup, repeats=repeats, min_time_s=min_time_s)
    with SavedBytes(params) as saved:
        head.loss(head.make_inputs(num_tokens, dtype=dtype, device=clock.device)).backward()
    head.module.zero_grad(set_to_none=True)
    return Point("head", ((num_tokens,),), False, fwd, bwd, float(saved.total))


# ---- cache -----------------------------------------------------------------------------------
class PointCache:
    """Measured points in a JSON file, keyed by target signature, device and point."""

    def __init__(self, path: str | Path | None, context: str):
        self.path = None if path is None else Path(path)
        self.context = context
        self.data: dict[str, dict] = {}
        if self.path is not None and self.path.exists():
            with contextlib.suppress(ValueError, OSError):
                self.data = json.loads(self.path.read_text())

    def key(self, block: str, shapes, recompute: bool) -> str:
        return f"{self.context}|{block}|{recompute}|{json.dumps(shapes)}"

    def get(self, key: str) -> Point | None:
        d = self.data.get(key)
        if d is None:
            return None
        shapes = tuple(tuple(s) for s in d["shapes"])
        return Point(
            **{
                **d,
                "shapes": shapes,
                "fwd_samples": tuple(d["fwd_samples"]),
                "bwd_samples": tuple(d["bwd_samples"]),
            }
        )

    def put(self, key: str, p: Point) -> None:
        self.data[key] = asdict(p)

    def flush(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=0, sort_keys=True))


# ---- the whole profile -----------------------------------------------------------------------
def device_info(clock, dtype, num_threads: int | None) -> dict:
    dev = clock.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    return {
        "type": dev.type,
        "name": name or platform.machine(),
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "num_threads": torch.get_num_threads() if num_threads is None else num_threads,
        "host": platform.node(),
    }


def measure_all(
    target: ProfileTarget,
    config: ProfileConfig,
    *,
    clock=None,
    dtype=torch.float32,
    cache_path: str | Path | None = None,
    progress: bool = True,
) -> list[Point]:
    """Measure every (block, shapes, recompute) of the grid and the head, in `passes` sweeps
    (each: warm-up + repeats per point); points found in the cache are not measured again."""
    clock = clock or default_clock()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    ctx = json.dumps(
        device_info(clock, dtype, config.num_threads)
        | {
            "sig": target.signature,
            "timing": [
                config.warmup,
                config.repeats,
                config.passes,
                config.min_time_s,
                "light-rec",
            ],
        },
        sort_keys=True,
    )
    cache = PointCache(cache_path, ctx)
    jobs = [
        (name, shapes, rec)
        for name in target.model.block_types
        for shapes in config.grid.points(target.model.kind)
        for rec in (False, True)
    ]
    if target.head is not None:
        jobs += [("head", ((n,),), False) for n in config.grid.head_tokens()]
    done = {j: cache.get(cache.key(*j)) for j in jobs}
    todo = [j for j in jobs if done[j] is None]
    kw = dict(
        clock=clock,
        warmup=config.warmup,
        repeats=config.repeats,
        dtype=dtype,
        min_time_s=config.min_time_s,
    )
    # Recompute-on points feed only the checkpoint bytes (exact in one run) and the
    # recompute-cost ratio (a median over points): one pass, one timed run is enough.
    light = dict(kw, repeats=1, min_time_s=0.0)
    runs = [(i, j) for i in range(config.passes) for j in todo if i == 0 or not j[2]]
    with _progress(progress, len(runs)) as advance:
        for _, job in runs:
            name, shapes, rec = job
            if name == "head":
                p = measure_head(target.head, shapes[0][0], **kw)
            else:
                p = measure_block(
                    target.blocks[name], shapes, recompute=rec, **(light if rec else kw)
                )
            done[job] = p if done[job] is None else done[job].merged(p)
            advance(f"{name} {shapes[0]}x{len(shapes)} rec={int(rec)}")
    for job in todo:
        cache.put(cache.key(*job), done[job])
    cache.flush()
    return [done[j] for j in jobs]


@contextlib.contextmanager
def _progress(enabled: bool, total: int):
    if not enabled:
        yield lambda desc: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn()) as bar:
        task = bar.add_task("profiling", total=total)
        yield lambda desc: bar.update(task, advance=1, description=desc)


def profile_model(
    target: ProfileTarget,
    config: ProfileConfig = ProfileConfig(),
    *,
    clock=None,
    dtype=torch.float32,
    cache_path: str | Path | None = None,
    progress: bool = True,
    a2a=(),
) -> Profile:
    """Measure, fit and return the Profile (save it with dcp_opt.profile_io.save_profile)."""
    clock = clock or default_clock()
    if config.reserved_bytes is None and clock.device.type == "cuda":
        config = replace(config, reserved_bytes=2e9)
    t0 = time.perf_counter()
    points = measure_all(
        target, config, clock=clock, dtype=dtype, cache_path=cache_path, progress=progress
    )
    coeffs, report = fit_points(target, points, config)
    return Profile(
        coefficients=coeffs,
        model=target.model,
        device=device_info(clock, dtype, config.num_threads),
        date=utc_now(),
        fit=report,
        a2a=tuple(a2a),
        method={
            "timing": getattr(clock, "mode", "cuda events"),
            "statistic": f"median of {config.repeats} after {config.warmup} warm-up runs",
            "memory": "saved_tensors_hooks bytes (exact saved activations; transient "
            "buffers inside ops not included)"
            + ("; CUDA allocator peak recorded per point" if clock.device.type == "cuda" else ""),
            "extrapolation": f"1 layer measured per block type, x{target.model.num_layers} layers",
            "grid": asdict(config.grid),
            "num_points": len(points),
            "wall_s": time.perf_counter() - t0,
            "target": target.signature,
        },
    )


# ---- runtime calibration: a short real run of the executor ------------------------------------
# Synthetic micro-batches (one sequence or several packed), spread over the profile grid's
# range and unlike any workload on purpose: they calibrate the runtime, not a benchmark.
CALIBRATION_1D = (
    ((192,),),
    ((640,),),
    ((1280,),),
    ((160,),) * 4,
    ((448,),) * 2,
    ((96,),) * 6,
    ((896,),) * 2,
)
CALIBRATION_2D = (
    ((4, 8, 8),),
    ((16, 8, 8),),
    ((8, 12, 12),),
    ((2, 8, 8),) * 2,
    ((16, 4, 4),) * 2,
    ((1, 12, 12),) * 3,
)


def calibration_plans(model, world: int, degrees=None) -> list:
    """[(Plan, Batch)]: per degree d (default: 1, 2, 4, .. up to `world`), one phase where
    every aligned group of d ranks runs the calibration micro-batches back to back, so all
    ranks are busy as in training. Each group has its own sequence ids."""
    from dcp_opt.batch import Batch, Sequence
    from dcp_opt.cost import default_normalizer_kind, loss_normalizer
    from dcp_opt.plan import Group, MicroBatch, Phase, Plan

    mbs = CALIBRATION_1D if model.kind == "1d" else CALIBRATION_2D
    if degrees is None:
        degrees = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= world and world % d == 0]
    kind = default_normalizer_kind(model)
    out = []
    for d in degrees:
        shapes, groups = [], []
        for start in range(0, world, d):
            ids = []
            for mb in mbs:
                ids.append(tuple(range(len(shapes), len(shapes) + len(mb))))
                shapes += list(mb)
            groups.append(Group(start, d, tuple(MicroBatch(i) for i in ids)))
        batch = Batch(tuple(Sequence(i, tuple(sh)) for i, sh in enumerate(shapes)))
        plan = Plan((Phase(tuple(groups)),), world, loss_normalizer(batch, kind), kind)
        out.append((plan, batch))
    return out


def calibration_samples(batch, runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(micro-batch samples, step samples) for fit_runtime_calibration from the per-rank
    results of runtime.profile.fidelity.run_plan: each micro-batch once (its group's first rank),
    its wall and CPU seconds the median over steps; per step, the slowest rank."""
    by: dict[tuple, dict] = {}
    for rank, res in enumerate(runs):
        for step in res["micro_batches"]:
            for ph, start, d, k, ids, rec, wall, cpu in step:
                if rank != start:
                    continue
                s = by.setdefault((ph, start, k), {"ids": ids, "d": d, "r": rec, "w": [], "c": []})
                s["w"].append(wall)
                s["c"].append(cpu)
    samples = [
        {
            "degree": s["d"],
            "shapes": [list(batch.by_id[i].shape) for i in s["ids"]],
            "recompute": s["r"],
            "measured_s": statistics.median(s["w"]),
            "cpu_s": statistics.median(s["c"]),
        }
        for s in by.values()
    ]
    steps = []
    for i in range(len(runs[0]["step_s"])):
        slow = max(runs, key=lambda r: sum(m[6] for m in r["micro_batches"][i]))
        steps.append(
            {
                "step_s": slow["step_s"][i],
                "mb_s": sum(m[6] for m in slow["micro_batches"][i]),
                "grad_sync_s": slow["grad_sync_s"][i],
            }
        )
    return samples, steps


def calibrate_runtime(profile: Profile, run_plan, *, world: int, steps: int = 2, warmup: int = 1):
    """`profile` with a RuntimeCalibration measured by `run_plan(plan, batch, steps, warmup)`,
    which must execute a plan on all `world` ranks with the runtime's executor and return
    every rank's result as runtime.profile.fidelity.run_plan does (e.g. DistWorkers.run of it)."""
    samples, step_rows = [], []
    for plan, batch in calibration_plans(profile.model, world):
        runs = run_plan(plan, batch, steps, warmup)
        s, st = calibration_samples(batch, runs)
        samples += s
        step_rows += [dict(r, degree=plan.phases[0].groups[0].degree) for r in st]
    # the per-step remainder is measured on the degree-1 plan: no all-to-all in flight
    ones = [r for r in step_rows if r["degree"] == 1] or step_rows
    cal = fit_runtime_calibration(profile.model, profile.coefficients, world, samples, ones)
    return replace(profile, runtime=cal)
