"""How `dcp-opt bench` shows its document (dcp_opt.analysis.bench): a rich table and error lines.

rich is imported only inside render_table, so importing this module costs nothing.
"""

from __future__ import annotations

# What the one-batch table is, and which published settings it changes (docs/baselines.md).
ONE_BATCH_FRAMING = (
    "Framing: one fixed 2M-token batch per step for every method. bucket, dcp_intra, "
    "dcp_inter and dcp_inter_pac are the published profile forced into a fixed batch, not the "
    "published methods: memory cap 0.9 (published 0.7), no drop_last (published on), PAC's "
    "minimum accumulation 2 (published 15), one optimizer step per batch (published: the "
    "sampler forms its own steps over the epoch, and none from one such batch), unbiased "
    "sp-size draw. The published methods as published: `dcp-opt bench --stream`."
)


def fmt_cell(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def render_table(doc: dict):
    """A rich Table of the summary rows (rich is imported only here)."""
    from rich.table import Table

    cfg = doc["config"]
    table = Table(
        title=f"dcp-opt bench: {cfg['cluster']} ({cfg['num_gpus']} GPUs), "
        f"{cfg['num_batches']} batches per workload, medians over batches",
        title_justify="left",
        caption="vs X: median over batches of X's step time / this planner's; gap: step time / "
        "tightest lower bound - 1; plan: planner wall time; valid: plans passing validate(). "
        f"{ONE_BATCH_FRAMING}",
        caption_justify="left",
    )
    for col, just in [
        ("workload", "left"),
        ("planner", "left"),
        ("step (s)", "right"),
        ("vs bucket", "right"),
        ("vs static", "right"),
        ("imbalance", "right"),
        ("gap", "right"),
        ("plan (ms)", "right"),
        ("valid", "right"),
    ]:
        table.add_column(col, justify=just)
    last = None
    for row in doc["summary"]:
        if last is not None and row["workload"] != last:
            table.add_section()
        last = row["workload"]
        valid = f"{row['num_valid']}/{row['num_batches']}"
        table.add_row(
            row["workload"],
            row["planner"],
            fmt_cell(row["median_step_time_s"], ".3f"),
            fmt_cell(row["median_speedup_vs_bucket"], ".2f", "x"),
            fmt_cell(row["median_speedup_vs_static_tuned"], ".2f", "x"),
            fmt_cell(row["median_imbalance"], ".1%"),
            fmt_cell(row["median_gap"], ".1%"),
            fmt_cell(
                None if row["median_wall_time_s"] is None else row["median_wall_time_s"] * 1e3,
                ".1f",
            ),
            valid if row["all_valid"] else f"[red]{valid}[/red]",
        )
    return table


def error_lines(doc: dict) -> list[str]:
    """One line per (workload, planner) that had errors, plus the bench's warnings."""
    out = [
        f"{r['workload']} / {r['planner']}: {r['num_errors']} error(s): {r['errors'][0]}"
        for r in doc["summary"]
        if r["errors"]
    ]
    if doc["skipped_planners"]:
        out.append(f"not built in this checkout, skipped: {', '.join(doc['skipped_planners'])}")
    return out + doc["warnings"]
