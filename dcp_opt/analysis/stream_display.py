"""How `dcp-opt bench --stream` shows its document (dcp_opt.analysis.stream): rich tables.

rich is imported only inside the render functions, so importing this module costs nothing.
"""

from __future__ import annotations

from .bench_display import fmt_cell


def _m(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def render_stream_table(doc: dict):
    """One row per (workload, method): throughput, step sizes, drops, planning, bound gap."""
    from rich.table import Table

    cfg = doc["config"]
    if cfg.get("epoch"):  # the user's own epoch (run_stream_epoch)
        e = doc["epochs"][0]
        epoch = f"{cfg['epoch']}: {e['num_sequences']:,} sequences, {e['num_tokens'] / 2**20:.4g}M tokens"
    else:
        epoch = (
            f"of {cfg['num_batches']} x {cfg['tokens_per_batch'] / 2**20:.3g}M tokens per workload"
        )
    table = Table(
        title=f"dcp-opt bench --stream: {cfg['cluster']} ({cfg['num_gpus']} GPUs), one epoch "
        + epoch,
        title_justify="left",
        caption="published: the VideoSys sampler over the epoch (cap 0.7, PAC min 15 "
        "micro-batches, drop_last; /nodrop keeps every sample); planner@size: fixed steps of "
        "that many tokens in data order (+former: the step former); 1D: megatron_dynamic_cp@ "
        "and verl_balanced@size (framework) schedule the same fixed global batches, with "
        "greedy+cp@size, on a cost model offering ulysses, cp and ring (Megatron on ring, verl on "
        "Ulysses); M = 2^20 tokens; vs X: "
        "tokens/s over published X; gap: epoch time / stream lower bound - 1 (+former rows: the "
        "bound of any reassignment to as many steps, which sees no packing granularity; "
        "own: the bound of the very steps the former formed)",
        caption_justify="left",
    )
    cols = [
        ("workload", "left"),
        ("method", "left"),
        ("Mtok/s", "right"),
        ("step M p50 [p10-p90]", "right"),
        ("dropped", "right"),
        ("vs bucket", "right"),
        ("vs PAC", "right"),
        ("gap", "right"),
        ("own", "right"),
        ("plan s", "right"),
    ]
    for col, just in cols:
        table.add_column(col, justify=just)
    last = None
    for r in doc["methods"]:
        if last is not None and r["workload"] != last:
            table.add_section()
        last = r["workload"]
        st = r["step_tokens"]
        table.add_row(
            r["workload"],
            r["method"],
            fmt_cell(None if r["tokens_per_s"] is None else r["tokens_per_s"] / 1e6, ".3f"),
            f"{_m(st['median'])} [{_m(st['p10'])}-{_m(st['p90'])}]",
            fmt_cell(r["dropped_share"], ".1%"),
            fmt_cell(r["speedup_vs_bucket"], ".2f", "x"),
            fmt_cell(r["speedup_vs_pac"], ".2f", "x"),
            fmt_cell(r["gap_to_bound"], ".1%"),
            fmt_cell(r.get("gap_to_steps_bound") if r.get("step_former") else None, ".1%"),
            fmt_cell(r["planning_s"], ".2f"),
        )
    return table


def render_fidelity_table(doc: dict):
    """Published methods over published bucket on this cost model, next to the paper's."""
    from rich.table import Table

    table = Table(
        title=f"published / published bucket, {doc['config']['num_gpus']} GPUs: this cost "
        "model vs the paper (README figure: 8 GPUs; paper table: 32 GPUs, ranges)",
        title_justify="left",
    )
    for col in ("workload", "method", "model", "paper"):
        table.add_column(col, justify="left" if col in ("workload", "method") else "right")
    for r in doc["fidelity"]:
        p = r["paper_ratio"]
        if isinstance(p, (list, tuple)):
            paper = "-".join("?" if x is None else f"{x:.2f}" for x in p) + "x"
        else:
            paper = fmt_cell(p, ".2f", "x")
        table.add_row(r["workload"], r["method"], fmt_cell(r["model_ratio"], ".2f", "x"), paper)
    return table


def render_matched_table(doc: dict):
    """The project's best planner at each published median step size, against the published
    methods, and what the stream bound allows; followed by the text frameworks' table when
    the run has 1D workloads (one renderable: `dcp-opt bench --stream` prints it as is)."""
    from rich.console import Group

    table = _matched_table(doc)
    return Group(table, render_framework_table(doc)) if doc.get("frameworks") else table


def _matched_table(doc: dict):
    from rich.table import Table

    table = Table(
        title="at matched tokens per optimizer step (the published median step): best project "
        "planner vs published, nothing dropped",
        title_justify="left",
        caption="bound vs X: the stream lower bound's tokens/s over published X (no plan of "
        "those steps does better)",
        caption_justify="left",
    )
    for col in ("workload", "matched to", "former", "method", "vs PAC", "vs bucket", "gap",
                "bound vs PAC", "bound vs bucket"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "method") else "right")
    for r in doc["matched"]:
        table.add_row(
            r["workload"],
            r["matched_to"],
            "yes" if r["step_former"] else "no",
            r["method"],
            fmt_cell(r["vs_pac"], ".2f", "x"),
            fmt_cell(r["vs_bucket"], ".2f", "x"),
            fmt_cell(r["gap_to_bound"], ".1%"),
            fmt_cell(r.get("bound_vs_pac"), ".2f", "x"),
            fmt_cell(r.get("bound_vs_bucket"), ".2f", "x"),
        )
    return table


def render_framework_table(doc: dict):
    """1D: greedy on the cost model with the three SP kinds against the text frameworks, at the
    same fixed steps (dcp_opt.analysis.stream_frameworks)."""
    from rich.table import Table

    table = Table(
        title="text frameworks at the same fixed steps (data order, ulysses + cp + ring "
        "offered): greedy+cp over each",
        title_justify="left",
        caption="megatron_dynamic_cp: Megatron-Core dev's dynamic CP schedule of each global "
        "batch; verl_balanced: verl's dynamic batch size (Karmarkar-Karp micro-batches, one "
        "Ulysses degree); each at the setting tuned on the first steps (setting columns); "
        "gap: to the stream bound over the three kinds. Megatron's groups are ring (its own "
        "kind: TransformerEngine's P2P ring), verl's Ulysses; greedy+cp chooses per group",
        caption_justify="left",
    )
    cols = ("workload", "step", "vs megatron", "vs verl", "vs greedy (ulysses)", "gap",
            "megatron gap", "verl gap", "megatron setting", "verl setting")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("workload", "step") else "right")
    for r in doc.get("frameworks", []):
        table.add_row(
            r["workload"],
            r["size"],
            fmt_cell(r["vs_megatron_dynamic_cp"], ".2f", "x"),
            fmt_cell(r["vs_verl_balanced"], ".2f", "x"),
            fmt_cell(r["vs_greedy"], ".3f", "x"),
            fmt_cell(r["gap_to_bound"], ".1%"),
            fmt_cell(r["megatron_dynamic_cp_gap_to_bound"], ".1%"),
            fmt_cell(r["verl_balanced_gap_to_bound"], ".1%"),
            _setting(r.get("megatron_dynamic_cp_setting")),
            _setting(r.get("verl_balanced_setting")),
        )
    return table


def _setting(setting) -> str:
    """A tuned setting in a cell: its values, short (max_seqlen_per_rank 8192 -> 8K)."""
    if not isinstance(setting, dict):
        return str(setting or "-")
    short = {"max_seqlen_per_rank": "M", "max_token_len_per_gpu": "len", "recompute": "",
             "balance": "", "checkpointing": "ckpt", "kind": ""}  # fmt: skip
    parts = []
    for k, v in setting.items():
        v = f"{v // 1024}K" if isinstance(v, int) and not isinstance(v, bool) else v
        parts.append(f"{short.get(k, k)}{'=' if short.get(k, k) else ''}{v}")
    return " ".join(parts)
