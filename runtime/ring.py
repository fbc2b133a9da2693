"""Ring attention (the plan's `ring` groups) for 1D models: K/V blocks passed around the group
with point-to-point sends, each step's attention merged by logsumexp (cost model:
dcp_opt/cost/ring.py; docs/cost-model.md, "Ring attention").

Layout: cp's head-tail chunks (runtime/cp.py `head_tail_layout`, `shard_for_group`): member i
holds chunks i and 2d-1-i of every packed sequence, padded to M rows, so every block has the
same shape and the causal work of each ring step is ~1/d of the member's.

The scheme is TransformerEngine's (`AttnFuncWithCPAndKVP2P`, TE
`transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py` at d0067d0):
- forward: at step s member i holds the K/V block of member i-s; the send of its block to i+1
  and the receive of the next from i-1 (one `batch_isend_irecv`) are issued before the step's
  attention and waited after it (TE:1698-1720), so two blocks are in flight, never the
  gathered whole. Each step gives a partial output and logsumexp, merged online (Liu et al.
  2023; Dao 2023, FlashAttention-2 sec. 3.1). Kept for backward (TE:2087): q, the last block
  held (member i+1's), the output and the final logsumexp.
- backward, the ring reversed (send to i-1, receive from i+1, TE:2229): at step s member i
  holds member (i+1+s)'s block, computes dQ locally and its share of that block's dK/dV; the
  block's dK/dV accumulated so far travels one step behind its K/V (step 0 sends K/V, steps
  1..d-2 K/V and dK/dV in one [2, block] buffer, step d-1 dK/dV only: TE:2460-2495,
  2717-2727), so each block's gradient ends at its owner at the last step.
One member sends (d-1) blocks forward and 2 (d-1) backward (`record_sends` counts them:
tests/test_ring.py checks them against the cost model's charge).

Masks: the query rows and a block's rows are stream indices (the layout), so a key is visible
when it is in the query's segment, at or before it (causal), and within the window; padding
(segment -1, at the stream's end) is one more sequence. Each block is attended with an
explicit softmax (GQA by repeating kv heads inside the product; softcap; sinks join the final
logsumexp as one zero-value key per head), exact in float64; the backward rebuilds each
block's probabilities from the final logsumexp and takes the exact gradient of
<P, dO V^T - D> (D = rowsum(dO * O)), the FlashAttention-2 backward written for autograd.
Not built: a fused per-block kernel (TE calls FlashAttention / cuDNN per tile).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from .attention import visible
from .sp import SPGroup

_RECORDER: list | None = None  # (pass, step, bytes) of every send, under record_sends()


@contextmanager
def record_sends():
    """Collect (pass "fwd"/"bwd", step, bytes sent) of every ring send on this member."""
    global _RECORDER
    saved, _RECORDER = _RECORDER, []
    try:
        yield _RECORDER
    finally:
        _RECORDER = saved


def exchange_step(send: torch.Tensor, recv: torch.Tensor, sp: SPGroup) -> None:
    """One forward ring step's transfer, waited: `send` to the next member, `recv` from the
    previous (the profiler times this call: runtime/profile/fit.py measure_ring_steps)."""
    d, r = sp.degree, sp.rank
    _wait(_exchange(send, recv, sp, to=(r + 1) % d, frm=(r - 1) % d, tag=("profile", 0)))


def _exchange(send: torch.Tensor, recv: torch.Tensor, sp: SPGroup, *, to: int, frm: int, tag):
    """Start one P2P step: `send` to member `to`, `recv` from member `frm` (group indices)."""
    if _RECORDER is not None:
        _RECORDER.append((*tag, send.numel() * send.element_size()))
    ops = [
        dist.P2POp(dist.isend, send, group=sp.group, group_peer=to),
        dist.P2POp(dist.irecv, recv, group=sp.group, group_peer=frm),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _scores(q, k, *, scale, softcap):
    """[H, M, N] scores of q [M, H, Dh] against k [N, H_kv, Dh] (query head h reads kv head
    h // (H / H_kv)), softcapped."""
    g = q.shape[1] // k.shape[1]
    s = torch.matmul(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0).mT) * scale
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def _values(v, heads: int):
    return v.transpose(0, 1).repeat_interleave(heads // v.shape[1], 0)  # [H, N, Dh]


class _Masks:
    """Which of a block's keys each of this member's queries sees (module doc, Masks)."""

    def __init__(self, layout, segments, rank: int, window):
        self.idx = layout.to(segments.device)
        self.seg = segments[self.idx]  # [d, M]
        self.rank, self.window = rank, window

    def of(self, member: int) -> torch.Tensor:
        qi, ki = self.idx[self.rank], self.idx[member]
        same = self.seg[self.rank][:, None] == self.seg[member][None, :]
        return visible(qi, ki, same, causal=True, window=self.window)


def _block_forward(q, kv, mask, *, scale, softcap):
    """(output [H, M, Dh], logsumexp [H, M]) of q against one block kv [N, 2 H_kv, Dh]."""
    k, v = kv.chunk(2, dim=1)
    s = _scores(q, k, scale=scale, softcap=softcap).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.clamp(min=torch.finfo(s.dtype).min)[..., None])
    return p @ _values(v, q.shape[1]), lse


def _merge(out, lse, out_b, lse_b):
    """Online softmax: two partial results over disjoint keys as one (lse finite)."""
    new = torch.logaddexp(lse, lse_b)
    return out * (lse - new).exp()[..., None] + out_b * (lse_b - new).exp()[..., None], new


def _block_backward(q, kv, mask, dout, delta, lse, *, scale, softcap):
    """(dq [M, H, Dh], dkv [N, 2 H_kv, Dh]) of one block: the gradient of
    <P, dO V^T - D> with P = exp(S - lse) rebuilt from the final logsumexp (module doc)."""
    with torch.enable_grad():
        qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
        k, v = kvg.chunk(2, dim=1)
        s = _scores(qg, k, scale=scale, softcap=softcap).masked_fill(~mask, float("-inf"))
        p = torch.exp(s - lse[..., None])
        dp = dout @ _values(v, q.shape[1]).mT  # [H, M, N]
        f = (p * (dp - delta[..., None])).sum()
        dq, dkv = torch.autograd.grad(f, (qg, kvg))
    return dq, dkv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, sp, masks, scale, softcap):
        d, r = sp.degree, sp.rank
        cur = torch.cat([k, v], dim=1).contiguous()  # one block: K and V of the own rows
        out = lse = None
        for step in range(d):
            reqs, nxt = [], None
            if step < d - 1:  # the next block travels while this one is attended
                nxt = torch.empty_like(cur)
                reqs = _exchange(cur, nxt, sp, to=(r + 1) % d, frm=(r - 1) % d, tag=("fwd", step))
            o_b, l_b = _block_forward(q, cur, masks.of((r - step) % d), scale=scale,
                                      softcap=softcap)  # fmt: skip
            out, lse = (o_b, l_b) if step == 0 else _merge(out, lse, o_b, l_b)
            _wait(reqs)
            cur = nxt if nxt is not None else cur
        if sinks is not None:  # one zero-value key per head joins every query's softmax
            sink = sinks.to(lse.dtype)[:, None].expand_as(lse)
            new = torch.logaddexp(lse, sink)
            out, lse = out * (lse - new).exp()[..., None], new
        ctx.sp, ctx.masks, ctx.scale, ctx.softcap = sp, masks, scale, softcap
        ctx.has_sinks = sinks is not None
        # cur is member r+1's block (the last held): the backward ring starts with it
        ctx.save_for_backward(q, cur, out, lse, *(() if sinks is None else (sinks,)))
        return out.transpose(0, 1)  # [M, H, Dh]

    @staticmethod
    def backward(ctx, grad):
        q, cur, out, lse, *rest = ctx.saved_tensors
        sp, d, r = ctx.sp, ctx.sp.degree, ctx.sp.rank
        dout = grad.transpose(0, 1)  # [H, M, Dh]
        delta = (dout * out).sum(-1)  # [H, M]
        dq = torch.zeros_like(q)
        acc = None  # the dK/dV of the block held, accumulated so far
        for step in range(d):
            if step == 0:
                send = cur
            elif step < d - 1:
                send = torch.stack([cur, acc])
            else:
                send = acc
            recv = torch.empty_like(send)
            reqs = _exchange(send, recv, sp, to=(r - 1) % d, frm=(r + 1) % d, tag=("bwd", step))
            member = (r + 1 + step) % d
            dq_b, dkv_b = _block_backward(q, cur, ctx.masks.of(member), dout, delta, lse,
                                          scale=ctx.scale, softcap=ctx.softcap)  # fmt: skip
            dq = dq + dq_b
            _wait(reqs)
            if step == 0:  # the first visitor of member r+1's block
                acc, cur = dkv_b, recv
            elif step < d - 1:  # received: the next block and its gradient so far
                cur, acc = recv[0], recv[1] + dkv_b
            else:  # received: the own block's gradient from every other member
                acc = recv + dkv_b
        dk, dv = acc.chunk(2, dim=1)
        dsinks = None
        if ctx.has_sinks:  # d lse / d sink = p_sink; d loss / d sink = -sum_m p_sink D
            sinks = rest[0]
            p_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse)
            dsinks = -(p_sink * delta).sum(-1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sp: SPGroup,
    *,
    layout: torch.Tensor,
    segments: torch.Tensor,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this member's tokens (q [M, H, Dh]) to their own sequences, with
    the keys passed around the group (module doc). k, v: [M, H_kv, Dh] (H_kv divides H).
    `layout` [d, M] (runtime/cp.py head_tail_layout) and `segments` of the padded whole
    stream, as cp_attention takes them; `positions` is not read (in-sequence offsets are
    stream offsets inside a segment). `sinks`: [H] per-head logits (gpt-oss)."""
    if sp.degree == 1:
        raise ValueError("ring_attention: degree 1 has no ring; allowed: a group of degree >= 2")
    s = q.shape[-1] ** -0.5 if scale is None else scale
    masks = _Masks(layout, segments, sp.rank, window)
    return _RingAttention.apply(q, k, v, sinks, sp, masks, s, softcap)
