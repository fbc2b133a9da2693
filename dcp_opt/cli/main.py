"""The `dcp-opt` command line. Thin: one function per subcommand, the work is in the library.

    dcp-opt plan      plan one batch with one planner, print a summary, write plan JSON
    dcp-opt simulate  validate a plan JSON against its inputs and predict its step
    dcp-opt show      draw a plan JSON: Gantt chart per rank, memory per rank (dcp_opt.analysis.gantt)
    dcp-opt bench     every planner on every standard workload (dcp_opt.analysis.bench); with
                      --stream, every method over an epoch (dcp_opt.analysis.stream)
    dcp-opt whatif    speedups, degrees and memory for a length distribution (dcp_opt.analysis.whatif)
    dcp-opt profile   measure the model on this device, fit the cost model (dcp_opt.cli.profile)

Bad input (an unknown preset, a malformed file, a bad length, an empty batch, a sequence that
fits nowhere) prints one line `dcp-opt: error: <message>` on stderr and exits 2. An invalid
plan given to `simulate`, or a planner that returns no plan, exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..analysis.bench import (
    DEFAULT_MODELS,
    DEFAULT_NUM_BATCHES,
    BenchConfig,
    json_default,
    planner_kwargs,
)
from ..analysis.kind_map import kind_shares
from ..batch import Batch
from ..cluster import GB
from ..cost import SHARDING_MODES, CostModel
from ..errors import DcpOptError
from ..inputs import cost_model, load_cluster, profile_kind
from ..plan import Plan
from ..simulate import SimResult, simulate
from ..validate import validate
from ..workloads import DEFAULT_TOKENS_PER_GPU, STANDARD_WORKLOADS, load_batch, standard_batch
from .profile import add_profile_parser

PROG = "dcp-opt"
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other bad input."""

    def error(self, message: str):
        raise DcpOptError(f"{message} (see `{self.prog} --help`)")


# ---- shared arguments --------------------------------------------------------------------------
def _add_inputs(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--lengths",
        metavar="FILE",
        help="batch file: one length per line (1D), frames,height,width per line (2D), or JSON",
    )
    src.add_argument(
        "--workload",
        metavar="NAME",
        help=f"a standard workload: {', '.join(w.name for w in STANDARD_WORKLOADS)}",
    )
    p.add_argument("--seed", type=int, default=None, help="workload seed (default 0); planner seed")
    p.add_argument("--tokens-per-gpu", type=int, default=DEFAULT_TOKENS_PER_GPU)
    p.add_argument("--cluster", default="h200x32", help=f"{CLUSTER_HELP} (default h200x32)")
    p.add_argument(
        "--model",
        default=None,
        help=f"{MODEL_HELP} (default: the profile's model, else {DEFAULT_MODELS['1d']} for "
        f"1D, {DEFAULT_MODELS['2d']} for 2D batches)",
    )
    p.add_argument("--profile", metavar="FILE", help=PROFILE_HELP)
    p.add_argument("--optimizer-sharding", default="zero1", choices=SHARDING_MODES)
    _add_sp_kinds(p)


def _add_sp_kinds(p: argparse.ArgumentParser, *, note: str = "") -> None:
    p.add_argument(
        "--sp-kinds",
        default="ulysses",
        metavar="KINDS",
        help="SP kinds a group may take: ulysses (default), or ulysses with cp (all-gather-KV "
        "context parallelism) and/or ring (ring attention), e.g. ulysses,cp,ring (1D models; "
        f"the planners choose per group){note}",
    )


def _sp_kinds(args: argparse.Namespace, input_kind: str | None = None) -> tuple[str, ...]:
    """--sp-kinds as CostModel.sp_kinds; one-line errors naming the flag and the values."""
    from ..cost.cp import SP_KINDS

    kinds = _split(args.sp_kinds) or ()
    if (
        any(k not in SP_KINDS for k in kinds)
        or "ulysses" not in kinds
        or len(set(kinds)) < len(kinds)
    ):
        raise DcpOptError(
            f"--sp-kinds: {args.sp_kinds!r} not allowed; allowed: 'ulysses' with any of "
            "'cp', 'ring' (e.g. 'ulysses,cp,ring'), each once"
        )
    other = [k for k in kinds if k != "ulysses"]
    if other and input_kind == "2d":
        raise DcpOptError(
            f"--sp-kinds: {other[0]!r} not allowed for 2d (video) inputs; allowed: 'ulysses' "
            f"({other[0]} is for 1D causal models)"
        )
    return tuple(kinds)


CLUSTER_HELP = "cluster preset or Cluster JSON file"
MODEL_HELP = "model preset or ModelSpec JSON file"
PROFILE_HELP = (
    "profile JSON from `dcp-opt profile`: plan with its measured cost model (its model, or "
    "--model if that has the same layers)"
)


def _inputs(args: argparse.Namespace) -> tuple[Batch, CostModel]:
    cluster = load_cluster(args.cluster)
    if args.lengths is not None:
        batch = load_batch(args.lengths)
    else:
        batch = standard_batch(
            args.workload,
            args.seed or 0,
            num_gpus=cluster.num_gpus,
            tokens_per_gpu=args.tokens_per_gpu,
        )
    cost = cost_model(
        kind=batch.kind,
        cluster=cluster,
        model=args.model,
        profile=args.profile,
        default_model=DEFAULT_MODELS[batch.kind],
        optimizer_sharding=args.optimizer_sharding,
        sp_kinds=_sp_kinds(args, batch.kind),
    )
    return batch, cost


def _write(path: str, text: str, field: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise DcpOptError(f"{field} {path!r}: cannot write ({e.strerror})") from None


def _read_plan(path: str) -> Plan:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise DcpOptError(f"plan file {path!r}: cannot read ({e.strerror})") from None
    return Plan.from_json(text)


def _note(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)


def _split(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


# ---- plan --------------------------------------------------------------------------------------
def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="plan one batch and print a summary")
    _add_inputs(p)
    p.add_argument("--planner", default="greedy", help="planner name (default greedy)")
    p.add_argument("--out", metavar="PLAN_JSON", help="write the plan here")
    p.add_argument("--json", metavar="SUMMARY_JSON", help="write the summary here")
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="solver budget")
    p.add_argument("--workers", type=int, default=None, help="solver worker threads")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from dcp_opt.solvers import get_planner

    batch, cost = _inputs(args)
    cost.check_fits(batch)  # names the sequence, its need and the capacity
    fn = get_planner(args.planner)
    kwargs, ignored = planner_kwargs(
        fn, time_limit_s=args.time_limit, seed=args.seed, num_workers=args.workers
    )
    for name in ignored:
        _note(f"note: planner {args.planner!r} takes no {name}; ignored")
    res = fn(batch, cost, **kwargs)
    if not res.ok:
        _note(f"planner {args.planner!r} found no plan: {res.status}: {res.message}")
        return EXIT_FAILED
    sim = simulate(res.plan, batch, cost)
    summary = plan_summary(res, sim, batch, cost)
    for line in summary_lines(summary):
        print(line)
    if args.out:
        _write(args.out, res.plan.to_json() + "\n", "out")
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
        "peak_memory_gb": float(sim.peak_memory_bytes.max()) / GB,
        "capacity_gb": cost.capacity() / GB,
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
    }


def summary_lines(s: dict) -> list[str]:
    degrees = " | ".join(", ".join(f"{d}x{k}" for d, k in ph.items()) for ph in s["degrees"])
    return [
        f"planner     {s['planner']} ({s['status']}, {s['wall_time_s'] * 1e3:.1f} ms)",
        f"batch       {s['num_sequences']} sequences, {s['num_tokens']:,} tokens; "
        f"{s['model']} on {s['cluster']}",
        f"step time   {s['predicted_step_time_s']:.4f} s predicted; lower bound "
        f"{s['lower_bound_s']:.4f} s; gap {s['gap']:.1%}",
        f"balance     imbalance {s['imbalance']:.1%}; communication {s['comm_share']:.1%} "
        f"of busy time; peak memory {s['peak_memory_gb']:.1f} / {s['capacity_gb']:.1f} GB",
        f"plan        {s['num_phases']} phase(s), {s['num_groups']} busy group(s), "
        f"{s['num_micro_batches']} micro-batches; degree x groups: {degrees}",
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
    """The plan and its inputs, or None after printing every violation."""
    plan = _read_plan(args.plan)
    batch, cost = _inputs(args)
    violations = validate(plan, batch, cost, check_fingerprint=not args.ignore_fingerprint)
    if not violations:
        return plan, batch, cost
    _note(f"invalid plan: {len(violations)} violation(s)")
    for v in violations:
        print(f"  {v}", file=sys.stderr)
    kinds = sorted({g.kind for ph in plan.phases for g in ph.groups} - set(cost.sp_kinds))
    if any(v.code == "BAD_KIND" for v in violations) and kinds:
        want = ",".join(k for k in ("ulysses", "cp", "ring") if k in {*cost.sp_kinds, *kinds})
        _note(
            f"the plan has {'/'.join(kinds)} groups: pass --sp-kinds {want} as when it was planned"
        )
    return None


def _add_plan_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `dcp-opt plan --out`")
    _add_inputs(p)
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
    print(
        f"step time   {s['step_time_s']:.4f} s (finish {s['finish_s']:.4f} s + gradient sync "
        f"{s['grad_sync_s']:.4f} s)"
    )
    coll = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in s["collectives"].items())
    print(
        f"step sync   {cost.optimizer_sharding}: {coll or 'none'} per rank "
        f"({s['collectives_s']:.4f} s); closing micro-step {s['closing_step_s']:.4f} s"
    )
    print(f"imbalance   {s['imbalance']:.1%} of GPU-time idle before the gradient sync")
    print(f"comm share  {s['comm_share']:.1%} of busy time; recompute {s['recompute_share']:.1%}")
    print(
        f"peak memory {s['peak_memory_gb']:.1f} GB (capacity {cost.capacity() / GB:.1f} GB); "
        f"{s['num_micro_batches']} micro-batches"
    )
    if args.json:
        s.update(planner=plan.planner, cluster=cost.cluster.name, model=cost.model.name)
        _write(args.json, json.dumps(s, indent=1, default=json_default) + "\n", "json")
    return 0


# ---- show --------------------------------------------------------------------------------------
def _add_show(sub) -> None:
    p = sub.add_parser("show", help="draw a plan: Gantt chart per rank and memory per rank")
    _add_plan_file(p)
    p.add_argument("--out", required=True, metavar="PNG", help="image file (png, svg, pdf)")
    p.add_argument("--dpi", type=int, default=110)
    p.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    from ..analysis.gantt import plot_plan

    checked = _checked_plan(args)
    if checked is None:
        return EXIT_FAILED
    fig = plot_plan(*checked)
    try:
        fig.savefig(args.out, dpi=args.dpi)
    except (OSError, ValueError) as e:  # unwritable path or unknown image format
        raise DcpOptError(f"out {args.out!r}: cannot write ({e})") from None
    print(f"wrote {args.out}")
    return 0


# ---- bench -------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="every planner on every standard workload")
    p.add_argument("--cluster", default="h200x32", help=f"{CLUSTER_HELP} (default h200x32)")
    p.add_argument("--workloads", default=None, help="comma-separated (default: all six)")
    p.add_argument("--planners", default=None, help="comma-separated (default: all built)")
    p.add_argument("--batches", type=int, default=DEFAULT_NUM_BATCHES, help="seeds per workload")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    for kind in ("1d", "2d"):
        p.add_argument(f"--model-{kind}", help=f"{MODEL_HELP} (default {DEFAULT_MODELS[kind]})")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="profile JSON from `dcp-opt profile`: the cost model of the workloads of its "
        "model's kind (1d or 2d); the other kind keeps its model",
    )
    p.add_argument("--tokens-per-gpu", type=int, default=DEFAULT_TOKENS_PER_GPU)
    p.add_argument("--time-limit", type=float, default=None, metavar="S", help="solver budget")
    p.add_argument(
        "--json", metavar="OUT", help="write every figure here (see dcp_opt.analysis.bench)"
    )
    p.add_argument("--strict", action="store_true", help="exit 1 if any plan is missing/invalid")
    p.add_argument("--no-progress", action="store_true")
    _add_sp_kinds(p, note="; 2D workloads keep ulysses")
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
    s.add_argument("--epoch-batches", type=int, default=None, metavar="N", help="default 256")
    s.add_argument(
        "--step-sizes", default=None, metavar="M,M", help="tokens per step in 2^20 (2,8,16)"
    )
    s.add_argument("--former-k", type=int, default=None, help="step former: max shift (steps)")
    s.add_argument("--former-e", type=float, default=None, help="step former: token tolerance")
    s.add_argument("--memory-cap", type=float, default=None, help="published cap (0.7)")


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.stream:
        return cmd_stream(args)

    from ..analysis.bench import run_bench
    from ..analysis.bench_display import error_lines, render_table

    config = BenchConfig(
        cluster=args.cluster,
        workloads=_split(args.workloads) or BenchConfig().workloads,
        planners=_split(args.planners),
        num_batches=args.batches,
        first_seed=args.seed,
        tokens_per_gpu=args.tokens_per_gpu,
        planner_options={"time_limit_s": args.time_limit},
    )
    make_cost = _bench_costs(args)
    with _progress(disabled=args.no_progress) as (on_start, on_done):
        doc = run_bench(config, make_cost=make_cost, on_start=on_start, on_done=on_done)
    doc["config"]["profile"] = args.profile
    doc["config"]["sp_kinds"] = list(_sp_kinds(args))  # the 1D workloads'
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
    kw["workloads"] = _split(args.workloads) or kw.get("workloads", STREAM_WORKLOADS)
    if args.planners:
        kw["planners"] = _split(args.planners)
    if args.epoch_batches is not None:
        kw["num_batches"] = args.epoch_batches
    if args.step_sizes:
        try:
            kw["step_sizes"] = tuple(int(float(x) * MILLION) for x in _split(args.step_sizes))
        except ValueError:
            raise DcpOptError(f"step-sizes: {args.step_sizes!r} is not a list of numbers") from None
    if args.time_limit is not None:
        kw["cpsat_budget_s"] = args.time_limit
    for flag, key in (
        ("former_k", "former_max_shift"),
        ("former_e", "former_tolerance"),
        ("memory_cap", "memory_cap"),
    ):
        if getattr(args, flag) is not None:
            kw[key] = getattr(args, flag)
    return StreamConfig(**kw)


def cmd_stream(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..analysis.stream import run_stream
    from ..analysis.stream_display import (
        render_fidelity_table,
        render_matched_table,
        render_stream_table,
    )

    config = stream_config(args)
    with _progress(disabled=args.no_progress) as (on_start, on_done):
        doc = run_stream(config, make_cost=_bench_costs(args), on_start=on_start, on_done=on_done)
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


def _bench_costs(args: argparse.Namespace):
    """make_cost for run_bench: it hands over the default preset model of each kind; the
    user's model file or profile replaces it (run_bench reports the model it got)."""
    models = {"1d": args.model_1d, "2d": args.model_2d}
    kind_of_profile = profile_kind(args.profile) if args.profile else None
    kinds = {"1d": _sp_kinds(args), "2d": ("ulysses",)}  # cp serves 1D models only

    def make_cost(preset, cluster) -> CostModel:
        k = preset.kind
        return cost_model(
            kind=k,
            cluster=cluster,
            model=models[k],
            profile=args.profile if k == kind_of_profile else None,
            default_model=preset.name,
            source=f"each {k} workload",
            sp_kinds=kinds[k],
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
    p.add_argument("--batches", type=int, default=d.num_batches, help="sampled global batches")
    p.add_argument("--sweep-batches", type=int, default=d.sweep_batches)
    p.add_argument("--gpus", default=",".join(map(str, d.gpus)), help="GPU counts to sweep")
    p.add_argument(
        "--inter-bw-scale",
        default=",".join(f"{s:g}" for s in d.inter_bw_scales),
        help="inter-node bandwidth factors to sweep",
    )
    p.add_argument("--planners", default=None, help="comma-separated (default: all built)")
    p.add_argument("--tokens-per-gpu", type=int, default=d.tokens_per_gpu)
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, metavar="S")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--optimizer-sharding", default=d.optimizer_sharding, choices=SHARDING_MODES)
    p.add_argument(
        "--json", metavar="OUT", help="write the document here (see dcp_opt.analysis.whatif)"
    )
    p.add_argument("--plot", metavar="PNG", help="write the six-panel figure here")
    p.add_argument("--no-progress", action="store_true")
    _add_sp_kinds(p, note="; with cp the document has the kind map (where each kind wins)")
    p.set_defaults(func=cmd_whatif)


def _numbers(text: str, field: str, kind: type) -> tuple:
    try:
        return tuple(kind(x) for x in _split(text))
    except ValueError:
        raise DcpOptError(f"{field}: expected comma-separated numbers, got {text!r}") from None


def cmd_whatif(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from rich.console import Console

    from ..analysis.whatif import WhatIfConfig, run_whatif
    from ..analysis.whatif_display import recommendation, render_tables, save_whatif_png
    from ..histogram import LengthDistribution

    if args.histogram is not None:
        dist = LengthDistribution.from_histogram(args.histogram)
    else:
        dist = LengthDistribution.from_lengths(args.lengths)
    cost = cost_model(
        kind=dist.kind,
        cluster=load_cluster(args.cluster),
        model=args.model,
        profile=args.profile,
        default_model=DEFAULT_MODELS[dist.kind],
        source=dist.source,
        optimizer_sharding=args.optimizer_sharding,
        sp_kinds=_sp_kinds(args, dist.kind),
    )
    config = WhatIfConfig(
        cluster=cost.cluster.name,
        model=cost.model.name,
        num_batches=args.batches,
        sweep_batches=args.sweep_batches,
        gpus=_numbers(args.gpus, "gpus", int),
        inter_bw_scales=_numbers(args.inter_bw_scale, "inter-bw-scale", float),
        tokens_per_gpu=args.tokens_per_gpu,
        planners=_split(args.planners),
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
        _note(line)
    if args.json:
        _write(args.json, json.dumps(doc, indent=1, default=json_default) + "\n", "json")
    if args.plot:
        save_whatif_png(doc, args.plot)
        print(f"wrote {args.plot}")
    print(f"whatif took {doc['wall_time_s']:.1f} s")
    return 0


# ---- entry point -------------------------------------------------------------------------------
# One registration function per subcommand; `whatif` (issue 6) adds its own here.
COMMANDS = (_add_plan, _add_simulate, _add_show, _add_bench, _add_whatif, add_profile_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Plan, simulate and benchmark distributed training on variable-length "
        "sequences (SP degree, micro-batches and recompute chosen per batch).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except DcpOptError as e:
        msg = " ".join(str(e).split())  # one line, whatever the message holds
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
