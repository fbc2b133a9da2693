"""The additive features of a sequence (the cost model's docstring): attention work Q per
block type, tokens T and sequences S; a packed micro-batch sums its members' rows."""

from __future__ import annotations

import numpy as np

from ..batch import Batch, Sequence
from ..errors import DcpOptError
from . import dit3d
from .coeffs import windowed_quad


class Features:
    """CostModel's features (a mixin: reads `model` and `memoised` of dcp_opt.cost.model)."""

    @property
    def num_features(self) -> int:
        return len(self.model.block_types) + 2

    def features(self, seq: Sequence) -> np.ndarray:
        """Additive features of one sequence: [Q_b for each block type..., T, S]."""
        if seq.kind != self.model.input_kind:
            raise DcpOptError(
                f"sequence {seq.id}: a {seq.kind} shape {seq.shape} does not fit the "
                f"{self.model.kind} model {self.model.name!r}"
            )
        t = float(seq.num_tokens)
        if self.model.kind == "1d":
            return np.array([self._quad_1d(t), t, 1.0])
        if self.model.kind == "3d":  # one full-attention block per layer (cost/dit3d.py)
            return np.array([dit3d.quad(t, self.model), t, 1.0])
        fr, sp = float(seq.frames), float(seq.spatial_tokens)
        return np.array([fr * sp * sp, sp * fr * fr, t, 1.0])

    def _quad_1d(self, t):
        """Q of a 1D sequence of t tokens (a float or an array), averaged over the layers.
        Causal attention over s tokens scores s(s+1)/2 ~ s^2/2 pairs: Q = s^2 (quad_flops
        counts 2h per unit). Under a window w (ModelSpec.window) a query sees min(i+1, w)
        keys, w(w+1)/2 + (s-w)w ~ s*w - w^2/2 pairs for s > w: Q_w = s^2 - (s-w)^2 = 2sw - w^2
        (equal to s^2 at s = w). Without a window the feature is s^2 bit for bit as before."""
        m = self.model
        return windowed_quad(t, m.window if m.windowed_layers else 0, m.windowed_share)

    def batch_features(self, batch: Batch) -> np.ndarray:
        """(n, F) features of every sequence of the batch, in batch order (memoised)."""
        return self.memoised(("bf", batch.fingerprint()), lambda: self._batch_features(batch))

    def _batch_features(self, batch: Batch) -> np.ndarray:
        self.features(batch.sequences[0])  # a batch has one kind: check it once
        x = np.array([s.shape for s in batch.sequences], dtype=float)
        if self.model.kind == "1d":
            t = x[:, 0]
            return np.stack([self._quad_1d(t), t, np.ones_like(t)], axis=1)
        # the same columns as features(), for every row at once
        fr, sp = x[:, 0], x[:, 1] * x[:, 2]
        if self.model.kind == "3d":
            t = fr * sp
            return np.stack([dit3d.quad(t, self.model), t, np.ones_like(t)], axis=1)
        return np.stack([fr * sp * sp, sp * fr * fr, fr * sp, np.ones_like(fr)], axis=1)

    def batch_rows(self, batch: Batch) -> dict[int, int]:
        """Sequence id -> its row of batch_features (memoised with the features)."""
        return self.memoised(
            ("rows", batch.fingerprint()), lambda: {s.id: k for k, s in enumerate(batch.sequences)}
        )
