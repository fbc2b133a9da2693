"""The `dcp-opt` command line. Thin: one function per subcommand, the work is in the library.

    dcp-opt plan      plan one batch with one planner, print a summary, write plan JSON
    dcp-opt simulate  validate a plan JSON against its inputs and predict its step
    dcp-opt show      draw a plan JSON: Gantt chart per rank, memory per rank (dcp_opt.analysis.gantt)
    dcp-opt bench     every planner on every standard workload (dcp_opt.analysis.bench); with
                      --stream, every method over an epoch (dcp_opt.analysis.stream)
    dcp-opt whatif    speedups, degrees and memory for a length distribution (dcp_opt.analysis.whatif)
    dcp-opt profile   measure the model on this device, fit the cost model (dcp_opt.cli.profile)

Exit codes (README, "Command line"): 0 success; 1 no plan (an invalid plan given to `simulate`
or `show`, a planner that returns none, `bench --strict` failures); 2 bad input (an unknown
preset, a malformed file, a bad length, an empty batch, a sequence that fits nowhere), one line
`dcp-opt: error: <message>` on stderr; 3 an internal error (a bug in dcp_opt), one line
`dcp-opt: internal error: ...` asking for a bug report (DCP_OPT_TRACEBACK=1 prints the
traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ..analysis.bench import DEFAULT_MODELS, json_default, planner_kwargs
from ..analysis.kind_map import kind_shares
from ..batch import Batch
from ..cluster import GB
from ..cost import SHARDING_MODES, CostModel
from ..cost.cp import SP_KINDS
from ..errors import DcpOptError, format_bytes, read_text
from ..inputs import cost_model, load_cluster
from ..plan import Plan, fingerprint_inputs
from ..simulate import SimResult, simulate
from ..validate import validate
from ..workloads import (
    DEFAULT_TOKENS_PER_GPU,
    STANDARD_WORKLOADS,
    VIDEO_3D_WORKLOADS,
    load_batch,
    standard_batch,
)
from . import args as types
from . import handoff
from .args import add_sp_kinds, sp_kinds, split
from .bench import add_bench_parser
from .handoff import cluster_choice, model_choice, note, print_violations, profile_warning
from .layout import add_layout_args, auto_sharding, layout_fields, whatif_layouts
from .pipeline import add_pp_arguments, pipeline_planner
from .profile import add_profile_parser

PROG = "dcp-opt"
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERNAL = 3
BUG_REPORT = (
    "this is a bug in dcp_opt: please report it with the command line "
    "(DCP_OPT_TRACEBACK=1 prints the traceback)"
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other bad input."""

    def error(self, message: str):
        raise DcpOptError(f"{message} (see `{self.prog} --help`)")


# ---- shared arguments --------------------------------------------------------------------------
def _add_inputs(p: argparse.ArgumentParser, *, from_plan: bool = False) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--lengths",
        metavar="FILE",
        help="batch file: one length per line (1D), frames,height,width per line (2D), or JSON",
    )
    src.add_argument(
        "--workload",
        metavar="NAME",
        help=f"a standard workload: {', '.join(w.name for w in STANDARD_WORKLOADS)}; "
        f"full-attention video DiTs (--model opensora2-11b, ...): {', '.join(VIDEO_3D_WORKLOADS)}",
    )
    p.add_argument("--seed", type=int, default=None, help="workload seed (default 0); planner seed")
    p.add_argument(
        "--tokens-per-gpu",
        type=types.tokens_per_gpu,
        default=None,
        help=f"with --workload: tokens drawn per GPU (default {DEFAULT_TOKENS_PER_GPU})",
    )
    p.add_argument("--cluster", default=None, help=f"{CLUSTER_HELP} (default {DEFAULT_CLUSTER})")
    p.add_argument(
        "--model",
        default=None,
        help=f"{MODEL_HELP} (default: the profile's model, else {DEFAULT_MODELS['1d']} for "
        f"1D, {DEFAULT_MODELS['2d']} for 2D batches; the model used is printed)",
    )
    p.add_argument("--profile", metavar="FILE", help=PROFILE_HELP)
    p.add_argument(
        "--optimizer-sharding",
        default=None,
        choices=SHARDING_MODES,
        help="default: plan takes the least sharded that fits (zero1, zero2, zero3, then zero3 "
        "per layer over the least --shard-domain) and says so; simulate, show: the plan's own",
    )
    add_layout_args(p)
    add_sp_kinds(p, default=None if from_plan else "ulysses")


DEFAULT_CLUSTER = "h200x32"
CLUSTER_HELP = "cluster preset or Cluster JSON file"
MODEL_HELP = "model preset or ModelSpec JSON file"
PROFILE_HELP = (
    "profile JSON from `dcp-opt profile`: plan with its measured cost model (its model, or "
    "--model if that has the same layers)"
)


def _inputs(args: argparse.Namespace, plan: Plan | None = None) -> tuple[Batch, CostModel]:
    """The batch and cost model the arguments name. With `plan` (simulate, show), what the
    arguments leave out is what the plan records: its optimizer sharding, its SP kinds, and
    its model and cluster where those are presets (each default used is printed)."""
    recorded = plan.fingerprint_inputs if plan is not None else {}
    cluster = load_cluster(cluster_choice(args.cluster, recorded, DEFAULT_CLUSTER))
    if args.lengths is not None:
        if args.tokens_per_gpu is not None:  # it would be silently unused
            raise DcpOptError(
                "--tokens-per-gpu: only with --workload (a --lengths file is the batch as given)"
            )
        batch = load_batch(args.lengths)
    else:
        batch = standard_batch(
            args.workload,
            args.seed or 0,
            num_gpus=cluster.num_gpus,
            tokens_per_gpu=args.tokens_per_gpu or DEFAULT_TOKENS_PER_GPU,
        )
    # --shard-domain S > 0 alone means zero3 (the only mode with domains)
    default = "zero3" if args.shard_domain else "zero1"
    sharding = args.optimizer_sharding or (plan and plan.optimizer_sharding) or default
    if args.sp_kinds is None:  # simulate/show: the plan's kinds, else Ulysses
        used = {g.kind for ph in plan.phases for g in ph.groups} if plan else set()
        args.sp_kinds = recorded.get("sp_kinds") or ",".join(
            k for k in SP_KINDS if k == "ulysses" or k in used
        )
    model = model_choice(args, recorded, batch.kind, DEFAULT_MODELS[batch.kind])
    cost = cost_model(
        kind=batch.kind,
        cluster=cluster,
        model=model,
        profile=args.profile,
        default_model=DEFAULT_MODELS[batch.kind],
        optimizer_sharding=sharding,
        sp_kinds=sp_kinds(args, batch.kind),
        **layout_fields(args, plan),
    )
    if args.profile:
        profile_warning(args.profile, cluster)
    if plan is None and getattr(args, "pp", None) is None:  # a pipeline's stages hold 1/p
        cost = auto_sharding(
            cost,
            batch,
            mode_given=args.optimizer_sharding is not None,
            domain_given=args.shard_domain is not None,
        )
    return batch, cost


def _write(path: str, text: str, field: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise DcpOptError(f"{field} {path!r}: cannot write ({e.strerror})") from None


def _read_plan(path: str) -> Plan:
    return Plan.from_json(read_text(path, f"plan file {path!r}"))


# ---- plan --------------------------------------------------------------------------------------
def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="plan one batch and print a summary")
    _add_inputs(p)
    p.add_argument("--planner", default="greedy", help="planner name (default greedy)")
    p.add_argument("--out", metavar="PLAN_JSON", help="write the plan here")
    p.add_argument("--json", metavar="SUMMARY_JSON", help="write the summary here")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="solver budget")
    p.add_argument("--workers", type=types.workers, default=None, help="solver worker threads")
    add_pp_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from dcp_opt.solvers import get_planner

    batch, cost = _inputs(args)
    planner, pp_options = pipeline_planner(args)  # --pp: the pipeline planner, its options
    if not pp_options:  # a pipeline holds 1/p of the states: its planner checks its stages
        cost.check_fits(batch)  # names the sequence, its need and the capacity
    fn = get_planner(planner)
    kwargs, ignored = planner_kwargs(
        fn, time_limit_s=args.time_limit, seed=args.seed, num_workers=args.workers
    )
    for name in ignored:
        note(f"note: planner {planner!r} takes no {name}; ignored")
    res = fn(batch, cost, **kwargs, **pp_options)
    if not res.ok:
        note(f"planner {args.planner!r} found no plan: {res.status}: {res.message}")
        return EXIT_FAILED
    sim = simulate(res.plan, batch, cost)
    summary = plan_summary(res, sim, batch, cost)
    for line in summary_lines(summary):
        print(line)
    if args.out:  # with what its fingerprint was made of, so a mismatch can name the part
        plan = replace(res.plan, fingerprint_inputs=fingerprint_inputs(batch, cost))
        _write(args.out, plan.to_json() + "\n", "out")
    if args.json:
        _write(args.json, json.dumps(summary, indent=1, default=json_default) + "\n", "json")
    return 0


def _degrees(plan: Plan) -> list[dict[str, int]]:
    """Per phase: SP degree -> number of groups that run at least one micro-batch."""
    return [
        {
            str(d): k
            for d, k in sorted(Counter(g.degree for g in ph.groups if g.micro_batches).items())
        }
        for ph in plan.phases
    ]


def plan_summary(res, sim: SimResult, batch: Batch, cost: CostModel) -> dict:
    plan = res.plan
    return {
        **res.summary(),
        "imbalance": sim.imbalance,
        "comm_share": sim.comm_share,
        # per GPU: a plan rank is a unit of tensor_parallel GPUs, each holding 1/t
        "peak_memory_gb": float(sim.peak_memory_bytes.max()) / GB / cost.tensor_parallel,
        "capacity_gb": cost.capacity() / GB / cost.tensor_parallel,
        "tensor_parallel": cost.tensor_parallel,
        "shard_domain": cost.shard_domain,
        "num_phases": len(plan.phases),
        "num_groups": sum(1 for ph in plan.phases for g in ph.groups if g.micro_batches),
        "num_micro_batches": plan.num_micro_batches,
        "degrees": _degrees(plan),
        "sp_kinds": kind_shares(sim.events),  # GPU-time share per kind
        "cluster": cost.cluster.name,
        "model": cost.model.name,
        "num_sequences": len(batch),
        "num_tokens": batch.num_tokens,
        "fingerprint": plan.fingerprint,
        "pipeline": pipeline_line(plan),
    }


def pipeline_line(plan: Plan) -> str:
    """What a plan's pipeline is, in words; "" without one."""
    pipe = plan.pipeline
    if pipe is None:
        return ""
    form = (f"{len(plan.phases)} micro-steps whose groups change (schema 4)" if pipe.micro_steps
            else "columns: each group keeps its units for the step (schema 3)")  # fmt: skip
    return (f"{pipe.num_stages} stages ({pipe.schedule}, layers {list(pipe.stage_layers)}) x "
            f"tensor_parallel {plan.tensor_parallel}; {form}")  # fmt: skip


def summary_lines(s: dict) -> list[str]:
    degrees = " | ".join(", ".join(f"{d}x{k}" for d, k in ph.items()) for ph in s["degrees"])
    return [
        f"planner     {s['planner']} ({s['status']}, {s['wall_time_s'] * 1e3:.1f} ms)",
        f"batch       {s['num_sequences']} sequences, {s['num_tokens']:,} tokens; "
        f"{s['model']} on {s['cluster']}",
        f"step time   {s['predicted_step_time_s']:.4f} s predicted; lower bound "
        f"{s['lower_bound_s']:.4f} s; gap {s['gap']:.1%}",
        f"balance     imbalance {s['imbalance']:.1%}; communication {s['comm_share']:.1%} "
        f"of busy time; peak memory {format_bytes(s['peak_memory_gb'] * GB)} / "
        f"{format_bytes(s['capacity_gb'] * GB)}",
        f"plan        {s['num_phases']} phase(s), {s['num_groups']} busy group(s), "
        f"{s['num_micro_batches']} micro-batches; degree x groups: {degrees}",
        *([f"pipeline    {s['pipeline']}"] if s.get("pipeline") else []),
        *(
            [
                "sp kinds    "
                + ", ".join(f"{k} {v:.1%}" for k, v in s["sp_kinds"].items())
                + " of GPU-time"
            ]
            if set(s["sp_kinds"]) - {"ulysses"}
            else []
        ),
    ]


# ---- simulate ----------------------------------------------------------------------------------
def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="validate a plan against its inputs and simulate it")
    _add_plan_file(p)
    p.add_argument("--json", metavar="OUT", help="write the simulation summary here")
    p.set_defaults(func=cmd_simulate)


def _checked_plan(args: argparse.Namespace) -> tuple[Plan, Batch, CostModel] | None:
    """The plan and its inputs, or None after printing the violations (the first
    handoff.MAX_VIOLATION_LINES, then a count per code; a fingerprint mismatch names what
    differs)."""
    plan = _read_plan(args.plan)
    batch, cost = _inputs(args, plan)
    violations = validate(plan, batch, cost, check_fingerprint=not args.ignore_fingerprint)
    if not violations:
        return plan, batch, cost
    print_violations(violations, plan, batch, cost)
    return None


def _add_plan_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `dcp-opt plan --out`")
    _add_inputs(p, from_plan=True)
    p.add_argument(
        "--ignore-fingerprint",
        action="store_true",
        help="accept other inputs than the plan was made for (what-if)",
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    checked = _checked_plan(args)
    if checked is None:
        return EXIT_FAILED
    plan, batch, cost = checked
    sim = simulate(plan, batch, cost)
    s = sim.summary()
    if plan.pipeline is not None:  # its timeline is per column: count the plan's
        s["num_micro_batches"] = plan.num_micro_batches
        print(f"pipeline    {pipeline_line(plan)}")
    print(
        f"step time   {s['step_time_s']:.4f} s (finish {s['finish_s']:.4f} s + gradient sync "
        f"{s['grad_sync_s']:.4f} s)"
    )
    t = cost.tensor_parallel  # a plan rank is a unit of t GPUs, each sending 1/t
    coll = ", ".join(f"{k} {format_bytes(v / t)}" for k, v in s["collectives"].items())
    print(
        f"step sync   {cost.optimizer_sharding}: {coll or 'none'} per "
        f"{'rank' if t == 1 else 'GPU'} "
        f"({s['collectives_s']:.4f} s); closing micro-step {s['closing_step_s']:.4f} s"
    )
    print(f"imbalance   {s['imbalance']:.1%} of GPU-time idle before the gradient sync")
    print(f"comm share  {s['comm_share']:.1%} of busy time; recompute {s['recompute_share']:.1%}")
    print(
        f"peak memory {format_bytes(s['peak_memory_gb'] * GB / t)} (capacity "
        f"{format_bytes(cost.capacity() / t)}); {s['num_micro_batches']} micro-batches"
    )
    if args.json:
        s.update(planner=plan.planner, cluster=cost.cluster.name, model=cost.model.name)
        _write(args.json, json.dumps(s, indent=1, default=json_default) + "\n", "json")
    return 0


# ---- show --------------------------------------------------------------------------------------
def _add_show(sub) -> None:
    p = sub.add_parser("show", help="draw a plan: Gantt chart per rank and memory per rank")
    _add_plan_file(p)
    p.add_argument(
        "--out", required=True, metavar="PNG", help=f"image file ({', '.join(IMAGE_FORMATS)})"
    )
    p.add_argument(
        "--dpi", type=types.dpi, default=110, help=f"{types.MIN_DPI}..{types.MAX_DPI} (110)"
    )
    p.set_defaults(func=cmd_show)


# The image formats `show --out` writes, by the file's suffix: matplotlib would add ".png" to a
# name without one (`--out plan` wrote plan.png), so a name must say its format.
IMAGE_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff")


def _image_format(path: str) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in IMAGE_FORMATS:
        raise DcpOptError(
            f"out: {path!r} has no image suffix; allowed: "
            f"{', '.join('.' + f for f in IMAGE_FORMATS)} (the file is written as named)"
        )
    return suffix


def cmd_show(args: argparse.Namespace) -> int:
    from ..analysis.gantt import plot_plan

    fmt = _image_format(args.out)  # before the work: a bad name fails at once
    checked = _checked_plan(args)
    if checked is None:
        return EXIT_FAILED
    fig = plot_plan(*checked)
    try:
        fig.savefig(args.out, dpi=args.dpi, format=fmt)
    except (OSError, ValueError) as e:  # unwritable path or unknown image format
        raise DcpOptError(f"out {args.out!r}: cannot write ({e})") from None
    print(f"wrote {args.out}")
    return 0


# ---- whatif ------------------------------------------------------------------------------------
def _add_whatif(sub) -> None:
    from ..analysis.whatif import WhatIfConfig

    d = WhatIfConfig()
    p = sub.add_parser(
        "whatif", help="predicted speedups, degrees and memory for a length distribution"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", help="a batch file (see `plan --lengths`)")
    src.add_argument(
        "--histogram", metavar="FILE", help="CSV rows length,count or frames,height,width,count"
    )
    p.add_argument("--cluster", default=d.cluster, help=f"{CLUSTER_HELP} (default {d.cluster})")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default by the input's kind)")
    p.add_argument("--profile", metavar="FILE", help=PROFILE_HELP)
    p.add_argument(
        "--batches", type=types.batches, default=d.num_batches, help="sampled global batches"
    )
    p.add_argument("--sweep-batches", type=types.batches, default=d.sweep_batches)
    p.add_argument("--gpus", default=",".join(map(str, d.gpus)), help="GPU counts to sweep")
    p.add_argument(
        "--inter-bw-scale",
        default=",".join(f"{s:g}" for s in d.inter_bw_scales),
        help="inter-node bandwidth factors to sweep",
    )
    p.add_argument("--planners", default=None, help="comma-separated (default: all built)")
    p.add_argument("--tokens-per-gpu", type=types.tokens_per_gpu, default=d.tokens_per_gpu)
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, metavar="S")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--optimizer-sharding", default=d.optimizer_sharding, choices=SHARDING_MODES)
    p.add_argument(
        "--json", metavar="OUT", help="write the document here (see dcp_opt.analysis.whatif)"
    )
    p.add_argument("--plot", metavar="PNG", help="write the six-panel figure here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--layouts",
        action="store_true",
        help="sweep tensor parallelism x optimizer sharding (zero1, zero3) x zero3 shard "
        "domain instead: which settings fit, each one's step time (greedy, bucket, "
        "static_tuned; --planners to choose), the fastest (dcp_opt.analysis.whatif_layout)",
    )
    add_sp_kinds(p, note="; with cp the document has the kind map (where each kind wins)")
    p.set_defaults(func=cmd_whatif)


def _numbers(text: str, field: str, kind) -> tuple:
    try:
        return tuple(kind(x) for x in split(text))
    except (ValueError, argparse.ArgumentTypeError) as e:
        why = f" ({e})" if isinstance(e, argparse.ArgumentTypeError) else ""
        raise DcpOptError(
            f"{field}: expected comma-separated numbers, got {text[:80]!r}{why}"
        ) from None


def cmd_whatif(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from rich.console import Console

    from ..analysis.whatif import WhatIfConfig, run_whatif
    from ..analysis.whatif_display import recommendation, render_tables, save_whatif_png

    types.check_seed(args.seed)  # the planners get it as it is
    dist = load_distribution(args)
    cluster = load_cluster(args.cluster)
    cost = cost_model(
        kind=dist.kind,
        cluster=cluster,
        model=model_choice(args, {}, dist.kind, DEFAULT_MODELS[dist.kind]),
        profile=args.profile,
        default_model=DEFAULT_MODELS[dist.kind],
        source=dist.source,
        optimizer_sharding=args.optimizer_sharding,
        sp_kinds=sp_kinds(args, dist.kind),
    )
    if args.profile:
        profile_warning(args.profile, cluster)
    if args.layouts:
        return whatif_layouts(args, dist, cost)
    config = WhatIfConfig(
        cluster=cost.cluster.name,
        model=cost.model.name,
        num_batches=args.batches,
        sweep_batches=args.sweep_batches,
        gpus=_numbers(args.gpus, "gpus", types.gpus),
        inter_bw_scales=_numbers(args.inter_bw_scale, "inter-bw-scale", float),
        tokens_per_gpu=args.tokens_per_gpu,
        planners=split(args.planners),
        time_limit_s=args.time_limit,
        seed=args.seed,
        optimizer_sharding=args.optimizer_sharding,
    )
    status = None if args.no_progress else Console(stderr=True).status("what-if")
    with status or nullcontext():
        doc = run_whatif(
            dist, config, cost=cost, progress=status.update if status else lambda m: None
        )
    console = Console(soft_wrap=False, width=max(Console().width, 120))
    for table in render_tables(doc):
        console.print(table)
    for line in recommendation(doc):
        print(line)
    for line in doc["warnings"]:
        note(line)
    if args.json:
        _write(args.json, json.dumps(doc, indent=1, default=json_default) + "\n", "json")
    if args.plot:
        save_whatif_png(doc, args.plot)
        print(f"wrote {args.plot}")
    print(f"whatif took {doc['wall_time_s']:.1f} s")
    return 0


def load_distribution(args: argparse.Namespace):
    """The LengthDistribution of `--histogram` or `--lengths` (read as UTF-8: handoff)."""
    from ..histogram import LengthDistribution

    if args.histogram is not None:
        name = Path(args.histogram).name
        text = read_text(args.histogram, f"histogram file {args.histogram!r}")
        return LengthDistribution.from_histogram_text(text, source=f"histogram {name}")
    return LengthDistribution.from_lengths(args.lengths)


# ---- entry point -------------------------------------------------------------------------------
# One registration function per subcommand; `whatif` (issue 6) adds its own here.
COMMANDS = (_add_plan, _add_simulate, _add_show, add_bench_parser, _add_whatif, add_profile_parser)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(
        prog=PROG,
        description="Plan, simulate and benchmark distributed training on variable-length "
        "sequences (SP degree, micro-batches and recompute chosen per batch).",
        epilog="exit codes: 0 success; 1 no plan (invalid plan, planner found none, bench "
        "--strict failures); 2 bad input (one `dcp-opt: error:` line); 3 internal error (a bug)",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    handoff.defaults_suffix()  # forget a previous call's (main() is called in-process too)
    try:
        args = build_parser().parse_args(argv)
        rc = args.func(args)
        handoff.flush_defaults()
        return rc
    except DcpOptError as e:
        print(f"{PROG}: error: {one_line(str(e))}{handoff.defaults_suffix(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a bug: its own exit code, never 1 ("no plan") or 2 (bad input)
        if os.environ.get("DCP_OPT_TRACEBACK"):
            import traceback

            traceback.print_exc()
        print(
            f"{PROG}: internal error: {type(e).__name__}: {one_line(str(e))[:300]}; {BUG_REPORT}",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def one_line(message: str) -> str:
    """A message on one line, a run of more than 40 digits (a 400-digit number) shortened."""
    message = " ".join(message.split())
    return re.sub(r"\d{41,}", lambda m: f"{m[0][:12]}...({len(m[0])} digits)", message)


if __name__ == "__main__":
    sys.exit(main())
