"""Cost model: time and memory of one micro-batch at SP degree d with r recomputed layers.

Every quantity is per layer and per block type (1D: "layer"; 2D: "spatial", "temporal") and
is a function of additive features of the micro-batch, so packing sequences adds features:

    Q_b  attention work of block b: 1D sum s^2 (causal); 2D spatial sum F*S^2, temporal sum S*F^2;
         1D layers with a sliding window w: s^2 - (s-w)^2 for s > w, i.e. ~2sw (features.py)
         3D (full-attention video DiT): (v + j)^2 with j joint text tokens, v^2 under
         cross-attention (dit3d.py)
    T    tokens;   S  sequences

Time of one block's forward on one GPU of speed 1 (fitted by the profiler, or from FLOPs):
    t_b = quad_b * Q_b * heads_share(d) + (lin_b * T + seq_b * S) / d + const_b
where heads_share(d) = ceil(H/d)/H: Ulysses splits attention by heads (Jacobs et al. 2023,
DeepSpeed-Ulysses, sec. 3), so a degree that does not divide H leaves some ranks more heads.
Backward has its own coefficients; a recomputed layer pays one more forward (Chen et al. 2016,
"Training deep nets with sublinear memory cost"). Communication: Ulysses moves q, k, v and
the attention output through all-to-alls (4 per layer forward; DeepSpeed-Ulysses eq. 1; under
grouped-query attention k and v with fewer heads, ModelSpec.a2a_volume_share);
2D dimension switching moves the activations twice per layer (Zhao et al. 2024, DSP, sec. 3).
Each rank sends (d-1)/d of its T/d-token shard; the part leaving the node goes at the NIC rate.

Memory per member (Korthikanti et al. 2022, "Reducing activation recomputation", sec. 4):
model states + reserve + T/d * ((L - r) * act + r * ckpt + act + head), where the extra `act`
is the working set of the one layer being recomputed or back-propagated.

The package by concern: coeffs.py (coefficients and the FLOP-derived presets), features.py,
compute.py (time), dit3d.py (full-attention video DiTs), comm.py (all-to-alls and the step's
world collectives), memory.py, cp.py (the second SP kind, all-gather-KV context parallelism), phase.py (one phase priced
in one call), memo.py, and model.py (CostModel: the data, its checks and fingerprint).
"""

from .coeffs import (
    BlockCoeffs,
    CostCoefficients,
    Efficiency,
    TermCoeffs,
    flops_coefficients,
    windowed_quad,
)
from .comm import StepCosts, runtime_reduce_bytes
from .compute import TimeBreakdown
from .memo import MemoCache
from .memory import SHARDING_MODES
from .model import (
    CostModel,
    combine_fingerprints,
    default_normalizer_kind,
    loss_normalizer,
    plan_fingerprint,
)
from .phase import PhaseCosts

__all__ = [
    "SHARDING_MODES",
    "BlockCoeffs",
    "CostCoefficients",
    "CostModel",
    "Efficiency",
    "MemoCache",
    "PhaseCosts",
    "StepCosts",
    "TermCoeffs",
    "TimeBreakdown",
    "combine_fingerprints",
    "default_normalizer_kind",
    "flops_coefficients",
    "loss_normalizer",
    "plan_fingerprint",
    "runtime_reduce_bytes",
    "windowed_quad",
]
