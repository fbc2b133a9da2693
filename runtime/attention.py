"""Local (single-device) attention kernels the models call through a pluggable function.

Both take the whole sequence they attend over; sequence parallelism (runtime/sp.py) wraps
them: it gathers the sequence for a subset of heads, calls the kernel, and scatters back.
Rows never end up fully masked (padding tokens attend to each other), so softmax stays finite
and padded positions carry zero gradient once the loss masks them out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """Block-diagonal attention over a packed stream. q, k, v: [T, H, Dh]; segments: [T]
    (one id per packed sequence, padding has its own id). Sequences are contiguous in the
    stream, so causality inside a segment is causality by stream index. `scale`: the softmax
    scale (None: 1/sqrt(Dh), SDPA's default).

    The options transformers' attention functions take (integrations/sdpa_attention.py,
    models/gemma2 and gpt_oss eager_attention_forward), each applied exactly:
    - `window` (causal only): a query sees the `window` most recent keys of its own sequence,
      itself included: key j is visible from query i iff i - window < j <= i, as
      transformers.masking_utils.sliding_window_overlay (`kv_idx > q_idx - sliding_window`).
    - `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2).
    - `sinks`: [H] per-head logits of a virtual key with a zero value that joins every
      softmax and is then dropped (gpt-oss `s_aux`).

    On CUDA in half precision (causal, no softcap or sinks) every segment goes in one
    FlashAttention varlen call with `window_size` (_use_varlen): work ~ s * window, what the
    cost model charges a windowed layer. Otherwise computed one segment at a time: cost sum
    s^2 rather than (sum s)^2, which is what the cost model assumes of a packed micro-batch
    (as FlashAttention's varlen kernels do; Dao 2023, sec. 3.1), and unmasked 4-D inputs
    select PyTorch's fused kernel. A windowed segment longer than its window is one masked
    s x s call on this path (exact, but s^2 work, not s * window: a profile of a windowed
    model fitted on CPU sees that, docs/profiler.md). Softcap and sinks take an explicit float softmax in the inputs'
    dtype (no fused CPU kernel has them). Non-contiguous segment ids fall back to one masked
    call over the whole stream (same result)."""
    t = q.shape[0]
    if segments.shape[0] != t:
        raise ValueError(f"segments: length {segments.shape[0]} must equal sequence length {t}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"window: {window} not allowed; allowed: an integer >= 1, causal only")
    opts = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "sinks": sinks}
    ids, counts = torch.unique_consecutive(segments, return_counts=True)
    if ids.numel() != torch.unique(ids).numel():
        return _masked_segment_attention(q, k, v, segments=segments, **opts)
    if _use_varlen(q, causal=causal, softcap=softcap, sinks=sinks):
        return _varlen_attention(q, k, v, counts, scale=scale, window=window)
    sizes = counts.tolist()
    outs = [
        _one_segment(qs, ks, vs, **opts)
        for qs, ks, vs in zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
    ]
    return torch.cat(outs)


def _use_varlen(q: torch.Tensor, *, causal: bool, softcap, sinks) -> bool:
    """FlashAttention's varlen kernel (torch.nn.attention.varlen.varlen_attn) on CUDA for
    half precision, causal, no softcap or sinks; everything else takes the per-segment path
    (float32/64 and CPU: PyTorch's SDPA kernels)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and causal):
        return False
    if softcap is not None or sinks is not None:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_window_size(window: int | None) -> tuple[int, int]:
    """FlashAttention's (left, right) for transformers' window of w keys: FlashAttention
    lets query i see keys [i - left, i + right], so w keys, itself included, is (w - 1, 0)
    (transformers modeling_flash_attention_utils passes `sliding_window - 1` likewise);
    (-1, 0) is plain causal."""
    return (-1, 0) if window is None else (window - 1, 0)


def _varlen_attention(q, k, v, counts, *, scale, window):
    """All segments in one varlen call: cu_seqlens from the segment sizes (q, k, v: [T, H, Dh],
    equal head counts)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = F.pad(counts.cumsum(0), (1, 0)).to(device=q.device, dtype=torch.int32)
    longest = int(counts.max())
    return varlen_attn(
        q, k, v, cu, cu, longest, longest, scale=scale, window_size=varlen_window_size(window)
    )


def _visible(pos_q, pos_k, same, *, causal: bool, window: int | None) -> torch.Tensor:
    """[Tq, Tk] bool: which keys each query may attend to, from in-sequence positions."""
    mask = same
    if causal:
        mask = mask & (pos_k[None, :] <= pos_q[:, None])
    if window is not None:
        mask = mask & (pos_k[None, :] > pos_q[:, None] - window)
    return mask


def _one_segment(q, k, v, *, causal, scale, window, softcap, sinks):
    """One sequence: [s, H, Dh] -> [s, H, Dh]."""
    s = q.shape[0]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    if softcap is None and sinks is None and (window is None or s <= window):
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=scale)
        return out[0].transpose(0, 1)
    pos = torch.arange(s, device=q.device)
    same = torch.ones(s, s, dtype=torch.bool, device=q.device)
    mask = _visible(pos, pos, same, causal=causal, window=window)
    return _attend(q4, k4, v4, mask, scale=scale, softcap=softcap, sinks=sinks)[0].transpose(0, 1)


def _attend(q4, k4, v4, mask, *, scale, softcap, sinks):
    """[B, H, T, Dh] attention under a bool mask [T, T]; fused unless softcap or sinks."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
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
    mask = _visible(pos, pos, same, causal=causal, window=window)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = _attend(q4, k4, v4, mask, scale=scale, softcap=softcap, sinks=sinks)
    return out[0].transpose(0, 1)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full attention per batch row. q: [B, Lq, H, Dh]; k, v: [B, Lk, H, Dh];
    key_mask: [Lk] bool, False for keys nobody may attend to (padding)."""
    mask = None if key_mask is None else key_mask[None, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)
