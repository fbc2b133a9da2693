"""Local (single-device) attention kernels the models call through a pluggable function.

Every call takes the whole packed stream it attends over: q [Tq, H, Dh], k and v
[Tk, H_kv, Dh] (H a multiple of H_kv: grouped-query attention is native, kv heads are never
repeated before the call), cut into contiguous sequences by their lengths. Sequence
parallelism (runtime/sp.py) wraps these: it gathers the sequence for a subset of heads, calls
the kernel, and scatters back. Rows never end up fully masked (padding tokens form sequences
of their own), so softmax stays finite and padded positions carry zero gradient once the loss
masks them out.

The kernel is chosen in one place, `choose_kernel`:
- "varlen": on CUDA in half precision without softcap or sinks, every sequence of the call in
  one FlashAttention varlen call (torch.nn.attention.varlen.varlen_attn: cumulative sequence
  offsets, `enable_gqa`, `window_size`; Dao 2023, sec. 3.1). Work sum s^2 (sum s * window
  for a windowed causal layer), what the cost model charges.
- "reference": everywhere else (CPU, float32/64, softcap, sinks): PyTorch's SDPA, one
  batched call per distinct (query length, key length) of the call's sequences, so a 2D
  micro-batch (frames of one video share a length) is a handful of calls and the work is
  still sum s^2, never (sum s)^2.

What each kernel saves for backward, per attention call (the cost model's activation term
should follow the kernel in use; bytes per token per layer besides q, k, v themselves):
- varlen (FlashAttention): out [T, H, Dh] in the compute dtype and the logsumexp [H, T] in
  float32: torch/nn/attention/varlen.py (torch 2.13) `_setup_context`, line 498:
  save_for_backward(query, key, value, cu_seq_q, cu_seq_k, out, lse, rng_state); the lse is
  float32 (`_varlen_attn_fake`, line 167). So 2*H*Dh + 4*H bytes per token in bf16.
- reference, unmasked SDPA on CPU: PyTorch's fused CPU flash kernel
  (aten::_scaled_dot_product_flash_attention_for_cpu -> (output, logsumexp)), whose backward
  node ScaledDotProductFlashAttentionForCpuBackward0 saves q, k, v, out and logsumexp
  [B, H, s] in the inputs' dtype (float32 for bf16 inputs): measured with
  torch.autograd.graph.saved_tensors_hooks on torch 2.13 CPU. Same per-token bytes as
  varlen. A masked call (windowed sequence longer than its window, non-contiguous segment
  ids) also saves the mask as a float [s, s] tensor.
- reference with softcap or sinks: an explicit softmax (`attend`) that saves the scores
  and probabilities, [H, s, s] each per sequence: quadratic, not per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

KERNELS = ("varlen", "reference")
# FlashAttention's varlen kernels run in half precision with head dims up to 256 that are
# multiples of 8 (flash-attention README, "Requirements"; aten _flash_attention_forward).
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def varlen_available() -> bool:
    """Whether this torch has torch.nn.attention.varlen.varlen_attn (torch >= 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_kernel(
    device_type: str, dtype: torch.dtype, *, head_dim: int, softcap=None, sinks=None
) -> str:
    """The attention kernel for a call (one of KERNELS); the only place it is decided.
    varlen_attn cannot honour softcap or sinks (no such argument) nor float32/64 (FlashAttention
    is half precision only), so those calls take the exact reference path instead of being
    approximated; so does any device but CUDA."""
    if device_type != "cuda" or dtype not in _VARLEN_DTYPES:
        return "reference"
    if softcap is not None or sinks is not None:
        return "reference"
    if head_dim % 8 or head_dim > 256:
        return "reference"
    return "varlen" if varlen_available() else "reference"


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segments: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-diagonal self-attention over a packed stream. q: [T, H, Dh], k, v: [T, H_kv, Dh];
    segments: [T] (one id per packed sequence, padding has its own id). Sequences are
    contiguous in the stream, so causality inside a segment is causality by stream index.
    `scale`: the softmax scale (None: 1/sqrt(Dh), SDPA's default).

    The options transformers' attention functions take (integrations/sdpa_attention.py,
    models/gemma2 and gpt_oss eager_attention_forward), each applied exactly:
    - `window` (causal only): a query sees the `window` most recent keys of its own sequence,
      itself included: key j is visible from query i iff i - window < j <= i, as
      transformers.masking_utils.sliding_window_overlay (`kv_idx > q_idx - sliding_window`).
    - `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2).
    - `sinks`: [H] per-head logits of a virtual key with a zero value that joins every
      softmax and is then dropped (gpt-oss `s_aux`).

    Contiguous ids go to `packed_attention` (one kernel call, see the module docstring). On
    the reference path a windowed sequence longer than its window is one masked s x s call
    (exact, but s^2 work, not s * window: a profile of a windowed model fitted on CPU sees
    that, docs/profiler.md); softcap and sinks take an explicit float softmax in the inputs'
    dtype (no fused kernel has them). Non-contiguous segment ids fall back to one masked
    call over the whole stream (same result)."""
    t = q.shape[0]
    if segments.shape[0] != t:
        raise ValueError(f"segments: length {segments.shape[0]} must equal sequence length {t}")
    opts = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "sinks": sinks}
    _check_options(q, k, causal=causal, window=window)
    ids, counts = torch.unique_consecutive(segments, return_counts=True)
    if ids.numel() != torch.unique(ids).numel():
        return _masked_segment_attention(q, k, v, segments=segments, **opts)
    return packed_attention(q, k, v, lengths=counts.tolist(), **opts)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lengths: Sequence[int],
    k_lengths: Sequence[int] | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed sequences, each to itself (k_lengths None) or sequence i of q to
    sequence i of k (cross-attention, non-causal): q [sum lengths, H, Dh], k, v
    [sum k_lengths, H_kv, Dh] -> [sum lengths, H, Dh]. Options as segment_attention. One
    kernel call on the varlen path; one per distinct sequence shape on the reference path."""
    k_lengths = lengths if k_lengths is None else k_lengths
    _check_lengths(q, k, v, lengths, k_lengths, causal=causal)
    _check_options(q, k, causal=causal, window=window)
    kernel = choose_kernel(
        q.device.type, q.dtype, head_dim=q.shape[-1], softcap=softcap, sinks=sinks
    )
    if kernel == "varlen":
        return varlen_attention(
            q, k, v, lengths, k_lengths, causal=causal, scale=scale, window=window
        )
    opts = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "sinks": sinks}
    return _reference_attention(q, k, v, lengths, k_lengths, **opts)


def _check_options(q, k, *, causal: bool, window) -> None:
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window: {window} not allowed; allowed: an integer >= 1, causal only")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"heads: {q.shape[1]} query heads not allowed with {k.shape[1]} kv heads; "
            "allowed: a multiple of the kv heads"
        )


def _check_lengths(q, k, v, lengths, k_lengths, *, causal: bool) -> None:
    if len(lengths) != len(k_lengths):
        raise ValueError(
            f"k_lengths: {len(k_lengths)} sequences, allowed: as many as lengths ({len(lengths)})"
        )
    if min(lengths, default=1) < 1 or min(k_lengths, default=1) < 1:
        raise ValueError("lengths: every sequence needs >= 1 query and >= 1 key; allowed: >= 1")
    if sum(lengths) != q.shape[0] or sum(k_lengths) != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(
            f"lengths: sum {sum(lengths)} (keys {sum(k_lengths)}) must equal the tokens of q "
            f"({q.shape[0]}) and k, v ({k.shape[0]}, {v.shape[0]})"
        )
    if causal and list(lengths) != list(k_lengths):
        raise ValueError("causal: allowed only for self-attention (k_lengths equal to lengths)")


def varlen_window_size(window: int | None, causal: bool = True) -> tuple[int, int]:
    """FlashAttention's (left, right) for transformers' window of w keys: FlashAttention
    lets query i see keys [i - left, i + right], so w keys, itself included, is (w - 1, 0)
    (transformers modeling_flash_attention_utils passes `sliding_window - 1` likewise);
    (-1, 0) is plain causal and (-1, -1) no mask. A tuple, as varlen_attn compares
    `window_size == (-1, 0)` to set is_causal (torch/nn/attention/varlen.py:307)."""
    if not causal:
        return (-1, -1)
    return (-1, 0) if window is None else (window - 1, 0)


def _offsets(lengths: Sequence[int], device) -> torch.Tensor:
    """Cumulative sequence offsets [N + 1] (int32, as varlen_attn's cu_seq_q / cu_seq_k)."""
    return F.pad(torch.tensor(list(lengths), dtype=torch.int64).cumsum(0), (1, 0)).to(
        device=device, dtype=torch.int32
    )


def varlen_attention(q, k, v, lengths, k_lengths, *, causal, scale, window):
    """Every sequence in one varlen call; kv heads as they are (enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(
        q, k, v,
        _offsets(lengths, q.device), _offsets(k_lengths, q.device),
        max(lengths), max(k_lengths),
        scale=scale,
        window_size=varlen_window_size(window, causal),
        enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


def _reference_attention(q, k, v, lengths, k_lengths, **opts):
    """One batched SDPA per distinct (query length, key length): the sequences of one shape
    are gathered into [n, H, s, Dh], attended, and put back in stream order."""
    starts_q = [0, *accumulate(lengths)][:-1]
    starts_k = [0, *accumulate(k_lengths)][:-1]
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(zip(lengths, k_lengths, strict=True)):
        shapes.setdefault(shape, []).append(i)
    if len(shapes) == 1 and len(lengths) > 0:  # one shape: a reshape, no gather
        (a, b), n = next(iter(shapes)), len(lengths)
        out = _one_shape(_batch(q, n, a), _batch(k, n, b), _batch(v, n, b), **opts)
        return out.transpose(1, 2).reshape(q.shape)
    outs, order = [], []
    for (a, b), seqs in shapes.items():
        iq = _rows(starts_q, seqs, a, q.device)
        ik = _rows(starts_k, seqs, b, q.device)
        n = len(seqs)
        out = _one_shape(_batch(q[iq], n, a), _batch(k[ik], n, b), _batch(v[ik], n, b), **opts)
        outs.append(out.transpose(1, 2).reshape(n * a, *q.shape[1:]))
        order.append(iq)
    order_t = torch.cat(order)
    inverse = torch.empty_like(order_t)
    inverse[order_t] = torch.arange(order_t.numel(), device=q.device)
    return torch.cat(outs).index_select(0, inverse)


def _batch(x: torch.Tensor, n: int, s: int) -> torch.Tensor:
    """[n * s, H, Dh] -> [n, H, s, Dh]"""
    return x.reshape(n, s, *x.shape[1:]).transpose(1, 2)


def _rows(starts: list[int], seqs: list[int], length: int, device) -> torch.Tensor:
    """Stream indices of the tokens of sequences `seqs` (each `length` long), in order."""
    first = torch.tensor([starts[i] for i in seqs], device=device)
    return (first[:, None] + torch.arange(length, device=device)).reshape(-1)


def visible(pos_q, pos_k, same, *, causal: bool, window: int | None) -> torch.Tensor:
    """[Tq, Tk] bool: which keys each query may attend to, from in-sequence positions."""
    mask = same
    if causal:
        mask = mask & (pos_k[None, :] <= pos_q[:, None])
    if window is not None:
        mask = mask & (pos_k[None, :] > pos_q[:, None] - window)
    return mask


def _one_shape(q4, k4, v4, *, causal, scale, window, softcap, sinks):
    """n sequences of one shape: q4 [n, H, a, Dh], k4, v4 [n, H_kv, b, Dh] -> [n, H, a, Dh]."""
    a, b = q4.shape[2], k4.shape[2]
    gqa = k4.shape[1] != q4.shape[1]
    if softcap is None and sinks is None and (window is None or a <= window):
        return F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    pos_q, pos_k = torch.arange(a, device=q4.device), torch.arange(b, device=q4.device)
    same = torch.ones(a, b, dtype=torch.bool, device=q4.device)
    mask = visible(pos_q, pos_k, same, causal=causal, window=window)
    return attend(q4, k4, v4, mask, scale=scale, softcap=softcap, sinks=sinks)


def attend(q4, k4, v4, mask, *, scale, softcap, sinks):
    """[B, H, Tq, Dh] attention to [B, H_kv, Tk, Dh] under a bool mask [Tq, Tk]; fused
    (native GQA) unless softcap or sinks, where kv heads are repeated for the explicit
    softmax."""
    gqa = k4.shape[1] != q4.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    if gqa:  # kv head j serves query heads j*g .. j*g + g - 1 (SDPA's enable_gqa order)
        g = q4.shape[1] // k4.shape[1]
        k4, v4 = k4.repeat_interleave(g, dim=1), v4.repeat_interleave(g, dim=1)
    scale = q4.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q4, k4.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one extra column per head, dropped after the softmax
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v4)


def _masked_segment_attention(
    q, k, v, *, segments, causal: bool, scale=None, window=None, softcap=None, sinks=None
):
    """The whole stream in one call, any segment layout; positions counted inside each
    segment (so a window counts the segment's own keys only)."""
    t = q.shape[0]
    same = segments[:, None] == segments[None, :]
    # position of each token among the earlier tokens of its own segment
    pos = (same.tril().sum(dim=1) - 1) if window is not None else torch.arange(t, device=q.device)
    mask = visible(pos, pos, same, causal=causal, window=window)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = attend(q4, k4, v4, mask, scale=scale, softcap=softcap, sinks=sinks)
    return out[0].transpose(0, 1)
