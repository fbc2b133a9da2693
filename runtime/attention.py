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
) -> torch.Tensor:
    """Block-diagonal attention over a packed stream. q, k, v: [T, H, Dh]; segments: [T]
    (one id per packed sequence, padding has its own id). Sequences are contiguous in the
    stream, so causality inside a segment is causality by stream index. `scale`: the softmax
    scale (None: 1/sqrt(Dh), SDPA's default).

    Computed one segment at a time: cost sum s^2 rather than (sum s)^2, which is what the cost
    model assumes of a packed micro-batch (as FlashAttention's varlen kernels do; Dao 2023,
    sec. 3.1), and unmasked 4-D inputs select PyTorch's fused kernel. Non-contiguous segment
    ids fall back to one masked call over the whole stream (same result)."""
    t = q.shape[0]
    if segments.shape[0] != t:
        raise ValueError(f"segments: length {segments.shape[0]} must equal sequence length {t}")
    ids, counts = torch.unique_consecutive(segments, return_counts=True)
    if ids.numel() != torch.unique(ids).numel():
        return _masked_segment_attention(q, k, v, segments=segments, causal=causal, scale=scale)
    outs = [
        F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None],
            ks.transpose(0, 1)[None],
            vs.transpose(0, 1)[None],
            is_causal=causal,
            scale=scale,
        )[0].transpose(0, 1)
        for qs, ks, vs in zip(
            q.split(counts.tolist()),
            k.split(counts.tolist()),
            v.split(counts.tolist()),
            strict=True,
        )
    ]
    return torch.cat(outs)


def _masked_segment_attention(q, k, v, *, segments, causal: bool, scale: float | None = None):
    t = q.shape[0]
    mask = segments[:, None] == segments[None, :]
    if causal:
        mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


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
