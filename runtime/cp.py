"""Context parallelism (the plan's `cp` groups) for 1D models: all-gather-KV attention with
causal head-tail chunks (cost model: dcp_opt/cp_cost.py).

Layout. Each packed sequence is cut into 2d chunks (sizes differ by at most one token) and
member i holds chunks i and 2d-1-i of every sequence (head-tail / zigzag, Megatron-Core context
parallelism; Llama 3 report sec. 3.3.2), so every member has about 1/d of each sequence's
causal attention pairs. Members get equally many tokens by padding (segment -1, loss weight 0),
so the all-gather has equal parts.

Attention. Each layer gathers every member's K and V (only the kv heads travel under GQA) and
attends its own queries to all keys under a mask built from global stream indices and segment
ids: key j is visible from query i iff both are in the same segment and j <= i in the packed
stream (causality inside a sequence is stream order). So any token-to-member assignment is
exact: the result equals single-device attention over the packed stream. The gather's
backward is a reduce-scatter of dK, dV: every member's gradient for the gathered buffer is
summed at the member that owns each token (written as an all-to-all and a sum in member order,
which gloo has; the bytes moved are a ring reduce-scatter's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .attention import _attend, _visible
from .sp import SPGroup, pad_dim, shard_bounds

PAD = {"tokens": 0, "labels": -100, "positions": 0, "segments": -1, "weights": 0.0}


def head_tail_layout(lengths: list[int], degree: int) -> torch.Tensor:
    """[degree, M] global stream indices of each member's tokens for sequences of `lengths`
    packed back to back: member i takes chunks i and 2d-1-i of every sequence (in stream
    order), then indices >= sum(lengths) (padding) up to the longest member's count M."""
    owned: list[list[int]] = [[] for _ in range(degree)]
    start = 0
    for n in lengths:
        chunks = torch.arange(start, start + n).tensor_split(2 * degree)
        for i in range(degree):
            owned[i] += chunks[i].tolist() + chunks[2 * degree - 1 - i].tolist()
        start += n
    m = max(1, max(len(o) for o in owned))
    nxt = start
    for o in owned:
        extra = m - len(o)
        o += range(nxt, nxt + extra)
        nxt += extra
    return torch.tensor(owned, dtype=torch.long)


def shard_stream(whole: dict, lengths: list[int], sp: SPGroup) -> tuple[dict, dict, torch.Tensor]:
    """(this member's part, the whole stream padded to d*M, the [d, M] layout) of a packed
    stream `whole` (LMTask.pack at degree 1)."""
    layout = head_tail_layout(lengths, sp.degree)
    size = layout.numel()
    padded = {k: pad_dim(v, 0, size, PAD[k]) for k, v in whole.items()}
    mine = layout[sp.rank]
    return {k: v[mine] for k, v in padded.items()}, padded, layout


def all_gather_raw(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Every member's `x` concatenated along dim 0 in member order (the forward's gather;
    the profiler times this call: runtime/profile/fit.py measure_cp_collectives)."""
    parts = [torch.empty_like(x) for _ in range(sp.degree)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts)


def reduce_scatter_raw(g: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Member r gets sum over members j of their gradient for r's rows (dim 0), in member
    order: an all-to-all of the d row blocks, then a sum."""
    send = g.reshape(sp.degree, g.shape[0] // sp.degree, *g.shape[1:]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=sp.group)
    out = recv[0]
    for j in range(1, sp.degree):
        out = out + recv[j]
    return out


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp = sp
        return all_gather_raw(x, sp)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_raw(grad, ctx.sp), None


def gather_tokens(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """Concatenate every member's `x` along dim 0 in member order (equal shapes);
    differentiable: the backward reduce-scatters the gradient."""
    return x if sp.degree == 1 else _GatherTokens.apply(x, sp)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp: SPGroup,
    *,
    layout: torch.Tensor,
    segments: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this member's tokens (q [M, H, Dh]) over the whole packed stream.
    k, v: [M, H_kv, Dh] (H_kv divides H; query head h reads kv head h // (H / H_kv)).
    `layout` [d, M] (head_tail_layout), `segments` and `positions` (in-sequence, for the
    window) of the padded whole stream. Padding attends to earlier padding only."""
    kv_heads = k.shape[1]
    kv = gather_tokens(torch.cat([k, v], dim=1), sp)  # one call: K and V together
    # kv heads stay unrepeated: _attend's GQA is native (SDPA enable_gqa), so backward keeps
    # the gathered K/V at kv_heads, as the cost model charges (cp_cost.extra_act_bytes)
    k_all, v_all = kv[:, :kv_heads], kv[:, kv_heads:]
    dev = q.device
    qi, ki = layout[sp.rank].to(dev), layout.reshape(-1).to(dev)
    seg, pos = segments.to(dev), positions.to(dev)
    same = seg[qi][:, None] == seg[ki][None, :]
    mask = same & (ki[None, :] <= qi[:, None])  # causal in stream order, inside a segment
    if window is not None:
        mask = _visible(pos[qi], pos[ki], mask, causal=True, window=window)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k_all, v_all))
    out = _attend(q4, k4, v4, mask, scale=scale, softcap=softcap, sinks=sinks)
    return out[0].transpose(0, 1)


def shard_for_group(pack, samples, kind: str, state) -> dict:
    """This member's part of a packed micro-batch under the active group's SP kind (on the
    CPU); sets the whole stream's `segments` on `state`, and under cp its `layout` and
    `positions`. Ulysses: contiguous shards of the stream padded to a multiple of d
    (runtime/sp.py); cp: head-tail chunks of every sequence. `pack` is LMTask.pack."""
    sp = state.sp
    if state.kind == "cp" and sp.degree > 1:
        lengths = [s.shape[0] - 1 for _, s in samples]  # a sample is L + 1 token ids
        part, padded, layout = shard_stream(pack(samples, kind, 1), lengths, sp)
        state.segments, state.positions, state.layout = (
            padded["segments"],
            padded["positions"],
            layout,
        )
        return part
    whole = pack(samples, kind, sp.degree)
    _, lo, hi = shard_bounds(whole["tokens"].shape[0], sp.degree, sp.rank)
    state.segments = whole["segments"]
    return {k: v[lo:hi] for k, v in whole.items()}
