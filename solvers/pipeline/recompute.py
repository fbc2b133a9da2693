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

import numpy as np

from dcp_opt.pipeline.makespan import held_while_running, stage_walk

from .instance import Column, Instance


class _Peaks:
    """One stage's bytes held while each action of its walk runs (makespan.
    held_while_running), kept up to date as recompute lowers a micro-batch's stored bytes: they count
    from its forward to its backward on that chunk, so that span drops by the bytes saved.
    fit_recompute asks for the top once a round, hundreds of rounds a draft (a new walk
    each round cost 30 ms a draft at 256 GPUs)."""

    def __init__(self, walk, stored: np.ndarray, work: np.ndarray):
        _, c, k, self.first_f, self.first_b = walk
        self.peaks = held_while_running(walk, stored, work)
        self.span = {}  # (c, k) -> [index of its forward, of its backward]
        for i, key in enumerate(zip(c.tolist(), k.tolist(), strict=True)):
            self.span.setdefault(key, []).append(i)

    def top(self) -> tuple[float, list[int]]:
        """(peak bytes, the micro-batches in flight at its first moment)."""
        if not len(self.peaks):
            return 0.0, []
        i = int(np.argmax(self.peaks))
        live = np.flatnonzero((self.first_f <= i) & (self.first_b >= i))
        return float(self.peaks[i]), live.tolist()

    def lower(self, c: int, k: int, saved: float) -> None:
        if (c, k) in self.span:
            f, b = self.span[(c, k)]
            self.peaks[f : b + 1] -= saved


def fit_recompute(col: Column, inst: Instance, *, max_rounds: int = 10_000) -> bool:
    """Raise col.rec until every stage fits (the module docstring); False if it cannot.
    Stored bytes are updated for the one micro-batch changed per round."""
    lay = inst.layout
    p, pipe = lay.num_stages, lay.pipeline
    co = lay.cost.coeffs
    layers = pipe.stage_layers
    stored, work, room = col.memory(inst)
    peaks = [_Peaks(stage_walk(pipe.schedule, p, len(col.mbs), pipe.virtual_stages, s),
                    stored, work) for s in range(p)]  # fmt: skip
    held = stored.tolist()
    local = [float(inst.tokens[mb].sum()) / col.degree for mb in col.mbs]
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    f = col.times(inst)[0]  # a recomputed layer costs about one layer's forward
    per_stage = f.reshape(-1, p, f.shape[1]).sum(axis=0)  # chunk c on stage c % p
    per_layer = np.maximum(per_stage / np.array(layers, dtype=float)[:, None], 1e-30).tolist()
    todo = list(range(p))
    for _ in range(max_rounds):
        over = None
        for s in todo:
            peak, live = peaks[s].top()
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
            new = local[k] * ((n - r) * act + r * ckpt)
            peaks[s].lower(c, k, held[c][k] - new)
            held[c][k] = new
    return False
