"""Online recalibration: correct the cost model from measured micro-batch times, robustly.

The runtime reports, per micro-batch, the SP degree, the cost model's predicted time and the
measured time. For each degree d (and for all degrees together) the estimator keeps a factor
f_d ~ measured / predicted:

1. warm start: the first `warmup` ratios of a degree set log f_d to their median (a median
   of k values ignores up to (k-1)//2 outliers);
2. then a clipped EWMA in log space (a Huber-style M-estimator step):
       e = log(measured / predicted) - log f_d
       log f_d += alpha * clip(e, -clip_log, clip_log)
   so one observation moves f_d by at most a factor exp(alpha * clip_log) (default
   exp(0.1 * 0.3) = 1.030: 3%), however wild it is, while a real, lasting drift is tracked
   at up to 3% per observation;
3. f_d stays within [min_factor, max_factor].

Log space makes "twice as slow" and "twice as fast" symmetric. `drift()` exposes every
factor with its recent median ratio; `RecalibratedCostModel` is a CostModel whose
micro-batch times are multiplied by f_d (unseen degrees use the all-degree factor), so the
simulator and every planner use the corrected times unchanged. Gradient sync is not
corrected (it is not a micro-batch time).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .cost import CostModel
from .errors import DcpOptError, require

ALL = 0  # key of the all-degree factor


@dataclass(frozen=True)
class RecalibrationConfig:
    alpha: float = 0.1
    clip_log: float = 0.3
    warmup: int = 5
    min_factor: float = 0.2
    max_factor: float = 5.0
    window: int = 64  # recent ratios kept per degree for drift reporting

    def __post_init__(self) -> None:
        require(0 < self.alpha <= 1, "recalibration.alpha", f"must be in (0, 1], got {self.alpha}")
        require(self.clip_log > 0, "recalibration.clip_log", f"must be > 0, got {self.clip_log}")
        require(self.warmup >= 1, "recalibration.warmup", f"must be >= 1, got {self.warmup}")
        require(
            0 < self.min_factor <= 1 <= self.max_factor,
            "recalibration.min_factor/max_factor",
            f"need 0 < min <= 1 <= max, got {self.min_factor}, {self.max_factor}",
        )

    @property
    def max_step(self) -> float:
        """Largest factor change one observation can cause after warm-up."""
        return math.exp(self.alpha * self.clip_log)


@dataclass
class _State:
    log_factor: float = 0.0
    n: int = 0
    warm: list = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=64))


class Recalibrator:
    """Tracks measured / predicted per SP degree. Not thread-safe; feed it from one thread."""

    def __init__(self, config: RecalibrationConfig = RecalibrationConfig()):
        self.config = config
        self._states: dict[int, _State] = {}

    def observe(self, degree: int, predicted_s: float, measured_s: float) -> None:
        """One micro-batch: its degree, predicted and measured seconds."""
        if not (predicted_s > 0 and measured_s > 0):
            raise DcpOptError(
                f"recalibration: predicted_s and measured_s must be > 0, got "
                f"{predicted_s!r}, {measured_s!r}"
            )
        r = math.log(measured_s / predicted_s)
        for key in (int(degree), ALL):
            self._update(self._states.setdefault(key, self._new_state()), r)

    def _new_state(self) -> _State:
        return _State(recent=deque(maxlen=self.config.window))

    def _update(self, st: _State, log_ratio: float) -> None:
        c = self.config
        st.n += 1
        st.recent.append(log_ratio)
        if st.n <= c.warmup:
            st.warm.append(log_ratio)
            st.log_factor = float(np.median(st.warm))
        else:
            e = log_ratio - st.log_factor
            st.log_factor += c.alpha * max(-c.clip_log, min(c.clip_log, e))
        st.log_factor = min(math.log(c.max_factor), max(math.log(c.min_factor), st.log_factor))

    def factor(self, degree: int | None = None) -> float:
        """f_d; the all-degree factor for an unseen degree (or degree None); 1 before any."""
        st = self._states.get(ALL if degree is None else int(degree)) or self._states.get(ALL)
        return math.exp(st.log_factor) if st else 1.0

    def num_observations(self, degree: int | None = None) -> int:
        st = self._states.get(ALL if degree is None else int(degree))
        return st.n if st else 0

    def drift(self) -> dict:
        """{degree or "all": {factor, drift (= factor - 1), median_ratio of the window, n}}."""
        out = {}
        for key, st in sorted(self._states.items()):
            out["all" if key == ALL else key] = {
                "factor": math.exp(st.log_factor),
                "drift": math.exp(st.log_factor) - 1.0,
                "median_ratio": math.exp(float(np.median(st.recent))),
                "n": st.n,
            }
        return out

    def degree_factors(self) -> tuple[tuple[int, float], ...]:
        return tuple(
            (k, math.exp(st.log_factor)) for k, st in sorted(self._states.items()) if k != ALL
        )

    def corrected(self, cost: CostModel) -> RecalibratedCostModel:
        """A CostModel whose micro-batch times carry the current factors."""
        base = cost.base if isinstance(cost, RecalibratedCostModel) else cost
        return RecalibratedCostModel(
            **base.init_fields(),
            degree_factors=self.degree_factors(),
            default_factor=self.factor(None),
        )


@dataclass(frozen=True)
class RecalibratedCostModel(CostModel):
    """CostModel with micro-batch times multiplied by a measured factor per degree."""

    degree_factors: tuple[tuple[int, float], ...] = ()
    default_factor: float = 1.0

    def factor(self, d: int) -> float:
        return dict(self.degree_factors).get(int(d), self.default_factor)

    @property
    def base(self) -> CostModel:
        return CostModel(**self.init_fields())

    def time_parts(self, feats, d: int, recompute_layers, **kw):
        f = self.factor(d)
        c, r, m = super().time_parts(feats, d, recompute_layers, **kw)
        return c * f, r * f, m * f

    def fingerprint(self) -> str:
        extra = ",".join(f"{d}:{f:.9g}" for d, f in self.degree_factors)
        payload = f"{super().fingerprint()}|{extra}|{self.default_factor:.9g}"
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
