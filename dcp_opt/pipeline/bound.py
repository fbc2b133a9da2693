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

(4) Memory alone. A micro-batch's last-chunk backward on stage s runs after all its forwards
on s, so its stored bytes on every chunk of s, plus the running pass's working set, are held
at once: T/d ((L_s - r) act + r ckpt) + T/d (act + [s last] head) <= room_s (the roomiest
unit's capacity less the stage's states and reserve). A micro-batch holds at least its
sequence's tokens, so each sequence is priced (in (1), (2)) only at degrees where it fits
alone with everything recomputed, with at least the recompute r_lo(seq, d) it needs alone.

(5) Windows, 1F1B (V = p), plans of one phase (each unit runs one column, as every planner
and baseline here plans). Under 1F1B stage s, w = p - s, holds at B(s, k) the stored bytes
of micro-batches k .. k + w - 1 (actions.one_f_one_b_actions): each <= room_s per unit. Cut
a column's m micro-batches into ceil(m / w) blocks of w consecutive ones: per unit, the
column's stored bytes <= ceil(m / w) room_s <= (m + w - 1) room_s / w; over the stage,
sum_seq T ((L_s - r) act + r ckpt) <= room_s (M + n (w - 1)) / w with M = sum over
micro-batches of their degree (GPipe, all in flight: <= n room_s). Bytes are bought either
by recompute (sequence i: tokens_i (act - ckpt) bytes per layer for rho_i GPU-seconds, its
cheapest degree's extra forward) or by micro-batches (room_s / w bytes for c0_s, the least
per-unit micro-batch constant on s); the fractional knapsack gives the least GPU-seconds
for the bytes over the allowance, and (1) becomes head_s + (G_s + that) / n + tail_s. A
relaxation: each sequence takes its own degree, recompute is real-valued, micro-batches
cost only their constant. (G_s already holds each sequence's alone recompute at its degree,
so only the recompute past it is bought.)

(6) Windows by degree, the Lagrangian dual of (5)'s linear program with the degrees
coupled. Sum (5)'s per-column inequality over the columns of degree d: with x_id the share
of sequence i at degree d (0 where it does not fit alone), y_id the bytes its recompute past
r_lo(i, d) saves (<= cap_id x_id, cap_id = T_i (act - ckpt) (L_s - r_lo)), z_d the micro-
batches at d and u_d the units in columns of d (sum_d u_d <= n),

    sum_i B_id x_id - sum_i y_id <= room_s / w (d z_d + (w - 1) u_d)   for every d,

B_id = T_i ((L_s - r_lo) act + r_lo ckpt), while stage s's GPU-seconds are at least
sum_id d a_s(i, d) x_id + sum_id pi_id y_id + sum_d d c0_s(d) z_d (pi_id: a recomputed
layer's GPU-seconds per byte it saves, c0_s(d) what a micro-batch pays on s at d). For any
lambda_d >= 0 with lambda_d <= c0_s(d) w / room_s (else z_d makes the minimum -inf), the
minimum of that work + sum_d lambda_d (left - right) over the x, y, z, u above is at or
below every single-phase plan's GPU-seconds (weak duality), and it is

    g(lambda) = sum_i min_d [d a_s(i, d) + lambda_d T_i L_s ckpt + min(lambda_d, pi_id) cap_id]
                - n room_s (w - 1) / w max_d lambda_d

(y at its bound where pi_id < lambda_d, z at 0, all u on the largest lambda_d). So
finish >= head_s + g(lambda) / n + tail_s for every such lambda: `window_dual` evaluates
lambda_d = min(Lambda, c0_s(d) w / room_s) on a grid of Lambda and keeps the largest, a
valid bound whichever Lambda wins. GPipe holds all its micro-batches at once: w (w - 1) / w
becomes 1 and no z term (no upper limit on lambda_d).
"""

from __future__ import annotations

import numpy as np

from ..errors import DcpOptError
from .stages import StageLayout, column_times, stage_fixed_bytes


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
    """Per degree d (D,) the single-sequence columns' (f, b) at the least recompute with which
    the sequence alone fits each stage (`alone_recompute`), (D, V, n), transfers no
    column's are below, (D, V - 1, n), one column per sequence of the batch in batch order,
    and (D, n) whether it fits alone at d at all."""
    cost, cl = layout.cost, layout.cost.cluster
    if cl.speed_factors is not None:
        raise DcpOptError("cluster.speed_factors: the pipeline bound needs GPUs of one speed")
    feats = cost.batch_features(batch)
    recs = [alone_recompute(layout, feats[:, -2], d) for d in degrees]
    ok = np.array([r.min(axis=1) >= 0 for r in recs])  # (D, n)
    if not ok.any(axis=0).all():  # no plan holds some sequence: the bound as if memory did not
        ok[:] = True
        recs = [np.zeros_like(r) for r in recs]
    out = [column_times(layout, feats, d, 0, "ulysses", np.maximum(r, 0)) for d, r in
           zip(degrees, recs, strict=True)]  # fmt: skip
    f, b = (np.array([o[i] for o in out]) for i in (0, 1))
    # transfers at the fastest link and the least latency: any column's are at least that
    p, m = layout.num_stages, cost.model
    cross = np.array([c % p != (c + 1) % p for c in range(layout.num_virtual - 1)], dtype=float)
    bw = max(cl.intra_node_bw, cl.inter_node_bw)
    lat = min(cl.intra_node_latency_s, cl.inter_node_latency_s)
    sent = feats[:, -2] * m.hidden * m.dtype_bytes  # per unit (stages.py)
    x = np.array([cross[:, None] * (sent / d / bw + lat) for d in degrees])
    return f, b, x, ok


def alone_recompute(layout: StageLayout, tokens, d: int) -> np.ndarray:
    """(n, p) the fewest layers each sequence recomputes on each stage to fit there alone at
    degree d, -1 where all of them do not suffice ((4) above): held stored bytes T/d ((L_s -
    r) act + r ckpt) over the stage's chunks (a micro-batch's last-chunk backward on s runs
    after all its forwards on s) + the working set T/d (act + [s last] head) <= the room of
    the roomiest unit (capacity less the stage's states and reserve)."""
    cost, co = layout.cost, layout.cost.coeffs
    cl, p = cost.cluster, layout.num_stages
    mem = cl.memory_bytes if cl.memory_per_rank is None else max(cl.memory_per_rank)
    room = mem * cost.usable_memory_fraction - stage_fixed_bytes(layout)  # (p,)
    L = np.array(layout.pipeline.stage_layers, dtype=float)
    head = np.zeros(p)
    head[-1] = co.head_bytes_per_token
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    local = np.asarray(tokens, dtype=float)[:, None] / d  # (n, 1)
    need = local * (L * act + act + head) - room  # bytes over with nothing recomputed
    save = local * max(act - ckpt, 0.0)  # per recomputed layer
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(need <= 0, 0.0, np.ceil(need / np.where(save > 0, save, 1.0) - 1e-9))
    r = np.where((need > 0) & (save <= 0), np.inf, r)
    return np.where(r > L, -1, r).astype(int)


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
    return batch_bound_parts(layout, batch, degrees)["bound_s"]


def batch_bound_parts(layout: StageLayout, batch, degrees, *, windows: bool = True) -> dict:
    """The batch bound and its terms: per stage head, work / n and tail; the chain; with
    `windows`, (5) and (6) and the single-phase bound they make."""
    degrees = [d for d in degrees if d <= layout.num_units]
    p, n = layout.num_stages, layout.num_units
    f, b, x, ok = sequence_stage_times(layout, batch, degrees)  # (D, V, S), (D, V-1, S)
    D, V, S = f.shape
    big = np.where(ok, 0.0, np.inf)[:, None, :]  # a degree where the sequence cannot fit
    pre_f = np.concatenate([np.zeros((D, 1, S)), np.cumsum(f[:, :-1] + x, axis=1)], axis=1)
    pre_b = np.concatenate([np.zeros((D, 1, S)), np.cumsum(b[:, :-1] + x, axis=1)], axis=1)
    head = (pre_f[:, :p] + big).min(axis=(0, 2))  # (p,)
    tail = (pre_b[:, :p] + big).min(axis=(0, 2))
    # a_s(seq, d): the sequences' stage seconds less what a micro-batch pays once, (D, p, S)
    a = np.maximum(f + b - per_micro_batch_seconds(layout, degrees)[:, :, None], 0.0)
    a = a.reshape(D, V // p, p, S).sum(axis=1) + big
    gpu_s = (np.array(degrees, dtype=float)[:, None, None] * a).min(axis=0).sum(axis=1)
    fill = head + gpu_s / n + tail
    chain = ((f + b).sum(axis=1) + 2 * x.sum(axis=1) + big[:, 0]).min(axis=0).max()
    win = np.zeros(p)
    if p == V and windows:  # (5), (6): the least recompute and constants the windows need
        win = window_bounds(layout, batch, degrees, ok, head + tail, gpu_s)
        win = np.maximum(win, window_dual(layout, batch, degrees, a, head + tail))
    return {"bound_s": max(float(fill.max()), float(chain)), "head_s": head,
            "work_s": gpu_s / n, "tail_s": tail, "chain_s": float(chain),
            "window_s": win, "single_phase_bound_s": max(float(fill.max()), float(chain),
                                                         float(win.max()))}  # fmt: skip


def window_bounds(layout: StageLayout, batch, degrees, ok, ends, gpu_s) -> np.ndarray:
    """(5) above per stage (V = p; single-phase plans): the work bound with the least
    recompute and micro-batch constants that make the batch's stored bytes fit the windows,
    by the fractional knapsack (bytes bought at the lowest GPU-seconds per byte)."""
    cost, co = layout.cost, layout.cost.coeffs
    p, n, L = layout.num_stages, layout.num_units, layout.pipeline.stage_layers
    tokens = cost.batch_features(batch)[:, -2]
    big = np.where(ok, 0.0, np.inf)
    mem = cost.cluster.memory_bytes
    if cost.cluster.memory_per_rank is not None:
        mem = max(cost.cluster.memory_per_rank)
    room = mem * cost.usable_memory_fraction - stage_fixed_bytes(layout)
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    r_lo = np.array([alone_recompute(layout, tokens, int(d)) for d in degrees])  # (D, S, p)
    r_lo = np.where(r_lo < 0, np.array(L)[None, None, :], r_lo).min(axis=0).astype(float)
    rho = (recompute_gpu_seconds(layout, batch, degrees) + big[:, None, :]).min(axis=0)
    c0 = per_micro_batch_seconds(layout, degrees).min(axis=0)  # (p,) per unit, V = p
    gpipe = layout.pipeline.schedule == "gpipe"
    out = np.zeros(p)
    for s in range(p):
        if room[s] <= 0:
            continue  # no plan fits this stage: (1) stands
        lo = r_lo[:, s]  # gpu_s holds each sequence's alone recompute already
        fixed = 0.0
        w = None if gpipe else p - s
        free = n * room[s] * (1.0 if w is None else (w - 1) / w)
        need = float((tokens * ((L[s] - lo) * act + lo * ckpt)).sum()) - free
        price_m = np.inf if w is None else c0[s] * w / room[s]
        save = tokens * max(act - ckpt, 0.0)
        cap = save * (L[s] - lo)
        with np.errstate(divide="ignore", invalid="ignore"):
            price = np.where(save > 0, rho[s] / np.where(save > 0, save, 1.0), np.inf)
        out[s] = ends[s] + (gpu_s[s] + fixed + _buy(need, price, cap, price_m)) / n
    return out


def _buy(need: float, price, cap, price_m: float) -> float:
    """The least GPU-seconds for `need` bytes: items of `cap` bytes at `price` per byte, and
    unlimited bytes at price_m (inf: none). inf if they cannot."""
    if need <= 0:
        return 0.0
    order = np.argsort(price, kind="stable")
    price, cap = price[order], cap[order]
    keep = price < price_m
    price, cap = price[keep], cap[keep]
    got = np.cumsum(cap)
    k = int(np.searchsorted(got, need))
    if k < len(got):
        before = got[k - 1] if k else 0.0
        return float((price[:k] * cap[:k]).sum() + price[k] * (need - before))
    rest = need - (got[-1] if len(got) else 0.0)
    return float((price * cap).sum() + rest * price_m)


def recompute_gpu_seconds(layout: StageLayout, batch, degrees) -> np.ndarray:
    """(D, p, S): GPU-seconds (d x seconds) one recomputed layer adds to each sequence on
    each stage at degree d, less what it adds to an empty micro-batch (paid once). One
    layer recomputed on every stage lands in one chunk per stage (chunk_recompute)."""
    cost, p, V = layout.cost, layout.num_stages, layout.num_virtual
    feats = cost.batch_features(batch)
    both = np.vstack([feats, np.zeros((1, feats.shape[1]))])
    zero = np.zeros((len(both), p), dtype=int)
    out = []
    for d in degrees:
        base = column_times(layout, both, d, 0, "ulysses", zero)[1]
        extra = column_times(layout, both, d, 0, "ulysses", zero + 1)[1] - base  # (V, S + 1)
        extra = extra.reshape(V // p, p, -1).sum(axis=0)  # (p, S + 1)
        out.append(np.maximum(extra[:, :-1] - extra[:, -1:], 0.0) * d)
    return np.array(out)


def window_dual(layout: StageLayout, batch, degrees, a, ends) -> np.ndarray:
    """(6) above per stage (V = p; single-phase plans): head_s + max over a grid of Lambda of
    g(lambda(Lambda)) / n + tail_s. a: (D, p, S) the sequences' stage seconds at each degree
    with their alone recompute (inf where they do not fit alone)."""
    cost, co = layout.cost, layout.cost.coeffs
    p, n, L = layout.num_stages, layout.num_units, layout.pipeline.stage_layers
    tokens = cost.batch_features(batch)[:, -2]
    mem = cost.cluster.memory_bytes
    if cost.cluster.memory_per_rank is not None:
        mem = max(cost.cluster.memory_per_rank)
    room = mem * cost.usable_memory_fraction - stage_fixed_bytes(layout)
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    deg = np.array(degrees, dtype=float)
    r_lo = np.array([alone_recompute(layout, tokens, int(d)) for d in degrees])  # (D, S, p)
    r_lo = np.where(r_lo < 0, np.array(L)[None, None, :], r_lo).astype(float)
    rho = recompute_gpu_seconds(layout, batch, degrees)  # (D, p, S) per recomputed layer
    c0 = per_micro_batch_seconds(layout, degrees)  # (D, p) per unit, V = p
    gpipe = layout.pipeline.schedule == "gpipe"
    out = np.zeros(p)
    save = tokens * max(act - ckpt, 0.0)  # (S,) bytes a recomputed layer saves
    for s in range(p):
        if room[s] <= 0 or save.max() <= 0:
            continue
        w = p - s
        keep = 1.0 if gpipe else (w - 1) / w
        box = np.full(len(deg), np.inf) if gpipe else c0[:, s] * w / room[s]  # (D,)
        work = deg[:, None] * a[:, s, :]  # (D, S), inf where i does not fit alone at d
        cap = save[None, :] * (L[s] - r_lo[:, :, s])  # (D, S)
        with np.errstate(divide="ignore", invalid="ignore"):
            pi = np.where(save > 0, rho[:, s, :] / np.where(save > 0, save, 1.0), np.inf)
        base = tokens * L[s] * ckpt  # (S,)
        grid = _lambda_grid(pi, box, work, base, cap)
        lam = np.minimum(grid[:, None], box[None, :])[:, :, None]  # (G, D, 1)
        cost_i = work[None] + lam * base[None, None, :] + np.minimum(lam, pi[None]) * cap[None]
        g = cost_i.min(axis=1).sum(axis=1) - n * room[s] * keep * lam[:, :, 0].max(axis=1)
        out[s] = ends[s] + max(0.0, float(g.max())) / n
    return out


def _lambda_grid(pi, box, work, base, cap) -> np.ndarray:
    """Values of Lambda to try: 0, each degree's limit, and a geometric grid over the prices
    at which a sequence's cheapest degree or recompute can change (any value is valid)."""
    finite = np.concatenate([pi[np.isfinite(pi) & (pi > 0)], box[np.isfinite(box) & (box > 0)]])
    if finite.size == 0:
        return np.array([0.0])
    lo, hi = float(finite.min()), float(finite.max())
    geo = np.geomspace(lo / 4, hi * 4, 32)
    return np.unique(np.concatenate([[0.0], box[np.isfinite(box)], geo]))
