"""The cost of one phase of a plan, as the simulator asks it: every micro-batch's compute,
recompute, communication and memory in one call (CostModel.phase_costs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..batch import Batch


@dataclass(frozen=True)
class PhaseCosts:
    """Per micro-batch of a phase, in group order; `cuts[k]:cuts[k + 1]` are group k's."""

    compute_s: np.ndarray
    recompute_s: np.ndarray
    comm_s: np.ndarray
    memory_bytes: np.ndarray
    cuts: np.ndarray


def phase_costs(cost, groups, batch: Batch) -> PhaseCosts:
    """(compute, recompute, comm, memory) of every micro-batch of a phase's groups (each with
    at least one micro-batch), in group order, and the group boundaries: one feature sum for
    the phase, and one layer-time product per kind of group (degree, node span, speed, SP
    kind) on that kind's rows, as a per-kind cost call would do, so the sums round the same;
    the rest is elementwise, one call for the phase."""
    feats, row = cost.batch_features(batch), cost.batch_rows(batch)
    cluster = cost.cluster
    mbs = [mb for g in groups for mb in g.micro_batches]
    idx = [row[s] for mb in mbs for s in mb.sequence_ids]
    starts = np.cumsum([0] + [len(mb.sequence_ids) for mb in mbs[:-1]])
    f = np.add.reduceat(feats[idx], starts, axis=0)
    rec = np.array([mb.recompute_layers for mb in mbs])
    sizes = [len(g.micro_batches) for g in groups]
    cuts = np.cumsum([0] + sizes)
    kinds: dict[tuple, int] = {}
    kind_of = [
        kinds.setdefault(
            (
                g.degree,
                cluster.comm_class(g.start_rank, g.degree),  # node span, or placement
                cluster.group_speed(g.start_rank, g.degree),
                g.kind,  # the SP kind (cp_cost)
            ),
            len(kinds),
        )
        for g in groups
    ]
    kind_mb = np.repeat(kind_of, sizes)  # the kind of each micro-batch's group
    if not cost.takes_degree_vectors:  # a subclass reprices time per degree: call per kind
        return PhaseCosts(*_parts_per_kind(kinds, kind_mb, f, rec, cost), cuts)
    fwd, bwd = np.empty(len(mbs)), np.empty(len(mbs))
    # ring groups: their attention seconds, which the ring's transfers overlap (ring_cost)
    attn = np.zeros((2, len(mbs))) if any(k[3] == "ring" for k in kinds) else None
    for (d, _, _, sp), kid in kinds.items():
        sel = np.flatnonzero(kind_mb == kid) if len(kinds) > 1 else slice(None)
        fwd[sel], bwd[sel] = cost.layer_times(f[sel], d, **_kw(sp))
        if sp == "ring":
            attn[0, sel], attn[1, sel] = cost.attention_times(f[sel], d)
    d, spans, speed, sp = (_per_mb(col, kind_mb) for col in zip(*kinds, strict=True))
    tokens = f[:, -2]
    if not isinstance(sp, str):  # groups of several SP kinds in the phase: one call per kind
        return PhaseCosts(
            *_parts_per_sp_kind(fwd, bwd, tokens, d, rec, spans, speed, sp, cost, attn), cuts
        )
    kw = _kw(sp)
    c, r, m = cost.time_parts_from(
        fwd, bwd, tokens, d, rec, spans_nodes=spans, speed=speed, **kw, **_attn(sp, attn)
    )
    return PhaseCosts(c, r, m, cost.memory(tokens, d, rec, **kw), cuts)


def _attn(sp: str, attn, sel=slice(None)) -> dict:
    """time_parts_from's `attn` argument: a ring group's attention seconds, else none."""
    return {"attn": (attn[0, sel], attn[1, sel])} if sp == "ring" else {}


def _kw(sp: str) -> dict:
    """The cost calls' `kind` argument: none for Ulysses (the calls as before the kind)."""
    return {} if sp == "ulysses" else {"kind": sp}


def _parts_per_sp_kind(fwd, bwd, tokens, d, rec, spans, speed, sp, cost, attn):
    """time_parts_from and memory of a phase whose groups mix SP kinds, one call per kind."""
    parts = np.empty((4, len(tokens)))
    for k in set(sp.tolist()):
        sel = np.flatnonzero(sp == k)
        d_, sp_, sd_ = (x[sel] if np.ndim(x) else x for x in (d, spans, speed))
        c, r, m = cost.time_parts_from(
            fwd[sel], bwd[sel], tokens[sel], d_, rec[sel], spans_nodes=sp_, speed=sd_, kind=k,
            **_attn(k, attn, sel),
        )  # fmt: skip
        parts[0, sel], parts[1, sel], parts[2, sel] = c, r, m
        parts[3, sel] = cost.memory(tokens[sel], d_, rec[sel], k)
    return parts[0], parts[1], parts[2], parts[3]


def _per_mb(values: tuple, kind_mb: np.ndarray):
    """One value per micro-batch from one per kind; a scalar where every kind has the same
    (fewer numpy passes: no division by a speed of 1, no node-spanning share)."""
    return values[0] if len(set(values)) == 1 else np.array(values)[kind_mb]


def _parts_per_kind(kinds: dict, kind_mb, f, rec, cost):
    parts = np.empty((4, len(f)))
    for (d, spans, speed, sp), kid in kinds.items():
        sel = np.flatnonzero(kind_mb == kid) if len(kinds) > 1 else slice(None)
        kw = _kw(sp)
        c, r, m = cost.time_parts(f[sel], d, rec[sel], spans_nodes=spans, speed=speed, **kw)
        parts[0, sel], parts[1, sel], parts[2, sel] = c, r, m
        parts[3, sel] = cost.memory(f[sel, -2], d, rec[sel], **kw)
    return parts[0], parts[1], parts[2], parts[3]
