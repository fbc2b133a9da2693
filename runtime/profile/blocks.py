"""What the profiler measures: one block of a model behind a small protocol, and adapters for
the runtime's example models (runtime/models.py).

A `BlockUnderTest` builds synthetic inputs for a micro-batch of shapes and runs its block
forward on them. Inputs are a list of calls: a 1D block packs every sequence into one call
(as the runtime packs a micro-batch); a 2D block runs one call per video (a DiT block on one
video's [frames, spatial] grid; the runtime packs all videos of a micro-batch into one call,
runtime/video.py, with the same attention work per video, so the per-token terms fitted here
carry over; only the per-call constant is counted per video here and per micro-batch there);
a 3D block (full attention, kind "3d") packs its micro-batch into one call as runtime/joint.py
does. The first tensor of every call is the block input and requires grad, so the backward
computes the input gradient as it would inside a deep stack.

A `HeadUnderTest` is what runs once per micro-batch outside the layers (embedding, final norm,
output projection, loss); its time per token becomes `head_*_per_token_s` and its constant
`microbatch_overhead_s`.

To profile your own block, implement the two methods (duck typing is enough) and wrap them
in a `ProfileTarget` with the ModelSpec of the full model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from dcp_opt.model import ModelSpec

Shapes = Sequence[Sequence[int]]


class BlockUnderTest(Protocol):
    block_type: str  # "layer" (1D, 3D), "spatial" or "temporal" (2D)
    module: nn.Module

    def make_inputs(self, shapes: Shapes, *, dtype, device) -> list[tuple]: ...

    def forward(self, inputs: list[tuple]) -> list[torch.Tensor]: ...


class HeadUnderTest(Protocol):
    module: nn.Module

    def make_inputs(self, num_tokens: int, *, dtype, device) -> tuple: ...

    def loss(self, inputs: tuple) -> torch.Tensor: ...


@dataclass
class ProfileTarget:
    """A model to profile: its spec (full depth), one block per block type, and its head.

    `signature` names what is measured, for the cache of measured points: change it when the
    code of a block changes."""

    model: ModelSpec
    blocks: dict[str, BlockUnderTest]
    head: HeadUnderTest | None = None
    signature: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(self.model.block_types) - set(self.blocks)
        if missing:
            raise ValueError(
                f"blocks: missing block types {sorted(missing)} of model {self.model.name!r}"
            )


def _leaf(shape, *, dtype, device, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_(True)


# ---- adapters for runtime/models.py -------------------------------------------------------
class LMBlockAdapter:
    """runtime.models.LMBlock: h [T, C] packed, positions and segment ids [T]."""

    block_type = "layer"

    def __init__(self, module: nn.Module, hidden: int, seed: int = 0):
        self.module, self.hidden, self.seed = module, hidden, seed

    def make_inputs(self, shapes: Shapes, *, dtype, device) -> list[tuple]:
        gen = torch.Generator().manual_seed(self.seed)
        lengths = [int(s[0]) for s in shapes]
        pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(device)
        h = _leaf((sum(lengths), self.hidden), dtype=dtype, device=device, gen=gen)
        return [(h, pos, seg)]

    def forward(self, inputs: list[tuple]) -> list[torch.Tensor]:
        return [self.module(*args) for args in inputs]


class DiTBlockAdapter:
    """runtime.models.DiTBlock as a spatial block (rows = frames, attends over S) or a
    temporal block (rows = spatial positions, attends over F); one call per video."""

    def __init__(self, module, block_type: str, hidden: int, text: torch.Tensor, seed: int = 0):
        if block_type not in ("spatial", "temporal"):
            raise ValueError(f"block_type: {block_type!r} not allowed; allowed: spatial, temporal")
        self.module, self.block_type, self.hidden = module, block_type, hidden
        self.text, self.seed = text, seed

    def make_inputs(self, shapes: Shapes, *, dtype, device) -> list[tuple]:
        gen = torch.Generator().manual_seed(self.seed)
        out = []
        for f, hh, ww in shapes:
            rows, cols = (f, hh * ww) if self.block_type == "spatial" else (hh * ww, f)
            x = _leaf((rows, cols, self.hidden), dtype=dtype, device=device, gen=gen)
            out.append((x, self.text.to(device=device, dtype=dtype)))
        return out

    def forward(self, inputs: list[tuple]) -> list[torch.Tensor]:
        return [self.module(*args) for args in inputs]


class LMHeadAdapter:
    """Embedding, final norm, output projection and token cross-entropy of runtime's TinyLM."""

    def __init__(self, lm: nn.Module, seed: int = 0):
        self.lm, self.seed = lm, seed
        self.module = nn.ModuleList([lm.embed, lm.norm, lm.head])

    def make_inputs(self, num_tokens: int, *, dtype, device) -> tuple:
        gen = torch.Generator().manual_seed(self.seed)
        v = self.lm.cfg.vocab_size
        tok = torch.randint(0, v, (num_tokens,), generator=gen).to(device)
        return (tok, torch.roll(tok, -1))

    def loss(self, inputs: tuple) -> torch.Tensor:
        tok, tgt = inputs
        # The layers sit between embed and norm; an identity keeps the cost of both ends.
        logits = self.lm.head(self.lm.norm(self.lm.embed(tok)))
        # In the logits' dtype, as LMTask.run (runtime/tasks.py) computes the loss: an fp32
        # copy would save an fp32 log-softmax (4 B x vocab per token) the runtime never holds
        # (benchmarks/bench_memory.py measured the head 60 % above the runtime's in bf16).
        return nn.functional.cross_entropy(logits, tgt)


def lm_target(cfg, *, name: str = "tiny-lm", seed: int = 0, dtype=torch.float32) -> ProfileTarget:
    """Profile target for runtime.models.TinyLM with config `cfg` (an LMConfig): the block as
    runtime.models builds it, attention one kernel call per packed sequence
    (runtime.attention.segment_attention), which is what training runs at SP degree 1."""
    from ..models import TinyLM

    torch.manual_seed(seed)
    lm = TinyLM(cfg).to(dtype)
    spec = lm_spec(cfg, name=name, dtype_bytes=torch.finfo(dtype).bits // 8)
    return ProfileTarget(
        spec,
        {"layer": LMBlockAdapter(lm.layers[0], cfg.hidden, seed)},
        LMHeadAdapter(lm, seed),
        # "loss in the logits' dtype": points cached with the old fp32 loss are not reused
        signature=f"runtime.models.TinyLM/{cfg}/{dtype}/loss-in-logits-dtype",
    )


def lm_spec(cfg, *, name: str = "tiny-lm", dtype_bytes: int = 4) -> ModelSpec:
    return ModelSpec(
        name,
        "1d",
        cfg.num_layers,
        cfg.hidden,
        cfg.num_heads,
        cfg.ffn_hidden,
        vocab_size=cfg.vocab_size,
        dtype_bytes=dtype_bytes,
    )


def dit_target(
    cfg, *, name: str = "tiny-dit", text_tokens: int = 8, seed: int = 0, dtype=torch.float32
) -> ProfileTarget:
    """Profile target for runtime.models.TinyDiT with config `cfg` (a DiTConfig)."""
    from ..models import TinyDiT

    torch.manual_seed(seed)
    dit = TinyDiT(cfg).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(text_tokens, cfg.hidden, generator=gen, dtype=dtype)
    layer = dit.layers[0]
    spec = ModelSpec(
        name,
        "2d",
        cfg.num_layers,
        cfg.hidden,
        cfg.num_heads,
        cfg.ffn_hidden,
        text_tokens=text_tokens if cfg.cross_attention else 0,
        causal=False,
        dtype_bytes=torch.finfo(dtype).bits // 8,
    )
    blocks = {
        "spatial": DiTBlockAdapter(layer.spatial, "spatial", cfg.hidden, text, seed),
        "temporal": DiTBlockAdapter(layer.temporal, "temporal", cfg.hidden, text, seed),
    }
    return ProfileTarget(spec, blocks, None, signature=f"runtime.models.TinyDiT/{cfg}/{dtype}")


class Full3DLayerAdapter:
    """The cost model's one "layer" of a 3d model (runtime.models' full-attention blocks): a
    micro-batch packed into one call as the runtime packs it (joint.JointLayout at degree 1),
    video tokens [sum v, C] and text tokens [sum j, C] both leaves.

    `blocks` is what one call runs: one Wan block (cross), or a joint model's double- and
    single-stream blocks in the model's proportion (19 : 38 -> one double, two single); the
    fit divides times and saved bytes by `layers_per_call` (runtime/profile/fit.py), so the
    coefficient is one layer's average, which is what ModelSpec.params_per_block averages too.
    `joint_text` is the text tokens each sample adds to the attention sequence (0 under cross):
    the fit's Q is (v + joint_text)^2 per sample, as dcp_opt/cost/dit3d.quad charges."""

    block_type = "layer"

    def __init__(self, blocks, *, hidden: int, text_tokens: int, joint: bool, seed: int = 0):
        self.module = nn.ModuleList(blocks)
        self.layers_per_call = len(self.module)
        self.hidden, self.text_tokens, self.joint, self.seed = hidden, text_tokens, joint, seed
        self.joint_text = text_tokens if joint else 0

    def make_inputs(self, shapes: Shapes, *, dtype, device) -> list[tuple]:
        from ..joint import JointLayout
        from ..models import block_context

        gen = torch.Generator().manual_seed(self.seed)
        shapes = tuple(tuple(int(v) for v in s) for s in shapes)
        text = (self.text_tokens,) * len(shapes)
        lay = JointLayout(shapes, text, joint=self.joint, device=device)
        rows = lay.text_shard if self.joint else sum(lay.text_lengths)
        img = _leaf((lay.video_shard, self.hidden), dtype=dtype, device=device, gen=gen)
        txt = _leaf((rows, self.hidden), dtype=dtype, device=device, gen=gen)
        time = torch.randn(len(shapes), self.hidden, generator=gen, dtype=dtype).to(device)
        return [(img, txt, block_context(lay, time))]

    def forward(self, inputs: list[tuple]) -> list[torch.Tensor]:
        out = []
        for img, txt, ctx in inputs:
            for block in self.module:
                txt, img = block(txt, img, ctx)
            out.append(torch.cat([txt, img]) if self.joint else img)
        return out


def dit3d_target(
    model: ModelSpec, *, in_channels: int = 4, seed: int = 0, dtype=torch.float32
) -> ProfileTarget:
    """Profile target for a 3d ModelSpec (a preset, a model JSON, or a tiny model's spec): one
    layer of runtime.models' TinyMMDiT (text_mode "joint") or TinyWanDiT ("cross") at the
    spec's hidden, heads and FFN widths, its text `model.text_tokens` per sample. The spec
    (full depth) is the profile's model."""
    from ..models import DoubleBlock, Full3DConfig, SingleBlock, WanBlock

    if model.kind != "3d":
        raise ValueError(f"model.kind: {model.kind!r} not allowed; allowed: '3d'")
    if model.text_tokens < 1:
        raise ValueError(f"model.text_tokens: must be >= 1 for a 3d block, got {model.text_tokens}")
    single = model.single_layers if model.text_mode == "joint" else 0
    double = model.num_layers - single
    cfg = Full3DConfig(
        in_channels=in_channels,
        hidden=model.hidden,
        num_heads=model.num_heads,
        num_double=double,
        num_single=single,
        ffn_hidden=model.ffn_hidden,
        text_dim=model.hidden,
    )
    torch.manual_seed(seed)
    if model.text_mode == "joint":
        g = math.gcd(double, single)
        blocks = [DoubleBlock(cfg) for _ in range(double // g)]
        blocks += [SingleBlock(cfg) for _ in range(single // g)]
    else:
        blocks = [WanBlock(cfg)]
    blocks = [b.to(dtype) for b in blocks]
    layer = Full3DLayerAdapter(
        blocks,
        hidden=model.hidden,
        text_tokens=model.text_tokens,
        joint=model.text_mode == "joint",
        seed=seed,
    )
    spec = replace(model, dtype_bytes=torch.finfo(dtype).bits // 8)
    sig = f"runtime.models.Full3D/{model.text_mode}/{cfg}/{len(blocks)}/{model.text_tokens}"
    return ProfileTarget(spec, {"layer": layer}, None, signature=f"{sig}/{dtype}")
