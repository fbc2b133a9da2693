"""diffusers integration: an unmodified `WanTransformer3DModel`, `HunyuanVideoTransformer3DModel`
or `FluxTransformer2DModel` (the MMDiT) trained under DCP plans exactly, or refused by
`parallelize_diffusers` before anything changes (tests/test_diffusers_runtime.py).

Citations are to diffusers v0.42.1, src/diffusers/.

- Sequence sharding: where diffusers' own context-parallel plans split and gather
  (`_cp_plan`: models/transformers/transformer_wan.py:552-569, transformer_flux.py:573-581;
  HunyuanVideo has none, so the Wan pattern is used), torch forward hooks on the same modules
  split this member's contiguous share of the tokens (zero padded to a multiple of d) and
  gather the output of `proj_out` (FAMILIES below). Text follows diffusers' convention:
  split when it joins the attention sequence (Flux, HunyuanVideo), whole when it is only a
  cross-attention key (Wan: its processor runs cross-attention without `parallel_config`,
  transformer_wan.py:143-152).
- Attention: every attention module keeps its own processor class, wrapped through the
  public processor API (`AttentionMixin.set_attn_processor`, models/attention.py:64) in a
  subclass whose `__call__` runs the family's own `__call__` under `UlyssesSDPA`: the native
  backend's one `scaled_dot_product_attention` call (models/attention_dispatch.py:3760,
  reached through `dispatch_attention_fn`, :400) becomes Ulysses (runtime/sp.py) over the
  active group, with padded keys dropped, so each real query sees exactly the keys of
  single-process training. diffusers has no public way to add a backend (`dispatch_attention_fn`
  turns a name into the `AttentionBackendName` enum, :422; its registry is private, :262),
  and its own context parallelism binds one device mesh per model (`enable_parallelism`),
  where a plan switches groups per micro-batch.
- One forward per sample: a diffusers forward takes one shape per call (patch embedding and
  RoPE from the input's shape), so a micro-batch of mixed shapes runs its samples one after
  the other, each sharded over the whole group.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from .hf_layers import UnsupportedModelError
from .parallelize import SPState
from .replicas import sync_replicas
from .sp import SPGroup, ulysses_attention


@dataclass(frozen=True)
class Family:
    """Where a diffusers model's tokens are split and gathered, and its streams' order in
    the joint attention sequence ("video", "text")."""

    processor: str  # the family's own processor class name
    blocks: tuple[str, ...]  # attributes holding the transformer blocks, in call order
    joint_order: tuple[str, ...]  # streams of a self / joint attention call, in order
    refused: tuple[tuple[str, object], ...] = ()  # (config field, the only allowed value)


FAMILIES = {
    "WanTransformer3DModel": Family(
        "WanAttnProcessor",
        ("blocks",),
        ("video",),
        (("image_dim", None), ("added_kv_proj_dim", None)),
    ),
    "HunyuanVideoTransformer3DModel": Family(
        "HunyuanVideoAttnProcessor2_0",
        ("transformer_blocks", "single_transformer_blocks"),
        ("video", "text"),  # transformer_hunyuan_video.py:127-129
        (("image_condition_type", None),),
    ),
    "FluxTransformer2DModel": Family(
        "FluxAttnProcessor",
        ("transformer_blocks", "single_transformer_blocks"),
        ("text", "video"),  # transformer_flux.py:113-115, 218
    ),
}


@dataclass
class ShardRecord:
    """The current sample's streams on this member: real tokens and tokens held per member."""

    real: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)


# model -> (SPState, ShardRecord); processor wrappers and hooks read it at call time
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shard(x: torch.Tensor, dim: int, sp: SPGroup, record: ShardRecord, stream: str):
    n = x.shape[dim]
    per = -(-n // sp.degree)
    record.real[stream], record.held[stream] = n, per
    part = x.narrow(dim, min(sp.rank * per, n), max(0, min(per, n - sp.rank * per)))
    if part.shape[dim] < per:
        shape = list(part.shape)
        shape[dim] = per - part.shape[dim]
        part = torch.cat([part, part.new_zeros(shape)], dim=dim)
    return part


class _Gather(torch.autograd.Function):
    """All-gather along `dim`; backward keeps this member's slice (every member computes the
    same loss from the gathered tensor, so that slice's gradient is already whole)."""

    @staticmethod
    def forward(ctx, x, sp, dim):
        ctx.sp, ctx.dim, ctx.size = sp, dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(sp.degree)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.sp.rank * ctx.size, ctx.size), None, None


def gather(x: torch.Tensor, sp: SPGroup, dim: int, real: int) -> torch.Tensor:
    """The whole stream from every member's share, padding dropped."""
    if sp.degree == 1:
        return x.narrow(dim, 0, real)
    return _Gather.apply(x, sp, dim).narrow(dim, 0, real)


class UlyssesSDPA(TorchFunctionMode):
    """Inside one attention processor call: its `scaled_dot_product_attention` runs as
    Ulysses over the active group (self / joint attention) or as is (cross-attention to a
    caption every member holds). Anything it cannot run exactly raises, naming the argument."""

    def __init__(self, state: SPState, record: ShardRecord, order, cross: bool):
        super().__init__()
        self.state, self.record, self.order, self.cross = state, record, order, cross

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.attention(*args, **kwargs)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):  # fmt: skip
        _check_sdpa(query, attn_mask, dropout_p, is_causal, enable_gqa)
        if self.cross or self.state.sp.degree == 1:
            return F.scaled_dot_product_attention(query, key, value, scale=scale)
        held = [self.record.held[s] for s in self.order]
        if query.shape[2] != sum(held):
            raise RuntimeError(
                f"dcp ulysses: {query.shape[2]} local tokens, the shard holds {held} "
                f"({self.order}); the processor's sequence is not the sharded one"
            )
        mask = _real_keys(self.record, self.order, self.state.sp.degree).to(query.device)
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [S, H, Dh]
        out = ulysses_attention(q, k, v, self.state.sp, _masked_local, mask=mask, scale=scale)
        return out.transpose(0, 1)[None]


def _check_sdpa(query, attn_mask, dropout_p, is_causal, enable_gqa) -> None:
    if dropout_p:
        raise ValueError(f"dropout_p: {dropout_p} not supported; allowed: 0.0")
    if is_causal or enable_gqa:
        raise ValueError("is_causal / enable_gqa: allowed: False (full attention, equal heads)")
    if query.shape[0] != 1:
        raise ValueError(f"batch size: {query.shape[0]}; allowed: 1 (one sample per forward)")
    if attn_mask is not None and not bool(attn_mask.all()):
        # HunyuanVideo builds an all-true mask when every caption token is real
        raise ValueError("attention_mask: padded captions not supported; allowed: all true or None")


def _real_keys(record: ShardRecord, order, degree: int) -> torch.Tensor:
    """[d * sum held] bool: the gathered (member-major) positions that are real tokens."""
    rows = []
    for j in range(degree):
        for s in order:
            per, n = record.held[s], record.real[s]
            rows.append(torch.arange(j * per, (j + 1) * per) < n)
    return torch.cat(rows)


def _masked_local(q, k, v, *, mask, scale):
    """Every query (padding too: its output is dropped) to the real keys only."""
    q, k, v = q.transpose(0, 1)[None], k[mask].transpose(0, 1)[None], v[mask].transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1)


# ---- the refusal, then the change ---------------------------------------------------------
def _refuse(field_name: str, value, allowed: str, why: str) -> None:
    raise UnsupportedModelError(
        f"{field_name}: {value!r} not supported ({why}); allowed: {allowed}"
    )


def family_of(model: nn.Module) -> Family:
    name = type(model).__name__
    if name not in FAMILIES:
        _refuse("model", name, str(sorted(FAMILIES)), "no verified sharding for it")
    return FAMILIES[name]


def block_attention(model: nn.Module, family: Family) -> dict[str, nn.Module]:
    """Processor key ("<module>.processor", AttentionMixin.attn_processors) -> attention
    module, for the attention modules inside the family's transformer blocks."""
    out = {}
    for attr in family.blocks:
        for name, sub in getattr(model, attr).named_modules(prefix=attr):
            if hasattr(sub, "set_processor") and hasattr(sub, "processor"):
                out[f"{name}.processor"] = sub
    return out


def check_supported(model: nn.Module) -> Family:
    """Everything parallelize_diffusers needs, checked before anything changes."""
    family = family_of(model)
    if model in _ACTIVE:
        _refuse("model", type(model).__name__, "a model not yet parallelized", "already done")
    for field_name, allowed in family.refused:
        value = model.config.get(field_name, allowed)
        if value != allowed:
            _refuse(field_name, value, repr(allowed), "its extra inputs are not sharded")
    if getattr(model, "gradient_checkpointing", False):
        _refuse("gradient_checkpointing", True, "False", "recompute comes from the plan")
    backend = os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")
    if backend != "native":
        _refuse("DIFFUSERS_ATTN_BACKEND", backend, "'native'", "only its SDPA call is wrapped")
    for name, sub in model.named_modules():
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            _refuse(f"dropout (module {name})", sub.p, "0.0", "per-rank dropout masks")
    for key, attn in block_attention(model, family).items():
        proc = attn.processor
        if type(proc).__name__ != family.processor:
            _refuse(key, type(proc).__name__, family.processor, "its attention is not verified")
        backend = getattr(proc, "_attention_backend", None)  # set_attention_backend's
        if backend not in (None, "native"):
            _refuse(f"{key}._attention_backend", backend, "None", "not the native backend")
        if getattr(proc, "_parallel_config", None) is not None:
            _refuse(f"{key}._parallel_config", "set", "None", "diffusers' own parallelism is on")
    return family


def parallelize_diffusers(
    model: nn.Module, state: SPState, *, sync_weights: bool = True
) -> nn.Module:
    """Make a diffusers video / image transformer of FAMILIES run under `state` in place, and
    return it: its blocks' attention processors run Ulysses over the active group, hooks split
    each sample's tokens and gather `proj_out`'s output, and the first
    `state.recompute_layers` blocks recompute in backward. Parameter names are unchanged.

    Transactional: everything is checked first (`check_supported`); a refused model
    (UnsupportedModelError, a ValueError) is left exactly as it was. Collective under
    torch.distributed once accepted (`sync_weights`: rank 0's weights everywhere)."""
    family = check_supported(model)
    if sync_weights:
        sync_replicas(model)
    # -- nothing below raises: from here on the model changes --
    record = ShardRecord()
    _ACTIVE[model] = (state, record)
    processors = dict(model.attn_processors)
    for key, attn in block_attention(model, family).items():
        cross = bool(getattr(attn, "is_cross_attention", False))
        processors[key] = _wrap_processor(attn.processor, state, record, family, cross)
    model.set_attn_processor(processors)
    _add_split_hooks(model, type(model).__name__, state, record)
    blocks = [b for attr in family.blocks for b in getattr(model, attr)]
    for index, block in enumerate(blocks):
        _checkpoint_block(block, index, state)
    return model


@functools.cache
def _wrapper_class(cls: type) -> type:
    call = cls.__call__

    @functools.wraps(call)  # same signature: attention modules filter kwargs by it
    def __call__(self, attn, *args, **kwargs):
        with UlyssesSDPA(self.dcp_state, self.dcp_record, self.dcp_order, self.dcp_cross):
            return call(self, attn, *args, **kwargs)

    return type(f"Dcp{cls.__name__}", (cls,), {"__call__": __call__})


def _wrap_processor(proc, state, record, family: Family, cross: bool):
    out = object.__new__(_wrapper_class(type(proc)))
    out.__dict__.update(vars(proc))
    out.dcp_state, out.dcp_record, out.dcp_cross = state, record, cross
    out.dcp_order = family.joint_order
    return out


def _add_split_hooks(model: nn.Module, name: str, state: SPState, record: ShardRecord) -> None:
    """Split where diffusers' `_cp_plan` splits (module docstring), gather `proj_out`."""

    def split(x, dim, stream):
        return _shard(x, dim, state.sp, record, stream)

    if name == "FluxTransformer2DModel":

        def flux_inputs(_, args, kwargs):
            for key, dim, stream in (
                ("hidden_states", 1, "video"), ("encoder_hidden_states", 1, "text"),
                ("img_ids", 0, "video"), ("txt_ids", 0, "text"),
            ):  # fmt: skip
                if kwargs.get(key) is None:
                    raise ValueError(f"{key}: pass it by keyword (the hook splits it); got none")
                kwargs[key] = split(kwargs[key], dim, stream)
            return args, kwargs

        model.register_forward_pre_hook(flux_inputs, with_kwargs=True)
    else:  # Wan [1, S, 1, D] and HunyuanVideo [S, D] RoPE tables, then the block inputs
        rope_dim = 1 if name == "WanTransformer3DModel" else 0
        model.rope.register_forward_hook(
            lambda _, __, out: tuple(split(x, rope_dim, "video") for x in out)
        )
        first = (model.blocks if rope_dim == 1 else model.transformer_blocks)[0]

        def block_inputs(_, args, kwargs):
            args = (split(args[0], 1, "video"), *args[1:])
            if name == "HunyuanVideoTransformer3DModel":
                args = (args[0], split(args[1], 1, "text"), *args[2:])
            return args, kwargs

        first.register_forward_pre_hook(block_inputs, with_kwargs=True)
    model.proj_out.register_forward_hook(
        lambda _, __, out: gather(out, state.sp, 1, record.real["video"])
    )


def _checkpoint_block(block: nn.Module, index: int, state: SPState) -> None:
    inner = block.forward

    def forward(*args, **kwargs):
        if index < state.recompute_layers and torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    block.forward = forward
