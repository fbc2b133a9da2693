"""Fit cost-model coefficients to measured times and bytes (scipy, torch-free).

Time of one block's forward (or backward) on one device, for a micro-batch of packed
sequences (the form CostModel uses; docs/profiler.md):

    t = quad * Q + lin * T + seq * S + const

Q is the block's attention feature (1D layer: sum s^2, or with a sliding window w sum
s^2 - (s - w)^2 over s > w, dcp_opt.cost.windowed_quad; 2D spatial: sum F*S^2, temporal:
sum S*F^2), T the tokens, S the number of sequences. The fit is a non-negative least squares
(scipy.optimize.lsq_linear) on *relative* residuals (each row divided by its measurement):
the planner cares about relative error, and an unweighted fit lets the longest points drown
the short ones. Columns are scaled to unit norm first, since Q and 1 differ by ~10 orders.

Quality is judged on held-out grid points (a seeded split): R^2 and the median / max
relative error. The shipped coefficients are refitted on every point; the held-out figures
are the estimate of their error. A poor fit (median relative error above 10%, or R^2 below
0.9) raises a `PoorFitWarning` and is flagged in the report.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import lsq_linear

from .cost import TermCoeffs, windowed_quad
from .errors import DcpOptError

TERMS = ("quad", "lin", "seq", "const")
BLOCK_TYPES = ("layer", "spatial", "temporal")
MAX_MEDIAN_REL_ERR = 0.10
MIN_R2 = 0.9


class PoorFitWarning(UserWarning):
    """Held-out error of a fit is above the thresholds of the fit report."""


def block_features(
    block_type: str, shapes: Sequence[Sequence[int]], *, window: int = 0, joint_text: int = 0
) -> np.ndarray:
    """[Q, T, S] of a micro-batch of `shapes` for one block type (same as CostModel.features).

    1D shapes are (length,); 2D shapes are (frames, height, width) in latent patches, and so
    are a 3D model's, whose one "layer" attends over all F x H x W tokens plus `joint_text`
    text tokens per sample (0 under cross-attention): Q = (v + joint_text)^2 (cost/dit3d.quad).
    `window`: the sliding window of the measured 1D layer (0: none); its Q is the cost
    model's windowed term (dcp_opt.cost.windowed_quad), so the fitted `quad` is the cost of
    one unit of the same Q the cost model charges."""
    if window and block_type != "layer":
        raise DcpOptError(f"window: {window} not allowed for block {block_type!r}; allowed: 0")
    q = t = 0.0
    for shape in shapes:
        if block_type == "layer" and len(shape) == 3:  # a 3d model's full-attention layer
            v = float(math.prod(shape))
            q += (v + joint_text) ** 2
            t += v
            continue
        if block_type == "layer":
            (s,) = shape
            q += windowed_quad(float(s), window)  # causal halving is inside the coefficient
            t += s
            continue
        f, h, w = shape
        sp = float(h * w)
        if block_type == "spatial":
            q += f * sp * sp  # attention over the S spatial tokens of each of F frames
        elif block_type == "temporal":
            q += sp * f * f  # attention over the F frames of each of S positions
        else:
            raise DcpOptError(f"block_type: {block_type!r} not allowed; allowed: {BLOCK_TYPES}")
        t += f * sp
    return np.array([q, t, float(len(shapes))])


@dataclass(frozen=True)
class FitReport:
    """Quality of one fit. `*_test` are on held-out points (nan when too few were held out)."""

    n_train: int
    n_test: int
    r2_test: float
    median_rel_err_test: float
    max_rel_err_test: float
    r2_train: float
    median_rel_err_train: float
    poor: bool
    message: str = ""

    def to_dict(self) -> dict:
        return {
            k: (None if isinstance(v, float) and np.isnan(v) else v)
            for k, v in asdict(self).items()
        }


@dataclass(frozen=True)
class Fit:
    coef: tuple[float, ...]  # one per column, >= 0
    names: tuple[str, ...]
    report: FitReport

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=float) @ np.asarray(self.coef)

    def as_terms(self) -> TermCoeffs:
        return TermCoeffs(**dict(zip(self.names, self.coef, strict=True)))


def nonneg_relative_lsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum ((x c - y) / y)^2, columns scaled for conditioning."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise DcpOptError("measurements: every measured value must be finite and > 0")
    a = x / y[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0  # an all-zero column keeps coefficient 0
    res = lsq_linear(a / norms, np.ones(len(y)), bounds=(0, np.inf), method="bvls")
    # bvls can return a bound-touching value a rounding error below it (-3e-22 seen): the
    # promise is c >= 0, and profile_io refuses a negative coefficient
    return np.maximum(res.x, 0.0) / norms


def holdout_mask(n: int, fraction: float = 0.25, seed: int = 0) -> np.ndarray:
    """Boolean mask of held-out rows: a seeded ~`fraction` share, never the only rows."""
    if not 0 <= fraction < 1:
        raise DcpOptError(f"holdout_fraction: must be in [0, 1), got {fraction}")
    k = int(round(n * fraction))
    k = min(k, n - 1)
    mask = np.zeros(n, dtype=bool)
    if k > 0:
        mask[np.random.default_rng(seed).choice(n, size=k, replace=False)] = True
    return mask


def _scores(y: np.ndarray, pred: np.ndarray) -> tuple[float, float, float]:
    if len(y) == 0:
        return float("nan"), float("nan"), float("nan")
    rel = np.abs(pred - y) / y
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot if ss_tot > 0 else float("nan")
    return r2, float(np.median(rel)), float(rel.max())


def fit_nonneg(
    x: np.ndarray,
    y: np.ndarray,
    names: Sequence[str],
    *,
    label: str = "fit",
    holdout_fraction: float = 0.25,
    seed: int = 0,
    warn: bool = True,
) -> Fit:
    """Fit y ~ x @ coef with coef >= 0; report held-out quality; refit on all rows."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 2 or x.shape != (len(y), len(names)):
        raise DcpOptError(f"{label}: features must be ({len(y)}, {len(names)}), got {x.shape}")
    if len(y) < len(names):
        raise DcpOptError(
            f"{label}: {len(y)} measurements cannot fit {len(names)} terms; widen the grid"
        )
    test = holdout_mask(len(y), holdout_fraction, seed)
    if (~test).sum() < len(names):  # too few rows to hold any out
        test[:] = False
    c_train = nonneg_relative_lsq(x[~test], y[~test])
    r2_tr, med_tr, _ = _scores(y[~test], x[~test] @ c_train)
    r2_te, med_te, max_te = _scores(y[test], x[test] @ c_train)
    med, r2 = (med_te, r2_te) if test.any() else (med_tr, r2_tr)
    poor = bool(med > MAX_MEDIAN_REL_ERR or (np.isfinite(r2) and r2 < MIN_R2))
    msg = ""
    if poor:
        msg = (
            f"{label}: poor fit (median relative error {med:.1%}, R^2 {r2:.3f}; thresholds "
            f"{MAX_MEDIAN_REL_ERR:.0%}, {MIN_R2}); measurements may be noisy or the grid too "
            "narrow: pin threads, add repeats, widen the grid"
        )
        if warn:
            warnings.warn(msg, PoorFitWarning, stacklevel=2)
    report = FitReport(
        int((~test).sum()), int(test.sum()), r2_te, med_te, max_te, r2_tr, med_tr, poor, msg
    )
    coef = nonneg_relative_lsq(x, y)
    return Fit(tuple(float(c) for c in coef), tuple(names), report)


def fit_block_time(
    block_type: str,
    shapes_per_point: Sequence[Sequence[Sequence[int]]],
    seconds: Sequence[float],
    *,
    label: str | None = None,
    window: int = 0,
    joint_text: int = 0,
    **kw,
) -> Fit:
    """Fit TermCoeffs (quad, lin, seq, const) of one block from measured micro-batches
    (`window`: the measured layer's sliding window; `joint_text`: a 3d layer's joint text
    tokens per sample; block_features)."""
    feats = np.array(
        [
            block_features(block_type, s, window=window, joint_text=joint_text)
            for s in shapes_per_point
        ]
    )
    x = np.column_stack([feats, np.ones(len(feats))])
    return fit_nonneg(x, np.asarray(seconds), TERMS, label=label or block_type, **kw)


def fit_per_token(
    tokens: Sequence[float], values: Sequence[float], *, label: str, with_const: bool, **kw
) -> Fit:
    """values ~ a * tokens (+ b): head time per token, activation bytes per token."""
    t = np.asarray(tokens, dtype=float)
    cols = [t, np.ones_like(t)] if with_const else [t]
    names = ("per_token", "const") if with_const else ("per_token",)
    return fit_nonneg(np.column_stack(cols), np.asarray(values), names, label=label, **kw)
