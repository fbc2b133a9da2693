"""Hugging Face transformers integration: an unmodified causal LM of a verified family
(runtime/hf_layers.VERIFIED_FAMILIES: Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo 2,
GPT-NeoX, Qwen2/3-MoE, Mixtral, gpt-oss) trained under DCP plans exactly, or refused by
`parallelize_hf` before anything changes (tests/test_hf_families.py).

Nothing in the model changes class or parameter names:

- attention: `parallelize_hf` registers one function, "dcp_ulysses", in transformers'
  attention-function registry (`AttentionInterface.register`) and sets
  `config._attn_implementation` to it. The function runs Ulysses (runtime/sp.py) over the
  active group with causal attention inside each packed sequence (one kernel call per
  sequence, runtime/attention.py:segment_attention), so packed
  sequences never see each other. transformers builds no mask for a registered function that
  has no mask function (masking_utils `_preprocess_mask_arguments` exits early), so the
  packed layout is described only by the segment ids the task stores in `SPState`. Every
  kwarg the layer passes is honoured (scaling, the layer's own sliding window, softcap,
  sinks) or refused (dcp_attention); parallelize_hf refuses such models up front.
- positions: every token carries its position inside its own sequence (`position_ids`
  restart per packed sequence), so RoPE sees the positions single-device training sees.
- recompute: the first `state.recompute_layers` decoder layers run under
  `torch.utils.checkpoint` (non-reentrant), as runtime/parallelize.py does for TinyLM.

`HFCausalLMTask` is the executor's task for such a model: the sum of per-token cross-entropy
(or per-sample means), / plan.loss_normalizer, exactly as `LMTask`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dcp_opt.model import ulysses_kv_heads

from .attention import segment_attention
from .cp import cp_attention, shard_for_group
from .hf_layers import (  # noqa: F401 (UnsupportedModelError: re-exported)
    Locator,
    UnsupportedModelError,
    base_model,
    check_supported,
    find_layers,
    locate,
)
from .models import compute_dtype_bytes
from .parallelize import SPState
from .replicas import sync_replicas
from .ring import ring_attention
from .sp import pad_dim, ulysses_attention
from .tasks import LMTask, token_weight

ATTN_NAME = "dcp_ulysses"

# attention module -> the SPState it reads (weak: a dropped model frees its entry).
_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# decoder layer -> its forward before parallelize_hf wrapped it
_ORIGINAL_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_attention(q, k, v, *, segments, scaling: float, **options):
    """Causal attention inside each segment of a packed stream (options: window, softcap,
    sinks of runtime.attention.segment_attention). q: [T, H', Dh], k, v:
    [T, H'/g, Dh] (g > 1 under grouped-query attention: each kv head serves g consecutive
    query heads). The kernel takes the kv heads as they are (native GQA, no repeated heads;
    runtime/attention.py choose_kernel picks varlen on CUDA, SDPA elsewhere): cost sum s^2,
    as the cost model assumes, the same kernel as the runtime's own models."""
    return segment_attention(q, k, v, segments=segments, causal=True, scale=scaling, **options)


def _kv_for_ulysses(x: torch.Tensor, num_heads: int, degree: int) -> torch.Tensor:
    """[H_kv, T, Dh] kv heads -> [T, n, Dh] with n = ulysses_kv_heads(H, H_kv, d) (each kv
    head repeated n / H_kv times): the fewest heads that still give every member the kv heads
    of its query heads after the all-to-all (dcp_opt.model.ulysses_kv_heads)."""
    sent = ulysses_kv_heads(num_heads, x.shape[0], degree)
    return x.repeat_interleave(sent // x.shape[0], dim=0).transpose(0, 1)


# kwargs that carry nothing for attention over an already rotated packed stream: positions
# are in q and k (RoPE ran before the call); "dcp_ulysses" returns no attention weights.
_IGNORED_KWARGS = frozenset({"position_ids", "output_attentions", "use_cache", "cache_position"})


def dcp_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    is_causal=None,
    **kwargs,
):
    """transformers attention function: query [1, H, T_local, Dh], key/value
    [1, H_kv, T_local, Dh] (this rank's contiguous shard); returns ([1, T_local, H, Dh], None).

    Every kwarg is honoured or refused, never dropped: `scaling`, `sliding_window` (this
    layer's own window, transformers' definition: a query sees `sliding_window` keys, itself
    included), `softcap` (Gemma 2) and `s_aux` (gpt-oss attention sinks) go to the kernel;
    dropout, non-causal calls, a mask, and any kwarg not known here raise. parallelize_hf
    refuses such models before the first step; these raises are the last line."""
    state = _STATES.get(module)
    if state is None:
        raise RuntimeError(
            f"{ATTN_NAME}: module {type(module).__name__} was not prepared by parallelize_hf"
        )
    _check_call(query, attention_mask, dropout, is_causal, kwargs)
    heads, degree = query.shape[1], state.sp.degree
    q = query[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if state.kind in ("cp", "ring") and degree > 1:  # head-tail chunks (cp.py, ring.py)
        fn = cp_attention if state.kind == "cp" else ring_attention
        out = fn(
            q, key[0].transpose(0, 1), value[0].transpose(0, 1), state.sp,
            layout=state.layout, segments=state.segments, positions=state.positions,
            scale=scale, window=sliding_window, softcap=softcap, sinks=s_aux,
        )  # fmt: skip
        return out[None], None
    k, v = (_kv_for_ulysses(x[0], heads, degree) for x in (key, value))
    segments = state.segments
    if segments is None:  # plain single-sequence call (no executor): one segment
        segments = torch.zeros(q.shape[0] * state.sp.degree, dtype=torch.long, device=q.device)
    out = ulysses_attention(
        q,
        k,
        v,
        state.sp,
        _local_attention,
        segments=segments,
        scaling=scale,
        window=sliding_window,
        softcap=softcap,
        sinks=None if s_aux is None else _member_heads(s_aux, heads, state.sp),
    )
    return out[None], None


def _check_call(query, attention_mask, dropout, is_causal, kwargs) -> None:
    if dropout:
        # Ulysses would need dropout masks seeded per sequence, not per rank; not built.
        raise ValueError(f"attention_dropout: {dropout} not supported by {ATTN_NAME}; allowed: 0")
    if is_causal is False:
        raise ValueError(f"is_causal: False not supported by {ATTN_NAME}; allowed: True")
    if attention_mask is not None:
        raise ValueError(
            f"attention_mask: not supported by {ATTN_NAME} (the packed layout comes from "
            "SPState.segments); allowed: None"
        )
    extra = sorted(
        k
        for k, v in kwargs.items()
        if k not in _IGNORED_KWARGS and v is not None and v is not False
    )
    if extra:
        raise ValueError(
            f"{ATTN_NAME}: attention kwargs {extra} are not honoured; allowed: scaling, "
            f"dropout=0, sliding_window, softcap, s_aux, is_causal=True, {sorted(_IGNORED_KWARGS)}"
        )
    if query.shape[0] != 1:
        raise ValueError(f"batch size: {query.shape[0]} not allowed; allowed: 1 (packed stream)")


def _member_heads(per_head: torch.Tensor, heads: int, sp) -> torch.Tensor:
    """The entries of a per-head tensor [H] for the heads this Ulysses member attends over:
    heads padded to a multiple of d, member j takes [j H'/d, (j+1) H'/d) (runtime/sp.py)."""
    if sp.degree == 1:
        return per_head
    per = -(-heads // sp.degree)
    padded = pad_dim(per_head, 0, per * sp.degree)
    return padded[sp.rank * per : (sp.rank + 1) * per]


def register_attention() -> None:
    """Add "dcp_ulysses" to transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, dcp_attention)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`<base model>.layers`)."""
    find_layers(model)  # the same refusal as parallelize_hf for other layouts
    return base_model(model).layers


def parallelize_hf(
    model: nn.Module, state: SPState, *, locator: Locator | None = None, sync_weights: bool = True
):
    """Make a transformers causal LM run under `state` in place, and return it: register and
    select the "dcp_ulysses" attention, and give each decoder layer per-micro-batch recompute
    (the first `state.recompute_layers` layers). Parameter names are unchanged.

    `locator(model)` -> [(decoder layer, attention module)], for layouts find_layers does not
    know. Transactional: everything is checked first (runtime/hf_layers.check_supported), and
    a refused model (UnsupportedModelError, a ValueError) is left exactly as it was.
    Collective under torch.distributed once accepted: with `sync_weights` every rank then
    holds rank 0's weights (runtime/replicas.py: a checksum all-reduce, a broadcast and a
    warning only when they differed, e.g. a random initialisation without a seed)."""
    pairs = locate(model, locator)
    check_supported(model, pairs)
    if sync_weights:
        sync_replicas(model)
    register_attention()
    # -- nothing below raises: from here on the model changes --
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if hasattr(cfg, "_attn_implementation"):  # the model's config and sub-configs
            cfg._attn_implementation = ATTN_NAME
    model.config._attn_implementation = ATTN_NAME
    for index, (layer, attn) in enumerate(pairs):
        _STATES[attn] = state
        _checkpoint_layer(layer, index, state)
    return model


def _checkpoint_layer(layer: nn.Module, index: int, state: SPState) -> None:
    # the layer's own forward, also when parallelize_hf runs twice on one model
    inner = _ORIGINAL_FORWARD.setdefault(layer, layer.forward)

    def forward(*args, **kwargs):
        if index < state.recompute_layers and torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    layer.forward = forward


@dataclass(frozen=True)
class HFCausalLMTask:
    """Next-token prediction for a transformers causal LM. A sample is a LongTensor of L+1
    token ids (inputs = first L, labels = last L), as for `LMTask`; the micro-batch is one
    packed row ([1, T]) with per-sequence `position_ids`."""

    supports_cp = True  # shards by the group's SP kind (cp.shard_for_group)

    def run(self, model, samples, state: SPState, *, step: int, kind: str, scale: float):
        # contiguous shards (Ulysses) or head-tail chunks (cp) of the packed stream
        part = shard_for_group(LMTask().pack, samples, kind, state)
        device = next(model.parameters()).device
        out = model(
            input_ids=part["tokens"][None].to(device),
            position_ids=part["positions"][None].to(device),
            use_cache=False,
        )
        logits = out.logits[0]
        per_token = F.cross_entropy(
            logits, part["labels"].clamp(min=0).to(device), reduction="none"
        )
        # Weighted sum: padding has weight 0 but stays in the graph, so every member of the
        # group runs the same backward all-to-alls.
        loss = (per_token * part["weights"].to(per_token)).sum() * scale
        loss.backward()
        state.segments = None
        return loss.detach()

    def reference_loss(self, model, sequence_id: int, sample, *, step: int, kind: str):
        """Unscaled loss of one whole sequence on one device, through the model's own
        attention implementation (e.g. "sdpa"): no packing, no padding."""
        n = sample.shape[0] - 1
        device = next(model.parameters()).device
        out = model(
            input_ids=sample[None, :-1].to(device),
            position_ids=torch.arange(n, device=device)[None],
            use_cache=False,
        )
        ce = F.cross_entropy(out.logits[0], sample[1:].to(device), reduction="sum")
        return ce * token_weight(kind, n)


def tiny_llama(
    *,
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    vocab_size: int = 128,
    intermediate: int = 128,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    attn_implementation: str = "sdpa",
):
    """A small `LlamaForCausalLM` with random weights (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=4096,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn_implementation)
    return model.to(dtype)


def model_spec(model: nn.Module, *, name: str | None = None, dtype=None):
    """The dcp_opt ModelSpec (cost-model view) of a transformers causal LM of a supported
    family: widths, kv heads, windows and the exact parameter count from its config
    (dcp_opt.hf_spec).

    `dtype`: the compute dtype, which sizes the activations: "bf16" (or torch.bfloat16) for
    `shard(dtype="bf16")`, whose float32 parameters are only the master weights (the cost
    model charges model states as mixed-precision Adam whatever the dtype). None: the
    parameters' own dtype, right when the model computes in it (no mixed precision)."""
    from dcp_opt.hf_spec import spec_from_hf_config

    dtype = next(model.parameters()).dtype if dtype is None else dtype
    return spec_from_hf_config(model.config, name=name, dtype_bytes=compute_dtype_bytes(dtype))


def llama_spec(model: nn.Module, *, name: str = "hf-llama", dtype=None):
    """model_spec under its former name (Llama-style models)."""
    return model_spec(model, name=name, dtype=dtype)


def config_kv_heads(cfg) -> int | None:
    """num_key_value_heads of a transformers config, None when it equals the query heads."""
    kv = getattr(cfg, "num_key_value_heads", None)
    return None if kv in (None, cfg.num_attention_heads) else int(kv)
