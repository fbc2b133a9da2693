"""Sequence parallelism inside one group: autograd-correct all-to-all, Ulysses attention for
1D models, and DSP dimension switching for 2D spatial-temporal models.

- Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses, sec. 3): each rank holds a contiguous shard
  of the (packed) sequence with all heads; an all-to-all gives each rank the whole sequence for
  H/d heads, attention runs locally, a second all-to-all returns to sequence shards. When d does
  not divide H the heads are zero-padded to a multiple of d (the cost model's ceil(H/d)/H).
- DSP (Zhao et al. 2024, "DSP: Dynamic Sequence Parallelism", sec. 3): a video [F, S, C] is
  sharded over frames for spatial blocks and over spatial tokens for temporal blocks; one
  all-to-all switches the sharded dimension. F and S are padded to multiples of d. The
  runtime switches a whole micro-batch of videos in one all-to-all (runtime/video.py);
  `frames_to_tokens` / `tokens_to_frames` below are the one-video form.

Every collective here is an autograd Function whose backward is the inverse all-to-all, so
gradients flow to the rank that owns each token. These functions take plain tensors and an
SPGroup, so other attention front-ends (e.g. a transformers attention-function registry
entry) can call `ulysses_attention` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SPGroup:
    """One sequence-parallel group as seen by a member: handle, size, own index inside it."""

    group: Any
    degree: int
    rank: int

    @classmethod
    def single(cls) -> SPGroup:
        return cls(None, 1, 0)


def shard_bounds(n: int, degree: int, rank: int) -> tuple[int, int, int]:
    """(padded length, start, stop) of `rank`'s contiguous shard of n items over `degree`."""
    per = -(-n // degree)
    return per * degree, rank * per, (rank + 1) * per


def pad_dim(x: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    """Pad `x` along `dim` at the end up to `size` entries (autograd-friendly)."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _all_to_all_raw(x: torch.Tensor, sp: SPGroup, scatter_dim: int, gather_dim: int):
    d = sp.degree
    moved = x.movedim(scatter_dim, 0)
    chunk = moved.shape[0] // d
    send = moved.reshape(d, chunk, *moved.shape[1:]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=sp.group)
    parts = [recv[j].movedim(0, scatter_dim) for j in range(d)]
    return torch.cat(parts, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, scatter_dim, gather_dim):
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)
        return _all_to_all_raw(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all_raw(grad.contiguous(), ctx.sp, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, sp: SPGroup, *, scatter_dim: int, gather_dim: int):
    """Split `scatter_dim` into `degree` equal chunks, send chunk j to member j, and
    concatenate what arrives along `gather_dim` in member order. Differentiable."""
    if sp.degree == 1:
        return x
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    if x.shape[scatter_dim] % sp.degree:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} has size {x.shape[scatter_dim]}, "
            f"not a multiple of the group degree {sp.degree}; pad it first"
        )
    return _AllToAll.apply(x, sp, scatter_dim, gather_dim)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp: SPGroup,
    local_attention: Callable[..., torch.Tensor],
    *,
    seq_dim: int = 0,
    head_dim: int = 1,
    **kwargs,
) -> torch.Tensor:
    """Attention over a sequence sharded contiguously over `sp` (shards in member order).

    q, k, v hold this member's shard with all heads; `local_attention(q, k, v, **kwargs)` is
    called on the whole (padded) sequence with H/d heads, so kwargs describe the whole
    sequence (e.g. segment ids of every packed token). k and v may carry fewer heads than q
    (grouped-query attention, a multiple of d: runtime/hf.py sends no more than needed);
    each tensor's heads are padded to a multiple of d on their own."""
    if sp.degree == 1:
        return local_attention(q, k, v, **kwargs)
    heads = q.shape[head_dim]
    q, k, v = (
        all_to_all(
            pad_dim(x, head_dim, -(-x.shape[head_dim] // sp.degree) * sp.degree),
            sp,
            scatter_dim=head_dim,
            gather_dim=seq_dim,
        )
        for x in (q, k, v)
    )
    out = local_attention(q, k, v, **kwargs)
    out = all_to_all(out, sp, scatter_dim=seq_dim, gather_dim=head_dim)
    return out.narrow(head_dim, 0, heads)


def frames_to_tokens(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """DSP switch [F/d, S, C] (frame shard, all spatial tokens) -> [F_pad, S_pad/d, C]."""
    if sp.degree == 1:
        return x
    s_pad = -(-x.shape[1] // sp.degree) * sp.degree
    return all_to_all(pad_dim(x, 1, s_pad), sp, scatter_dim=1, gather_dim=0)


def tokens_to_frames(x: torch.Tensor, sp: SPGroup, num_spatial: int) -> torch.Tensor:
    """DSP switch back [F_pad, S_pad/d, C] -> [F/d, S, C] (drops the spatial padding)."""
    if sp.degree == 1:
        return x
    return all_to_all(x, sp, scatter_dim=0, gather_dim=1).narrow(1, 0, num_spatial)
