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

from dcp_opt.pipeline.makespan import column_actions
from dcp_opt.pipeline.stages import chunk_recompute

from .instance import Column, Instance


def _peak(acts, stored, work, s: int, p: int):
    """(peak bytes, in-flight micro-batches at the peak) of stage s."""
    held, live, best, at = 0.0, set(), -1.0, set()
    for a in acts:
        c, k = a.chunk * p + s, a.micro_batch
        if a.kind == "F":
            held += stored[c][k]
            live.add(k)
        if held + work[c][k] > best:
            best, at = held + work[c][k], set(live)
        if a.kind == "B":
            held -= stored[c][k]
            live.discard(k)
    return best, at


def fit_recompute(col: Column, inst: Instance, *, max_rounds: int = 10_000) -> bool:
    """Raise col.rec until every stage fits (the module docstring); False if it cannot.
    Stored bytes are updated in place for the one micro-batch changed per round."""
    lay = inst.layout
    p, pipe = lay.num_stages, lay.pipeline
    co = lay.cost.coeffs
    layers = pipe.stage_layers
    acts = column_actions(pipe.schedule, p, len(col.mbs), pipe.virtual_stages)
    stored_a, work_a, room = col.memory(inst)
    stored, work = stored_a.tolist(), work_a.tolist()
    local = [float(inst.tokens[mb].sum()) / col.degree for mb in col.mbs]
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    todo = list(range(p))
    for _ in range(max_rounds):
        over = None
        for s in todo:
            peak, live = _peak(acts[s], stored, work, s, p)
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
        k = max(cand, key=lambda k: stored_on(stored, k, s, p))
        more = max(1, math.ceil(excess / (local[k] * (act - ckpt))))
        col.rec[k, s] = min(layers[s], col.rec[k, s] + more)
        rc = chunk_recompute(lay, col.rec[k : k + 1])[:, 0]
        for c in range(s, lay.num_virtual, p):
            n = lay.chunk_layers[c]
            stored[c][k] = local[k] * ((n - rc[c]) * act + rc[c] * ckpt)
    return False


def stored_on(stored, k: int, s: int, p: int) -> float:
    return float(sum(stored[c][k] for c in range(s, len(stored), p)))
