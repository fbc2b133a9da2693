"""How `dcp-opt whatif` shows its document (dcp_opt.analysis.whatif): rich tables, a one-paragraph
recommendation, and a six-panel matplotlib figure (eight with the SP kind map: where cp or
Ulysses wins over length x degree, and the kinds the best planner used).

rich and matplotlib are imported only inside the functions that draw, so importing this
module costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DcpOptError


def _x(s: dict | None, key: str = "median") -> str:
    return "-" if s is None else f"{s[key]:.2f}x"


def _spread_text(s: dict | None) -> str:
    return "-" if s is None else f"{s['median']:.2f}x [{s['p10']:.2f}, {s['p90']:.2f}]"


def _tokens(n: float) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.1f}M"
    return f"{n / 1024:.0f}K" if n >= 1024 else f"{n:.0f}"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table (for notebooks: display(Markdown(...)))."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def recommendation(doc: dict) -> list[str]:
    """Plain sentences: the best planner, its speedup, the degrees to provision, memory."""
    best = doc["best_planner"]
    if best is None:
        errors = [f"{r['planner']}: {r['errors'][0]}" for r in doc["planners"] if r["errors"]]
        return ["no planner gave a valid plan on any batch"] + errors[:5]
    row = next(r for r in doc["planners"] if r["planner"] == best)
    sp = row["speedup"]
    out = [
        f"best planner: {best}, {_x(sp)} over bucket parallel (median over "
        f"{doc['config']['num_batches']} batches; p10 {_x(sp, 'p10')}, p90 {_x(sp, 'p90')})"
        if sp
        else f"best planner: {best} (bucket gave no valid plan to compare with)"
    ]
    used = [d for d in doc["degrees"] if d["gpu_time_share"] >= 0.01]
    parts = [
        f"{d['degree']} ({d['gpu_time_share']:.0%} of GPU-time, {d['sequence_share']:.0%} of "
        f"sequences, median {_tokens(d['median_tokens'])} tokens)"
        for d in used
    ]
    out.append("SP degrees it uses: " + "; ".join(parts))
    if row["min_headroom"] is not None:
        out.append(
            f"memory: peak {row['peak_memory_gb']['max']:.1f} GB of {row['capacity_gb']:.1f} GB "
            f"usable ({row['min_headroom']:.1%} headroom on the fullest rank of the worst batch)"
        )
    if "kind_map" in doc:
        shares = doc["kind_map"]["best_planner_kind_shares"]
        out.append(
            "SP kinds it uses: "
            + ", ".join(f"{k} {v:.0%} of GPU-time" for k, v in shares.items())
            + " (the kind map shows where each wins)"
        )
    return out


def render_tables(doc: dict) -> list:
    """rich Tables: planners, degrees of the best planner, the two sweeps."""
    from rich.table import Table

    cfg, dist = doc["config"], doc["distribution"]
    t = Table(
        title=f"dcp-opt whatif: {dist['source']} ({dist['kind']}, mean "
        f"{_tokens(dist['mean_tokens'])} tokens, max {_tokens(dist['max_tokens'])}) - "
        f"{cfg['model']} on {cfg['cluster']}, {cfg['num_batches']} batches of "
        f"{cfg['num_gpus']} x {_tokens(cfg['tokens_per_gpu'])} tokens",
        title_justify="left",
        caption="vs bucket: median \\[p10, p90] over batches of bucket's step time / this "
        "planner's; peak: fullest rank, worst batch; headroom: 1 - peak / usable capacity",
        caption_justify="left",
    )
    for col in ("planner", "step (s)", "tokens/s", "vs bucket", "peak GB", "headroom",
                "recompute", "plan (ms)", "valid"):  # fmt: skip
        t.add_column(col, justify="left" if col == "planner" else "right")
    for r in doc["planners"]:
        mark = " *" if r["planner"] == doc["best_planner"] else ""
        valid = f"{r['num_valid']}/{r['num_batches']}"
        peak = r["peak_memory_gb"]
        t.add_row(
            r["planner"] + mark,
            _fmt(r["median_step_time_s"], ".3f"),
            _fmt(r["median_tokens_per_s"], ",.0f"),
            _spread_text(r["speedup"]),
            "-" if peak is None else f"{peak['max']:.1f}/{r['capacity_gb']:.1f}",
            _fmt(r["min_headroom"], ".1%"),
            _fmt(r["recompute_share"], ".1%"),
            _fmt(r["median_wall_time_s"] * 1e3, ".1f"),
            valid if r["num_valid"] == r["num_batches"] else f"[red]{valid}[/red]",
        )
    return [
        t,
        _degree_table(doc),
        _sweep_table(doc, "sweep_gpus"),
        _sweep_table(doc, "sweep_inter_bw"),
        *([_kind_table(doc["kind_map"])] if "kind_map" in doc else []),
    ]


def _kind_cell(c: dict) -> str:
    """cp / Ulysses (and "|" ring / Ulysses where the map has ring), green where not Ulysses
    wins; "<kind> only" where only that kind fits."""
    ratios = [c[f"{k}_over_ulysses"] for k in ("cp", "ring") if f"{k}_s" in c]
    if all(r is None for r in ratios):
        return {"ulysses": "Ulysses only", None: "-"}.get(c["winner"], f"{c['winner']} only")
    text = "|".join("-" if r is None else f"{r:.2f}" for r in ratios)
    return f"[green]{text}[/green]" if c["winner"] not in ("ulysses", None) else text


def _kind_table(km: dict):
    from rich.table import Table

    t = Table(
        title="where each SP kind wins: cp time / Ulysses time of one sequence alone",
        title_justify="left",
        caption="green: cp faster; each kind at its fewest recomputed layers that fit",
        caption_justify="left",
    )
    t.add_column("tokens", justify="right")
    t.add_column("token share", justify="right")
    for d in km["degrees"]:
        t.add_column(f"d={d}", justify="right")
    shares = km["token_share"] or [None] * len(km["lengths"])
    for n, share, row in zip(km["lengths"], shares, km["cells"], strict=True):
        t.add_row(_tokens(n), _fmt(share, ".1%"), *(_kind_cell(c) for c in row))
    return t


def _degree_table(doc: dict):
    from rich.table import Table

    t = Table(title=f"SP degrees used by {doc['best_planner']} (all batches)", title_justify="left")
    for col in ("degree", "GPU-time", "sequences", "tokens", "tokens per sequence (median)",
                "recomputed"):  # fmt: skip
        t.add_column(col, justify="right")
    for d in doc["degrees"]:
        t.add_row(
            str(d["degree"]),
            f"{d['gpu_time_share']:.1%}",
            f"{d['sequence_share']:.1%}",
            f"{d['token_share']:.1%}",
            f"{_tokens(d['min_tokens'])}-{_tokens(d['max_tokens'])} "
            f"({_tokens(d['median_tokens'])})",
            f"{d['recompute_fraction']:.1%}",
        )
    return t


def _sweep_table(doc: dict, key: str):
    from rich.table import Table

    rows = doc[key]
    gpus = key == "sweep_gpus"
    n = doc["config"]["sweep_batches"]
    t = Table(
        title=(
            f"speedup over bucket vs GPU count (token budget scales with it; {n} batches)"
            if gpus
            else f"speedup over bucket vs inter-node bandwidth on {doc['config']['cluster']} "
            f"({n} batches)"
        ),
        title_justify="left",
    )
    t.add_column("GPUs" if gpus else "inter-node bw", justify="right")
    planners = list(rows[0]["speedup"]) if rows else []
    for p in planners:
        t.add_column(p, justify="right")
    t.add_column("note")
    for r in rows:
        label = (
            str(r["num_gpus"]) if gpus else f"x{r['scale']:g} ({r['inter_node_bw_gbps']:.1f} GB/s)"
        )
        t.add_row(label, *[_spread_text(r["speedup"][p]) for p in planners], r["note"])
    return t


# ---- the figure --------------------------------------------------------------------------------
def plot_whatif(doc: dict):
    """Six panels: input distribution, speedups, degrees, memory, GPU sweep, bandwidth sweep."""
    from matplotlib.figure import Figure

    kinds = "kind_map" in doc
    fig = Figure(figsize=(20 if kinds else 15, 8.5), layout="constrained")
    axes = fig.subplots(2, 4 if kinds else 3)
    if kinds:
        _plot_kind_map(axes[0, 3], doc["kind_map"])
        _plot_kind_shares(axes[1, 3], doc)
    _plot_input(axes[0, 0], doc)
    _plot_speedups(axes[0, 1], doc)
    _plot_degrees(axes[0, 2], doc)
    _plot_memory(axes[1, 0], doc)
    _plot_sweep(axes[1, 1], doc, "sweep_gpus")
    _plot_sweep(axes[1, 2], doc, "sweep_inter_bw")
    cfg, dist = doc["config"], doc["distribution"]
    fig.suptitle(
        f"what-if: {dist['source']} - {cfg['model']} on {cfg['cluster']}; "
        f"best planner {doc['best_planner']}",
        fontsize=11,
    )
    return fig


def save_whatif_png(doc: dict, out: str | Path, *, dpi: int = 100) -> Path:
    fig = plot_whatif(doc)
    try:
        fig.savefig(out, dpi=dpi)
    except (OSError, ValueError) as e:  # unwritable path or unknown image format
        raise DcpOptError(f"plot {str(out)!r}: cannot write ({e})") from None
    return Path(out)


def _plot_input(ax, doc: dict) -> None:
    h = doc["distribution"]["token_histogram"]
    edges = h["edges"]
    x = range(len(edges) - 1)
    ax.bar([i - 0.2 for i in x], h["sequence_share"], width=0.4, label="sequences")
    ax.bar([i + 0.2 for i in x], h["token_share"], width=0.4, label="tokens")
    ax.set_xticks(list(x), [_tokens(e) for e in edges[:-1]], rotation=45, fontsize=7)
    ax.set_xlabel("tokens per sequence (bin start, powers of two)")
    ax.set_ylabel("share")
    ax.set_title("input distribution", fontsize=10)
    ax.legend(fontsize=8)


def _plot_speedups(ax, doc: dict) -> None:
    rows = [r for r in doc["planners"] if r["speedup"]]
    y = range(len(rows))
    med = [r["speedup"]["median"] for r in rows]
    lo = [r["speedup"]["median"] - r["speedup"]["p10"] for r in rows]
    hi = [r["speedup"]["p90"] - r["speedup"]["median"] for r in rows]
    colors = ["C3" if r["planner"] == doc["best_planner"] else "C0" for r in rows]
    ax.barh(list(y), med, color=colors, alpha=0.8)
    ax.errorbar(med, list(y), xerr=[lo, hi], fmt="none", ecolor="black", capsize=3)
    ax.axvline(1.0, color="grey", ls="--")
    ax.set_yticks(list(y), [r["planner"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over bucket (median, p10-p90 whiskers)")
    ax.set_title("predicted speedup per planner", fontsize=10)


def _plot_degrees(ax, doc: dict) -> None:
    rows = doc["degrees"]
    x = range(len(rows))
    for k, (key, label) in enumerate(
        [("gpu_time_share", "GPU-time"), ("sequence_share", "sequences"), ("token_share", "tokens")]
    ):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[key] for r in rows], width=0.27, label=label)
    ax.set_xticks(list(x), [str(r["degree"]) for r in rows])
    ax.set_xlabel("SP degree")
    ax.set_ylabel("share")
    ax.set_title(f"degrees used by {doc['best_planner']}", fontsize=10)
    ax.legend(fontsize=8)


def _plot_memory(ax, doc: dict) -> None:
    rows = [r for r in doc["planners"] if r["peak_memory_gb"]]
    y = list(range(len(rows)))
    fixed = [r["fixed_memory_gb"] for r in rows]
    act = [r["peak_memory_gb"]["max"] - f for r, f in zip(rows, fixed, strict=True)]
    ax.barh(y, fixed, color="#606060", label="model states + reserve")
    ax.barh(y, act, left=fixed, color="#8172B3", label="activations at peak")
    if rows:
        cap = rows[0]["capacity_gb"]
        ax.axvline(cap, color="red", ls="--", label="usable capacity")
        ax.set_xlim(0, cap * 1.05)
    ax.set_yticks(y, [r["planner"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("peak memory of the fullest rank, worst batch (GB)")
    ax.set_title("memory headroom", fontsize=10)
    # below the axes: the bars reach the capacity line, so inside it would hide them
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3)


def _plot_sweep(ax, doc: dict, key: str) -> None:
    rows = doc[key]
    gpus = key == "sweep_gpus"
    xs = [r["num_gpus"] if gpus else r["inter_node_bw_gbps"] for r in rows]
    planners = list(rows[0]["speedup"]) if rows else []
    for p in planners:
        pts = [(x, r["speedup"][p]) for x, r in zip(xs, rows, strict=True) if r["speedup"][p]]
        if not pts:
            continue
        px = [x for x, _ in pts]
        ax.plot(px, [s["median"] for _, s in pts], marker="o", label=p)
        ax.fill_between(px, [s["p10"] for _, s in pts], [s["p90"] for _, s in pts], alpha=0.2)
    ax.axhline(1.0, color="grey", ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        xs, [str(r["num_gpus"]) if gpus else f"{x:g}" for x, r in zip(xs, rows, strict=True)]
    )
    ax.set_xlabel("GPUs" if gpus else "inter-node bandwidth per GPU (GB/s)")
    ax.set_ylabel("speedup over bucket")
    ax.set_title(
        "speedup vs GPU count (weak scaling)" if gpus else "speedup vs inter-node bandwidth",
        fontsize=10,
    )
    if ax.get_legend_handles_labels()[0]:  # no planner besides bucket: nothing to label
        ax.legend(fontsize=8)


def _plot_kind_map(ax, km: dict) -> None:
    """log2(cp / Ulysses) per (length, degree), the least of cp's and ring's where the map
    has ring: blue where cp (or ring) wins, red where Ulysses does,
    each cell labelled with the ratio; grey where only one kind fits (labelled) or none."""
    import numpy as np

    def best(c):  # the fastest other kind's ratio (ring's too where the map has it)
        rs = [c[k] for k in ("cp_over_ulysses", "ring_over_ulysses") if c.get(k) is not None]
        return min(rs) if rs else np.nan

    ratio = np.array([[best(c) for c in row] for row in km["cells"]])
    lim = max(float(np.nanmax(np.abs(np.log2(ratio)))) if np.isfinite(ratio).any() else 1, 0.1)
    im = ax.imshow(np.log2(ratio), cmap="coolwarm", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_facecolor("#d0d0d0")
    for i, row in enumerate(km["cells"]):
        for j, c in enumerate(row):
            text = _kind_cell(c).replace("[green]", "").replace("[/green]", "")
            ax.text(j, i, text.replace(" only", "\nonly"), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(km["degrees"])), [str(d) for d in km["degrees"]])
    shares = km["token_share"] or [None] * len(km["lengths"])
    labels = [_tokens(n) + ("" if s is None else f" ({s:.0%})") for n, s in zip(km["lengths"], shares, strict=True)]  # fmt: skip
    ax.set_yticks(range(len(km["lengths"])), labels, fontsize=7)
    ax.set_xlabel("SP degree")
    ax.set_ylabel("tokens per sequence (token share)")
    ax.set_title("cp time / Ulysses time (blue: cp wins)", fontsize=10)
    ax.figure.colorbar(im, ax=ax, label="log2(cp / Ulysses)", shrink=0.8)


def _plot_kind_shares(ax, doc: dict) -> None:
    shares = doc["kind_map"]["best_planner_kind_shares"]
    ax.bar(list(shares), list(shares.values()), color=["C0", "C1"][: len(shares)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of GPU-time")
    ax.set_title(f"SP kinds used by {doc['best_planner']}", fontsize=10)
