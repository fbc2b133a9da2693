"""Where a transformers causal LM keeps its decoder layers and attention modules, and whether
"dcp_ulysses" (runtime/hf.py) can run every one of them exactly.

`find_layers` gives (decoder layer, attention module) pairs for every family transformers
ships in the two layouts of its decoder-only models: Llama style
`<base>.layers[i].self_attn` (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo 2, Mixtral,
Qwen-MoE, gpt-oss, ...) and GPT-NeoX style `gpt_neox.layers[i].attention`; a user's own
`locator(model)` can name them for other layouts.

`check_supported` reads everything "dcp_ulysses" must honour before anything is changed
(parallelize_hf is transactional): the family (only families whose attention kwargs and masks
were verified against single-process training, tests/test_hf_families.py), attention dropout,
non-causal layers, and for mixture-of-experts models what would make a step depend on which
tokens share a micro-batch. Each refusal names the config field and its value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from dcp_opt.errors import DcpOptError
from dcp_opt.hf_spec import attention_windows

# config.model_type of the families verified by tests/test_hf_families.py: their attention
# functions receive only the kwargs runtime/hf.py honours (scaling, dropout, sliding_window,
# softcap, s_aux), and transformers builds their masks from nothing but causality and
# `sliding_window` / `layer_types` (masking_utils create_causal_mask /
# create_sliding_window_causal_mask), which those kwargs carry per layer.
VERIFIED_FAMILIES = (
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt_neox",
    "gpt_oss",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
)

Locator = Callable[[nn.Module], Iterable[tuple[nn.Module, nn.Module]]]


class UnsupportedModelError(DcpOptError):
    """parallelize_hf refused a model before changing anything (a ValueError too)."""


def base_model(model: nn.Module) -> nn.Module:
    """transformers' `base_model` (the decoder under the LM head: `model.model`,
    `model.gpt_neox`), else `model.model`, else the model itself."""
    for name in ("base_model", "model"):
        inner = getattr(model, name, None)
        if isinstance(inner, nn.Module):
            return inner
    return model


def find_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(decoder layer, its self-attention module) for every decoder layer, in order."""
    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise UnsupportedModelError(
            f"model: {type(model).__name__} has no decoder layer list at "
            "`<base model>.layers`; allowed: a transformers decoder-only causal LM "
            "(Llama or GPT-NeoX layout), or pass locator=(model -> [(layer, attention)])"
        )
    out = []
    for i, layer in enumerate(layers):
        attn = next(
            (getattr(layer, a) for a in ("self_attn", "attention") if hasattr(layer, a)), None
        )
        if not isinstance(attn, nn.Module):
            raise UnsupportedModelError(
                f"model.layers[{i}]: {type(layer).__name__} has no `self_attn` or `attention` "
                "module; allowed: decoder layers with one self-attention, or pass locator="
            )
        out.append((layer, attn))
    return out


def locate(model: nn.Module, locator: Locator | None) -> list[tuple[nn.Module, nn.Module]]:
    """The pairs of `locator` (default find_layers), checked: nn.Modules, no repeats."""
    try:
        pairs = [tuple(p) for p in (locator or find_layers)(model)]
    except UnsupportedModelError:
        raise
    except Exception as e:  # a user locator that fails is a refusal, not a half-change
        raise UnsupportedModelError(f"locator: failed on {type(model).__name__} ({e})") from e
    if not pairs or any(len(p) != 2 or not all(isinstance(m, nn.Module) for m in p) for p in pairs):
        raise UnsupportedModelError(
            "locator: must return a non-empty list of (decoder layer, attention module) pairs"
        )
    if len({id(a) for _, a in pairs}) != len(pairs):
        raise UnsupportedModelError("locator: an attention module is listed twice")
    return pairs


def _refuse(field: str, value, allowed: str, why: str) -> None:
    raise UnsupportedModelError(
        f"config.{field}: {value!r} not supported ({why}); allowed: {allowed}"
    )


def check_supported(model: nn.Module, pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Raise UnsupportedModelError for anything "dcp_ulysses" cannot run exactly."""
    cfg = model.config
    family = getattr(cfg, "model_type", None)
    if family not in VERIFIED_FAMILIES:
        _refuse(
            "model_type",
            family,
            str(list(VERIFIED_FAMILIES)),
            "its attention kwargs and masks are not verified against single-process training",
        )
    _check_stray_attention(model, pairs)
    try:  # windows the layers use: integers >= 1, layer types sliding or full only
        attention_windows(cfg)
    except DcpOptError as e:
        raise UnsupportedModelError(str(e)) from None
    for i, (_, attn) in enumerate(pairs):
        p = getattr(attn, "attention_dropout", getattr(cfg, "attention_dropout", 0.0))
        p = getattr(p, "p", p)  # GPT-NeoX keeps an nn.Dropout
        if p:
            # dropout masks would have to be drawn per sequence, not per rank, to match
            _refuse("attention_dropout", p, "0.0", "per-sequence dropout masks are not built")
        if getattr(attn, "is_causal", True) is not True:
            field = "use_bidirectional_attention"
            _refuse(field, getattr(cfg, field, None), "False", f"layer {i} is not causal")
    _check_hidden_dropout(model)
    _check_moe(cfg)


def _check_hidden_dropout(model: nn.Module) -> None:
    """Dropout outside attention (GPT-NeoX hidden_dropout, Phi-3 resid_pdrop / embd_pdrop)
    draws its masks from each rank's own generator over that rank's shard, so a step's
    gradient would differ from single-process training's: refuse, naming the config field
    that sets it (the module's name where no field holds its probability)."""
    cfg = model.config
    for name, sub in model.named_modules():
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            fields = [
                k
                for k, v in vars(cfg).items()
                if (k.endswith("dropout") or k.endswith("pdrop")) and v == sub.p
            ]
            field = fields[0] if fields else f"(module model.{name})"
            _refuse(field, sub.p, "0.0", f"dropout in model.{name}: per-rank masks")


def _check_stray_attention(model: nn.Module, pairs) -> None:
    """Every attention module outside the located ones would also switch to "dcp_ulysses"
    (composite models: vision towers, cross-attention) without being prepared: refuse."""
    inside = {id(m) for _, a in pairs for m in a.modules()}
    for name, sub in model.named_modules():
        if id(sub) not in inside and type(sub).__name__.endswith("Attention"):
            raise UnsupportedModelError(
                f"model.{name}: {type(sub).__name__} is an attention module outside the "
                "decoder layers; allowed: a decoder-only causal LM, or a locator listing it"
            )


def _check_moe(cfg) -> None:
    """Under a plan the micro-batches hold other tokens than single-process training's
    batch: a router whose result depends on which tokens travel together cannot match."""
    if getattr(cfg, "output_router_logits", False):
        _refuse(
            "output_router_logits",
            True,
            "False",
            "the router's load-balancing loss depends on which tokens share a micro-batch",
        )
    noise = getattr(cfg, "router_jitter_noise", 0.0)
    if noise:
        _refuse("router_jitter_noise", noise, "0.0", "random router noise in training")
    for field in ("capacity_factor", "expert_capacity"):
        value = getattr(cfg, field, None)
        if value:  # token dropping at capacity depends on the micro-batch's other tokens
            _refuse(field, value, "None", "token dropping depends on the micro-batch")
