"""A plan as a picture: a Gantt chart with one row per rank, and memory per rank beside it.

    fig = plot_plan(plan, batch, cost)          # a matplotlib Figure (no pyplot state)
    save_plan_png(plan, batch, cost, "plan.png")
    dcp-opt show plan.json --lengths FILE --cluster ... --out plan.png

What it draws, from `simulate()` (the same timeline the runtime follows):
- every micro-batch as a box over its group's ranks, split into compute (blue), recompute
  (orange) and all-to-all communication (red) in proportion to their predicted times; the
  box is outlined per group, solid in phase 0 and dashed in later phases, and labelled with
  its phase and degree where there is room; white lines separate consecutive micro-batches;
- idle time (light grey) wherever a rank waits, and the end-of-step gradient all-reduce
  (green);
- node boundaries (horizontal lines);
- on the right, peak memory per rank: model states and reserve (dark grey) plus activations
  (purple), against the usable capacity (dashed red line).

matplotlib is imported only inside these functions, so `import dcp_opt` never pulls it in.
"""

from __future__ import annotations

from pathlib import Path

from ..batch import Batch
from ..cluster import GB
from ..cost import CostModel
from ..plan import Plan
from ..simulate import Event, SimResult, simulate

COLORS = {
    "compute": "#4C72B0",
    "recompute": "#DD8452",
    "comm": "#C44E52",
    "idle": "#E6E6E6",
    "grad_sync": "#55A868",
    "states": "#606060",
    "activations": "#8172B3",
}


def plot_plan(plan: Plan, batch: Batch, cost: CostModel, *, title: str | None = None):
    """The Gantt chart and memory bars of `plan`, as a matplotlib Figure."""
    from matplotlib.figure import Figure

    sim = simulate(plan, batch, cost)
    n = cost.cluster.num_gpus
    height = min(2.0 + 0.28 * n, 30.0)
    fig = Figure(figsize=(14, height), layout="constrained")
    gs = fig.add_gridspec(1, 2, width_ratios=(5, 1))
    ax = fig.add_subplot(gs[0, 0])
    mem_ax = fig.add_subplot(gs[0, 1], sharey=ax)
    _draw_timeline(ax, sim, n)
    _draw_groups(ax, plan, sim)
    _draw_nodes(ax, cost)
    _draw_memory(mem_ax, sim, cost)
    ax.set_ylim(n, 0)  # rank 0 on top
    ax.set_xlim(0, sim.step_time_s * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("rank")
    ax.set_yticks([r + 0.5 for r in range(n)], [str(r) for r in range(n)], fontsize=7)
    fig.suptitle(title or _title(plan, sim, cost), fontsize=10)
    _legend(fig, cost)
    return fig


def save_plan_png(
    plan: Plan, batch: Batch, cost: CostModel, out: str | Path, *, dpi: int = 110
) -> Path:
    fig = plot_plan(plan, batch, cost)
    fig.savefig(out, dpi=dpi)
    return Path(out)


def _title(plan: Plan, sim: SimResult, cost: CostModel) -> str:
    return (
        f"{plan.planner or 'plan'} on {cost.cluster.name} ({cost.model.name}): "
        f"step {sim.step_time_s:.3f} s, imbalance {sim.imbalance:.1%}, "
        f"communication {sim.comm_share:.1%} of busy time, "
        f"{len(plan.phases)} phase(s), {plan.num_micro_batches} micro-batches"
    )


def _draw_timeline(ax, sim: SimResult, n: int) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    # Idle underneath everything; busy boxes cover it where a rank works.
    back = [
        Rectangle((0, 0), sim.finish_s, n, color=COLORS["idle"]),
        Rectangle((sim.finish_s, 0), sim.grad_sync_s, n, color=COLORS["grad_sync"]),
    ]
    ax.add_collection(PatchCollection(back, match_original=True))
    # One box per micro-batch over its group's ranks, split in three in time.
    for part in ("compute", "recompute", "comm"):
        boxes = []
        for e in sim.events:
            left, width = _segment(e, part)
            if width > 0:
                boxes.append(Rectangle((left, e.start_rank), width, e.degree))
        ax.add_collection(PatchCollection(boxes, facecolor=COLORS[part], edgecolor="none"))


def _segment(e: Event, part: str) -> tuple[float, float]:
    """Where each part of a micro-batch sits inside its box: compute, recompute, comm."""
    if part == "compute":
        return e.start_s, e.compute_s
    if part == "recompute":
        return e.start_s + e.compute_s, e.recompute_s
    return e.start_s + e.compute_s + e.recompute_s, e.comm_s


def _draw_groups(ax, plan: Plan, sim: SimResult) -> None:
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.patches import Rectangle

    span = sim.step_time_s
    by_group: dict[tuple[int, int, int], list[Event]] = {}
    for e in sim.events:
        by_group.setdefault((e.phase, e.start_rank, e.degree), []).append(e)
    boxes = {True: [], False: []}  # phase 0 -> solid outline, later phases -> dashed
    cuts = []
    for (phase, start, degree), events in by_group.items():
        t0, t1 = events[0].start_s, events[-1].end_s
        boxes[phase == 0].append(Rectangle((t0, start), t1 - t0, degree))
        cuts += [[(e.start_s, start), (e.start_s, start + degree)] for e in events[1:]]
        if (t1 - t0) > 0.06 * span:
            label = f"P{phase} d{degree}: {len(events)} mb"
            ax.text(
                t0 + 0.005 * span,
                start + degree / 2,
                label,
                va="center",
                fontsize=6.5,
                color="white",
                clip_on=True,
            )
    ax.add_collection(LineCollection(cuts, colors="white", linewidths=0.6))
    for solid, patches in boxes.items():
        ax.add_collection(
            PatchCollection(
                patches,
                facecolor="none",
                edgecolor="black",
                linewidth=0.9,
                linestyle="-" if solid else "--",
            )
        )


def _draw_nodes(ax, cost: CostModel) -> None:
    c = cost.cluster
    if c.topology is not None:  # the fabric's domains (NVLink domain, leaf, ...) by level
        colors = ("black", "crimson", "darkviolet", "darkorange")
        for rank, level in c.topology.domain_starts():
            ax.axhline(rank, color=colors[min(level, 3)], linewidth=1.2 + 1.2 * level)
        return
    for k in range(1, c.num_nodes):
        ax.axhline(k * c.gpus_per_node, color="black", linewidth=1.6)


def _draw_memory(ax, sim: SimResult, cost: CostModel) -> None:
    n = sim.num_ranks
    ranks = list(range(n))
    fixed = cost.fixed_bytes() / GB
    peak = sim.peak_memory_bytes / GB
    ax.barh(ranks, [fixed] * n, height=0.9, align="edge", color=COLORS["states"])
    ax.barh(ranks, peak - fixed, left=fixed, height=0.9, align="edge", color=COLORS["activations"])
    caps = [cost.capacity(r, 1) / GB for r in ranks]
    ax.plot(caps + [caps[-1]], list(range(n + 1)), drawstyle="steps-post", color="red", ls="--")
    ax.set_xlim(0, max(caps) * 1.08)
    ax.set_xlabel("peak memory (GB)")
    ax.tick_params(labelleft=False)


def _legend(fig, cost: CostModel) -> None:
    from matplotlib.patches import Patch

    # the step's world collectives as runtime/sharding.py runs the mode (CostModel.grad_sync_time)
    sync = "gradient all-reduce"
    if cost.optimizer_sharding != "none":
        sync = "all-gather + reduce-scatter + closing step"

    labels = {
        "compute": "compute",
        "recompute": "recompute",
        "comm": "all-to-all",
        "idle": "idle",
        "grad_sync": sync,
        "states": "model states + reserve",
        "activations": "activations",
    }
    handles = [Patch(color=COLORS[k], label=v) for k, v in labels.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
