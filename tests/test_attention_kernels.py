"""The attention kernel choice (runtime/attention.py choose_kernel), the packed call both
kernels serve (native GQA, cross-attention, non-causal), and the 2D micro-batch run as one
packed stream (runtime/video.py): each checked against attention written from its
definition, on CPU. The CUDA varlen path is checked through a stand-in that follows
torch.nn.attention.varlen.varlen_attn's documentation (no GPU here)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dcp_opt.runtime import attention  # noqa: E402
from dcp_opt.runtime.attention import choose_kernel, packed_attention  # noqa: E402
from dcp_opt.runtime.models import DiTConfig, TinyDiT  # noqa: E402
from dcp_opt.runtime.video import VideoLayout  # noqa: E402

F64 = torch.float64


def _by_definition(q, k, v, lengths, k_lengths, *, causal, scale=None, window=None):
    """Query i of sequence n sees key j of sequence n iff (not causal or j <= i) and
    (no window or i - j < window); kv head h // g serves query head h (g = H / H_kv)."""
    g = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, a0, b0 = torch.zeros_like(q), 0, 0
    for a, b in zip(lengths, k_lengths, strict=True):
        for h in range(q.shape[1]):
            for i in range(a):
                js = [j for j in range(b) if (not causal or j <= i)]
                js = [j for j in js if window is None or i - j < window]
                s = torch.stack([q[a0 + i, h] @ k[b0 + j, h // g] for j in js]) * scale
                p = torch.softmax(s, 0)
                out[a0 + i, h] = sum(p[n] * v[b0 + j, h // g] for n, j in enumerate(js))
        a0, b0 = a0 + a, b0 + b
    return out


def _qkv(tq, tk, heads, kv_heads, dh=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, heads, dh, dtype=F64, generator=gen)
    k, v = (torch.randn(tk, kv_heads, dh, dtype=F64, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    "device,dtype,opts,want",
    [
        ("cuda", torch.bfloat16, {}, "varlen"),
        ("cuda", torch.float16, {}, "varlen"),
        ("cuda", torch.float32, {}, "reference"),  # FlashAttention is half precision only
        ("cuda", torch.float64, {}, "reference"),
        ("cuda", torch.bfloat16, {"softcap": 30.0}, "reference"),  # varlen has no softcap
        ("cuda", torch.bfloat16, {"sinks": torch.zeros(2)}, "reference"),  # nor sinks
        ("cuda", torch.bfloat16, {"head_dim": 12}, "reference"),  # not a multiple of 8
        ("cuda", torch.bfloat16, {"head_dim": 320}, "reference"),  # over 256
        ("cpu", torch.bfloat16, {}, "reference"),
        ("cpu", torch.float64, {}, "reference"),
    ],
)
def test_choose_kernel(monkeypatch, device, dtype, opts, want):
    monkeypatch.setattr(attention, "varlen_available", lambda: True)
    opts = {"head_dim": 128, **opts}
    assert choose_kernel(device, dtype, **opts) == want


def test_choose_kernel_without_varlen_in_torch(monkeypatch):
    monkeypatch.setattr(attention, "varlen_available", lambda: False)
    assert choose_kernel("cuda", torch.bfloat16, head_dim=128) == "reference"


CALLS = {  # (lengths, k_lengths or None, heads, kv heads, causal, window)
    "causal gqa": ([5, 8, 2], None, 4, 2, True, None),
    "window gqa": ([5, 8, 2], None, 4, 1, True, 3),
    "bidirectional frames": ([3, 3, 3, 4, 4], None, 2, 2, False, None),
    "cross": ([6, 6, 4], [2, 3, 2], 4, 2, False, None),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_reference_kernel_follows_the_definition(case):
    """One batched SDPA per distinct shape, put back in stream order, with kv heads as given."""
    lengths, k_lengths, heads, kv, causal, window = CALLS[case]
    k_lengths = k_lengths or lengths
    q, k, v = _qkv(sum(lengths), sum(k_lengths), heads, kv)
    got = packed_attention(
        q, k, v, lengths=lengths, k_lengths=k_lengths, causal=causal, scale=0.7, window=window
    )
    want = _by_definition(q, k, v, lengths, k_lengths, causal=causal, scale=0.7, window=window)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


def _varlen_by_its_docs(seen):
    """varlen_attn as documented: cu_seq offsets, window_size (left, right) with -1
    unbounded, is_causal iff window_size == (-1, 0), enable_gqa required when kv heads are
    fewer. Records its arguments in `seen`."""

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size, enable_gqa=False):
        assert isinstance(window_size, tuple)
        assert enable_gqa == (k.shape[1] != q.shape[1])
        seen.update(cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max=(max_q, max_k), kv=k.shape[1])
        left, right = window_size
        g, out = q.shape[1] // k.shape[1], []
        for (a0, a1), (b0, b1) in zip(
            zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True),
            zip(cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True),
            strict=True,
        ):
            i, j = torch.arange(a1 - a0)[:, None], torch.arange(b1 - b0)[None, :]
            mask = torch.ones(a1 - a0, b1 - b0, dtype=torch.bool)
            if left >= 0:
                mask &= j >= i - left
            if right >= 0:
                mask &= j <= i + right
            qs, ks, vs = (x.transpose(0, 1) for x in (q[a0:a1], k[b0:b1], v[b0:b1]))
            ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale
            )
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    return fake


@pytest.mark.parametrize("case", list(CALLS))
def test_varlen_path_arguments(monkeypatch, case):
    """The CUDA path is one varlen call: offsets of every sequence, the longest lengths,
    kv heads not repeated, (w - 1, 0) / (-1, 0) / (-1, -1) windows; with a kernel that
    follows varlen_attn's documentation it gives the definition's result."""
    from torch.nn.attention import varlen

    seen: dict = {}
    monkeypatch.setattr(attention, "choose_kernel", lambda *a, **kw: "varlen")
    monkeypatch.setattr(varlen, "varlen_attn", _varlen_by_its_docs(seen))
    lengths, k_lengths, heads, kv, causal, window = CALLS[case]
    k_lengths = k_lengths or lengths
    q, k, v = _qkv(sum(lengths), sum(k_lengths), heads, kv, seed=1)
    got = packed_attention(
        q, k, v, lengths=lengths, k_lengths=k_lengths, causal=causal, scale=0.7, window=window
    )
    want = _by_definition(q, k, v, lengths, k_lengths, causal=causal, scale=0.7, window=window)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    cums = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert seen["cu_q"] == cums and seen["max"] == (max(lengths), max(k_lengths))
    assert seen["cu_k"] == [0, *torch.tensor(k_lengths).cumsum(0).tolist()]
    assert seen["kv"] == kv


@pytest.mark.parametrize("lengths", [[6, 6, 6], [6, 6, 6, 9, 9]])
def test_reference_saves_per_token_tensors_only(lengths):
    """What the CPU kernel keeps for backward is linear in tokens (q, k, v, out and a
    logsumexp per head: the fused CPU flash kernel), never an s x s matrix: the activation
    bytes attention.py's docstring gives the cost model. Sequences of several shapes add the
    int64 gather indices of q, k, v and of the reorder (4 per token)."""
    t, heads, dh = sum(lengths), 2, 4
    q, k, v = (x.requires_grad_() for x in _qkv(t, t, heads, heads))
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        packed_attention(q, k, v, lengths=lengths, causal=False)
    per_token = (4 * heads * dh + heads) * 8  # q, k, v, out, logsumexp in float64
    indices = 4 * 8 if len(set(lengths)) > 1 else 0
    assert sum(saved) == t * (per_token + indices)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lengths": [3, 3]}, "lengths: sum 6"),
        ({"lengths": [5, 0]}, "lengths: every sequence"),
        ({"lengths": [5], "k_lengths": [2, 3]}, "k_lengths: 2 sequences"),
        ({"lengths": [5], "k_lengths": [5], "causal": True, "window": 0}, "window: 0"),
    ],
)
def test_packed_attention_bad_input(kwargs, match):
    q = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match=match):
        packed_attention(q, q, q, **kwargs)


def test_packed_attention_refuses_causal_cross_and_odd_heads():
    q, k, v = _qkv(5, 4, 3, 2)
    with pytest.raises(ValueError, match="heads: 3 query heads"):
        packed_attention(q, k, v, lengths=[5], k_lengths=[4], causal=False)
    q, k, v = _qkv(5, 4, 2, 2)
    with pytest.raises(ValueError, match="causal: allowed only for self-attention"):
        packed_attention(q, k, v, lengths=[5], k_lengths=[4], causal=True)


def _dit_block_by_definition(block, h, txt):
    """DiTBlock on h [R, L, C], each row one sequence, every token to the whole caption."""
    r, n, c = h.shape
    heads = block.num_heads
    q, k, v = block.attn.split(block.norm1(h))  # [R, L, H, Dh]
    p = torch.softmax(torch.einsum("rlhd,rmhd->rhlm", q, k) * (c // heads) ** -0.5, -1)
    h = h + block.attn.out(torch.einsum("rhlm,rmhd->rlhd", p, v).reshape(h.shape))
    cq = block.cross["q"](block.norm_x(h)).reshape(r, n, heads, -1)
    ck, cv = (x.reshape(txt.shape[0], heads, -1) for x in block.cross["kv"](txt).chunk(2, -1))
    p = torch.softmax(torch.einsum("rlhd,thd->rhlt", cq, ck) * (c // heads) ** -0.5, -1)
    h = h + block.cross["out"](torch.einsum("rhlt,thd->rlhd", p, cv).reshape(h.shape))
    return h + block.mlp(block.norm2(h))


def _dit_by_definition(model, x, t, text):
    """One video x [F, S, C_in] through TinyDiT's weights, written out: spatial blocks
    attend over each frame's S tokens, temporal ones over each position's F frames."""
    from dcp_opt.runtime.models import sinusoid

    num_f, num_s, _ = x.shape
    c = model.cfg.hidden
    pos = sinusoid(torch.arange(num_f), c, F64)[:, None] + sinusoid(torch.arange(num_s), c, F64)
    h = model.inp(x) + pos + model.time(sinusoid(t * 1000.0, c, F64))
    txt = model.text(text)
    for layer in model.layers:
        h = _dit_block_by_definition(layer.spatial, h, txt)
        h = _dit_block_by_definition(layer.temporal, h.transpose(0, 1), txt).transpose(0, 1)
    return model.out(model.norm(h))


def test_tinydit_packed_micro_batch_follows_the_definition():
    """Videos of different shapes and captions run as one packed stream (each attention one
    call for all of them) give, video by video, the model written out one video at a time."""
    torch.manual_seed(0)
    cfg = DiTConfig(in_channels=3, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)
    model = TinyDiT(cfg).double()
    gen = torch.Generator().manual_seed(1)
    shapes, text_lengths = [(3, 5), (2, 4), (3, 5), (1, 2)], [2, 3, 2, 1]
    xs = [torch.randn(f, s, 3, dtype=F64, generator=gen) for f, s in shapes]
    ts = torch.rand(len(shapes), dtype=F64, generator=gen)
    texts = [torch.randn(n, cfg.text_dim, dtype=F64, generator=gen) for n in text_lengths]
    layout = VideoLayout(tuple(shapes), tuple(text_lengths))
    with torch.no_grad():
        got = model(torch.cat([x.reshape(-1, 3) for x in xs]), ts, torch.cat(texts), layout)
        want = [
            _dit_by_definition(model, x, t, txt) for x, t, txt in zip(xs, ts, texts, strict=True)
        ]
    assert torch.allclose(got, torch.cat([w.reshape(-1, 3) for w in want]), atol=1e-12)


def _exchange(bufs):
    """all_to_all_single of equal chunks among len(bufs) members, in one process."""
    d = len(bufs)
    m = bufs[0].shape[0] // d
    return [torch.cat([bufs[j][r * m : (r + 1) * m] for j in range(d)]) for r in range(d)]


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
@pytest.mark.parametrize("shapes", [((2, 2), (4, 1), (2, 2)), ((1, 5), (3, 3)), ((5, 7),)])
def test_dsp_switch_moves_every_token_where_the_layout_says(degree, shapes):
    """Each token, tagged (video, frame, spatial), lands in the temporal layout at (video,
    held spatial token, frame), padding as zeros; the switch back returns the input."""
    lays = [VideoLayout(shapes, (1,) * len(shapes), degree, r) for r in range(degree)]
    xs = []
    for lay in lays:
        video = torch.cat([torch.full((n,), v) for v, n in enumerate(lay.spatial.videos)])
        tag = video * 10000 + lay.frame_ids * 100 + lay.spatial_ids + 1
        xs.append((tag * lay.real).to(F64)[:, None])  # padded frames are zeros too
    sends = [
        torch.cat([x, x.new_zeros(1, 1)])[lay._index["send"]]
        for x, lay in zip(xs, lays, strict=True)
    ]
    temporal = [b[lay._index["recv"]] for b, lay in zip(_exchange(sends), lays, strict=True)]
    for r, (got, lay) in enumerate(zip(temporal, lays, strict=True)):
        want = []
        for v, (f, s) in enumerate(shapes):
            f_pad, per = -(-f // degree) * degree, -(-s // degree)
            for sg in range(r * per, (r + 1) * per):
                want += [
                    v * 10000 + fr * 100 + sg + 1 if sg < s and fr < f else 0 for fr in range(f_pad)
                ]
        assert got[:, 0].tolist() == want
        assert sum(lay.temporal.lengths) == len(want) == sum(lay.temporal.videos)
    backs = [t[lay._index["recv_inverse"]] for t, lay in zip(temporal, lays, strict=True)]
    for x, b, lay in zip(xs, _exchange(backs), lays, strict=True):
        assert torch.equal(b[lay._index["back"]], x)


@pytest.mark.parametrize(
    "args,match",
    [
        (((), ()), "shapes: 0 videos"),
        ((((2, 2),), (1, 1)), "shapes: 1 videos with 2 captions"),
        ((((0, 2),), (1,)), "shapes: frames, spatial tokens and caption tokens"),
        ((((2, 2),), (1,), 2, 2), "rank: 2 not allowed"),
    ],
)
def test_video_layout_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        VideoLayout(*args)


def test_diffusion_task_runs_a_micro_batch_through_each_attention_once():
    """DiffusionTask.run on three videos of two shapes: every attention of every block is
    one kernel call for all videos (4 per layer: spatial and temporal self-attention, their
    cross-attention), and the loss and gradients are those of the videos one at a time."""
    from dcp_opt.runtime import DiffusionTask, SPState

    torch.manual_seed(0)
    cfg = DiTConfig(in_channels=3, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)
    model, task = TinyDiT(cfg).double(), DiffusionTask(seed=3)
    gen = torch.Generator().manual_seed(2)
    samples = [
        (sid, {"x": torch.randn(f, s, 3, dtype=F64, generator=gen),
               "text": torch.randn(n, cfg.text_dim, dtype=F64, generator=gen)})
        for sid, (f, s, n) in enumerate([(3, 4, 2), (2, 5, 3), (3, 4, 1)])
    ]  # fmt: skip
    calls = []
    real = attention._reference_attention

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    attention._reference_attention = counted
    try:
        loss = task.run(model, samples, SPState(), step=1, kind="samples", scale=0.5)
    finally:
        attention._reference_attention = real
    assert len(calls) == 4 * cfg.num_layers
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = sum(task.reference_loss(model, sid, s, step=1, kind="samples") for sid, s in samples)
    (want * 0.5).backward()
    assert abs(loss.item() - 0.5 * want.item()) <= 1e-12 * abs(want.item())
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-10, atol=1e-14)
