"""Profile a Hugging Face causal LM: one decoder layer and the LM head behind the profiler's
protocols (runtime/profile/blocks.py), with the ModelSpec of the full model from its config.

    target = hf_target("llama-7b", dtype=torch.bfloat16, device="cuda")   # built-in config
    target = hf_target(model)                 # a loaded transformers PreTrainedModel
    profile = runtime.profile.measure.profile_model(target, clock=CudaClock(), dtype=torch.bfloat16)

What runs is what the runtime runs (runtime/hf.py): a packed row [1, T] whose `position_ids`
restart at every sequence, through transformers' own decoder layer, with runtime.hf's
"dcp_ulysses" attention function at SP degree 1 (no all-to-all): one PyTorch SDPA call per
packed sequence (4-D, causal, no mask: the flash kernel on CUDA at bf16, the fused kernel on
CPU), cost sum s^2, as the cost model and FlashAttention's varlen kernels assume (Dao 2023,
sec. 3.1). A layer with a sliding window w (Mistral, Qwen2 / Gemma 2-3 "sliding_attention"
layers) attends within it, cost sum s^2 - (s - w)^2: its adapter carries the window and the
fit uses that feature (dcp_opt.cost.windowed_quad).

A config is built offline and never downloaded: a built-in name, a directory holding
config.json, a config.json file, or a hub id already in the local cache. Only one decoder
layer (plus embedding and LM head) is instantiated; the spec carries the full depth, which
the CostModel multiplies in (runtime/profile/measure.py: the extrapolation).
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from dcp_opt.errors import DcpOptError
from dcp_opt.hf_spec import attention_windows, spec_from_hf_config
from dcp_opt.model import ModelSpec

from ..hf import ATTN_NAME, decoder_layers, parallelize_hf
from ..parallelize import SPState
from .blocks import LMHeadAdapter, ProfileTarget, Shapes

# Offline configs (no hub access needed). Llama 2 7B: 32 layers, hidden 4096, 32 heads,
# SwiGLU 11008, vocab 32000 (Touvron et al. 2023, table 1), as dcp_opt's "llama-7b" preset.
BUILTIN_CONFIGS: dict[str, dict] = {
    "llama-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    "tiny-llama": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
}
ALLOWED_FORMS = (
    f"hf:<built-in name> ({', '.join(BUILTIN_CONFIGS)}), hf:<directory with config.json>, "
    "hf:<path/to/config.json>, hf:<hub id already in the local Hugging Face cache>"
)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise DcpOptError(
            "HF profiling needs transformers, which is not installed; "
            "install it with: pip install 'dcp_opt[hf]'"
        ) from None
    return transformers


def load_hf_config(ref: str):
    """A transformers config from `ref` (see ALLOWED_FORMS, without the "hf:"), offline."""
    tf = _transformers()
    if ref in BUILTIN_CONFIGS:
        cfg = tf.LlamaConfig(**BUILTIN_CONFIGS[ref], attention_dropout=0.0)
        cfg.name_or_path = ref
        return cfg
    path = Path(ref)
    try:
        if path.is_file():
            d = json.loads(path.read_text())
            cfg = tf.AutoConfig.for_model(d.pop("model_type"), **d)
        else:
            cfg = tf.AutoConfig.from_pretrained(ref, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DcpOptError(
            f"model: cannot load an HF config from {ref!r} offline ({why}); "
            f"allowed: {ALLOWED_FORMS}"
        ) from None
    cfg.name_or_path = cfg.name_or_path or ref
    return cfg


@dataclass(frozen=True)
class PackedRow:
    """What every layer of a packed micro-batch shares: position ids [1, T] and segment
    ids [T] (which sequence each token belongs to)."""

    positions: torch.Tensor
    segments: torch.Tensor


class HFLayerAdapter:
    """One transformers decoder layer on a packed row. A call is (h [1, T, C], PackedRow):
    h is drawn on the target device; position ids [1, T] restart per sequence.

    Inside the model, positions, segment ids and RoPE's (cos, sin) are made once per step
    and shared by every layer, so a checkpointed layer keeps only its h. Here they travel
    in a non-tensor holder, which torch's checkpoint does not save (it keeps its tensor
    arguments), and (cos, sin) are computed inside the forward (time negligible next to a
    layer's): the measured checkpoint bytes are then exactly h's. The segment ids reach the
    attention through `state` (runtime.hf's SPState), as in training; they stay set after
    the forward, for the checkpoint's recompute in backward."""

    block_type = "layer"

    def __init__(
        self, layer: nn.Module, rotary: nn.Module, hidden: int, *, state, seed=0, window=0,
        layer_type=None,
    ):  # fmt: skip
        self.module, self.rotary, self.hidden = layer, rotary, hidden
        self.state, self.seed = state, seed
        self.window = window  # the layer's sliding window (0: none): the fit's Q follows it
        self.layer_type = layer_type  # for a rotary embedding per layer type (Gemma 3)

    def make_inputs(self, shapes: Shapes, *, dtype, device) -> list[tuple]:
        device = torch.device(device)
        gen = torch.Generator(device).manual_seed(self.seed)
        lengths = [int(s[0]) for s in shapes]
        pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        seg = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
        shape = (1, sum(lengths), self.hidden)
        h = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(True)
        self.rotary.to(device)
        return [(h, PackedRow(pos, seg))]

    def forward(self, inputs: list[tuple]) -> list[torch.Tensor]:
        outs = []
        for h, row in inputs:
            pos = row.positions
            self.state.segments = row.segments
            with torch.no_grad():  # Gemma 3: one RoPE per layer type (local / global)
                extra = () if self.layer_type is None else (self.layer_type,)
                cos, sin = self.rotary(h, pos, *extra)
            out = self.module(h, position_ids=pos, position_embeddings=(cos, sin), use_cache=False)
            outs.append(out[0] if isinstance(out, tuple) else out)  # older transformers: tuple
        return outs


def _parts(model: nn.Module):
    """(decoder layers, rotary embedding, token embedding, final norm, LM head) of a
    Llama-style transformers causal LM, or a DcpOptError naming what is missing."""
    inner = getattr(model, "model", None)
    parts = {
        "model.layers": inner is not None and decoder_layers(model),
        "model.rotary_emb": getattr(inner, "rotary_emb", None),
        "model.embed_tokens": getattr(inner, "embed_tokens", None),
        "model.norm": getattr(inner, "norm", None),
        "lm_head": getattr(model, "lm_head", None),
    }
    missing = [k for k, v in parts.items() if not isinstance(v, nn.Module)]
    if missing:
        raise DcpOptError(
            f"model: {type(model).__name__} has no {', '.join(missing)}; allowed: a Llama-style "
            "transformers causal LM (Llama, Mistral, Qwen2, ...) with rotary embeddings"
        )
    return tuple(parts.values())


def _build_one_layer(config, *, dtype, device, seed: int) -> nn.Module:
    """The model of `config` with one decoder layer, built directly on `device`."""
    tf = _transformers()
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    # the layer's attention becomes runtime.hf's function (_runtime_attention), so the
    # implementation it is built with does not run; "eager" for families without SDPA (Gemma 2)
    for impl in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            with torch.device(device):
                model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
            return model.to(dtype)
        except ValueError as e:
            why = str(e).splitlines()[0]
    raise DcpOptError(
        f"model: {cfg.model_type!r} is not a causal LM transformers can build ({why})"
    )


def hf_spec(config, *, name: str, dtype_bytes: int) -> ModelSpec:
    """The cost-model view of the full-depth model, from its config alone
    (dcp_opt.hf_spec.spec_from_hf_config, as runtime.hf.model_spec builds it for training):
    depth, widths, gated MLP, the kv heads of grouped-query attention (fewer all-to-all
    bytes), sliding windows (`window`, `windowed_layers`; the cost model's attention term
    follows them) and the exact parameter count. A family it does not cover is refused
    with the allowed list."""
    return spec_from_hf_config(config, name=name, dtype_bytes=dtype_bytes)


def layer_window(config, index: int = 0) -> int:
    """Sliding window of decoder layer `index` (0: full attention), as transformers builds
    it: `layer_types[index]` when the config lists them (Qwen2, Gemma 2/3: "sliding_attention"
    layers use `sliding_window`), else `sliding_window` on every layer (Mistral, Phi-3)."""
    attention_windows(config)  # checks the window and layer types, naming the field
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types is not None and types[index] != "sliding_attention":
        return 0
    return int(window)


def hf_target(
    model_or_config,
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> ProfileTarget:
    """ProfileTarget of a transformers causal LM: a PreTrainedModel (its first layer is
    copied, so the model itself is left unchanged; `dtype` and `device` are the model's), a
    config, or a config reference string (load_hf_config). Built from a config, the model
    gets one layer, random weights, `dtype` (default float32) on `device`."""
    if isinstance(model_or_config, nn.Module):
        model, config = model_or_config, model_or_config.config
        layers, rotary, embed, norm, head = _parts(model)
        layer = copy.deepcopy(layers[0])
    else:
        config = model_or_config
        if isinstance(config, str):
            config = load_hf_config(config)
        model = _build_one_layer(config, dtype=dtype or torch.float32, device=device, seed=seed)
        layers, rotary, embed, norm, head = _parts(model)
        layer = layers[0]
    dtype = next(layer.parameters()).dtype
    state = _runtime_attention(layer)
    spec = hf_spec(
        config,
        name=name or f"hf:{config.name_or_path or config.model_type}",
        dtype_bytes=torch.finfo(dtype).bits // 8,
    )
    window = layer_window(config, 0)  # the measured layer is the model's first
    shim = SimpleNamespace(embed=embed, norm=norm, head=head, cfg=config)  # LMHeadAdapter's view
    meta = {
        "hf_model_type": config.model_type,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", config.num_attention_heads)),
        "head_dim": int(layer.self_attn.head_dim),
        "attention": ATTN_NAME,
        **({"window": window} if window else {}),
    }
    kind = None  # a rotary embedding per layer type (Gemma 3) takes the layer's type
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        kind = config.layer_types[0]
    adapter = HFLayerAdapter(
        layer, rotary, spec.hidden, state=state, seed=seed, window=window, layer_type=kind
    )
    return ProfileTarget(
        spec,
        {"layer": adapter},
        LMHeadAdapter(shim, seed),
        signature=f"hf/{json.dumps(meta, sort_keys=True)}/{spec.to_dict()}/{dtype}",
        meta=meta,
    )


def _runtime_attention(layer: nn.Module) -> SPState:
    """Point `layer`'s attention at runtime.hf's function, at SP degree 1, through a config
    copy of its own, so no other module sharing the config changes; returns the SPState the
    function reads."""
    attn = layer.self_attn
    attn.config = copy.copy(attn.config)
    # parallelize_hf wants a causal LM; a shell holding just this layer (degree 1, no
    # recompute: the profiler checkpoints the layer itself).
    shell = nn.Module()
    shell.config, shell.model = attn.config, nn.Module()
    shell.model.layers = nn.ModuleList([layer])
    state = SPState()
    parallelize_hf(shell, state, sync_weights=False)  # one layer of this process's own
    return state
