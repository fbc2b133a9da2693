"""`dcp-opt plan --pp P`: the pipeline arguments and which planner they pick (issue 30).

With --pp the plan is for P pipeline stages (dcp_opt/pipeline/): the planner named by
--planner is its pipeline form (greedy -> pp_greedy, cpsat -> pp_cpsat; a pp_ name as is),
and the plan is written as schema 3 with its `pipeline` (schema 4 when the planner picks
micro-steps whose groups change, docs/plan-format.md; --pp-form columns keeps to columns).
`dcp-opt simulate` reads it as any other plan. --tp, where the cost model prices tensor parallelism, is passed on as the plan's
`tensor_parallel` (the rank map of docs/plan-format.md)."""

from __future__ import annotations

import argparse

from ..errors import DcpOptError
from ..pipeline.actions import SCHEDULES

PIPELINE_PLANNERS = {"greedy": "pp_greedy", "cpsat": "pp_cpsat"}


def add_pp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=None, metavar="P", help="pipeline stages")
    p.add_argument("--pp-schedule", default="1f1b", choices=list(SCHEDULES),
                   help="the stages' order (default 1f1b)")  # fmt: skip
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="model chunks per stage (interleaved only; default 1)")  # fmt: skip
    p.add_argument("--pp-layers", default=None, metavar="N,N,...",
                   help="the layer split, fixed (one count a stage; default: the planner's "
                        "choice per batch)")  # fmt: skip
    p.add_argument("--pp-form", default="best", choices=["best", "columns"],
                   help="best: columns or micro-steps whose groups change, the faster "
                        "(schema 4); columns: groups fixed for the step (schema 3)")  # fmt: skip


def pipeline_planner(args: argparse.Namespace) -> tuple[str, dict]:
    """(planner name, its pipeline options) for --pp; the planner unchanged without it."""
    if args.pp is None:
        return args.planner, {}
    if args.pp < 1:
        raise DcpOptError(f"pp: must be an integer >= 1, got {args.pp}")
    name = PIPELINE_PLANNERS.get(args.planner, args.planner)
    if not name.startswith("pp_"):
        raise DcpOptError(
            f"planner: {args.planner!r} plans no pipeline; allowed with --pp: "
            f"{sorted(PIPELINE_PLANNERS) + sorted(PIPELINE_PLANNERS.values())}"
        )
    opts = {"pp": args.pp, "schedule": args.pp_schedule, "virtual_stages": args.virtual_stages}
    if name in PIPELINE_PLANNERS.values():  # the baselines plan columns only
        opts["micro_steps"] = args.pp_form == "best"
    tp = getattr(args, "tp", None)
    if tp:
        opts["tensor_parallel"] = tp
    if getattr(args, "pp_layers", None):
        opts["stage_layers"] = parse_layers(args.pp_layers)
    return name, opts


def parse_layers(text: str) -> tuple[int, ...]:
    """--pp-layers "20,20,20,20" as integers, or a one-line error naming the field."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise DcpOptError(
            f"pp-layers: {text!r}; allowed: comma-separated integers, one a stage"
        ) from None
