import pytest

torch = pytest.importorskip("torch")

from dcp_opt.runtime.attention import _masked_segment_attention, segment_attention  # noqa: E402


@pytest.mark.parametrize("segs", [[0] * 5 + [1] * 3 + [2] * 4, [0, 0, 1, 1, 0, 0], [7]])
@pytest.mark.parametrize("causal", [True, False])
def test_per_segment_equals_one_masked_call(segs, causal):
    """The per-segment path (cost sum s^2) and the masked whole-stream call each give
    attention by its definition; ids that repeat non-contiguously ([0,0,1,1,0,0]) take the
    masked path (so there the definition, not the other path, is what checks it)."""
    gen = torch.Generator().manual_seed(0)
    t = len(segs)
    q, k, v = (torch.randn(t, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    s = torch.tensor(segs)
    want = _by_definition(q, k, v, segs, causal=causal)
    a = segment_attention(q, k, v, segments=s, causal=causal)
    b = _masked_segment_attention(q, k, v, segments=s, causal=causal)
    assert torch.allclose(a, want, atol=1e-12)
    assert torch.allclose(b, want, atol=1e-12)


def test_segments_length_checked():
    q = torch.zeros(3, 1, 2)
    with pytest.raises(ValueError, match="segments: length 2"):
        segment_attention(q, q, q, segments=torch.tensor([0, 0]))


@pytest.mark.parametrize("segs", [[0] * 3 + [1] * 4, [0, 1, 0]])
def test_scale_is_the_softmax_temperature(segs):
    """An explicit scale (HF models pass config.scaling) equals a rescaled query at the
    default scale, on both paths; a different scale gives a different result."""
    gen = torch.Generator().manual_seed(1)
    t = len(segs)
    q, k, v = (torch.randn(t, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    s = torch.tensor(segs)
    a = segment_attention(q, k, v, segments=s, scale=0.3)
    b = segment_attention(q * 0.3 / 4**-0.5, k, v, segments=s)
    assert torch.allclose(a, b, atol=1e-12)
    assert not torch.allclose(a, segment_attention(q, k, v, segments=s), atol=1e-6)


def _by_definition(
    q, k, v, segs, *, window=None, softcap=None, sinks=None, scale=None, causal=True
):
    """Attention written out query by query: key j of the same sequence is visible from
    query i iff (j <= i, or any j when not causal) and (no window, or p(i) - p(j) < window, p = position inside the
    sequence: transformers.masking_utils sliding_window_overlay, `kv_idx > q_idx -
    sliding_window`, on one sequence); scores capped as
    softcap * tanh(s / softcap); a sink adds exp(sink_h) to each softmax denominator."""
    t, heads, dh = q.shape
    scale = dh**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    pos = [segs[:i].count(segs[i]) for i in range(t)]
    for h in range(heads):
        for i in range(t):
            js = [
                j
                for j in range(i + 1 if causal else t)
                if segs[j] == segs[i] and (window is None or pos[i] - pos[j] < window)
            ]
            s = torch.stack([(q[i, h] * k[j, h]).sum() * scale for j in js])
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            e = torch.exp(s)
            denom = e.sum() + (torch.exp(sinks[h]) if sinks is not None else 0.0)
            out[i, h] = sum(e[n] / denom * v[j, h] for n, j in enumerate(js))
    return out


CASES = {
    "window": {"window": 3},
    "window 1": {"window": 1},
    "window >= lengths": {"window": 9},
    "softcap": {"softcap": 0.7},
    "sinks": {"sinks": torch.tensor([0.5, -1.0], dtype=torch.float64)},
    "all": {"window": 2, "softcap": 0.7, "sinks": torch.tensor([0.5, -1.0], dtype=torch.float64)},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("segs", [[0] * 5 + [1] * 8 + [2] * 2, [0, 0, 1, 1, 1, 0, 0, 0]])
def test_options_follow_their_definition(case, segs):
    """Windows, softcap and sinks give attention written from its definition, on the
    per-segment path and on the masked path (non-contiguous ids); a window counts the
    sequence's own keys only."""
    gen = torch.Generator().manual_seed(2)
    t = len(segs)
    q, k, v = (torch.randn(t, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    opts = CASES[case]
    got = segment_attention(q, k, v, segments=torch.tensor(segs), scale=0.8, **opts)
    want = _by_definition(q, k, v, segs, scale=0.8, **opts)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_a_window_changes_the_result_only_beyond_it():
    """Rows whose sequence prefix fits the window are plain causal attention; later rows
    differ (so the window is really applied)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(7, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    s = torch.zeros(7, dtype=torch.long)
    plain = segment_attention(q, k, v, segments=s)
    windowed = segment_attention(q, k, v, segments=s, window=3)
    assert torch.equal(windowed[:3], plain[:3])
    assert not torch.allclose(windowed[3:], plain[3:], atol=1e-6)


def test_window_must_be_causal_and_positive():
    q = torch.zeros(3, 1, 2)
    for kwargs in ({"window": 0}, {"window": 2, "causal": False}):
        with pytest.raises(ValueError, match="window"):
            segment_attention(q, q, q, segments=torch.zeros(3, dtype=torch.long), **kwargs)


def _flash_varlen_by_its_docs(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size, enable_gqa=False
):
    """torch.nn.attention.varlen.varlen_attn as documented (FlashAttention's window: query i
    of a sequence sees keys [i - left, i + right] of that sequence; -1 = unbounded), written
    with masks so the CUDA path's arguments can be checked on CPU."""
    left, right = window_size
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        i = torch.arange(b - a)
        mask = torch.ones(b - a, b - a, dtype=torch.bool)
        if left >= 0:
            mask &= i[None, :] >= i[:, None] - left
        if right >= 0:
            mask &= i[None, :] <= i[:, None] + right
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), attn_mask=mask, scale=scale
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 1, 3])
def test_cuda_varlen_path_arguments(monkeypatch, window):
    """The CUDA path hands varlen_attn cu_seqlens of the packed sequences and
    window_size = (w - 1, 0) for transformers' w keys: with a kernel that follows
    varlen_attn's documentation it gives the definition's result (no GPU needed)."""
    from dcp_opt.runtime import attention
    from torch.nn.attention import varlen

    monkeypatch.setattr(attention, "choose_kernel", lambda *a, **kw: "varlen")
    monkeypatch.setattr(varlen, "varlen_attn", _flash_varlen_by_its_docs)
    segs = [0] * 5 + [1] * 8 + [2] * 2
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(len(segs), 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    got = segment_attention(q, k, v, segments=torch.tensor(segs), scale=0.8, window=window)
    want = _by_definition(q, k, v, segs, scale=0.8, window=window)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert attention.varlen_window_size(window) == ((-1, 0) if window is None else (window - 1, 0))
