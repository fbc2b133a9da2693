"""Micro-batch composition and columns: which sequences train together, and which column
(a group of `degree` units, the same on every stage) runs each micro-batch.

Composition: longest-processing-time packing (Graham 1969) of the sequences, heaviest first
by their additive seconds at the degree (instance.Instance.additive), into K micro-batches
of at most `max_tokens` tokens each (a sequence that fits no open one opens another).
Columns: the micro-batches, heaviest first, each to the column with the least seconds so
far (LPT again); under the interleaved schedule each column takes exactly K / C of them
(its count must be a multiple of p)."""

from __future__ import annotations

import numpy as np

from .instance import Column, Instance


def pack(inst: Instance, d: int, num_bins: int, max_tokens: float, ids=None) -> list[list[int]]:
    """LPT of the sequences `ids` (default all) into num_bins micro-batches: each, heaviest
    first, to the least loaded one with room for its tokens (ties: the lowest index), or a
    new one when none has."""
    a = inst.additive(d)
    tok = inst.tokens
    ids = np.arange(len(a)) if ids is None else np.asarray(ids, dtype=int)
    order = ids[np.argsort(-a[ids], kind="stable")]
    size = num_bins + len(order)  # at most one new micro-batch per sequence
    load, room = np.full(size, np.inf), np.full(size, float(max_tokens))
    load[:num_bins] = 0.0
    used = num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i, t, w in zip(order.tolist(), tok[order].tolist(), a[order].tolist(), strict=True):
        k = int(np.argmin(np.where(room[:used] >= t, load[:used], np.inf))) if used else 0
        if not used or room[k] < t:  # no open micro-batch has room: open one
            k, used = used, used + 1
            load[k] = 0.0
            bins.append([])
        bins[k].append(i)
        room[k] -= t
        load[k] += w
    return [b for b in bins if b]


def columns(inst: Instance, d: int, mbs: list[list[int]], *, equal_counts: bool = False,
            start: int = 0, units: int | None = None):  # fmt: skip
    """Draft columns of degree d over `units` of a stage's units from `start` (default all:
    start units 0, d, 2d, ...)."""
    n = (inst.layout.num_units if units is None else units) // d
    a = inst.additive(d)
    w = [float(a[mb].sum()) for mb in mbs]
    cap = -(-len(mbs) // n) if equal_counts else len(mbs)
    load, out = [0.0] * n, [[] for _ in range(n)]
    for k in sorted(range(len(mbs)), key=lambda k: -w[k]):
        c = min((c for c in range(n) if len(out[c]) < cap), key=lambda c: load[c])
        out[c].append(mbs[k])
        load[c] += w[k]
    p = inst.layout.num_stages
    return [Column(d, start + c * d, col, np.zeros((len(col), p), dtype=int)) for c, col in
            enumerate(out) if col]  # fmt: skip


def split_by_degree(inst: Instance, hi: int, lo: int, lo_tokens: float, units_hi: int):
    """Mixed columns (Megatron dev's dynamic CP gives each group its own size; here each
    column keeps one): sequences longer than lo_tokens, and then the longest others while
    the high-degree units are the less loaded per unit, to columns of degree hi on the first
    units_hi units; the rest to columns of degree lo. (hi ids, lo ids)."""

    def make():
        tok = inst.tokens
        order = np.argsort(-tok, kind="stable")
        k = int((tok[order] > lo_tokens).sum())
        forced = float((inst.additive(hi)[order[:k]] * hi).sum())
        moved = (inst.additive(hi)[order[k:]] * hi).cumsum()  # GPU-s with ..i moved
        stay = (inst.additive(lo)[order[k:]] * lo)[::-1].cumsum()[::-1]  # with i.. kept
        return order, k, forced, moved, stay

    order, k, forced, moved, stay = inst.memo(("split", hi, lo, lo_tokens), make)
    n = inst.layout.num_units
    over = (forced + moved) / units_hi - stay / (n - units_hi) >= 0
    j = k + int(np.searchsorted(over, True))
    return order[:j].tolist(), order[j:].tolist()


def consecutive(inst: Instance, d: int, max_tokens: float) -> list[list[int]]:
    """DynaPipe's composition (Jiang et al., EuroSys'24, sec. 4): the sequences sorted by
    length, cut into consecutive micro-batches minimising sum(t) / C + (p - 1) max(t) over
    the C columns of degree d, by scanning 8 caps on max(t) of 1 to 64 x the longest
    sequence's time (for a cap, greedy cuts make the fewest micro-batches, and sum(t) grows
    only by the per-micro-batch constant)."""
    lay = inst.layout
    p, n = lay.num_stages, lay.num_units // d
    c0 = inst.per_micro_batch(d)
    idx = np.argsort(inst.tokens, kind="stable")
    a, tok = inst.additive(d)[idx], inst.tokens[idx]
    ca, ct = np.concatenate([[0.0], np.cumsum(a)]), np.concatenate([[0.0], np.cumsum(tok)])
    best, best_v = None, float("inf")
    for limit in [float(a.max()) * x for x in (1, 1.5, 2, 3, 4, 8, 16, 64)]:
        cuts, i = [0], 0
        while i < len(a):  # the longest run from i within the cap and the tokens, >= 1
            j = min(np.searchsorted(ca, ca[i] + limit, side="right"),
                    np.searchsorted(ct, ct[i] + max_tokens, side="right")) - 1  # fmt: skip
            i = max(int(j), i + 1)
            cuts.append(i)
        times = np.diff(ca[cuts]) + c0
        v = times.sum() / n + (p - 1) * times.max()
        if v < best_v:
            best, best_v = cuts, v
    return [idx[x:y].tolist() for x, y in zip(best[:-1], best[1:], strict=True)]
