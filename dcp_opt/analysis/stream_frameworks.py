"""The text frameworks' baselines on the stream (issue 16 item 5): `megatron_dynamic_cp` and
`verl_balanced` over the 1D epochs of `dcp-opt bench --stream`, in the form their users run
them, beside the project's planner with the same SP kinds.

Framing (docs/stream.md, "Framework baselines"): both frameworks take a fixed global batch
and decide only how it runs; neither forms its own optimizer steps from a stream.
- verl's dynamic batch size cuts a fixed global batch (ppo_mini_batch_size) into balanced
  micro-batches (verl/utils/seqlen_balancing.py, rearrange_micro_batches; solvers/baselines/verl.py);
- Megatron-Core's dynamic CP schedules the sequences of a given global batch into CP groups
  and micro-steps (data_schedule.py, get_groups_and_subsamples; solvers/baselines/megatron.py).
So each runs on the same fixed-size steps in data order as the project's planners
(`<framework>@<size>`), every sample trained once. The cost model offers the three SP kinds
(CostModel.sp_kinds = CP_KINDS: ulysses, cp = all-gather-KV, ring = TransformerEngine's P2P
ring, dcp_opt/cost/ring.py) to every row. Each framework runs on its own kind
(FRAMEWORK_KINDS): Megatron's groups are `ring` (Megatron-Core's context parallelism is TE's
P2P ring: megatron-core 0.16.1, core/extensions/transformer_engine.py:1240-1241, cp_comm_type
None -> "p2p"), verl keeps Ulysses (its published kind; verl_balanced has no other). The
project's greedy planner runs on the same steps and cost model, choosing the kind per group
among the three (`greedy+cp@<size>`: "+cp" for the CP kinds offered, cp and ring), so the
three rows differ only in the planner. Their stream bound is the bound over the three kinds
(the per-step tables take the least over cost.sp_kinds; ring's overlap is left out, so it is
looser than over ulysses and cp).

Each framework runs at the setting its users would pick: tuned on the first
`framework_tune_steps` steps of the row (StreamConfig, default 2; 0 runs the planners'
defaults), on its own kind, the setting then fixed for the epoch and written in the row
(`setting`, Megatron's with its `kind`); see `tuned_setting`. That is not always its best
fixed setting over the epoch (benchmarks/bench_framework_settings.py, docs/baselines.md).

2D workloads are left out: neither framework serves a video DiT (solvers/baselines/megatron.py).
"""

from __future__ import annotations

from collections.abc import Callable

from .stream_figures import method_row

FRAMEWORKS = ("megatron_dynamic_cp", "verl_balanced")
CP_KINDS = ("ulysses", "cp", "ring")
# each framework's own SP kind, fixed in all its runs, tuning included (module doc); verl's
# planner has no kind option: its groups are Ulysses
FRAMEWORK_KINDS = {"megatron_dynamic_cp": {"kind": "ring"}, "verl_balanced": {}}
CP_TAG = "+cp"  # the project planner's row on the cost model offering CP_KINDS: greedy+cp@size


def framework_runs(
    config,
    workload: str,
    epoch,
    cost,
    targets: dict[int, str],
    *,
    steps_of: Callable,
    run_fixed: Callable,
    cache_of: Callable,
    on_done: Callable[[str, str], None],
) -> list[dict]:
    """Rows of the frameworks and of greedy on the cp-enabled cost model, at each step size
    of `config.framework_sizes` (None: every size the project's planners run, the published
    medians included; the default runs 2M only: at 8M-16M tokens a step of 1d-short holds
    2,500-5,000 sequences and the two frameworks take 0.6-3 s to plan it here)."""
    if not workload.startswith("1d") or not (config.frameworks or config.cp_planner):
        return []
    cp_cost = cost.with_(sp_kinds=CP_KINDS)
    cache = cache_of(epoch, cp_cost)
    sizes = config.framework_sizes
    out = []
    for target, label in targets.items():
        if sizes is not None and target not in sizes:
            continue
        steps = steps_of(epoch, target)
        bound = "compute"  # one stream bound for these steps, shared by the three planners
        planners = [(p, p, "framework") for p in config.frameworks]
        if config.cp_planner:
            planners.append((config.cp_planner, config.cp_planner + CP_TAG, "project"))
        for planner, tag, family in planners:
            name = f"{tag}@{label}"
            options = FRAMEWORK_KINDS[planner] if family == "framework" else {}
            if family == "framework" and config.framework_tune_steps:
                options = tuned_setting(planner, steps, cache, cp_cost, config.framework_tune_steps)
            run = run_fixed(epoch, cp_cost, planner, steps, options, 0, bound=bound, cache=cache)
            bound = run.bound_s
            out.append(
                method_row(
                    workload, name, run, epoch, family=family, planner=planner,
                    drop_last=False, step_former=False, target_tokens=target,
                    sp_kinds=list(CP_KINDS), setting=options or None,
                )
            )  # fmt: skip
            on_done(workload, name)
    return out


def tuned_setting(planner: str, steps, cache, cost, num_steps: int) -> dict:
    """The framework's best setting on the first `num_steps` steps, as its users tune it
    (solvers/baselines/tuned.py `tune`: Megatron's max_seqlen_per_rank 2K-128K x recompute,
    verl's max_token_len 2K-128K x balance x checkpointing; settings that run out of memory
    dropped), every setting on the framework's own kind (FRAMEWORK_KINDS); that kind alone
    (its defaults otherwise) if every setting is dropped."""
    from dcp_opt.solvers.baselines.tuned import tune

    fixed = FRAMEWORK_KINDS[planner]
    setting, _ = tune(planner, [cache.batch(ids) for ids in steps[:num_steps]], cost, fixed=fixed)
    return setting or dict(fixed)


def count_runs(config, sizes_per_workload: int) -> int:
    """Rows framework_runs adds for one 1D workload (for the progress bar)."""
    per_size = len(config.frameworks) + bool(config.cp_planner)
    if config.framework_sizes is None:
        return per_size * sizes_per_workload
    return per_size * len(config.framework_sizes)


def framework_table(rows: list[dict]) -> list[dict]:
    """Per 1D workload and step size: the project's planner on the cp-enabled cost model over
    each framework and over Ulysses-only greedy, at the same steps; the gaps to the bound."""
    by = {(r["workload"], r["method"]): r for r in rows}
    out = []
    for (w, method), r in by.items():
        if r["family"] != "project" or not method.startswith("greedy" + CP_TAG + "@"):
            continue
        size = method.split("@", 1)[1]
        row = {"workload": w, "size": size, "target_tokens": r["target_tokens"]}
        row["greedy_cp_tokens_per_s"] = r["tokens_per_s"]
        row["gap_to_bound"] = r["gap_to_bound"]
        for ref in (*FRAMEWORKS, "greedy"):
            other = by.get((w, f"{ref}@{size}"))
            ok = other is not None and other["tokens_per_s"]
            row[f"vs_{ref}"] = r["tokens_per_s"] / other["tokens_per_s"] if ok else None
            if ref in FRAMEWORKS:
                row[f"{ref}_gap_to_bound"] = other["gap_to_bound"] if other else None
                row[f"{ref}_setting"] = other.get("setting") if other else None
        out.append(row)
    return out
