"""The job's layout on the command line (issue 26): `--tp`, `--shard-domain`, the least
sharded mode that fits when no `--optimizer-sharding` is given, zero3's least fitting domain
when no domain is given, and `whatif --layouts`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..analysis.bench import json_default
from ..batch import Batch
from ..cost import CostModel
from ..errors import DcpOptError
from ..plan import Plan
from .args import int_in, split
from .handoff import note


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """`--tp` and `--shard-domain` on plan, simulate and show."""
    p.add_argument(
        "--tp",
        type=int_in(1, 1 << 16),
        default=None,
        help="tensor-parallel GPUs per unit, dividing the node and the heads; the planner's "
        "ranks are units (default 1; simulate, show: the plan's own)",
    )
    p.add_argument(
        "--shard-domain",
        type=int_in(0, 1 << 16),
        default=None,
        help="zero3 per layer over aligned blocks of this many units (0: parameters gathered "
        "once per step; default 0; simulate, show: the plan's own)",
    )


def layout_fields(args: argparse.Namespace, plan: Plan | None) -> dict:
    """--tp and --shard-domain as CostModel fields; left out: the plan's (simulate, show)."""
    tp = args.tp if args.tp is not None else (plan.tensor_parallel if plan else 1)
    domain = args.shard_domain
    if domain is None:
        domain = plan.shard_domain if plan else 0
    return {"tensor_parallel": tp, "shard_domain": domain}


def auto_sharding(
    cost: CostModel, batch: Batch, *, mode_given: bool, domain_given: bool
) -> CostModel:
    """`plan` without `--shard-domain`: without `--optimizer-sharding`, the least-sharded
    setting whose states and longest sequence fit (zero1, zero2, zero3 once per step, then
    zero3 per layer over the least shard domain; cost/settings.py `least_sharded`), with a
    note saying which and why; with `--optimizer-sharding zero3`, its least domain
    (`auto_shard_domain`). Anything else, or nothing that fits, keeps the given setting (the
    planner's error then names the states or the sequence)."""
    if domain_given:
        return cost
    longest = max(q.num_tokens for q in batch.sequences)
    if mode_given:
        return auto_shard_domain(cost, longest)
    from ..cost.settings import STEP_LEVEL_MODES, least_sharded, shortfall

    chosen = least_sharded(cost, longest)
    if chosen is None or chosen.optimizer_sharding == cost.optimizer_sharding:
        return cost
    what = chosen.optimizer_sharding
    if chosen.shard_domain:
        what += f" per layer over shard domains of {chosen.shard_domain} units"
    modes = STEP_LEVEL_MODES
    tried = modes[1:] if chosen.shard_domain else modes[1 : modes.index(chosen.optimizer_sharding)]
    same = [
        m for m in tried if cost.with_(optimizer_sharding=m).fixed_bytes() == cost.fixed_bytes()
    ]
    alike = f"; {' and '.join(same)} once per step hold the same" if same else ""
    note(
        f"optimizer sharding: {what} ({cost.optimizer_sharding}'s "
        f"{shortfall(cost, longest)} per GPU{alike}; --optimizer-sharding to choose)"
    )
    return chosen


def auto_shard_domain(cost: CostModel, longest: int) -> CostModel:
    """`--optimizer-sharding zero3` without `--shard-domain`: the step-level schedule where
    the states and the longest sequence (`longest` tokens) fit, else per-layer zero3 over the
    least shard domain where they do (cost/settings.py; a note says which)."""
    from ..cost.settings import fits, least_shard_domain

    if cost.optimizer_sharding != "zero3" or fits(cost, longest):
        return cost
    s = least_shard_domain(cost, longest)
    if s is None:
        return cost  # the planner's error names the states or the sequence
    note(
        f"zero3 per layer over shard domains of {s} units: the least whose states and longest "
        "sequence fit (--shard-domain to choose; 0: gathered once per step)"
    )
    return cost.with_(shard_domain=s)


def whatif_layouts(args: argparse.Namespace, dist, cost: CostModel) -> int:
    """`whatif --layouts`: the TP x mode x shard-domain sweep on --batches sampled batches."""
    from ..analysis.whatif import check_sample_size
    from ..analysis.whatif_layout import layout_lines, layout_sweep

    budget = cost.gpu_cluster.num_gpus * args.tokens_per_gpu
    check_sample_size(dist, budget)
    batches = [dist.sample_batch(args.seed + i, budget) for i in range(args.batches)]
    planners = split(args.planners) or ("greedy", "bucket", "static_tuned")
    doc = layout_sweep(batches, cost, planners=planners)
    doc["config"] = {
        "cluster": cost.gpu_cluster.name,
        "model": cost.model.name,
        "num_batches": args.batches,
        "tokens_per_gpu": args.tokens_per_gpu,
        "seed": args.seed,
    }
    for line in layout_lines(doc):
        print(line)
    if args.json:
        text = json.dumps(doc, indent=1, default=json_default) + "\n"
        try:
            Path(args.json).write_text(text)
        except OSError as e:
            raise DcpOptError(f"json {args.json!r}: cannot write ({e.strerror})") from None
    return 0
