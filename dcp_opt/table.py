"""Per-sequence cost table: for every sequence and allowed degree, the fewest recomputed
layers that fit and the resulting time. Planners and bounds share it (computed once)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .cost import CostModel
from .cost.finite import check_table_finite


@dataclass(frozen=True)
class SeqTable:
    degrees: tuple[int, ...]
    feats: np.ndarray  # (n, F) additive features
    tokens: np.ndarray  # (n,)
    r_min: np.ndarray  # (n, D) fewest recomputed layers that fit alone; -1 = never
    time: np.ndarray  # (n, D) seconds alone at r_min (inf where infeasible)
    time_no_overhead: np.ndarray  # (n, D) the same less the per-micro-batch overhead
    # (n, D) the same less every per-micro-batch constant (overhead, per-layer kernel
    # launches, all-to-all latency): the part a packed micro-batch cannot share, so a sum of
    # these never exceeds the packed time (what a certified bound needs). A ring group's
    # exposed transfers are left out (packing may hide them: CostModel.additive_time).
    time_marginal: np.ndarray | None = None
    # (D,) seconds of an empty micro-batch at r = 0: the per-micro-batch constant that
    # sequences packed into one micro-batch pay once (ring: without its exposed latency).
    const: np.ndarray | None = None
    # (n, D) index into cost.sp_kinds of the kind whose time `time` is (None: Ulysses only).
    # With several kinds every time column is the least over the kinds (so bounds from the
    # table hold for plans of any kind) and r_min the fewest layers over them (Ulysses': cp
    # holds more, dcp_opt/cost/cp.py), a valid recompute for a Ulysses group.
    kind: np.ndarray | None = None

    @property
    def feasible(self) -> np.ndarray:
        return self.r_min >= 0

    def min_degree_index(self) -> np.ndarray:
        """Index of the smallest degree at which each sequence fits (argmax of first True)."""
        return np.argmax(self.feasible, axis=1)


def seq_table(batch: Batch, cost: CostModel) -> SeqTable:
    """Each degree priced at its cheapest placement: a lower bound of every placement, what
    bounds read."""
    return _table(batch, cost, worst=False)


def plan_table(batch: Batch, cost: CostModel) -> SeqTable:
    """What planners plan with: each degree priced at its costliest placement (class, on a
    fabric where a degree's placements differ: a 32-group inside a 72-GPU rack or across
    two), so that a plan is never slower than planned wherever its groups land; simulate()
    then prices each group where it is. Where every degree's placements cost alike (every
    cluster without a topology, every power-of-two fabric) it is seq_table itself."""
    if one_price_per_degree(cost.cluster):
        return seq_table(batch, cost)
    return _table(batch, cost, worst=True)


def one_price_per_degree(cluster) -> bool:
    """Whether every placement of each allowed degree costs the same (one comm class): the
    planners' tables are then exact wherever a group lands."""
    if cluster.topology is None:
        return True
    return all(len(cluster.comm_classes(d)) == 1 for d in cluster.allowed_degrees)


def _table(batch: Batch, cost: CostModel, worst: bool) -> SeqTable:
    key = ("plan_table" if worst else "table", batch.fingerprint())
    if len(cost.sp_kinds) > 1:
        return cost.memoised(key, lambda: _least_over_kinds(batch, cost, worst))
    return cost.memoised(key, lambda: _kind_table(batch, cost, "ulysses", worst))


def _least_over_kinds(batch: Batch, cost: CostModel, worst: bool = False) -> SeqTable:
    """The elementwise least over cost.sp_kinds of each kind's table, the argmin recorded."""
    tabs = [_kind_table(batch, cost, k, worst) for k in cost.sp_kinds]
    times = np.stack([t.time for t in tabs])
    kind = np.argmin(times, axis=0)
    least = np.take_along_axis(times, kind[None], axis=0)[0]
    over = cost.coeffs.microbatch_overhead_s
    marginal = np.min(np.stack([t.time_marginal for t in tabs]), axis=0)
    const = np.min(np.stack([t.const for t in tabs]), axis=0)
    r_min = tabs[0].r_min  # Ulysses': the fewest layers over the kinds
    return SeqTable(
        tabs[0].degrees, tabs[0].feats, tabs[0].tokens, r_min, least, least - over, marginal,
        const, kind,
    )  # fmt: skip


def _kind_table(batch: Batch, cost: CostModel, sp_kind: str, worst: bool = False) -> SeqTable:
    """The table of one SP kind (every group of that kind)."""
    feats = cost.batch_features(batch)
    tokens = feats[:, -2]
    degrees = cost.cluster.allowed_degrees
    over = cost.coeffs.microbatch_overhead_s
    # time is affine in the features, t(f) = t(0) + marginal(f), so marginal = t - t(0) at
    # the row's recompute level. Each cost call prices the sequences and, beside them, an
    # empty micro-batch at every level r = 0..L (level 0: the constant that packed
    # sequences share), for a block of degrees at once.
    levels = np.arange(cost.model.num_layers + 1)
    rows = np.vstack([feats, np.zeros((len(levels), feats.shape[1]))])
    step = max(1, BLOCK_ELEMENTS // len(rows))
    blocks = [
        _block(cost, tokens, rows, levels, degrees[a : a + step], sp_kind, worst)
        for a in range(0, len(degrees), step)
    ]
    for a, b in zip(range(0, len(degrees), step), blocks, strict=True):
        check_table_finite(cost, batch, degrees[a : a + step], b[0], b[1])
    r_min, time, marginal = (np.vstack([b[k] for b in blocks]).T.copy() for k in range(3))
    const = np.concatenate([b[3] for b in blocks])
    return SeqTable(degrees, feats, tokens, r_min, time, time - over, marginal, const)


# Elements of one block's arrays (64 KiB of floats): larger temporaries are fresh pages from
# the OS on every call (glibc mmap / trim thresholds), which costs more than a numpy call.
BLOCK_ELEMENTS = 8192


def _block(
    cost: CostModel, tokens, rows, levels, degrees: tuple[int, ...], sp_kind: str, worst: bool
):
    """(r_min, time, marginal) of a block of degrees, one row per degree (D, n), and the
    empty micro-batch's time (D,). Rows that fit nowhere (r = -1) are priced too, then
    masked: cheaper than copying the rows that fit."""
    n = len(tokens)
    caps = np.array([best_capacity(cost, d) for d in degrees])[:, None]
    kw = {} if sp_kind == "ulysses" else {"kind": sp_kind}
    r_min = cost.min_recompute(tokens, np.array(degrees)[:, None], caps, **kw)
    rec = np.hstack([r_min, np.broadcast_to(levels, (len(degrees), len(levels)))])
    t_all = cost.time_by_degree(rows, degrees, rec, **kw)
    if worst:  # a degree whose placements differ: its costliest class (time grows with comm)
        for i, d in enumerate(degrees):
            classes = cost.cluster.comm_classes(d)
            if len(classes) > 1:
                at = [cost.time(rows, d, rec[i], spans_nodes=k, **kw) for k in classes]
                t_all[i] = np.max(at, axis=0)
    t, empty = t_all[:, :n], t_all[:, n:]
    if sp_kind == "ring" or cost.shard_domain:  # marginal and constant without the
        # exposure (ring transfers, zero3 gathers), which packing can hide
        # (CostModel.additive_time; docs/cost-model.md, ring, Bounds): no comm classes
        add = cost.additive_time_by_degree(rows, degrees, rec, kind=sp_kind)
        t_add, empty = add[:, :n], add[:, n:]
    else:
        t_add = t
    ok = r_min >= 0
    marginal = np.where(ok, t_add - np.take_along_axis(empty, r_min, axis=1), np.inf)
    return r_min, np.where(ok, t, np.inf), marginal, empty[:, 0]


def best_capacity(cost: CostModel, d: int) -> float:
    """The most memory a degree-d group can have on any aligned placement. On a cluster with
    one memory size every placement has it: no scan (1024 GPUs have ~2000 placements)."""
    if cost.cluster.memory_per_rank is None:
        return cost.capacity(0, d)
    return max(cost.capacity(s, d) for s in cost.cluster.placements(d))
