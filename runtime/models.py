"""Two small models with no parallel code: a 1D decoder LM and a 2D spatial-temporal DiT.

Attention goes through `attention_fn` attributes (see runtime/attention.py) and the 2D
model's layout changes through the `to_temporal` / `to_spatial` attributes of each DiTLayer;
both default to single-device behaviour. `runtime/parallelize.py` swaps them for
sequence-parallel versions. TinyDiT runs a whole micro-batch of videos as one packed stream
(runtime/video.py), so each attention is one kernel call for all its videos.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from dcp_opt.model import ModelSpec

from .attention import packed_attention, segment_attention
from .video import PackedRows, VideoLayout, to_spatial, to_temporal


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 64
    hidden: int = 16
    num_heads: int = 4
    num_layers: int = 3
    ffn_hidden: int = 32
    rope_base: float = 10000.0


@dataclass(frozen=True)
class DiTConfig:
    in_channels: int = 4
    hidden: int = 16
    num_heads: int = 4
    num_layers: int = 2
    ffn_hidden: int = 32
    text_dim: int = 8
    cross_attention: bool = True


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, RoFormer, eq. 34) on x: [T, H, Dh] at `positions`."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=x.dtype, device=x.device) / half)
    ang = positions.to(x.dtype)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sinusoid(values: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal embedding (Vaswani et al. 2017, sec. 3.5) of integer or real values."""
    half = dim // 2
    freqs = torch.arange(half, dtype=dtype, device=values.device)
    freqs = torch.exp(-math.log(10000.0) * freqs / half)
    ang = values.to(dtype)[..., None] * freqs
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.attention_fn = segment_attention

    def split(self, x: torch.Tensor):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # heads counted from the width (torchtitan's view(..., -1, head_dim)): a projection
        # that holds a slice of the heads (tensor parallelism) splits into its own heads
        shape = (*x.shape[:-1], -1, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)


class MLP(nn.Sequential):
    def __init__(self, hidden: int, ffn: int):
        super().__init__(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class LMBlock(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.num_heads)
        self.norm2 = nn.RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden)

    def forward(self, h, positions, segments):
        q, k, v = self.attn.split(self.norm1(h))
        q, k = rope(q, positions, self.cfg.rope_base), rope(k, positions, self.cfg.rope_base)
        a = self.attn.attention_fn(q, k, v, segments=segments, causal=True)
        h = h + self.attn.out(a.flatten(-2))
        return h + self.mlp(self.norm2(h))


class TinyLM(nn.Module):
    """Decoder LM on a packed token stream: tokens, positions (inside each sequence) and
    segment ids (which sequence) are [T]; returns logits [T, vocab]."""

    def __init__(self, cfg: LMConfig = LMConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(LMBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, tokens, positions, segments):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, positions, segments)
        return self.head(self.norm(h))


class DiTBlock(nn.Module):
    """Pre-norm self-attention, optional cross-attention to the caption, MLP, on packed tokens
    h [T, C] split by `rows` (video.PackedRows): spatial blocks attend within each frame,
    temporal ones within each spatial position. A 3-D h [rows, cols, C] (one video, rows of
    equal length: what the profiler feeds) is one sequence per row."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.num_heads)
        self.attn.attention_fn = partial(packed_attention, causal=False)
        self.cross = None
        if cfg.cross_attention:
            self.norm_x = nn.LayerNorm(cfg.hidden)
            self.cross = nn.ModuleDict(
                {
                    "q": nn.Linear(cfg.hidden, cfg.hidden, bias=False),
                    "kv": nn.Linear(cfg.hidden, 2 * cfg.hidden, bias=False),
                    "out": nn.Linear(cfg.hidden, cfg.hidden, bias=False),
                }
            )
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden)
        self.num_heads = cfg.num_heads

    def forward(self, h, text, rows: PackedRows | None = None):
        if rows is None:  # one video as [rows, cols, C]
            n, s, c = h.shape
            rows = PackedRows((s,) * n, (n * s,), (text.shape[0],))
            return self.forward(h.reshape(n * s, c), text, rows).reshape(n, s, c)
        q, k, v = self.attn.split(self.norm1(h))
        a = self.attn.attention_fn(q, k, v, lengths=rows.lengths)
        h = h + self.attn.out(a.reshape(h.shape))
        if self.cross is not None:
            # Each video's tokens attend to its own caption: every rank holds the whole
            # caption, so cross-attention needs no communication under either layout.
            cq = self.cross["q"](self.norm_x(h)).reshape(h.shape[0], self.num_heads, -1)
            ck, cv = self.cross["kv"](text).reshape(text.shape[0], 2, self.num_heads, -1).unbind(1)
            a = packed_attention(cq, ck, cv, lengths=rows.videos, k_lengths=rows.text, causal=False)
            h = h + self.cross["out"](a.reshape(h.shape))
        return h + self.mlp(self.norm2(h))


class DiTLayer(nn.Module):
    """One spatial block then one temporal block (Open-Sora STDiT3 layout)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.spatial = DiTBlock(cfg)
        self.temporal = DiTBlock(cfg)
        self.to_temporal = to_temporal  # (h, layout): spatial layout -> temporal layout
        self.to_spatial = to_spatial  # and back

    def forward(self, h, text, layout: VideoLayout):
        h = self.spatial(h, text, layout.spatial)
        t = self.temporal(self.to_temporal(h, layout), text, layout.temporal)
        return self.to_spatial(t, layout)


class TinyDiT(nn.Module):
    """Video diffusion transformer: predicts the noise of latent videos at their timesteps
    given their captions.

    - One whole video (layout None): x [F, S, C_in] (S = spatial patches of a frame), t a
      scalar, text [Tt, text_dim]; returns [F, S, C_in].
    - A packed micro-batch (runtime/video.py VideoLayout, this member's share): x [T, C_in]
      in the layout's spatial order, t [V] (one per video), text [sum Tt, text_dim] (the
      captions back to back); returns [T, C_in]."""

    def __init__(self, cfg: DiTConfig = DiTConfig()):
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.in_channels, cfg.hidden)
        self.time = nn.Linear(cfg.hidden, cfg.hidden)
        self.text = nn.Linear(cfg.text_dim, cfg.hidden)
        self.layers = nn.ModuleList(DiTLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.in_channels)

    def forward(self, x, t, text, layout: VideoLayout | None = None):
        if layout is None:
            num_f, num_s, c_in = x.shape
            one = VideoLayout(((num_f, num_s),), (text.shape[0],), device=x.device)
            return self.forward(x.reshape(-1, c_in), t.reshape(1), text, one).reshape(x.shape)
        dt, c = x.dtype, self.cfg.hidden
        pos = sinusoid(layout.frame_ids, c, dt) + sinusoid(layout.spatial_ids, c, dt)
        per_video = torch.tensor(layout.spatial.videos, device=x.device)
        time = self.time(sinusoid(t * 1000.0, c, dt)).repeat_interleave(per_video, dim=0)
        h = self.inp(x) + pos + time
        txt = self.text(text)
        for layer in self.layers:
            h = layer(h, txt, layout)
        return self.out(self.norm(h))


# Compute dtypes by name (runtime/sharding.py's `dtype` vocabulary, plus fp16 and fp64).
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


def compute_dtype_bytes(dtype) -> int:
    """Bytes per value of a compute dtype: a name of DTYPE_BYTES or a floating torch.dtype."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return torch.finfo(dtype).bits // 8
    if isinstance(dtype, str) and dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(
        f"dtype: {dtype!r} not allowed; allowed: {list(DTYPE_BYTES)} or a floating torch.dtype "
        "(the compute dtype: 'bf16' for shard(dtype='bf16'))"
    )


def model_spec(
    cfg: LMConfig | DiTConfig | TinyLM | TinyDiT,
    *,
    dtype=None,
    dtype_bytes: int | None = None,
    text_tokens: int = 0,
) -> ModelSpec:
    """The ModelSpec the cost model and planners need for one of these models.

    `dtype`: the compute dtype, which sizes the activations (e.g. "bf16" for
    `shard(dtype="bf16")`, whose fp32 parameters are only the master weights; the cost model
    charges model states as mixed-precision Adam whatever the dtype). None: the parameters'
    dtype for a model, fp32 for a config. `dtype_bytes` is the older spelling, in bytes.
    A model (rather than its config) also gives the exact parameter count, norms and biases
    included."""
    if dtype is not None and dtype_bytes is not None:
        raise ValueError("dtype / dtype_bytes: give at most one of them")
    model = cfg if isinstance(cfg, (TinyLM, TinyDiT)) else None
    if model is not None:
        cfg = model.cfg
        if dtype is None and dtype_bytes is None:
            dtype = next(model.parameters()).dtype
    if dtype is not None:
        dtype_bytes = compute_dtype_bytes(dtype)
    dtype_bytes = 4 if dtype_bytes is None else dtype_bytes
    num_params = None if model is None else float(sum(p.numel() for p in model.parameters()))
    if isinstance(cfg, LMConfig):
        return ModelSpec(
            "tiny-lm", "1d", cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.ffn_hidden,
            vocab_size=cfg.vocab_size, dtype_bytes=dtype_bytes, num_params=num_params,
        )  # fmt: skip
    return ModelSpec(
        "tiny-dit", "2d", cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.ffn_hidden,
        text_tokens=text_tokens, causal=False, dtype_bytes=dtype_bytes, num_params=num_params,
    )  # fmt: skip
