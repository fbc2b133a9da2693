"""Perturbed cost models: what a measured profile may differ from the FLOP preset by.

Users plan with the cost model `dcp-opt profile` measures on their hardware and model; the
planners were tuned on the preset. Each knob below moves one thing a measurement could show,
within the range such a measurement could give, using the cost model's own knobs
(dcp_opt/cost/), so the simulator and the bounds charge it exactly as the planners see it:

| knob | range | what a measurement could show |
|---|---|---|
| `sp_step` | 0 - 0.5 | any degree > 1 runs a layer 1 + x slower than its FLOP share: smaller kernels on T/d tokens, shard copies, waiting for the slowest member (the issue 19 case: "SP groups are expensive") |
| `sp_per_doubling` | 0 - 0.15 | the same growing with log2(d): +45 % at d = 8 at the top of the range |
| `replicated_seq_s` | 0 - 10 ms | per-sample work every rank of a group repeats (VideoSys keeps the caption's cross-attention k/v and the data path whole on every rank; REFERENCE.md sec. 5 reports +8-13 % for such terms); STDiT3-XL's caption projections alone are ~0.5 ms per sample by FLOPs |
| `microbatch_scale` | 0.25 - 5 | per-micro-batch fixed cost (preset 4 ms: embedding, loss, hooks, data copy) between 1 and 20 ms, as eager frameworks measure |
| `step_overhead_s` | 0 - 0.5 s | fixed cost per optimizer step (optimizer, host sync); ~0.25 s fits the DSP paper's Fig. 3 (REFERENCE.md sec. 5) |
| `bw_scale` | 0.25 - 1 | collective bandwidth: NCCL all-to-all reaches 25-85 % of the link rate depending on message size and topology (nccl-tests busbw) |
| `latency_scale` | 1 - 10 | per-peer collective latency 5 -> 50 us intra-node (NCCL small messages, host launch) |
| `attn_half_len` | 0 - 1024 | attention efficiency by length: eff(s) = s / (s + s_half); FlashAttention-2 runs ~0.6x of its long-sequence throughput at 512 tokens (Dao 2023, Fig. 4), s_half ~ 340; up to 1024 for slower kernels. Charged as the per-token term quad * s_half, exact: sum s^2 / eff(s) = sum s^2 + s_half * sum s |
| `attn_scale` | 0.7 - 1.5 | attention throughput overall (mfu_attention 0.30 - 0.64) |
| `act_scale` | 0.8 - 1.5 | activation bytes per token (allocator rounding, buffers Korthikanti's formula leaves out) |
| `reserved_gb` | 2 - 16 | reserved memory (CUDA context, NCCL buffers of many groups, fragmentation) |

What the profiler fits today: the block coefficients (attention quad term and the linear
terms, so `attn_half_len` and `attn_scale` appear as fitted quad/lin), the per-micro-batch
overhead and the step's gradient sync (runtime calibration, dcp_opt/profile_io.py), and the
all-to-all bandwidth and latency per group size. The runtime calibration
(`dcp-opt profile --calibrate-world N`, runtime/profile/fit.py) also fits
`sp_compute_overhead` per degree jointly with the in-situ all-to-all, `replicated_seq_s`
(per layer, from calibration micro-batches of several sample counts at several degrees) and
`step_overhead_s` (the step beyond the executor's gradient sum), and
`cost_model_from_profile` sets them (docs/profiler.md). `fit_sp_overhead` turns micro-batch
times with the all-to-all already taken out into `sp_compute_overhead`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from .cluster import GB
from .cost import BlockCoeffs, CostModel, TermCoeffs
from .errors import DcpOptError

# knob -> (low, high, preset value)
RANGES: dict[str, tuple[float, float, float]] = {
    "sp_step": (0.0, 0.5, 0.0),
    "sp_per_doubling": (0.0, 0.15, 0.0),
    "replicated_seq_s": (0.0, 0.010, 0.0),
    "microbatch_scale": (0.25, 5.0, 1.0),
    "step_overhead_s": (0.0, 0.5, 0.0),
    "bw_scale": (0.25, 1.0, 1.0),
    "latency_scale": (1.0, 10.0, 1.0),
    "attn_half_len": (0.0, 1024.0, 0.0),
    "attn_scale": (0.7, 1.5, 1.0),
    "act_scale": (0.8, 1.5, 1.0),
    "reserved_gb": (2.0, 16.0, None),  # None: the base model's own value
}

# The named family: each knob at the end of its range that hurts, one at a time, then all
# of them at mid-range together.
FAMILY: dict[str, dict[str, float]] = {
    "preset": {},
    "sp-step": {"sp_step": 0.5},
    "sp-per-doubling": {"sp_per_doubling": 0.15},
    "replicated-sample": {"replicated_seq_s": 0.010},
    "microbatch-fixed": {"microbatch_scale": 5.0},
    "step-fixed": {"step_overhead_s": 0.5},
    "slow-collectives": {"bw_scale": 0.25, "latency_scale": 10.0},
    "attention-by-length": {"attn_half_len": 1024.0, "attn_scale": 1.5},
    "activation-bytes": {"act_scale": 1.5},
    "reserved-memory": {"reserved_gb": 16.0},
    "combined": {
        "sp_step": 0.25,
        "sp_per_doubling": 0.05,
        "replicated_seq_s": 0.004,
        "microbatch_scale": 2.0,
        "step_overhead_s": 0.25,
        "bw_scale": 0.5,
        "latency_scale": 3.0,
        "attn_half_len": 512.0,
        "attn_scale": 1.2,
        "act_scale": 1.2,
        "reserved_gb": 8.0,
    },
}


def perturb(base: CostModel, **knobs: float) -> CostModel:
    """`base` with the knobs of RANGES applied (each relative to `base`, so they compose with
    a profile's own coefficients). An unknown knob or a value outside its range is an error;
    `base` is left unchanged."""
    for k, v in knobs.items():
        if k not in RANGES:
            raise DcpOptError(f"perturbation {k!r}: not a knob; allowed: {sorted(RANGES)}")
        lo, hi, _ = RANGES[k]
        if not (isinstance(v, (int, float)) and lo <= v <= hi):
            raise DcpOptError(f"perturbation {k}: must be in [{lo}, {hi}], got {v!r}")
    get = knobs.get
    co = base.coeffs
    a, half = get("attn_scale", 1.0), get("attn_half_len", 0.0)

    def term(t: TermCoeffs) -> TermCoeffs:
        # attention at efficiency s / (s + s_half): quad * (s^2 + s_half * s) per sequence
        # of the block's axis; the s term sums to the block's tokens
        return replace(t, quad=t.quad * a, lin=t.lin + t.quad * a * half)

    # only the fields a knob moves: an untouched integer stays one (the fingerprint's JSON
    # writes 3 and 3.0 differently)
    changes: dict = {}
    if "attn_scale" in knobs or "attn_half_len" in knobs:
        changes["blocks"] = {n: BlockCoeffs(term(b.fwd), term(b.bwd)) for n, b in co.blocks.items()}
    if "microbatch_scale" in knobs:
        changes["microbatch_overhead_s"] = co.microbatch_overhead_s * knobs["microbatch_scale"]
    if "act_scale" in knobs:
        changes["act_bytes_per_token_layer"] = co.act_bytes_per_token_layer * knobs["act_scale"]
    if "reserved_gb" in knobs:
        changes["reserved_bytes"] = knobs["reserved_gb"] * GB
    coeffs = replace(co, **changes) if changes else co
    c = base.cluster
    cluster = c
    if "bw_scale" in knobs or "latency_scale" in knobs:
        bw, lat = get("bw_scale", 1.0), get("latency_scale", 1.0)
        cluster = c.with_(
            intra_node_bw=c.intra_node_bw * bw,
            inter_node_bw=c.inter_node_bw * bw,
            intra_node_latency_s=c.intra_node_latency_s * lat,
            inter_node_latency_s=c.inter_node_latency_s * lat,
        )
    over = dict(base.sp_compute_overhead)
    step, per = get("sp_step", 0.0), get("sp_per_doubling", 0.0)
    if step or per:
        for d in cluster.allowed_degrees:
            if d > 1:
                over[d] = over.get(d, 0.0) + step + per * math.log2(d)
    knob_changes = {
        k: getattr(base, k) + knobs[k]
        for k in ("replicated_seq_s", "step_overhead_s")
        if knobs.get(k)
    }
    return base.with_(
        coeffs=coeffs,
        cluster=cluster,
        sp_compute_overhead=tuple(sorted((d, x) for d, x in over.items() if x)),
        **knob_changes,
    )


def perturbed_cost_models(base: CostModel) -> dict[str, CostModel]:
    """The named family (FAMILY) built on `base`: name -> CostModel."""
    return {name: perturb(base, **knobs) for name, knobs in FAMILY.items()}


def fit_sp_overhead(samples: Iterable[tuple[int, float, float]]) -> tuple[tuple[int, float], ...]:
    """`sp_compute_overhead` from (degree, predicted layer-compute seconds, measured layer-
    compute seconds) of micro-batches run at several degrees (the measured all-to-all taken
    out): per degree above 1, the median of measured / predicted less the median at degree 1
    (what degree 1 shows is a calibration of all degrees, CostModel's compute factor, not an
    SP overhead), floored at 0. A median of k ratios ignores up to (k - 1) // 2 outliers."""
    ratios: dict[int, list[float]] = {}
    for d, pred, meas in samples:
        if not (pred > 0 and meas > 0 and int(d) >= 1):
            raise DcpOptError(
                f"sp overhead sample: needs degree >= 1 and times > 0, got {(d, pred, meas)}"
            )
        ratios.setdefault(int(d), []).append(meas / pred)
    if 1 not in ratios:
        raise DcpOptError("sp overhead samples: need degree-1 samples as the reference")

    def median(x: list[float]) -> float:
        s = sorted(x)
        m = len(s) // 2
        return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])

    ref = median(ratios[1])
    return tuple((d, max(median(r) / ref - 1.0, 0.0)) for d, r in sorted(ratios.items()) if d > 1)
