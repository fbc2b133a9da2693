"""ModelSpec attention windows and the cost model's view of them (no torch needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dcp_opt import Batch, Cluster, CostModel, ModelSpec
from dcp_opt.errors import DcpOptError
from dcp_opt.hf_spec import attention_windows, spec_from_hf_config

CLUSTER = Cluster("h100", 1, 8, 989e12, 80e9, 450e9, 50e9)


def _spec(**kw) -> ModelSpec:
    return ModelSpec("m", "1d", 4, 1024, 8, 4096, vocab_size=1000, gated_mlp=True, **kw)


def test_windowed_attention_work_follows_s_times_w():
    """4 layers, 2 of them with a window of w = 100 keys. A 1000-token sequence:
    full layers Q = s^2 = 1,000,000 (s^2/2 scored pairs, x2); windowed layers
    Q_w = s^2 - (s - w)^2 = 1,000,000 - 810,000 = 190,000 (= 2 s w - w^2 = 200,000 - 10,000:
    w(w+1)/2 + (s-w) w = 95,050 pairs ~ s w - w^2/2). Per layer on average
    (2 * 1,000,000 + 2 * 190,000) / 4 = 595,000. An 80-token sequence fits the window:
    Q = 6,400 on every layer."""
    plain = CostModel(_spec(), CLUSTER)
    windowed = CostModel(_spec(window=100, windowed_layers=2), CLUSTER)
    batch = Batch.from_lengths([1000, 80])
    long, short = batch.sequences
    assert plain.features(long)[0] == 1_000_000
    assert windowed.features(long)[0] == 595_000
    assert windowed.features(short)[0] == plain.features(short)[0] == 6_400
    assert windowed.batch_features(batch)[:, 0].tolist() == [595_000, 6_400]
    # Time: only the attention term moves, by L * (quad_fwd + quad_bwd) * heads_share *
    # (1,000,000 - 595,000) at degree 1 (heads_share 1).
    co = windowed.coeffs.blocks["layer"]
    saved = 4 * (co.fwd.quad + co.bwd.quad) * 405_000
    got = float(plain.time(plain.features(long)[None], 1)[0]) - float(
        windowed.time(windowed.features(long)[None], 1)[0]
    )
    assert got == pytest.approx(saved, rel=1e-12)
    # Activation memory has no s^2 term (FlashAttention-style kernels keep O(s) per layer),
    # so a window leaves it as it is.
    assert windowed.memory(1000, 1, 0) == plain.memory(1000, 1, 0)


def test_a_model_without_window_keeps_its_document_and_fingerprint():
    spec = _spec()
    assert "window" not in spec.to_dict() and "windowed_layers" not in spec.to_dict()
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    windowed = _spec(window=64, windowed_layers=4)
    assert ModelSpec.from_dict(windowed.to_dict()) == windowed
    assert CostModel(windowed, CLUSTER).fingerprint() != CostModel(spec, CLUSTER).fingerprint()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"window": 64}, "model.windowed_layers"),
        ({"windowed_layers": 2}, "model.windowed_layers"),
        ({"window": 64, "windowed_layers": 5}, "model.windowed_layers"),
        ({"window": -1, "windowed_layers": 1}, "model.window"),
    ],
)
def test_window_fields_are_checked(kw, field):
    with pytest.raises(DcpOptError, match=field):
        _spec(**kw)


def _cfg(**kw):
    base = dict(
        model_type="qwen2",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        sliding_window=None,
        layer_types=None,
        tie_word_embeddings=False,
    )
    return SimpleNamespace(**{**base, **kw})


def test_windows_from_config():
    full, slide = "full_attention", "sliding_attention"
    assert attention_windows(_cfg()) == (0, 0)
    assert attention_windows(_cfg(sliding_window=32)) == (32, 4)  # Mistral: every layer
    alternate = _cfg(sliding_window=32, layer_types=[slide, full, slide, full])  # Gemma 2/3
    assert attention_windows(alternate) == (32, 2)
    assert attention_windows(_cfg(sliding_window=32, layer_types=[full] * 4)) == (0, 0)
    with pytest.raises(DcpOptError, match="config.layer_types"):
        attention_windows(_cfg(sliding_window=32, layer_types=["chunked_attention"] * 4))
    spec = spec_from_hf_config(alternate)
    assert (spec.window, spec.windowed_layers, spec.num_kv_heads) == (32, 2, 2)


def test_unknown_family_is_refused():
    with pytest.raises(DcpOptError, match="config.model_type: 'gpt2'"):
        spec_from_hf_config(_cfg(model_type="gpt2"))
