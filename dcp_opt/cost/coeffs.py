"""Cost coefficients: seconds per unit of each additive feature, per block and pass, and the
bytes per token of activations and all-to-alls; from a profile (profile_io) or from FLOP
counts and the cluster's peak (`flops_coefficients`, the preset)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from ..cluster import GB, Cluster
from ..errors import DcpOptError, is_int, is_real
from ..model import ModelSpec
from . import dit3d


@dataclass(frozen=True)
class TermCoeffs:
    """Seconds on one GPU of speed 1, for one block of one layer."""

    quad: float = 0.0
    lin: float = 0.0
    seq: float = 0.0
    const: float = 0.0


@dataclass(frozen=True)
class BlockCoeffs:
    fwd: TermCoeffs
    bwd: TermCoeffs


@dataclass(frozen=True)
class CostCoefficients:
    blocks: dict[str, BlockCoeffs]
    head_fwd_per_token_s: float
    head_bwd_per_token_s: float
    microbatch_overhead_s: float
    a2a_bytes_per_token_layer: float
    a2a_calls_per_layer: int
    act_bytes_per_token_layer: float
    ckpt_bytes_per_token_layer: float
    head_bytes_per_token: float
    reserved_bytes: float
    source: str = "preset"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostCoefficients:
        d = dict(d)
        try:
            d["blocks"] = {
                k: BlockCoeffs(TermCoeffs(**v["fwd"]), TermCoeffs(**v["bwd"]))
                for k, v in d["blocks"].items()
            }
            return cls(**d)
        except (KeyError, TypeError, AttributeError) as e:
            raise DcpOptError(f"cost coefficients: malformed ({e})") from None


_TERMS = ("quad", "lin", "seq", "const")
# Fields the cost model divides by (through the per-token memory (L + 1) * act + head that
# solvers/greedy/instance.py and the baselines' profile divide capacity by): > 0.
_POSITIVE = ("act_bytes_per_token_layer",)


def check_coefficients(
    coeffs, where: str = "cost coefficients", error: type[DcpOptError] = DcpOptError
) -> None:
    """Refuse coefficients the cost model cannot price with, naming the field: every time
    (seconds per unit) and every byte count finite and >= 0, the activation bytes > 0 (the
    cost model divides by them), one time coefficient > 0 (planners divide by step times),
    the all-to-all calls an integer >= 0 (no bool), the blocks a dict of BlockCoeffs. The profile loader's rule (dcp_opt/profile_io.py) for a
    CostCoefficients built in Python: a negative coefficient would plan to a negative step
    time, a nan or inf to nan everywhere. `error`: the class raised (the profile loader's
    ProfileError, say), a DcpOptError by default."""
    try:
        _check(coeffs, where)
    except DcpOptError as e:
        if error is DcpOptError:
            raise
        raise error(str(e)) from None


def _check(coeffs, where: str) -> None:
    if not isinstance(coeffs, CostCoefficients):
        raise DcpOptError(f"{where}: must be a CostCoefficients, got {type(coeffs).__name__}")
    if not isinstance(coeffs.blocks, dict) or not coeffs.blocks:
        raise DcpOptError(f"{where}.blocks: must be a non-empty dict of block name -> BlockCoeffs")
    for name, block in coeffs.blocks.items():
        if not isinstance(block, BlockCoeffs):
            raise DcpOptError(f"{where}.blocks.{name}: must be a BlockCoeffs, got {block!r}")
        for part in ("fwd", "bwd"):
            terms = getattr(block, part)
            if not isinstance(terms, TermCoeffs):
                raise DcpOptError(f"{where}.blocks.{name}.{part}: must be a TermCoeffs")
            for term in _TERMS:
                _nonnegative(getattr(terms, term), f"{where}.blocks.{name}.{part}.{term}")
    for f in fields(CostCoefficients):
        if f.name in ("blocks", "source"):
            continue
        v = getattr(coeffs, f.name)
        field_name = f"{where}.{f.name}"
        if f.name == "a2a_calls_per_layer":
            if not (is_int(v) and v >= 0):
                raise DcpOptError(f"{field_name}: must be an integer >= 0, got {v!r}")
            continue
        _nonnegative(v, field_name)
        if f.name in _POSITIVE and not v > 0:
            raise DcpOptError(
                f"{field_name}: must be > 0 (the cost model divides capacity by the bytes a "
                f"token holds), got {v!r}"
            )
    seconds = [getattr(getattr(b, part), t) for b in coeffs.blocks.values()
               for part in ("fwd", "bwd") for t in _TERMS]  # fmt: skip
    seconds += [coeffs.head_fwd_per_token_s, coeffs.head_bwd_per_token_s]
    if not any(v > 0 for v in [*seconds, coeffs.microbatch_overhead_s]):
        raise DcpOptError(
            f"{where}: every time coefficient is 0, so every micro-batch would take 0 s (the "
            "planners divide by step times); at least one (e.g. microbatch_overhead_s) must "
            "be > 0"
        )
    if not isinstance(coeffs.source, str):
        raise DcpOptError(f"{where}.source: must be a string, got {coeffs.source!r}")


def _nonnegative(v, field_name: str) -> None:
    if not (is_real(v) and v >= 0):
        raise DcpOptError(f"{field_name}: must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class Efficiency:
    """Assumptions behind the FLOP-derived presets (docs/cost-model.md)."""

    mfu_linear: float = 0.55  # matmul share of peak reached in training (Megatron reports ~0.5)
    mfu_attention: float = 0.45  # FlashAttention-2/3 fwd+bwd share of peak on Hopper
    bwd_linear_ratio: float = 2.0  # backward = 2x forward FLOPs (Narayanan et al. 2021, eq. 3)
    bwd_attention_ratio: float = 2.5  # FlashAttention-2 backward ~2.5x forward (Dao 2023, sec. 3)
    block_launch_s: float = 30e-6  # kernel launches of one block's forward
    microbatch_overhead_s: float = 4e-3  # embedding, loss, data copy, hooks
    reserved_bytes: float = 4 * GB  # CUDA context, NCCL buffers of many groups, fragmentation


def flops_coefficients(
    model: ModelSpec, cluster: Cluster, eff: Efficiency = Efficiency()
) -> CostCoefficients:
    """Coefficients from FLOP counts and the cluster's peak (no profile needed)."""
    h, f, b = model.hidden, model.ffn_hidden, model.dtype_bytes
    lin_rate = cluster.peak_flops * eff.mfu_linear
    att_rate = cluster.peak_flops * eff.mfu_attention
    # Forward FLOPs of the matmuls: 2 per parameter per token (Kaplan et al. 2020, sec. 2.1).
    lin_flops = 2 * model.params_per_block
    if model.kind == "1d":
        quad_flops = 2 * h  # QK^T and PV: 4 s^2 h, halved by the causal mask
        seq_flops = 0.0
    elif model.kind == "3d":  # full 3-D attention, text joint or cross (cost/dit3d.py)
        quad_flops, lin_flops, seq_flops = dit3d.forward_flops(model)
    else:
        quad_flops = 4 * h  # full (non-causal) attention over the block's axis
        lin_flops += 4 * h * model.text_tokens  # cross-attention scores and PV
        seq_flops = 4 * h * h * model.text_tokens  # cross-attention k, v of the caption
    fwd = TermCoeffs(
        quad_flops / att_rate, lin_flops / lin_rate, seq_flops / lin_rate, eff.block_launch_s
    )
    bwd = TermCoeffs(
        fwd.quad * eff.bwd_attention_ratio,
        fwd.lin * eff.bwd_linear_ratio,
        fwd.seq * eff.bwd_linear_ratio,
        fwd.const * 2,
    )
    blocks = {name: BlockCoeffs(fwd, bwd) for name in model.block_types}
    nb = len(model.block_types)
    if model.kind == "1d":
        head_flops = 2 * h * model.vocab_size
        # Saved per token per layer (2-byte units), FlashAttention so no s^2 term: norm inputs
        # 2h, qkv input h, q k v 3h (k, v narrower under GQA), attention output h, MLP input
        # h, gate/up/act/product 4f (SwiGLU; 2f for a plain MLP) -- Korthikanti et al. 2022
        # eq. 1 re-derived for Llama.
        act = b * ((6 + 2 * model.kv_fraction) * h + (4 if model.gated_mlp else 2) * f)
        head_bytes = 6 * model.vocab_size  # bf16 logits + fp32 softmax of the loss
        a2a = 4 * h * b
        calls = 4
    elif model.kind == "3d":
        head_flops = 2 * h * 64  # final projection to patch channels (64 in all four presets)
        act = dit3d.activation_bytes(model)
        head_bytes = 4 * h * b
        a2a = 4 * h * b  # Ulysses' q, k, v and output of the (self-)attention, as 1D
        calls = 4
    else:
        head_flops = 2 * h * 64  # final projection to patch channels
        act = nb * b * (13 * h + 2 * f)  # per block: attention 8h, cross 4h, MLP h + 2f
        head_bytes = 4 * h * b
        a2a = 2 * h * b
        calls = 2
    return CostCoefficients(
        blocks=blocks,
        head_fwd_per_token_s=head_flops / lin_rate,
        head_bwd_per_token_s=2 * head_flops / lin_rate,
        microbatch_overhead_s=eff.microbatch_overhead_s,
        a2a_bytes_per_token_layer=a2a,
        a2a_calls_per_layer=calls,
        act_bytes_per_token_layer=act,
        ckpt_bytes_per_token_layer=nb * b * h,
        head_bytes_per_token=head_bytes,
        reserved_bytes=eff.reserved_bytes,
        source="flops",
    )


def windowed_quad(t, window: int = 0, share: float = 1.0):
    """Attention feature Q of a causal 1D sequence of t tokens (a float or an array) when a
    `share` of the layers has a sliding window of `window` keys (0: none): s^2, less
    share * (s - w)^2 for s > w (CostModel._quad_1d gives the arithmetic). The one definition:
    the cost model's features and the profiler's fit (dcp_opt/fit.py) both call it. Without
    a window it is t * t bit for bit."""
    if not window:
        return t * t
    excess = np.maximum(t - window, 0.0)
    return t * t - share * (excess * excess)
