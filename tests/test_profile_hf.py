"""Profiling a Hugging Face causal LM (runtime/profile/hf.py): the layer adapter computes what
the model computes, the spec is the config's, a tiny profile drives a CostModel, and bad model
references fail with the allowed forms. CPU, tiny sizes, nothing downloaded."""

from __future__ import annotations

import copy
import functools
import json
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dcp_opt.runtime.hf import tiny_llama  # noqa: E402
from dcp_opt.runtime.profile import measure as P  # noqa: E402
from dcp_opt.runtime.profile.hf import (  # noqa: E402
    ALLOWED_FORMS,
    hf_target,
    load_hf_config,
)

from dcp_opt import CostModel, Sequence, cluster_preset, model_preset  # noqa: E402
from dcp_opt.errors import DcpOptError  # noqa: E402
from dcp_opt.profile_io import (  # noqa: E402
    cost_model_from_profile,
    layer_fingerprint,
    load_profile,
    save_profile,
)

TINY_GRID = P.Grid(lengths=(8, 16, 32, 48), pack=(1, 2, 3), max_tokens=96)
TINY = P.ProfileConfig(grid=TINY_GRID, warmup=0, repeats=1, passes=1, min_time_s=0.0)


@functools.cache
def _model():
    # 2 layers, 4 query heads over 2 kv heads (grouped-query attention), float64.
    return tiny_llama(num_layers=2, num_kv_heads=2, dtype=torch.float64)


def _reference(model, lengths, seed=3):
    """Layer 0 of the model, each sequence alone through the model's own "sdpa" attention,
    positions 0..s-1: what single-sequence training computes."""
    gen = torch.Generator().manual_seed(seed)
    hs = [torch.randn(1, n, model.config.hidden_size, generator=gen, dtype=torch.float64)
          for n in lengths]  # fmt: skip
    outs = []
    for h in hs:
        pos = torch.arange(h.shape[1])[None]
        cos_sin = model.model.rotary_emb(h, pos)
        outs.append(model.model.layers[0](h, position_ids=pos, position_embeddings=cos_sin))
    return hs, torch.cat(outs, dim=1)


def test_layer_adapter_matches_each_sequence_alone():
    # Through runtime.hf's attention at degree 1; 4 query heads over 2 kv heads, so the
    # comparison also covers the repeat of kv heads.
    model = _model()
    lengths = [5, 9, 3]
    hs, want = _reference(model, lengths)
    target = hf_target(model)
    block = target.blocks["layer"]
    [(h, row)] = block.make_inputs([(n,) for n in lengths], dtype=torch.float64, device="cpu")
    pos = row.positions
    assert pos[0].tolist() == [*range(5), *range(9), *range(3)]  # restart per sequence
    with torch.no_grad():
        h.copy_(torch.cat(hs, dim=1))
    got = block.forward([(h, row)])[0]
    assert torch.allclose(got, want, rtol=0, atol=1e-10)
    # Packed without per-sequence attention, the second sequence would see the first: the
    # comparison above can fail.
    lone = model.model.layers[0](
        h, position_ids=pos, position_embeddings=model.model.rotary_emb(h, pos)
    )
    assert not torch.allclose(lone, want, atol=1e-6)


def test_user_model_is_left_unchanged():
    model = _model()
    before = model.model.layers[0].self_attn.config._attn_implementation
    target = hf_target(model)
    assert model.config._attn_implementation == before == "sdpa"
    assert model.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    assert "forward" not in vars(model.model.layers[0])  # no recompute wrapper on the user's
    assert "forward" in vars(target.blocks["layer"].module)  # ... only on the profiled copy


def test_attention_dropout_is_rejected():
    # The runtime's attention has no dropout (runtime.hf.dcp_attention); profiling a model
    # that would train with it must fail rather than measure a different computation
    # (parallelize_hf refuses it up front, issue 12).
    cfg = copy.deepcopy(_model().config)
    cfg.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        hf_target(cfg, dtype=torch.float64)


def test_spec_matches_the_hf_config():
    model = _model()
    cfg = model.config
    for target in (hf_target(model), hf_target(cfg, dtype=torch.float64)):
        spec = target.model
        assert (spec.kind, spec.num_layers, spec.hidden) == ("1d", 2, cfg.hidden_size)
        assert (spec.num_heads, spec.ffn_hidden) == (cfg.num_attention_heads, 128)
        assert spec.vocab_size == cfg.vocab_size and spec.gated_mlp and spec.causal
        assert spec.dtype_bytes == 8
        # Exact parameter count of the full-depth model, though one layer was built.
        assert spec.num_params == sum(p.numel() for p in model.parameters())
        assert target.meta["num_kv_heads"] == 2 and target.meta["head_dim"] == 16
        assert spec.kv_heads == 2  # the cost model charges the GQA all-to-all volume
    # Built from a config: one layer only, whatever the depth.
    built = hf_target(cfg).blocks["layer"].module
    assert sum(1 for _ in built.modules()) == sum(1 for _ in model.model.layers[0].modules())


def test_builtin_llama_7b_is_the_llama_7b_preset():
    # On the meta device: shapes only, no memory, no time.
    target = hf_target("llama-7b", dtype=torch.bfloat16, device="meta", name="llama-7b")
    preset = model_preset("llama-7b")
    assert layer_fingerprint(target.model) == layer_fingerprint(preset)
    assert target.model.num_layers == preset.num_layers == 32
    assert target.model.num_params == pytest.approx(preset.num_params, rel=1e-3)


def test_tiny_profile_loads_into_a_cost_model(tmp_path):
    target = hf_target(_model().config, dtype=torch.float32, name="tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # timing noise of a loaded CPU; fit quality not tested
        prof = P.profile_model(target, TINY, clock=P.CpuClock(), progress=False)
    path = save_profile(prof, tmp_path / "tiny.profile.json")
    cost = cost_model_from_profile(path, target.model, cluster_preset("h200x8"))
    assert isinstance(cost, CostModel) and cost.coeffs.source == "profile"
    assert load_profile(path).model == target.model
    # Checkpoint bytes per token: the layer input h alone, 64 float32 = 256 (positions and
    # segment ids are shared by every layer); activations are many times that.
    assert prof.coefficients.ckpt_bytes_per_token_layer == pytest.approx(256)
    assert prof.coefficients.act_bytes_per_token_layer > 5 * 256
    assert prof.fit["layer"]["fwd"]["n_train"] >= 4 and "head" in prof.fit
    # Full depth: the measured layer counted num_layers (= 2) times.
    t = cost.microbatch_time([Sequence(0, (40,))], 1)
    layer_fwd = cost.coeffs.blocks["layer"].fwd
    assert t.total_s >= 2 * (layer_fwd.lin * 40 + layer_fwd.const) > 0


def test_cli_profiles_an_hf_config_directory(tmp_path, capsys):
    from dcp_opt.cli import main

    _model().config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf.profile.json"
    argv = ["profile", "--model", f"hf:{tmp_path / 'cfg'}", "-o", str(out), "--quick"]
    assert main([*argv, "--no-progress", "--json", "--no-cache"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fit"]["layer"]["fwd"]["n_train"] >= 4
    prof = load_profile(out)
    assert prof.model.num_layers == 2 and prof.model.dtype_bytes == 4
    assert prof.method["target"].startswith("hf/")


@pytest.mark.parametrize("ref", ["no-such/model-xyz", "./missing-dir", "LLAMA-7B"])
def test_bad_model_reference_names_the_allowed_forms(ref):
    with pytest.raises(DcpOptError, match="allowed: hf:<built-in name>") as e:
        load_hf_config(ref)
    assert repr(ref) in str(e.value)


def test_config_json_of_an_unknown_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-arch", "hidden_size": 8}))
    with pytest.raises(DcpOptError, match="cannot load an HF config"):
        load_hf_config(str(path))


def test_cli_errors(tmp_path, capsys, monkeypatch):
    from dcp_opt.cli import main

    out = str(tmp_path / "p.json")
    assert main(["profile", "--model", "llama-7b", "-o", out]) == 2  # no "hf:" prefix
    assert ALLOWED_FORMS.split(",")[0] in capsys.readouterr().err
    assert main(["profile", "--model", "hf:no-such/model-xyz", "-o", out]) == 2
    assert "offline" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    assert main(["profile", "--model", "hf:tiny-llama", "-o", out]) == 2
    assert "pip install 'dcp_opt[hf]'" in capsys.readouterr().err


# ---- sliding windows (issue 12): the spec records them, the fit's Q follows them ----------
def _windowed_configs():
    import transformers as tf

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, sliding_window=24)  # fmt: skip
    alternating = ["sliding_attention", "full_attention"] * 2  # window 24 on layer 0
    return {
        "mistral": tf.MistralConfig(**base, num_hidden_layers=2),
        "qwen2": tf.Qwen2Config(
            **base, num_hidden_layers=4, use_sliding_window=True, layer_types=alternating
        ),
        # Gemma 2: attention-logit softcapping (50) on by default; Gemma 3: a RoPE per type
        "gemma2": tf.Gemma2Config(**base, num_hidden_layers=4, head_dim=16),
        "gemma3": tf.Gemma3TextConfig(
            **base, num_hidden_layers=4, head_dim=16, layer_types=alternating
        ),
    }


@pytest.mark.parametrize("family, windowed_layers", [("mistral", 2), ("qwen2", 2),
                                                     ("gemma2", 2), ("gemma3", 2)])  # fmt: skip
def test_windowed_spec_and_layer_attend_within_the_window(family, windowed_layers):
    from transformers import AutoModelForCausalLM

    cfg = _windowed_configs()[family]
    torch.manual_seed(0)
    # the reference: the family's SDPA attention; Gemma 2 has none, and its eager attention
    # takes the softmax in float32 (modeling_gemma2.eager_attention_forward), so it is
    # compared at float32's precision
    impl, atol = ("eager", 1e-6) if family == "gemma2" else ("sdpa", 1e-10)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).double()
    target = hf_target(model)
    assert (target.model.window, target.model.windowed_layers) == (24, windowed_layers)
    assert target.model.num_params == sum(p.numel() for p in model.parameters())
    block = target.blocks["layer"]
    assert block.window == 24 and target.meta["window"] == 24
    # from the config alone too (Gemma 2 has no SDPA: built with eager attention)
    assert hf_target(cfg).blocks["layer"].window == 24
    # the adapter's layer attends within the window: the model's own layer 0 (softcapping
    # included) given the sliding causal mask (key j visible from query i iff
    # i - 24 < j <= i) as an additive mask, each sequence alone (a mask leaking past the
    # window differs by ~0.05 here)
    lengths = [40, 9]
    [(h, row)] = block.make_inputs([(n,) for n in lengths], dtype=torch.float64, device="cpu")
    got = block.forward([(h, row)])[0]
    rope = () if family != "gemma3" else ("sliding_attention",)
    want, start = [], 0
    for n in lengths:
        x, pos = h[:, start : start + n], torch.arange(n)[None]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        hidden = ~((j <= i) & (j > i - 24))
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(hidden, -torch.inf)
        cs = model.model.rotary_emb(x, pos, *rope)
        out = model.model.layers[0](x, attention_mask=mask[None, None], position_ids=pos,
                                    position_embeddings=cs)  # fmt: skip
        want.append(out[0] if isinstance(out, tuple) else out)
        start += n
    assert torch.allclose(got, torch.cat(want, dim=1), rtol=0, atol=atol)


def test_windowed_profile_fits_the_windowed_term(tmp_path):
    cfg = _windowed_configs()["mistral"]
    target = hf_target(cfg, dtype=torch.float32, name="tiny-mistral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # timing noise of a loaded CPU; fit quality not tested
        prof = P.profile_model(target, TINY, clock=P.CpuClock(), progress=False)
    fit = prof.fit["layer"]
    assert fit["window"] == 24  # the fit used the measured layer's window
    # beside it, the same points fitted on plain s^2 (does the kernel exploit the window?)
    assert set(fit["plain_s2_median_rel_err_test"]) == {"fwd", "bwd"}
    # the held-out error is reported (a number; its size depends on the machine's load)
    assert fit["fwd"]["n_test"] >= 1 and fit["fwd"]["median_rel_err_test"] >= 0
    path = save_profile(prof, tmp_path / "mistral.profile.json")
    assert load_profile(path).model.window == 24
    cost = cost_model_from_profile(path, target.model, cluster_preset("h200x8"))
    # a 96-token sequence: attention Q = 96^2 - (96 - 24)^2 = 4032, not 96^2 = 9216
    assert cost.features(Sequence(0, (96,)))[0] == 4032
