"""Pipeline stages built from a model's own layers (no copy, no new parameter): stage s holds
the next `stage_layers[s]` decoder layers, the embedding rides on stage 0 and the final norm,
head and loss on the last stage (plan.Pipeline; Megatron-Core's `pre_process` /
`post_process`, Narayanan et al. 2021 sec. 2.2).

A stage runs one micro-batch piece of the packed stream (this SP member's shard, as
`runtime/cp.py:shard_for_group` cuts it): `forward(x, part)` takes the token ids on stage 0
or the previous stage's hidden states [T_local, hidden] elsewhere, and returns the hidden
states for the next stage, or on the last stage the micro-batch's weighted loss sum (unscaled;
the executor scales it). Hidden states always travel as [T_local, hidden].

Supported: TinyLM (runtime/models.py, after `parallelize`) and transformers Llama decoders
(runtime/hf.py, after `parallelize_hf`). Everything else is refused by name before anything
changes; a stage holds references only, so the model is never modified by `build_stage`.
Recompute stays the model's own per-layer switch (`SPState.recompute_layers` counts layers
from the model's first): the executor sets it to the stage's first layer plus the micro-batch's
`stage_recompute[s]`, so exactly the first `stage_recompute[s]` layers of the stage recompute.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from dcp_opt.errors import DcpOptError

from ..hf_layers import base_model
from ..models import TinyLM

HF_FAMILIES = ("llama",)  # config.model_type whose decoder forward build_stage re-creates
# Models build_stage split (held weakly): each rank of a pipeline run updates only its own
# stage's parameters, so the rest of its model copy goes stale; checkpoint.save refuses them.
STAGED: weakref.WeakSet = weakref.WeakSet()


def is_staged(model: nn.Module) -> bool:
    """Whether `model` is, or is a model split by build_stage into, pipeline stages."""
    return isinstance(model, PipelineStage) or model in STAGED


class StageSplitError(DcpOptError):
    """A model or a pipeline that cannot be split into stages (a ValueError too)."""


def weighted_loss(logits: torch.Tensor, part: dict) -> torch.Tensor:
    """Sum of per-token cross-entropy times the token weights (padding weighs 0 but stays in
    the graph, as in runtime/tasks.py LMTask.run)."""
    labels = part["labels"].clamp(min=0).to(logits.device)
    per_token = F.cross_entropy(logits, labels, reduction="none")
    return (per_token * part["weights"].to(per_token)).sum()


class PipelineStage(nn.Module):
    """One stage of a model: its layers `[layer_offset, layer_offset + num_layers)` of the
    model's `total_layers`, plus the embedding (first stage) and norm, head and loss (last)."""

    def __init__(self, model: nn.Module, stage_layers: tuple[int, ...], stage: int, layers):
        super().__init__()
        self.stage, self.stage_layers = stage, tuple(stage_layers)
        self.num_stages = len(stage_layers)
        self.layer_offset = sum(stage_layers[:stage])
        self.total_layers = sum(stage_layers)
        self.first, self.last = stage == 0, stage == self.num_stages - 1
        self.layers = nn.ModuleList(layers[self.layer_offset : self.layer_offset + self.size])
        # the model itself, unregistered: parameters are the stage's own submodules only
        self.__dict__["model"] = model

    @property
    def size(self) -> int:
        return self.stage_layers[self.stage]

    def model_parameter_names(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under their names in the whole model."""
        mine = {id(p) for p in self.parameters()}
        return {n: p for n, p in self.model.named_parameters() if id(p) in mine}


class TinyLMStage(PipelineStage):
    def __init__(self, model: TinyLM, stage_layers, stage: int):
        super().__init__(model, stage_layers, stage, model.layers)
        self.hidden = model.cfg.hidden
        self.embed = model.embed if self.first else None
        self.norm = model.norm if self.last else None
        self.head = model.head if self.last else None

    def forward(self, x: torch.Tensor, part: dict) -> torch.Tensor:
        dev = x.device
        positions, segments = part["positions"].to(dev), part["segments"].to(dev)
        h = self.embed(x) if self.first else x
        for layer in self.layers:
            h = layer(h, positions, segments)
        if not self.last:
            return h
        return weighted_loss(self.head(self.norm(h)), part)


class HFLlamaStage(PipelineStage):
    """A transformers Llama decoder's stage: what LlamaModel.forward does for its layers
    (embed_tokens, rotary_emb, each decoder layer, norm) and LlamaForCausalLM's lm_head, on
    one packed row [1, T_local] with per-sequence position_ids and no mask ("dcp_ulysses"
    keeps attention inside each sequence from SPState.segments, runtime/hf.py)."""

    def __init__(self, model: nn.Module, stage_layers, stage: int):
        base = base_model(model)
        super().__init__(model, stage_layers, stage, base.layers)
        self.hidden = model.config.hidden_size
        self.rotary_emb = base.rotary_emb
        self.embed_tokens = base.embed_tokens if self.first else None
        self.norm = base.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None

    def forward(self, x: torch.Tensor, part: dict) -> torch.Tensor:
        positions = part["positions"].to(x.device)[None]
        h = self.embed_tokens(x[None]) if self.first else x[None]
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:
            h = layer(
                h,
                attention_mask=None,
                position_ids=positions,
                position_embeddings=rotary,
                use_cache=False,
            )
        if not self.last:
            return h[0]
        return weighted_loss(self.lm_head(self.norm(h))[0], part)


def empty_pass(stage: PipelineStage, state) -> None:
    """One token through the stage alone, its output x 0 backward: every parameter's
    gradient gets an exact zero, so each FSDP unit of the stage runs its reduce-scatter once
    (runtime/sharding.py's closing micro-step, per stage: no transfer, since the other
    stages' passes are not needed for a zero). SP degree 1, nothing recomputed; under
    tensor parallelism the execute step's `state.tp_degree` pads the token to a multiple of
    it, as every micro-batch."""
    from ..cp import shard_for_group
    from ..sp import SPGroup
    from ..tasks import LMTask

    state.sp, state.kind = SPGroup.single(), "ulysses"
    state.recompute_layers = stage.layer_offset
    param = next(stage.parameters())
    part = shard_for_group(LMTask().pack, [(-1, torch.zeros(2, dtype=torch.long))], "tokens",
                           state)  # fmt: skip
    device = param.device
    if stage.first:
        x = part["tokens"].to(device)
    else:  # under TP (state.tp_degree t) a GPU's share of the padded stream, as _forward's
        rows = part["tokens"].shape[0] // max(state.tp_degree, 1)
        x = torch.zeros(rows, stage.hidden, dtype=param.dtype, device=device)
    out = stage(x, part)
    (out.sum() * 0.0).backward()


def global_view(stage: PipelineStage) -> nn.Module:
    """A module tree with the whole model's paths holding only this stage's parameters and
    persistent buffers (the same objects): its state dict names them as the model's does,
    so the stages of a run write one checkpoint of the whole model and read theirs back by
    name under any split (runtime/checkpoint.py; docs/integration.md, "Checkpoints of a
    pipeline run"). An optimizer over `stage.parameters()` holds exactly the view's
    parameters."""
    mine = {id(t) for t in (*stage.parameters(), *stage.buffers())}
    view = nn.Module()
    made = {"": view}  # module path -> the view's module there
    for name, t in stage.model.state_dict(keep_vars=True).items():
        if id(t) not in mine:
            continue
        *path, leaf = name.split(".")
        at, where = view, ""
        for part in path:
            here = f"{where}.{part}" if where else part
            if here not in made:
                made[here] = nn.Module()
                at.add_module(part, made[here])
            at, where = made[here], here
        if isinstance(t, nn.Parameter):
            at.register_parameter(leaf, t)
        else:
            at.register_buffer(leaf, t)
    return view


def model_layers(model: nn.Module) -> int:
    """How many decoder layers the model splits into (refusing models it cannot split)."""
    return len(_split_kind(model)[1])


def build_stage(model: nn.Module, stage_layers, stage: int) -> PipelineStage:
    """Stage `stage` of `model` under `stage_layers` (plan.pipeline.stage_layers). Refuses,
    naming the reason, a model it cannot split or a split that does not fit it."""
    kind, layers = _split_kind(model)
    stage_layers = tuple(stage_layers)
    if not stage_layers or any(not isinstance(n, int) or n < 1 for n in stage_layers):
        raise StageSplitError(
            f"stage_layers: {list(stage_layers)}; allowed: a non-empty list of integers >= 1"
        )
    if sum(stage_layers) != len(layers):
        raise StageSplitError(
            f"stage_layers: {list(stage_layers)} sum to {sum(stage_layers)} but "
            f"{type(model).__name__} has {len(layers)} layers; allowed: a split summing to "
            f"{len(layers)}"
        )
    if not 0 <= stage < len(stage_layers):
        raise StageSplitError(f"stage: {stage}; allowed: 0..{len(stage_layers) - 1}")
    out = (TinyLMStage if kind == "tiny" else HFLlamaStage)(model, stage_layers, stage)
    STAGED.add(model)
    return out


def _split_kind(model: nn.Module) -> tuple[str, nn.ModuleList]:
    if isinstance(model, TinyLM):
        return "tiny", model.layers
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family is None:
        raise StageSplitError(
            f"model: {type(model).__name__} cannot be split into pipeline stages; allowed: "
            f"TinyLM, a transformers causal LM of model_type {list(HF_FAMILIES)}"
        )
    if family not in HF_FAMILIES:
        raise StageSplitError(
            f"model.config.model_type: {family!r} cannot be split into pipeline stages (its "
            f"decoder forward is not re-created per stage); allowed: {list(HF_FAMILIES)}"
        )
    if getattr(cfg, "tie_word_embeddings", False):
        raise StageSplitError(
            "model.config.tie_word_embeddings: True: the embedding (first stage) and the head "
            "(last stage) would be one parameter on two stages; allowed: False"
        )
    if getattr(cfg, "_attn_implementation", None) != "dcp_ulysses":
        raise StageSplitError(
            f"model.config._attn_implementation: {cfg._attn_implementation!r}; allowed: "
            "'dcp_ulysses' (call runtime.hf.parallelize_hf(model, state) first)"
        )
    return "hf", base_model(model).layers
