"""Per-stage recompute that fits each stage's memory window (InfiniPipe's question: a stage
with fewer micro-batches in flight can keep more activations).

Stage s holds the stored activations of its in-flight micro-batches (the schedule's order:
up to p - s under 1F1B) plus the running one's working set (dcp_opt/pipeline/makespan.py,
stage_peaks). While some stage's peak exceeds its room, the micro-batch holding the most
bytes in that stage's worst moment recomputes as many more of the stage's layers as close
the excess (each saves (act - ckpt) bytes per local token per layer), up to all of them;
when every micro-batch at the peak recomputes everything, the column does not fit.
Recompute is added only where a stage needs it, so each micro-batch pays the fewest extra
forwards this greedy finds.
"""

from __future__ import annotations

import math

from dcp_opt.pipeline.makespan import stage_walk

from .instance import Column, Instance


def _peak(walk, stored: list, work: list):
    """(peak bytes, in-flight micro-batches at the peak) of one stage: makespan.walk_peak's
    running sum in the same order, on lists (a column holds tens of micro-batches, where a
    Python loop beats a dozen numpy calls; fit_recompute asks once a round, hundreds of
    rounds a draft). walk: `_lists` of makespan.stage_walk."""
    sign, c, k, first_f, first_b = walk
    if not sign:
        return 0.0, []
    held, best, at = 0.0, -math.inf, 0
    for i, (forward, cc, kk) in enumerate(zip(sign, c, k, strict=True)):
        v = stored[cc][kk]
        if forward:
            held += v
            peak = held + work[cc][kk]
        else:
            held -= v
            peak = held + v + work[cc][kk]
        if peak > best:
            best, at = peak, i
    return best, [j for j, (f, b) in enumerate(zip(first_f, first_b, strict=True))
                  if f <= at <= b]  # fmt: skip


def _lists(walk) -> tuple:
    sign, c, k, first_f, first_b = walk
    return ((sign > 0).tolist(), c.tolist(), k.tolist(), first_f.tolist(), first_b.tolist())


def fit_recompute(col: Column, inst: Instance, *, max_rounds: int = 10_000) -> bool:
    """Raise col.rec until every stage fits (the module docstring); False if it cannot.
    Stored bytes are updated for the one micro-batch changed per round."""
    lay = inst.layout
    p, pipe = lay.num_stages, lay.pipeline
    co = lay.cost.coeffs
    layers = pipe.stage_layers
    stored, work, room = col.memory(inst)
    walks = [_lists(stage_walk(pipe.schedule, p, len(col.mbs), pipe.virtual_stages, s))
             for s in range(p)]  # fmt: skip
    held, work = stored.tolist(), work.tolist()  # _peak's lists
    local = [float(inst.tokens[mb].sum()) / col.degree for mb in col.mbs]
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    f = col.times(inst)[0]  # a recomputed layer costs about one layer's forward
    per_layer = [[max(float(f[s::p, k].sum()) / layers[s], 1e-30) for k in range(len(col.mbs))]
                 for s in range(p)]  # fmt: skip
    todo = list(range(p))
    for _ in range(max_rounds):
        over = None
        for s in todo:
            peak, live = _peak(walks[s], held, work)
            if peak > room[s] * (1 - 1e-9):
                over = (s, peak - room[s] * (1 - 1e-9), live)
                break
            todo = [t for t in todo if t != s]  # a stage that fits stays fitting: only
            # its own micro-batches' recompute changes its bytes, and that only lowers them
        if over is None:
            return True
        s, excess, live = over
        cand = [k for k in live if col.rec[k, s] < layers[s] and act > ckpt]
        if not cand:
            return False
        k = max(cand, key=lambda k: local[k] / per_layer[s][k])  # bytes per second spent
        more = max(1, math.ceil(excess / (local[k] * (act - ckpt))))
        col.rec[k, s] = min(layers[s], col.rec[k, s] + more)
        left = int(col.rec[k, s])  # a stage's first layers: its chunks' in order
        for c in range(s, lay.num_virtual, p):
            n = lay.chunk_layers[c]
            r, left = min(left, n), left - min(left, n)
            held[c][k] = local[k] * ((n - r) * act + r * ckpt)
    return False
