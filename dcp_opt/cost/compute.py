"""Time of a micro-batch: one layer's forward and backward from the coefficients (features @
w + c per degree and SP kind), the head, the per-micro-batch constant, recompute, and the
communication the SP kind adds (comm.py; the formulas in the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..batch import Sequence
from . import cp as cp_cost
from . import ring as ring_cost
from . import zero3
from .coeffs import TermCoeffs
from .units import tp_comm_outside_layers, tp_comm_per_layer

_PASS_SHARE = {"fwd": 1 / 3, "bwd": 2 / 3}  # CostModel.replicated_seq_s per pass


@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float
    recompute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.recompute_s + self.comm_s


class Compute:
    """CostModel's time (a mixin: reads the fields of dcp_opt.cost.model.CostModel)."""

    def sp_factor(self, d: int) -> float:
        """Multiplier of one layer's time at degree d (1 + sp_compute_overhead's x)."""
        return 1.0 + dict(self.sp_compute_overhead).get(int(d), 0.0)

    def _heads_share(self, d: int) -> float:
        h = self.model.num_heads
        return math.ceil(h / d) / h

    def _layer_vectors(
        self, d: int, kind: str = "ulysses"
    ) -> tuple[np.ndarray, float, np.ndarray, float]:
        """(w_fwd, c_fwd, w_bwd, c_bwd): one layer's time = features @ w + c at degree d.
        Under `cp` and `ring` the attention splits 1/d by causal head-tail chunks (cp_cost)."""
        key = ("lv", d) if kind == "ulysses" else ("lv", d, kind)
        return self.memoised(key, lambda: self._make_layer_vectors(d, kind))

    def _make_layer_vectors(self, d: int, kind: str) -> tuple:
        hs = self._heads_share(d) if kind == "ulysses" else 1.0 / d
        nb = len(self.model.block_types)
        out = []
        for part in ("fwd", "bwd"):
            w = np.zeros(nb + 2)
            c = 0.0
            for i, name in enumerate(self.model.block_types):
                tc: TermCoeffs = getattr(self.coeffs.blocks[name], part)
                w[i] = tc.quad * hs
                w[nb] += tc.lin / d
                w[nb + 1] += tc.seq / d
                c += tc.const
            if self.replicated_seq_s:  # not split by d: every member repeats it
                w[nb + 1] += self.replicated_seq_s * _PASS_SHARE[part] / self.model.num_layers
            if self.sp_compute_overhead:
                f = self.sp_factor(d)
                w, c = w * f, c * f
            out += [w, c]
        return tuple(out)

    def _layer_stack(
        self, degrees: tuple[int, ...], kind: str = "ulysses"
    ) -> tuple[np.ndarray, ...]:
        """_layer_vectors of every degree, stacked: (W_fwd (D, F), c_fwd (D,), W_bwd, c_bwd)."""
        key = ("ls", degrees) if kind == "ulysses" else ("ls", degrees, kind)

        def make():
            vs = [self._layer_vectors(d, kind) for d in degrees]
            return tuple(np.array([v[k] for v in vs]) for k in range(4))

        return self.memoised(key, make)

    def layer_times(self, feats, d, kind: str = "ulysses") -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds of one layer for rows of `feats` (n, F) at degree d. A column
        of degrees (D, 1) gives (D, n): a stack of matrix-vector products, so each row is
        bit-for-bit the one-degree call (one matrix product would round differently)."""
        if np.ndim(d) == 0:
            wf, cf, wb, cb = self._layer_vectors(d, kind)
            return feats @ wf + cf, feats @ wb + cb
        wf, cf, wb, cb = self._layer_stack(tuple(int(x) for x in np.ravel(d)), kind)
        fwd = np.matmul(feats, wf[:, :, None])[..., 0] + cf[:, None]
        return fwd, np.matmul(feats, wb[:, :, None])[..., 0] + cb[:, None]

    def attention_times(self, feats, d, kind: str = "ring") -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds of one layer's attention alone (the quad columns of
        layer_times' weights: no linear, per-sequence or constant term) for rows of `feats`
        at degree d or a column of degrees, as layer_times: what a ring step can hide its
        transfer behind (ring_cost)."""
        nb = len(self.model.block_types)
        q = feats[..., :nb]
        if np.ndim(d) == 0:
            wf, _, wb, _ = self._layer_vectors(d, kind)
            return q @ wf[:nb], q @ wb[:nb]
        wf, _, wb, _ = self._layer_stack(tuple(int(x) for x in np.ravel(d)), kind)
        fwd = np.matmul(q, wf[:, :nb, None])[..., 0]
        return fwd, np.matmul(q, wb[:, :nb, None])[..., 0]

    def time_parts(
        self,
        feats,
        d,
        recompute_layers,
        *,
        spans_nodes=None,
        speed=1.0,
        kind="ulysses",
    ):
        """Vectorised over rows of `feats` (n, F) -> (compute, recompute, comm), seconds.
        `d` may be a column of degrees (D, 1): each part is then (D, n), one row per degree,
        and `recompute_layers`, `spans_nodes` and `speed` broadcast against it. `kind`: the
        SP kind of the group, "ulysses", "cp" (cp_cost) or "ring" (ring_cost)."""
        if kind != "ulysses":
            cp_cost.check_kind(self.model, kind)
        feats = np.asarray(feats, dtype=float)
        if spans_nodes is None and self.cluster.topology is None:  # None: per-degree default
            spans_nodes = np.asarray(d) > self.cluster.gpus_per_node
        fwd, bwd = self.layer_times(feats, d, kind)
        tokens = feats[..., -2]
        kw = {"attn": self.attention_times(feats, d)} if kind == "ring" else {}
        return self.time_parts_from(
            fwd, bwd, tokens, d, recompute_layers, spans_nodes=spans_nodes, speed=speed,
            kind=kind, **kw,
        )  # fmt: skip

    def time_parts_from(
        self, fwd, bwd, tokens, d, recompute_layers, *, spans_nodes, speed, kind="ulysses",
        attn=None,
    ):  # fmt: skip
        """time_parts from one layer's (fwd, bwd) seconds (layer_times). Elementwise: every
        argument may be an array, e.g. one degree, span and speed per micro-batch. `attn`:
        under `ring`, the layer's (fwd, bwd) attention seconds (attention_times), which the
        ring's transfers overlap (ring_cost)."""
        L = self.model.num_layers
        co = self.coeffs
        head = tokens / d * (co.head_fwd_per_token_s + co.head_bwd_per_token_s)
        compute = L * (fwd + bwd) + head + co.microbatch_overhead_s
        r = np.asarray(recompute_layers, dtype=float)
        recompute = r * fwd  # one more forward per recomputed layer (Chen et al. 2016)
        if np.ndim(speed) or speed != 1:  # x / 1.0 == x: skip two passes at full speed
            compute, recompute = compute / speed, recompute / speed
        if kind == "ring":  # what the transfers do not hide, forward + backward + recompute
            assert attn is not None, "time_parts_from: a ring group needs `attn`"
            x_f, x_b = ring_cost.exposed_per_layer(self, tokens, d, spans_nodes, *attn, speed)
            comm = L * (x_f + x_b) + r * x_f
        else:
            layer_comm = self.comm_time_per_layer(tokens, d, spans_nodes, kind)
            comm = (2 * L + r) * layer_comm  # forward, backward, each recomputed forward
            if kind == "cp":  # a measured reduce-scatter: the backward at its own rate
                comm = comm + cp_cost.backward_extra(self, tokens, d, spans_nodes, L, layer_comm)
        if self.tensor_parallel > 1 or self.shard_domain:
            comm = comm + self.unit_comm(fwd, bwd, tokens, d, r, speed)
        return compute, recompute, comm

    def unit_comm(self, fwd, bwd, tokens, d, r, speed):
        """What tensor parallelism and per-layer zero3 add to a micro-batch: the TP
        collectives of every layer's forward, backward and recomputed forward and those at
        the embedding and the head (units.py), and the per-layer gathers that prefetch does
        not hide (zero3.py)."""
        tp = (2 * self.model.num_layers + r) * tp_comm_per_layer(self, tokens, d)
        tp = tp + tp_comm_outside_layers(self, tokens, d)
        return tp + zero3.exposed_gather_time(self, fwd, bwd, speed)

    @property
    def takes_degree_vectors(self) -> bool:
        """Whether time_parts is this class's own, which takes a column of degrees. A subclass
        that reprices it per degree (recalibrate.RecalibratedCostModel) takes one degree."""
        return type(self).time_parts is Compute.time_parts

    def time_by_degree(self, feats, degrees, recompute_layers, kind="ulysses") -> np.ndarray:
        """time() of every row of `feats` (n, F) at every degree (D,) -> (D, n), with
        `recompute_layers` (D, n): one vectorised call, or one per degree for a subclass."""
        kw = {} if kind == "ulysses" else {"kind": kind}
        if self.takes_degree_vectors:
            return self.time(feats, np.asarray(degrees)[:, None], recompute_layers, **kw)
        rows = zip(degrees, recompute_layers, strict=True)
        return np.stack([self.time(feats, d, r, **kw) for d, r in rows])

    def time(self, feats, d, recompute_layers=0, **kw):
        c, r, m = self.time_parts(feats, d, recompute_layers, **kw)
        return c + r + m

    def additive_time(self, feats, d, recompute_layers=0, **kw):
        """time() less what is not additive over the sequences of a packed micro-batch: a
        ring group's exposed transfers (ring_cost), which a packed partner's attention may
        hide, and per-layer zero3's exposed gathers (zero3.exposed_gather_time: max(gather -
        compute, 0) per layer, which a packed partner's compute hides). A lower bound of
        every micro-batch holding these features; time() itself for the other cases.
        Tables and bounds read it (dcp_opt/table.py)."""
        if self.shard_domain:
            return self.without_gathers().additive_time(feats, d, recompute_layers, **kw)
        c, r, m = self.time_parts(feats, d, recompute_layers, **kw)
        return c + r if kw.get("kind") == "ring" else c + r + m

    def without_gathers(self):
        """This cost model with per-layer zero3's gathers left out of the micro-batch time
        (shard_domain 0: the same mode, layout and coefficients; time_parts then adds no
        exposure, which is >= 0): what a certified bound may charge every micro-batch."""
        return self.memoised("without_gathers", lambda: self.with_(shard_domain=0))

    def additive_time_by_degree(self, feats, degrees, recompute_layers, kind="ulysses"):
        """additive_time of every row at every degree (D,) -> (D, n), as time_by_degree."""
        if self.shard_domain:
            flat = self.without_gathers()
            return flat.additive_time_by_degree(feats, degrees, recompute_layers, kind)
        if kind != "ring":
            return self.time_by_degree(feats, degrees, recompute_layers, kind)
        if self.takes_degree_vectors:
            col = np.asarray(degrees)[:, None]
            return self.additive_time(feats, col, recompute_layers, kind=kind)
        rows = zip(degrees, recompute_layers, strict=True)
        return np.stack([self.additive_time(feats, d, r, kind=kind) for d, r in rows])

    def microbatch_time(
        self,
        seqs: list[Sequence],
        d: int,
        recompute_layers: int = 0,
        *,
        spans_nodes: bool | None = None,
        speed: float = 1.0,
        kind: str = "ulysses",
    ) -> TimeBreakdown:
        f = sum(self.features(s) for s in seqs)
        kw = {} if kind == "ulysses" else {"kind": kind}
        c, r, m = self.time_parts(
            f, d, recompute_layers, spans_nodes=spans_nodes, speed=speed, **kw
        )
        return TimeBreakdown(float(c), float(r), float(m))
