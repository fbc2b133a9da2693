"""Context parallelism (the plan's `cp` groups) for 1D models: all-gather-KV attention with
causal head-tail chunks (cost model: dcp_opt/cost/cp.py).

Layout. Each packed sequence is cut into 2d chunks (sizes differ by at most one token) and
member i holds chunks i and 2d-1-i of every sequence (head-tail / zigzag, Megatron-Core context
parallelism; Llama 3 report sec. 3.3.2), so every member has about 1/d of each sequence's
causal attention pairs. Members get equally many tokens by padding (segment -1, loss weight 0),
so the all-gather has equal parts.

Attention. Each layer gathers every member's K and V (only the kv heads travel under GQA) into
stream order and attends each of its query chunks (a run of its tokens contiguous in one
sequence: at most 2 per sequence) to the keys of that sequence only, up to the chunk's end:
c queries at the end of a p-key prefix, causal aligned bottom-right (query i of the chunk sees
keys <= p - c + i; FlashAttention >= 2.1's semantics for unequal lengths). No mask over the
whole stream is built, so what attention keeps for backward is the gathered K/V plus per local
token output and logsumexp, what dcp_opt/cost/cp.py charges (docs/cost-model.md, cp). The
result equals single-device attention over each sequence. The gather's backward is a
reduce-scatter of dK, dV: every member's gradient for the gathered buffer is summed at the
member that owns each token (written as an all-to-all and a sum in member order, which gloo
has; the bytes moved are a ring reduce-scatter's).

Kernels per chunk (`chunk_kernel`): on CUDA in half precision one FlashAttention varlen call
for all chunks (bottom-right causal natively, window through window_size); on CPU, without
softcap/sinks/an active window, the prefix split in two fused calls (keys before the chunk,
unmasked; the chunk's own keys, causal) merged by logsumexp, with the fused kernel's own
backward on the merged output and logsumexp (the blockwise rule of ring attention, Liu et al.
2023, and FlashAttention-2, Dao 2023 sec. 3.1); softcap, sinks, a window shorter than the
prefix, or another device: one explicit or masked call per chunk over its key range with a
c x n mask (n <= p; a window w limits the keys to [p - c - w + 1, p)). Padding (segment -1,
at the end of the stream) is one more sequence: it attends to earlier padding only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .attention import attend, choose_kernel, varlen_attention, visible
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
    def forward(ctx, x, sp, order):
        ctx.sp, ctx.order = sp, order
        if order is None:
            return all_gather_raw(x, sp)
        parts = [torch.empty_like(x) for _ in range(sp.degree)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        stream = x.new_empty(sp.degree * x.shape[0], *x.shape[1:])
        for j, rows in enumerate(order.reshape(sp.degree, -1)):
            stream[rows] = parts[j]  # member j's row t is stream index order[j M + t]
        return stream

    @staticmethod
    def backward(ctx, grad):
        # the order is the layout the caller keeps anyway: nothing is saved for it
        grad = grad if ctx.order is None else grad[ctx.order]
        return reduce_scatter_raw(grad, ctx.sp), None, None


def gather_tokens(x: torch.Tensor, sp: SPGroup, order: torch.Tensor | None = None):
    """Concatenate every member's `x` along dim 0 in member order (equal shapes), or, with
    `order` (the flattened [d, M] layout: gathered row r is stream index order[r]), put the
    rows in stream order; differentiable: the backward reduce-scatters the gradient."""
    return x if sp.degree == 1 else _GatherTokens.apply(x, sp, order)


def local_chunks(layout: torch.Tensor, segments: torch.Tensor, rank: int) -> list[tuple]:
    """(first local row, c rows, stream index where its sequence starts, p = in-sequence end)
    of each run of member `rank`'s rows that is contiguous in the stream inside one sequence
    (the padded tail, segment -1, counts as one): query j of a run sits at in-sequence
    position p - c + j. At most 2 per sequence under head_tail_layout."""
    _, counts = torch.unique_consecutive(segments.cpu(), return_counts=True)
    starts = counts.cumsum(0) - counts
    mine = layout[rank].cpu()
    seq = torch.searchsorted(starts, mine, right=True) - 1
    # a run ends where the next row is not the next stream index or is another sequence
    brk = (mine[1:] != mine[:-1] + 1) | (seq[1:] != seq[:-1])
    first = torch.cat([torch.zeros(1, dtype=torch.long), brk.nonzero().flatten() + 1])
    last = torch.cat([first[1:], torch.tensor([mine.numel()])]) - 1
    begin = starts[seq[first]]
    cols = (first, last - first + 1, begin, mine[last] - begin + 1)
    return list(zip(*(x.tolist() for x in cols), strict=True))


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixCausal(torch.autograd.Function):
    """c queries at the end of n keys, causal bottom-right, on PyTorch's fused CPU kernel
    (q [1, H, c, Dh], k, v [1, H_kv, n, Dh], native GQA). Keys [0, n - c) are visible to every
    query (one unmasked call), keys [n - c, n) are the chunk's own (one causal c x c call);
    the two partial results merge by their logsumexps, and each part's backward is the fused
    kernel's own, run on the merged output and logsumexp (exact: the softmax of the whole row
    is exp(s - lse) with the merged lse; Dao 2023, FlashAttention-2 sec. 3.1, backward). Kept
    for backward: q, k, v (views of the caller's tensors), output and logsumexp [1, H, c]."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        c, n = q.shape[2], k.shape[2]
        qc = q.contiguous()
        out, lse = _FLASH_CPU(qc, k[:, :, n - c :].contiguous(), v[:, :, n - c :].contiguous(),
                              0.0, True, scale=scale)  # fmt: skip
        if n > c:
            o1, l1 = _FLASH_CPU(qc, k[:, :, : n - c].contiguous(), v[:, :, : n - c].contiguous(),
                                0.0, False, scale=scale)  # fmt: skip
            merged = torch.logaddexp(l1, lse)
            out = o1 * (l1 - merged).exp()[..., None] + out * (lse - merged).exp()[..., None]
            lse = merged
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        c, n = q.shape[2], k.shape[2]
        g, qc = grad.contiguous(), q.contiguous()
        parts = [(n - c, n, True)] + ([(0, n - c, False)] if n > c else [])
        dq, dks, dvs = None, [], []
        for lo, hi, causal in parts:
            kp, vp = k[:, :, lo:hi].contiguous(), v[:, :, lo:hi].contiguous()
            a, b, e = _FLASH_CPU_BACKWARD(g, qc, kp, vp, out, lse, 0.0, causal, scale=ctx.scale)
            dq = a if dq is None else dq + a
            dks.insert(0, b)
            dvs.insert(0, e)
        return dq, torch.cat(dks, dim=2), torch.cat(dvs, dim=2), None


def chunk_kernel(q: torch.Tensor, *, window, softcap, sinks) -> str:
    """How cp_attention attends its chunks: "varlen" (every chunk in one FlashAttention call,
    attention.choose_kernel's rule), "prefix" (_PrefixCausal, CPU, plain causal or a window
    that excludes no key), else "masked" (one call per chunk with a c x n mask)."""
    kernel = choose_kernel(
        q.device.type, q.dtype, head_dim=q.shape[-1], softcap=softcap, sinks=sinks
    )
    if kernel == "varlen":
        return "varlen"
    plain = softcap is None and sinks is None
    return "prefix" if plain and q.device.type == "cpu" else "masked"


def _key_range(c: int, p: int, window: int | None) -> int:
    """First in-sequence key any of the chunk's queries sees (a window w: p - c - w + 1)."""
    return 0 if window is None else max(0, p - c - window + 1)


def _chunk_mask(c: int, n: int, window: int | None, device) -> torch.Tensor:
    """[c, n] bool: query i (at key index n - c + i) sees keys j <= n - c + i, and with a
    window w only those with j > n - c + i - w (transformers' sliding window)."""
    pos_q = torch.arange(n - c, n, device=device)
    same = torch.ones(c, n, dtype=torch.bool, device=device)
    return visible(pos_q, torch.arange(n, device=device), same, causal=True, window=window)


def _attend_chunk(q, k, v, *, kernel, scale, window, softcap, sinks):
    """One chunk: q [c, H, Dh] at the end of the n keys k, v [n, H_kv, Dh] -> [c, H, Dh]."""
    c, n = q.shape[0], k.shape[0]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    if kernel == "prefix" and (window is None or n <= window):
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return _PrefixCausal.apply(q4, k4, v4, s)[0].transpose(0, 1)
    mask = _chunk_mask(c, n, window, q.device)
    return attend(q4, k4, v4, mask, scale=scale, softcap=softcap, sinks=sinks)[0].transpose(0, 1)


def cp_attention(
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
    """Causal attention of this member's tokens (q [M, H, Dh]) to their own sequences.
    k, v: [M, H_kv, Dh] (H_kv divides H; query head h reads kv head h // (H / H_kv)).
    `layout` [d, M] (head_tail_layout) and `segments` of the padded whole stream; in-sequence
    positions (for the window) are stream offsets inside each segment, so `positions` is not
    read (kept for the callers). Padding attends to earlier padding only."""
    kv_heads = k.shape[1]
    # one call for K and V; rows in stream order. kv heads stay unrepeated (native GQA in
    # every kernel), so backward keeps the gathered K/V at kv_heads (cost.cp.extra_act_bytes)
    kv = gather_tokens(torch.cat([k, v], dim=1), sp, layout.reshape(-1).to(q.device))
    chunks = local_chunks(layout, segments, sp.rank)
    kernel = chunk_kernel(q, window=window, softcap=softcap, sinks=sinks)
    if kernel == "varlen":
        return _varlen_chunks(q, kv, kv_heads, chunks, scale=scale, window=window)
    outs = []
    for row, c, start, p in chunks:
        lo = _key_range(c, p, window)
        keys = kv[start + lo : start + p]
        outs.append(
            _attend_chunk(
                q[row : row + c],
                keys[:, :kv_heads],
                keys[:, kv_heads:],
                kernel=kernel,
                scale=scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )  # fmt: skip
        )
    return torch.cat(outs)


def _varlen_chunks(q, kv, kv_heads, chunks, *, scale, window):
    """Every chunk in one FlashAttention varlen call: query sequence i is chunk i's c rows,
    key sequence i its key range (copied out of the stream-ordered buffer: the head and tail
    chunks' ranges overlap, about 1/(2d) more keys than the buffer); FlashAttention >= 2.1
    aligns causality bottom-right when a sequence has more keys than queries. Not run here
    (no GPU); its arguments are attention.varlen_attention's."""
    rows, lengths, k_lengths = [], [], []
    for _, c, start, p in chunks:
        lo = _key_range(c, p, window)
        rows.append(torch.arange(start + lo, start + p, device=q.device))
        lengths.append(c)
        k_lengths.append(p - lo)
    keys = kv.index_select(0, torch.cat(rows))
    k, v = keys[:, :kv_heads], keys[:, kv_heads:]
    return varlen_attention(q, k, v, lengths, k_lengths, causal=True, scale=scale, window=window)


def shard_for_group(pack, samples, kind: str, state) -> dict:
    """This member's part of a packed micro-batch under the active group's SP kind (on the
    CPU); sets the whole stream's `segments` on `state`, and under cp and ring its `layout`
    and `positions`. Ulysses: contiguous shards of the stream padded to a multiple of d
    (times `state.tp_degree` under tensor parallelism; runtime/sp.py); cp and ring (runtime/ring.py): head-tail chunks of every sequence.
    `pack` is LMTask.pack."""
    sp = state.sp
    if state.kind in ("cp", "ring") and sp.degree > 1:
        lengths = [s.shape[0] - 1 for _, s in samples]  # a sample is L + 1 token ids
        part, padded, layout = shard_stream(pack(samples, kind, 1), lengths, sp)
        state.segments, state.positions, state.layout = (
            padded["segments"],
            padded["positions"],
            layout,
        )
        return part
    # under TP each member's contiguous shard splits again over the unit's tp_degree GPUs
    whole = pack(samples, kind, sp.degree * getattr(state, "tp_degree", 1))
    _, lo, hi = shard_bounds(whole["tokens"].shape[0], sp.degree, sp.rank)
    state.segments = whole["segments"]
    return {k: v[lo:hi] for k, v in whole.items()}
