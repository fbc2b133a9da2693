"""Micro-batch composition and columns: which sequences train together, and which column
(a group of `degree` units, the same on every stage) runs each micro-batch.

Composition: longest-processing-time packing (Graham 1969) of the sequences, heaviest first
by their additive seconds at the degree (instance.Instance.additive), into K micro-batches
of at most `max_tokens` tokens each (a sequence that fits no open one opens another).
Columns: the micro-batches, heaviest first, each to the column with the least seconds so
far (LPT again); under the interleaved schedule each column takes exactly K / C of them
(its count must be a multiple of p)."""

from __future__ import annotations

import heapq

import numpy as np

from .instance import Column, Instance


def pack(inst: Instance, d: int, num_bins: int, max_tokens: float) -> list[list[int]]:
    a = inst.additive(d)
    tok = inst.tokens.tolist()
    least = min(tok)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    room = [float(max_tokens)] * num_bins
    heap = [(0.0, k) for k in range(num_bins)]
    order = np.argsort(-a, kind="stable").tolist()
    al = a.tolist()
    for i in order:
        skipped = []
        while heap and room[heap[0][1]] < tok[i]:
            x = heapq.heappop(heap)
            if room[x[1]] >= least:  # a bin no sequence fits any more is dropped
                skipped.append(x)
        if heap:
            load, k = heapq.heappop(heap)
        else:  # no open micro-batch has room: open one
            bins.append([])
            room.append(float(max_tokens))
            load, k = 0.0, len(bins) - 1
        bins[k].append(i)
        room[k] -= tok[i]
        if room[k] >= least:
            heapq.heappush(heap, (load + al[i], k))
        for x in skipped:
            heapq.heappush(heap, x)
    return [b for b in bins if b]


def columns(inst: Instance, d: int, mbs: list[list[int]], *, equal_counts: bool = False):
    """Draft columns of degree d over one stage's units (start units 0, d, 2d, ...)."""
    n = inst.layout.num_units // d
    a = inst.additive(d)
    w = [float(a[mb].sum()) for mb in mbs]
    cap = -(-len(mbs) // n) if equal_counts else len(mbs)
    load, out = [0.0] * n, [[] for _ in range(n)]
    for k in sorted(range(len(mbs)), key=lambda k: -w[k]):
        c = min((c for c in range(n) if len(out[c]) < cap), key=lambda c: load[c])
        out[c].append(mbs[k])
        load[c] += w[k]
    p = inst.layout.num_stages
    return [Column(d, c * d, col, np.zeros((len(col), p), dtype=int)) for c, col in
            enumerate(out) if col]  # fmt: skip


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
