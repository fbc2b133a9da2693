"""What the pipeline planners read before drafting: a stage's room for activations, the
1F1B windows' token caps, whether the longest sequence fits alone, and the stage-uniform
estimate of a draft (with the recompute its windows need) that ranks the drafts."""

from __future__ import annotations

import numpy as np

from .instance import Column, Instance


def fewest(inst: Instance, ids, tokens: float) -> int:
    """The fewest micro-batches of at most `tokens` tokens that hold `ids`' tokens."""
    return max(1, int(-(-float(inst.tokens[ids].sum()) // tokens)))


def estimate(inst: Instance, d: int, ids, units: int, m: int, tokens: float,
             part: tuple | None = None) -> float:  # fmt: skip
    """The stage-uniform estimate g (sum(t) / p + (p - 1) max(t) / p) of the slowest column of
    degree d over `units` holding `ids` in about m micro-batches each (t: a micro-batch's
    additive seconds over all stages; LPT's slowest is about max(longest, mean), Graham),
    g = 1 + the recompute the windows need over sum(t) (`recompute_estimate`); m = 0: the
    fewest micro-batches of at most `tokens` tokens. part: `summary(inst, d, ids)`."""
    p = inst.layout.num_stages
    total, top, tok, full = summary(inst, d, ids) if part is None else part
    c0 = inst.per_micro_batch(d)
    ncol = units // d
    k = max(min(ncol * m, len(ids)), -(-tok // tokens))
    g = 1.0 + recompute_estimate(inst, d, tok, full, k, ncol) / max(total, 1e-30)
    return g * ((total + k * c0) / ncol / p + (p - 1) * (max(top, total / k) + c0) / p)


def summary(inst: Instance, d: int, ids) -> tuple:
    """(sum of additive seconds, the largest, tokens, (p,) every layer's recompute seconds
    summed) of `ids` at degree d: what `estimate` reads."""
    a = inst.additive(d)[ids]
    full = inst.recompute_all(d)[ids].sum(axis=0)
    return float(a.sum()), float(a.max()), float(inst.tokens[ids].sum()), full


def split_summary(inst: Instance, d: int, j: int, side: int) -> tuple:
    """`summary` of the j longest sequences (side 0: the length-descending order's first j,
    stable, as compose.split_by_degree and steps.split_ids cut) or of the rest (side 1), in
    O(1) from prefix sums kept per degree."""

    def make():
        order = np.argsort(-inst.tokens, kind="stable")
        a = inst.additive(d)[order]
        zero = np.zeros(1)
        cum = np.concatenate([zero, np.cumsum(a)])
        head = np.concatenate([[-np.inf], np.maximum.accumulate(a)])
        tail = np.concatenate([np.maximum.accumulate(a[::-1])[::-1], [-np.inf]])
        tok = np.concatenate([zero, np.cumsum(inst.tokens[order])])
        full = inst.recompute_all(d)[order]
        rec = np.vstack([np.zeros((1, full.shape[1])), np.cumsum(full, axis=0)])
        return cum, head, tail, tok, rec

    cum, head, tail, tok, rec = inst.memo(("prefix", d), make)
    if side == 0:
        return float(cum[j]), float(head[j]), float(tok[j]), rec[j]
    return float(cum[-1] - cum[j]), float(tail[j]), float(tok[-1] - tok[j]), rec[-1] - rec[j]


def recompute_estimate(inst: Instance, d: int, tok: float, full, k: float, ncol: int) -> float:
    """Seconds of recompute summed over the stages that `tok` tokens in k micro-batches of
    equal tokens on ncol columns of degree d need for stage s's window (p - s in flight
    under 1F1B, the column's all under GPipe) to fit: the fraction of the layers that
    closes the excess (recompute.fit_recompute's rule, uniform), times `full` (p,), every
    layer's recompute. Plain floats: p is a handful, and drafts are ranked by thousands."""
    per_col = k / ncol
    gpipe = inst.layout.pipeline.schedule == "gpipe"
    local = tok / k / d
    out = 0.0
    for s, (keep, save, work, room) in enumerate(window_terms(inst, d)):
        w = per_col if gpipe else min(len(full) - s, per_col)
        need = local * (w * keep + work) - room
        if need > 0:
            out += min(need / max(local * w * save, 1e-30), 1.0) * float(full[s])
    return out


def window_terms(inst: Instance, d: int) -> list:
    """Per stage (keep, save, work, room): bytes a local token keeps with nothing
    recomputed, bytes recomputing everything saves, the working set's bytes per local
    token, the room; floats."""

    def make():
        co, lay = inst.layout.cost.coeffs, inst.layout
        act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
        room = stage_room(inst, d)
        p = lay.num_stages
        return [(n * act, n * max(act - ckpt, 1e-30),
                 act + (co.head_bytes_per_token if s == p - 1 else 0.0), float(room[s]))
                for s, n in enumerate(lay.pipeline.stage_layers)]  # fmt: skip

    return inst.memo(("window", d), make)


def stage_room(inst: Instance, d: int) -> np.ndarray:
    """(p,) a unit's bytes left on each stage for activations (a column of degree d at
    unit 0)."""
    return inst.memo(("room", d), lambda: Column(d, 0, [[0]], np.zeros(
        (1, inst.layout.num_stages), dtype=int)).memory(inst)[2])  # fmt: skip


def window_tokens(inst: Instance, d: int, keep: bool = False) -> float:
    """Tokens per micro-batch with which p - s in-flight micro-batches, every layer
    recomputed (keep: none), fit stage s (the 1F1B window; a first guess, fit_recompute
    decides). A longer sequence gets a micro-batch of its own (compose.pack)."""
    return inst.memo(("window_tokens", d, keep), lambda: _window_tokens(inst, d, keep))


def _window_tokens(inst: Instance, d: int, keep: bool) -> float:
    lay = inst.layout
    co, p = lay.cost.coeffs, lay.num_stages
    room = stage_room(inst, d)
    stored = co.act_bytes_per_token_layer if keep else co.ckpt_bytes_per_token_layer
    out = float("inf")
    for s, n in enumerate(lay.pipeline.stage_layers):
        per_token = (p - s) * n * stored + co.act_bytes_per_token_layer
        per_token += co.head_bytes_per_token if s == p - 1 else 0.0
        out = min(out, room[s] * d / per_token)
    return out


def token_caps(inst: Instance, d: int, cap: float) -> list[float]:
    """The micro-batch token caps tried at degree d: the window with every layer recomputed,
    with none, and their geometric mean, each at most `cap`."""
    lo, hi = window_tokens(inst, d, keep=True), window_tokens(inst, d)
    return sorted({min(cap, x) for x in (lo / 2, lo, (lo * hi) ** 0.5, hi)})


def fits_alone(inst: Instance, d: int) -> bool:
    """Whether the longest sequence alone, every layer recomputed, fits every stage."""
    lay = inst.layout
    k = int(inst.tokens.argmax())
    col = Column(d, 0, [[k]], np.array([lay.pipeline.stage_layers]))
    stored, work, room = col.memory(inst)
    per_stage = [(stored[s::lay.num_stages] + work[s::lay.num_stages]).sum() for s in
                 range(lay.num_stages)]  # fmt: skip
    return all(x <= r for x, r in zip(per_stage, room, strict=True))
