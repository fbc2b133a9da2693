"""Certified lower bounds of a pipeline's finish (makespan.py's graph), proved here and
checked in tests/test_pipeline_bound.py against every order (exhaustively) and random plans.

Column bound (fixed micro-batches, any order, gpipe, 1f1b or interleaved). Physical stage s
runs all its passes one at a time: W_s = sum_k sum_{c on s} (f[c, k] + b[c, k]). Its first
pass is a forward of chunk 0 (virtual stage s) of some k, which needs that k's forwards on
virtual stages 0..s-1 and their transfers: head_s = min_k sum_{c<s} (f[c, k] + x[c, k]).
Its last pass is a backward of some chunk c' >= s of some k, after which that k's backwards
on virtual stages c'-1..0 still run: tail_s = min_k sum_{c<s} (b[c, k] + x[c, k]). So

    finish >= max_s (head_s + W_s + tail_s)                                         (1)
    finish >= max_k sum_c (f[c, k] + b[c, k]) + 2 sum_{c<V-1} x[c, k]                (2)

(2) is one micro-batch's chain. With stage-uniform costs and no transfers (1) is the
textbook sum(t) + (p - 1)(min f + min b) and (2) is p max t.

Under 1F1B (v = 1) a window adds to (1): on stage s, between the start of F(s, k) and the
end of B(s, k) lie k's round trip R_s(k) = sum_{c>=s} (f[c, k] + b[c, k]) + 2 sum_{s<=c<V-1}
x[c, k], and stage s runs only the forwards of the next w = p - s - 1 micro-batches and the
backwards of the previous w in between (actions.one_f_one_b_actions: warm-up w, then one
forward, one backward). So stage s idles there at least R_s(k) - (f + b)[s, k] - (the w
largest other forwards + the w largest other backwards on s), whatever the order, and that
idle time is inside [first pass, last pass]:

    finish >= head_s + W_s + tail_s + max(0, max_k idle_s(k))                      (3)

Batch bound (every plan of the batch: any composition, columns, degrees, order,
recompute). On stage s, unit u's passes take W_s(u) in total, between its first pass
(>= head_s) and its last (<= finish - tail_s), so finish >= head_s + max_u W_s(u) + tail_s
>= head_s + G_s / n + tail_s, where G_s = sum over sequences of min_d d a_s(seq, d), a_s
the sequence's additive stage-s seconds at degree d (its micro-batch's seconds are at least
the sum of its sequences': the per-micro-batch constants, per-layer constants and latencies
are >= 0) and n the units of a stage, as sum_u W_s(u) >= G_s. head_s and tail_s take the
minimum over single sequences at every degree: a micro-batch holds at least one sequence,
and its times only grow with what it holds (every coefficient >= 0). (2) likewise with the
longest sequence alone at its best degree; recompute only adds time.
"""

from __future__ import annotations

import numpy as np

from ..errors import DcpOptError
from .stages import StageLayout, column_times


def column_lower_bound(f, b, x, *, num_stages: int, schedule: str = "") -> float:
    """max of (1) and (2) above for one column, (3) in place of (1) under "1f1b":
    f, b (V, m); x (V - 1, m)."""
    f, b = np.asarray(f, dtype=float), np.asarray(b, dtype=float)
    V, m = f.shape
    if m == 0:
        return 0.0
    x = np.asarray(x, dtype=float).reshape(V - 1, m)
    p = num_stages
    pre_f = np.vstack([np.zeros(m), np.cumsum(f[:-1] + x, axis=0)])  # (V, m): before c
    pre_b = np.vstack([np.zeros(m), np.cumsum(b[:-1] + x, axis=0)])
    work = (f + b).reshape(V // p, p, m).sum(axis=(0, 2))  # per physical stage
    one = float(((f + b).sum(axis=0) + 2 * x.sum(axis=0)).max())
    fill = pre_f[:p].min(axis=1) + work + pre_b[:p].min(axis=1)
    if schedule == "1f1b" and p == V:
        fill = fill + np.array([window_idle(f, b, x, s) for s in range(p)])
    return max(float(fill.max()), one)


def window_idle(f, b, x, s: int) -> float:
    """(3)'s max(0, max_k idle_s(k)) on stage s of a 1F1B column (V = p)."""
    V, m = f.shape
    w = V - s - 1
    trip = (f[s:] + b[s:]).sum(axis=0) + 2 * x[s:].sum(axis=0)
    best = 0.0
    top_f, top_b = np.sort(f[s])[::-1], np.sort(b[s])[::-1]
    for k in range(m):
        inside = _top_others(top_f, f[s, k], w) + _top_others(top_b, b[s, k], w)
        best = max(best, trip[k] - f[s, k] - b[s, k] - inside)
    return float(best)


def _top_others(desc: np.ndarray, own: float, w: int) -> float:
    """The w largest values of `desc` (sorted descending) once `own` is taken out."""
    if w <= 0:
        return 0.0
    head = desc[: w + 1]
    if own >= head[-1] and len(head) == w + 1:  # own is among the w + 1 largest: drop it
        return float(head.sum() - own)
    return float(desc[:w].sum())


def sequence_stage_times(layout: StageLayout, batch, degrees) -> tuple:
    """Per degree d (D,) the single-sequence columns' (f, b) at no recompute, (D, V, n),
    and transfers no column's are below, (D, V - 1, n), one column per sequence of the batch
    in batch order."""
    cost, cl = layout.cost, layout.cost.cluster
    if cl.speed_factors is not None:
        raise DcpOptError("cluster.speed_factors: the pipeline bound needs GPUs of one speed")
    feats = cost.batch_features(batch)
    rec = np.zeros((len(feats), layout.num_stages), dtype=int)
    out = [column_times(layout, feats, d, 0, "ulysses", rec) for d in degrees]
    f, b = (np.array([o[i] for o in out]) for i in (0, 1))
    # transfers at the fastest link and the least latency: any column's are at least that
    p, m = layout.num_stages, cost.model
    cross = np.array([c % p != (c + 1) % p for c in range(layout.num_virtual - 1)], dtype=float)
    bw = max(cl.intra_node_bw, cl.inter_node_bw)
    lat = min(cl.intra_node_latency_s, cl.inter_node_latency_s)
    sent = feats[:, -2] * m.hidden * m.dtype_bytes  # per unit (stages.py)
    x = np.array([cross[:, None] * (sent / d / bw + lat) for d in degrees])
    return f, b, x


def per_micro_batch_seconds(layout: StageLayout, degrees) -> np.ndarray:
    """(D, V) what every micro-batch pays on each virtual stage whatever it holds: the
    formula at zero features (the per-micro-batch overhead, each layer's constant, the
    latencies)."""
    zero = np.zeros((1, layout.cost.num_features))
    rec = np.zeros((1, layout.num_stages), dtype=int)
    out = []
    for d in degrees:
        f0, b0, _ = column_times(layout, zero, d, 0, "ulysses", rec)
        out.append((f0 + b0)[:, 0])
    return np.array(out)


def batch_lower_bound(layout: StageLayout, batch, degrees) -> float:
    """The batch bound above (finish only; add the step's collectives for the step)."""
    degrees = [d for d in degrees if d <= layout.num_units]
    p, n = layout.num_stages, layout.num_units
    f, b, x = sequence_stage_times(layout, batch, degrees)  # (D, V, S), (D, V-1, S)
    D, V, S = f.shape
    pre_f = np.concatenate([np.zeros((D, 1, S)), np.cumsum(f[:, :-1] + x, axis=1)], axis=1)
    pre_b = np.concatenate([np.zeros((D, 1, S)), np.cumsum(b[:, :-1] + x, axis=1)], axis=1)
    head = pre_f[:, :p].min(axis=(0, 2))  # (p,)
    tail = pre_b[:, :p].min(axis=(0, 2))
    # a_s(seq, d): the sequences' stage seconds less what a micro-batch pays once, (D, p, S)
    a = np.maximum(f + b - per_micro_batch_seconds(layout, degrees)[:, :, None], 0.0)
    a = a.reshape(D, V // p, p, S).sum(axis=1)
    gpu_s = (np.array(degrees, dtype=float)[:, None, None] * a).min(axis=0).sum(axis=1)
    fill = float((head + gpu_s / n + tail).max())
    chain = (f + b).sum(axis=1) + 2 * x.sum(axis=1)  # (D, S)
    return max(fill, float(chain.min(axis=0).max()))
