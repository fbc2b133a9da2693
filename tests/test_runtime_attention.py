import pytest

torch = pytest.importorskip("torch")

from dcp_opt.runtime.attention import _masked_segment_attention, segment_attention  # noqa: E402


@pytest.mark.parametrize("segs", [[0] * 5 + [1] * 3 + [2] * 4, [0, 0, 1, 1, 0, 0], [7]])
@pytest.mark.parametrize("causal", [True, False])
def test_per_segment_equals_one_masked_call(segs, causal):
    """The per-segment path (cost sum s^2) gives the masked whole-stream result; ids that
    repeat non-contiguously ([0,0,1,1,0,0]) take the masked path."""
    gen = torch.Generator().manual_seed(0)
    t = len(segs)
    q, k, v = (torch.randn(t, 2, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    s = torch.tensor(segs)
    a = segment_attention(q, k, v, segments=s, causal=causal)
    b = _masked_segment_attention(q, k, v, segments=s, causal=causal)
    assert torch.allclose(a, b, atol=1e-12)


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
