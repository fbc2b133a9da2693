"""`dcp-opt bench`: every planner on every standard workload (dcp_opt.analysis.bench); with
--stream, every method over an epoch (dcp_opt.analysis.stream): the standard workloads', or
your own (`--lengths FILE` in data order, `--histogram FILE` drawn), through
dcp_opt.analysis.stream.run_stream_epoch."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from ..analysis.bench import DEFAULT_MODELS, DEFAULT_NUM_BATCHES, BenchConfig, json_default
from ..cost import SHARDING_MODES, CostModel
from ..errors import DcpOptError, read_text
from ..inputs import cost_model, profile_kind
from ..workloads import DEFAULT_TOKENS_PER_GPU, load_batch
from . import args as types
from .args import add_sp_kinds, sp_kinds, split
from .handoff import note as _note

EXIT_FAILED = 1
CLUSTER_HELP = "cluster preset or Cluster JSON file"
MODEL_HELP = "model preset or ModelSpec JSON file"


def _write(path: str, text: str, field: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise DcpOptError(f"{field} {path!r}: cannot write ({e.strerror})") from None


# ---- bench -------------------------------------------------------------------------------------
def _stream_defaults() -> tuple[int, int]:
    from ..analysis.stream import QUICK, StreamConfig

    return StreamConfig().num_batches, QUICK["num_batches"]


_EPOCH_DEFAULT, _EPOCH_QUICK = _stream_defaults()


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="every planner on every standard workload")
    p.add_argument("--cluster", default="h200x32", help=f"{CLUSTER_HELP} (default h200x32)")
    p.add_argument("--workloads", default=None, help="comma-separated (default: all six)")
    p.add_argument("--planners", default=None, help="comma-separated (default: all built)")
    p.add_argument(
        "--batches", type=types.batches, default=DEFAULT_NUM_BATCHES, help="seeds per workload"
    )
    p.add_argument("--seed", type=int, default=0, help="first seed")
    for kind in ("1d", "2d", "3d"):
        p.add_argument(f"--model-{kind}", help=f"{MODEL_HELP} (default {DEFAULT_MODELS[kind]})")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="profile JSON from `dcp-opt profile`: the cost model of the workloads of its "
        "model's kind (1d or 2d); the other kind keeps its model",
    )
    p.add_argument("--tokens-per-gpu", type=types.tokens_per_gpu, default=DEFAULT_TOKENS_PER_GPU)
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="solver budget")
    p.add_argument(
        "--json", metavar="OUT", help="write every figure here (see dcp_opt.analysis.bench)"
    )
    p.add_argument("--strict", action="store_true", help="exit 1 if any plan is missing/invalid")
    p.add_argument("--no-progress", action="store_true")
    add_sp_kinds(p, note="; 2D workloads keep ulysses")
    _add_layout(p)
    _add_stream_args(p)
    p.set_defaults(func=cmd_bench)


def _add_stream_args(p) -> None:
    s = p.add_argument_group("stream (an epoch per workload; see dcp_opt.analysis.stream)")
    s.add_argument(
        "--stream",
        action="store_true",
        help="judge every method over an epoch, published methods as published",
    )
    s.add_argument("--quick", action="store_true", help="with --stream: a small epoch (CI)")
    own = s.add_mutually_exclusive_group()
    own.add_argument(
        "--lengths",
        metavar="FILE",
        help="with --stream: your own epoch, a batch file (see `plan --lengths`) in data order",
    )
    own.add_argument(
        "--histogram",
        metavar="FILE",
        help="with --stream: your own epoch drawn from a histogram (see `whatif --histogram`): "
        "--epoch-batches x 2M tokens",
    )
    s.add_argument(
        "--epoch-batches",
        type=types.epoch_batches,
        default=None,
        metavar="N",
        help=f"global batches of 2M tokens per epoch (default {_EPOCH_DEFAULT}; --quick "
        f"{_EPOCH_QUICK}; at most {types.MAX_EPOCH_BATCHES})",
    )
    s.add_argument(
        "--step-sizes", default=None, metavar="M,M", help="tokens per step in 2^20 (2,8,16)"
    )
    s.add_argument(
        "--former-k", type=types.former_shift, default=None, help="step former: max shift (steps)"
    )
    s.add_argument("--former-e", type=float, default=None, help="step former: token tolerance")
    s.add_argument("--memory-cap", type=float, default=None, help="published cap (0.7)")


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    types.check_seed(args.seed, 1 if args.stream else args.batches)
    if args.stream:
        return cmd_stream(args)
    if args.lengths or args.histogram:
        raise DcpOptError(
            "--lengths/--histogram: with --stream only (your epoch over a stream); the "
            "one-batch bench runs the standard workloads (one batch of yours: `dcp-opt plan`, "
            "`dcp-opt whatif`)"
        )

    from ..analysis.bench import run_bench
    from ..analysis.bench_display import error_lines, render_table

    config = BenchConfig(
        cluster=args.cluster,
        workloads=split(args.workloads) or BenchConfig().workloads,
        planners=split(args.planners),
        num_batches=args.batches,
        first_seed=args.seed,
        tokens_per_gpu=args.tokens_per_gpu,
        planner_options={"time_limit_s": args.time_limit},
    )
    make_cost = _bench_costs(args)
    _profile_warning(args)
    with _progress(disabled=args.no_progress) as (on_start, on_done):
        doc = run_bench(config, make_cost=make_cost, on_start=on_start, on_done=on_done)
    doc["config"]["profile"] = args.profile
    doc["config"]["sp_kinds"] = list(sp_kinds(args))  # the 1D workloads'
    doc["config"].update(_layout(args))
    Console(soft_wrap=False, width=max(Console().width, 110)).print(render_table(doc))
    for line in error_lines(doc):
        _note(line)
    if args.json:
        _write(args.json, json.dumps(doc, indent=1, default=json_default) + "\n", "json")
    failed = any(not r["all_valid"] for r in doc["summary"])
    return EXIT_FAILED if (args.strict and failed) else 0


def stream_config(args: argparse.Namespace):
    """StreamConfig from the bench arguments (--quick first, explicit flags over it)."""
    from ..analysis.stream import MILLION, QUICK, STREAM_WORKLOADS, StreamConfig

    kw: dict = dict(QUICK) if args.quick else {}
    kw["cluster"] = args.cluster
    kw["seed"] = args.seed
    kw["workloads"] = split(args.workloads) or kw.get("workloads", STREAM_WORKLOADS)
    if args.planners:
        kw["planners"] = split(args.planners)
    if args.epoch_batches is not None:
        kw["num_batches"] = args.epoch_batches
    if args.step_sizes:
        sizes = []
        for x in split(args.step_sizes):
            try:
                m = float(x)
            except ValueError:
                m = float("nan")
            if not 0 < m <= MAX_STEP_M:  # also NaN and inf
                raise DcpOptError(
                    f"step-sizes: {args.step_sizes[:80]!r}: each must be a number of 2^20 "
                    f"tokens in (0, {MAX_STEP_M}]"
                )
            sizes.append(max(int(m * MILLION), 1))
        kw["step_sizes"] = tuple(sizes)
    if args.time_limit is not None:
        kw["cpsat_budget_s"] = args.time_limit
    for flag, key in (
        ("former_k", "former_max_shift"),
        ("former_e", "former_tolerance"),
        ("memory_cap", "memory_cap"),
    ):
        if getattr(args, flag) is not None:
            kw[key] = getattr(args, flag)
    for key, high in (("former_tolerance", 1.0), ("memory_cap", 1.0)):
        if key in kw and not 0 <= kw[key] <= high:  # also NaN
            raise DcpOptError(f"{key.replace('_', '-')}: must be in [0, {high}], got {kw[key]}")
    return StreamConfig(**kw)


MAX_STEP_M = 1024  # a step of 2^30 tokens: 512x the default global batch


def _own_epoch(args: argparse.Namespace, config):
    """The epoch of --lengths (as read: data order) or --histogram (drawn), with its name."""
    from ..analysis.whatif import check_sample_size
    from ..histogram import LengthDistribution

    if args.lengths:
        return load_batch(args.lengths), Path(args.lengths).name
    text = read_text(args.histogram, f"histogram file {args.histogram!r}")
    name = Path(args.histogram).name
    dist = LengthDistribution.from_histogram_text(text, source=f"histogram {name}")
    budget = config.num_batches * config.tokens_per_batch
    check_sample_size(dist, budget, "epoch-batches")
    return dist.sample_batch(config.seed, budget), name


def cmd_stream(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..analysis.stream import run_stream, run_stream_epoch
    from ..analysis.stream_display import (
        render_fidelity_table,
        render_matched_table,
        render_stream_table,
    )

    config = stream_config(args)
    make_cost = _bench_costs(args)
    _profile_warning(args)
    own = args.lengths or args.histogram
    if own and args.workloads:
        raise DcpOptError("--workloads: not with --lengths/--histogram (the epoch is yours)")
    epoch, name = _own_epoch(args, config) if own else (None, None)
    with _progress(disabled=args.no_progress) as (on_start, on_done):
        if epoch is None:
            doc = run_stream(config, make_cost=make_cost, on_start=on_start, on_done=on_done)
        else:
            doc = run_stream_epoch(
                epoch, config, name=name, make_cost=make_cost, on_start=on_start, on_done=on_done
            )
            if args.histogram:
                doc["config"].update(
                    num_batches=config.num_batches, tokens_per_batch=config.tokens_per_batch
                )
    doc["config"].update(_layout(args))
    console = Console(soft_wrap=False, width=max(Console().width, 130))
    console.print(render_stream_table(doc))
    if doc["matched"]:
        console.print(render_matched_table(doc))
    if doc["fidelity"]:
        console.print(render_fidelity_table(doc))
    for line in doc["notes"]:
        _note(line)
    _note(f"stream bench: {doc['total_wall_time_s']:.1f} s")
    if args.json:
        _write(args.json, json.dumps(doc, indent=1, default=json_default) + "\n", "json")
    return 0


def _profile_warning(args: argparse.Namespace) -> None:
    if args.profile:
        from ..inputs import load_cluster
        from .handoff import profile_warning

        profile_warning(args.profile, load_cluster(args.cluster))


def _add_layout(p: argparse.ArgumentParser) -> None:
    """The job's layout every row of the table runs at (issue 26: big models compare at the
    setting that fits them). Explicit here, unlike `plan`: a comparison is at one setting."""
    p.add_argument(
        "--optimizer-sharding",
        default="zero1",
        choices=SHARDING_MODES,
        help="every row's optimizer sharding (default zero1)",
    )
    p.add_argument(
        "--tp",
        type=types.int_in(1, 1 << 16),
        default=1,
        help="tensor-parallel GPUs per unit, dividing the node and the heads (default 1)",
    )
    p.add_argument(
        "--shard-domain",
        type=types.int_in(0, 1 << 16),
        default=0,
        help="with --optimizer-sharding zero3: per layer over aligned blocks of this many "
        "units (default 0: gathered once per step)",
    )


def _layout(args: argparse.Namespace) -> dict:
    """The layout every row ran at, for the JSON's config."""
    return {
        "optimizer_sharding": args.optimizer_sharding,
        "tensor_parallel": args.tp,
        "shard_domain": args.shard_domain,
    }


def _bench_costs(args: argparse.Namespace):
    """make_cost for run_bench: it hands over the default preset model of each kind; the
    user's model file or profile replaces it (run_bench reports the model it got)."""
    models = {"1d": args.model_1d, "2d": args.model_2d, "3d": args.model_3d}
    kind_of_profile = profile_kind(args.profile) if args.profile else None
    kinds = {"1d": sp_kinds(args), "2d": ("ulysses",), "3d": ("ulysses",)}  # cp: 1D only

    def make_cost(preset, cluster) -> CostModel:
        k = preset.kind
        return cost_model(
            kind=preset.input_kind,
            cluster=cluster,
            model=models[k],
            profile=args.profile if k == kind_of_profile else None,
            default_model=preset.name,
            source=f"each {k} workload",
            sp_kinds=kinds[k],
            optimizer_sharding=args.optimizer_sharding,
            tensor_parallel=args.tp,
            shard_domain=args.shard_domain,
        )

    return make_cost


class _progress:
    """A rich progress bar on stderr, driven by run_bench's callbacks."""

    def __init__(self, disabled: bool):
        self.disabled = disabled
        self.bar = None

    def __enter__(self) -> tuple[Callable[[int], None], Callable[[str, str], None]]:
        from rich.console import Console
        from rich.progress import Progress

        self.bar = Progress(console=Console(stderr=True), transient=True, disable=self.disabled)
        self.bar.__enter__()
        task = self.bar.add_task("planning", total=None)

        def on_start(total: int) -> None:
            self.bar.update(task, total=total)

        def on_done(workload: str, planner: str) -> None:
            self.bar.update(task, advance=1, description=f"{workload} {planner}")

        return on_start, on_done

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)
