"""Apply sequence parallelism and per-layer activation checkpointing to an unmodified model.

The model keeps its parameter names (no wrapper modules): attention functions and the 2D
layout switches are swapped on the existing modules, and each layer's `forward` is replaced
by one that consults `SPState.recompute_layers` (the first r layers recompute in backward,
Chen et al. 2016; pyramid order as in the cost model). The executor updates the SPState per
micro-batch, so one parallelized model serves every group and every recompute choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import segment_attention
from .cp import cp_attention
from .joint import joint_attention
from .models import DiTLayer, Full3DDiT, LMBlock, TinyDiT, TinyLM
from .replicas import sync_replicas
from .ring import ring_attention
from .sp import SPGroup, ulysses_attention
from .video import to_spatial, to_temporal


@dataclass
class SPState:
    """What the swapped-in functions read at call time (mutable on purpose: it is the
    "active group" switch, owned by the executor, never part of a plan).

    1D: `segments` holds the segment id of every token of the whole padded packed stream.
    2D: the micro-batch's layout travels with the model's inputs (runtime/video.py).
    `kind`: the active group's SP kind ("ulysses", "cp" or "ring", plan Group.kind); under
    cp and ring `layout` [d, M] holds each member's stream indices and `positions` the whole
    stream's in-sequence positions (runtime/cp.py, runtime/ring.py).
    `tp_degree`: the GPUs of a unit under tensor parallelism (runtime/tensor_parallel.py):
    each unit's part of the stream is padded to a multiple of it, so sequence parallelism
    splits it evenly over the unit's GPUs."""

    sp: SPGroup = field(default_factory=SPGroup.single)
    recompute_layers: int = 0
    segments: torch.Tensor | None = None
    kind: str = "ulysses"
    layout: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    tp_degree: int = 1


def parallelize(model: nn.Module, state: SPState, *, sync_weights: bool = True) -> nn.Module:
    """Make `model` (TinyLM, TinyDiT or a Full3DDiT) run under `state` in place, and return it.

    Collective under torch.distributed (every rank calls it at the same point): with
    `sync_weights` every rank then holds rank 0's weights (runtime/replicas.py: a checksum
    all-reduce, a broadcast and a warning only when they differed)."""
    if not isinstance(model, (TinyLM, TinyDiT, Full3DDiT)):
        raise ValueError(
            f"model: {type(model).__name__} not supported; allowed: TinyLM, TinyDiT, "
            "TinyMMDiT, TinyWanDiT"
        )
    if sync_weights:
        sync_replicas(model)
    if isinstance(model, TinyLM):
        _parallelize_lm(model, state)
    elif isinstance(model, TinyDiT):
        _parallelize_dit(model, state)
    else:
        _parallelize_full3d(model, state)
    for i, layer in enumerate(model.layers):
        _checkpoint_layer(layer, i, state)
    return model


def _parallelize_lm(model: TinyLM, state: SPState) -> None:
    def attention(q, k, v, *, segments, causal):
        if state.kind in ("cp", "ring") and state.sp.degree > 1:  # head-tail chunks
            fn = cp_attention if state.kind == "cp" else ring_attention
            return fn(
                q, k, v, state.sp,
                layout=state.layout, segments=state.segments, positions=state.positions,
            )  # fmt: skip
        # The model passes its local shard's segments; Ulysses attends over the whole stream.
        whole = segments if state.sp.degree == 1 else state.segments
        return ulysses_attention(
            q, k, v, state.sp, segment_attention, segments=whole, causal=causal
        )

    for block in model.layers:
        assert isinstance(block, LMBlock)
        block.attn.attention_fn = attention


def _parallelize_dit(model: TinyDiT, state: SPState) -> None:
    # DSP: attention stays local (padded frames are sequences of their own, video.py); only
    # the layout switches communicate, over the active group.
    def switch_to_temporal(x, layout):
        return to_temporal(x, layout, state.sp)

    def switch_to_spatial(x, layout):
        return to_spatial(x, layout, state.sp)

    for layer in model.layers:
        assert isinstance(layer, DiTLayer)
        layer.to_temporal = switch_to_temporal
        layer.to_spatial = switch_to_spatial


def _parallelize_full3d(model: Full3DDiT, state: SPState) -> None:
    # Ulysses over the joint sequence (runtime/joint.py) on the active group.
    def attention(q, k, v, layout):
        return joint_attention(q, k, v, layout, state.sp)

    for block in model.layers:
        block.attention_fn = attention


def _checkpoint_layer(layer: nn.Module, index: int, state: SPState) -> None:
    inner = layer.forward

    def forward(*args, **kwargs):
        if index < state.recompute_layers and torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    layer.forward = forward
