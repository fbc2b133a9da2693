"""The cost-model view (ModelSpec) of a Hugging Face transformers decoder, from its config
alone: duck-typed attributes, no torch or transformers import (dcp_opt core).

Covers the families runtime/hf.py trains (runtime/hf_layers.VERIFIED_FAMILIES): Llama-style
(Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo 2), GPT-NeoX, and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE, Mixtral and gpt-oss. `num_params` is counted from the config exactly
as transformers builds the model (tests/test_hf_families.py checks it against
sum(p.numel())); `ffn_hidden` of an MoE model is the FFN width one token passes through
(top-k experts plus the shared expert), the work the cost model's FLOPs count per token.
"""

from __future__ import annotations

from .errors import DcpOptError
from .model import ModelSpec

GATED = ("gemma", "gemma2", "gemma3_text", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3")
MOE = ("gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES = (*GATED, "gpt_neox", *MOE)


def _int(cfg, field: str) -> int:
    value = getattr(cfg, field, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DcpOptError(f"config.{field}: must be an integer >= 1, got {value!r}")
    return value


def attention_windows(cfg) -> tuple[int, int]:
    """(window, number of windowed layers) of a config: `layer_types` when it lists them
    ("sliding_attention" layers use `sliding_window`), else every layer when
    `sliding_window` is set (Mistral, Phi-3, Mixtral)."""
    layers = _int(cfg, "num_hidden_layers")
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise DcpOptError(
                f"config.layer_types: {unknown} not supported; "
                "allowed: 'sliding_attention', 'full_attention'"
            )
        count = list(types).count("sliding_attention")
    else:
        count = layers if window is not None else 0
    if count == 0:
        return 0, 0
    return _int(cfg, "sliding_window"), count


def spec_from_hf_config(cfg, *, name: str | None = None, dtype_bytes: int = 2) -> ModelSpec:
    """ModelSpec of a transformers causal-LM config (an object with its attributes)."""
    family = getattr(cfg, "model_type", None)
    if family not in FAMILIES:
        raise DcpOptError(f"config.model_type: {family!r} not supported; allowed: {list(FAMILIES)}")
    h, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    window, windowed = attention_windows(cfg)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if family == "gpt_neox":  # fused multi-head qkv; the config may still carry the field
        kv = heads
    return ModelSpec(
        name or f"hf-{family}",
        "1d",
        _int(cfg, "num_hidden_layers"),
        h,
        heads,
        _active_ffn(cfg, family),
        vocab_size=_int(cfg, "vocab_size"),
        gated_mlp=family != "gpt_neox",
        dtype_bytes=dtype_bytes,
        num_params=float(count_params(cfg)),
        num_kv_heads=None if kv == heads else int(kv),
        window=window,
        windowed_layers=windowed,
    )


def _head_dim(cfg) -> int:
    d = getattr(cfg, "head_dim", None)
    return d if isinstance(d, int) and d > 0 else cfg.hidden_size // cfg.num_attention_heads


def _moe_layers(cfg) -> list[bool]:
    """Which layers have experts (Qwen-MoE: every `decoder_sparse_step`-th layer not in
    `mlp_only_layers`; Mixtral and gpt-oss: every layer)."""
    n = cfg.num_hidden_layers
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def _experts(cfg) -> tuple[int, int, int]:
    """(experts, experts per token, expert FFN width)."""
    e = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    f = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return int(e), int(cfg.num_experts_per_tok), int(f)


def _active_ffn(cfg, family: str) -> int:
    """FFN width one token goes through, averaged over the layers (MoE: top-k experts and
    the shared expert; dense layers: intermediate_size)."""
    f = _int(cfg, "intermediate_size")
    if family not in MOE:
        return f
    _, k, fe = _experts(cfg)
    sparse = k * fe + (getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    flags = _moe_layers(cfg)
    return max(1, round(sum(sparse if m else f for m in flags) / len(flags)))


def count_params(cfg) -> int:
    """Parameters of the model transformers builds from `cfg` (embeddings, tied or not)."""
    family, h, v = cfg.model_type, cfg.hidden_size, cfg.vocab_size
    embed = v * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    if family == "gpt_neox":
        return embed + cfg.num_hidden_layers * _neox_layer(cfg) + 2 * h  # final LayerNorm
    flags = _moe_layers(cfg) if family in MOE else [False] * cfg.num_hidden_layers
    layers = sum(_attention(cfg, family) + _norms(cfg, family) + _mlp(cfg, m) for m in flags)
    return embed + layers + h  # final RMSNorm


def _attention(cfg, family: str) -> int:
    h, dh = cfg.hidden_size, _head_dim(cfg)
    q, kv = cfg.num_attention_heads * dh, (cfg.num_key_value_heads or cfg.num_attention_heads) * dh
    n = 2 * h * q + 2 * h * kv  # q, o and k, v projections
    if family in ("qwen2", "qwen2_moe"):
        n += q + 2 * kv  # q, k, v biases (Qwen2 attention)
    elif getattr(cfg, "attention_bias", False):
        n += q + 2 * kv + h  # q, k, v and o biases
    if family in ("qwen3", "qwen3_moe", "gemma3_text"):
        n += 2 * dh  # per-head q_norm, k_norm
    if family == "olmo2":
        n += q + kv  # q_norm, k_norm over the whole projection
    if family == "gpt_oss":
        n += cfg.num_attention_heads  # attention sinks, one logit per head
    return n


def _norms(cfg, family: str) -> int:
    """RMSNorm weights of one layer: two (Gemma 2/3: four, around attention and MLP)."""
    return cfg.hidden_size * (4 if family in ("gemma2", "gemma3_text") else 2)


def _mlp(cfg, moe: bool) -> int:
    h = cfg.hidden_size
    if not moe:
        return 3 * h * cfg.intermediate_size  # gate, up, down
    e, _, f = _experts(cfg)
    if cfg.model_type == "gpt_oss":  # biased router and experts (gate_up and down)
        return e * h + e + e * (2 * h * f + 2 * f + f * h + h)
    n = e * h + e * 3 * h * f  # router, experts
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    if shared:
        n += 3 * h * shared + h  # shared expert and its sigmoid gate
    return n


def _neox_layer(cfg) -> int:
    """GPT-NeoX: fused biased qkv, biased dense output, biased non-gated MLP, two
    LayerNorms with bias."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
