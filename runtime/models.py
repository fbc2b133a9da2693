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
from .joint import JointLayout, cross_attention, joint_attention
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


@dataclass(frozen=True)
class Full3DConfig:
    """A tiny 3-D full-attention video DiT: `num_double` double-stream blocks then
    `num_single` single-stream blocks (TinyMMDiT), or `num_double + num_single` Wan blocks
    (TinyWanDiT). hidden / num_heads must be even and >= 6 (3-D RoPE: frame, row, column;
    rope3d)."""

    in_channels: int = 4
    hidden: int = 24
    num_heads: int = 4
    num_double: int = 1
    num_single: int = 1
    ffn_hidden: int = 32
    text_dim: int = 8

    def __post_init__(self):
        head = self.hidden // self.num_heads
        if self.hidden % self.num_heads or head % 2 or head < 6:
            raise ValueError(
                f"hidden: {self.hidden} with num_heads {self.num_heads}; allowed: a head "
                "width (hidden / num_heads) that is even and >= 6 (3-D RoPE)"
            )


def rope3d(x: torch.Tensor, pos: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """3-D RoPE (Wan, HunyuanVideo): the head dim in three parts rotated by frame, row and
    column; x [T, H, Dh], pos three [T] index tensors. The parts are Wan's split (Wan-Video/
    Wan2.1 wan/modules/model.py:481, WanModel.__init__): rows and columns 2 x
    (Dh // 6) each, frames the rest, so Dh = 128 rotates 44 + 42 + 42 (thirds when 6 | Dh)."""
    side = 2 * (x.shape[-1] // 6)
    parts = x.split([x.shape[-1] - 2 * side, side, side], dim=-1)
    return torch.cat([rope(p, i, 10000.0) for p, i in zip(parts, pos, strict=True)], dim=-1)


def modulate(x, shift, scale):
    """adaLN (Peebles & Xie 2023, DiT, sec. 3.2): per-token shift and scale."""
    return x * (1 + scale) + shift


class Stream(nn.Module):
    """One stream's weights of a 3-D DiT block: adaLN modulation (6 per-token vectors),
    qkv with RMS qk-norm, attention output and MLP."""

    def __init__(self, cfg: Full3DConfig):
        super().__init__()
        self.mod = nn.Linear(cfg.hidden, 6 * cfg.hidden)
        self.norm1 = nn.LayerNorm(cfg.hidden, elementwise_affine=False)
        self.attn = SelfAttention(cfg.hidden, cfg.num_heads)
        self.q_norm = nn.RMSNorm(cfg.hidden // cfg.num_heads)
        self.k_norm = nn.RMSNorm(cfg.hidden // cfg.num_heads)
        self.norm2 = nn.LayerNorm(cfg.hidden, elementwise_affine=False)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden)

    def qkv(self, h, time, pos=None):
        mods = self.mod(time).chunk(6, dim=-1)
        q, k, v = self.attn.split(modulate(self.norm1(h), mods[0], mods[1]))
        q, k = self.q_norm(q), self.k_norm(k)
        if pos is not None:
            q, k = rope3d(q, pos), rope3d(k, pos)
        return (q, k, v), mods

    def finish(self, h, a, mods):
        h = h + mods[2] * self.attn.out(a.reshape(h.shape))
        return h + mods[5] * self.mlp(modulate(self.norm2(h), mods[3], mods[4]))


class DoubleBlock(nn.Module):
    """MMDiT double-stream block (Esser et al. 2024, SD3, fig. 2; Flux; HunyuanVideo):
    text and video tokens have their own weights and meet in one joint attention."""

    def __init__(self, cfg: Full3DConfig):
        super().__init__()
        self.text, self.video = Stream(cfg), Stream(cfg)
        self.attention_fn = joint_attention

    def forward(self, txt, img, ctx):
        (tq, tk, tv), tmod = self.text.qkv(txt, ctx["text_time"])
        (vq, vk, vv), vmod = self.video.qkv(img, ctx["time"], ctx["pos"])
        a = self.attention_fn(
            *(torch.cat(p) for p in ((tq, vq), (tk, vk), (tv, vv))), ctx["layout"]
        )
        n = txt.shape[0]
        return self.text.finish(txt, a[:n], tmod), self.video.finish(img, a[n:], vmod)


class SingleBlock(nn.Module):
    """MMDiT single-stream block (Flux, HunyuanVideo): shared weights over the joint stream."""

    def __init__(self, cfg: Full3DConfig):
        super().__init__()
        self.stream = Stream(cfg)
        self.attention_fn = joint_attention

    def forward(self, txt, img, ctx):
        h, n = torch.cat([txt, img]), txt.shape[0]
        time = torch.cat([ctx["text_time"], ctx["time"]])
        qkv, mods = self.stream.qkv(h, time, ctx["joint_pos"])
        h = self.stream.finish(h, self.attention_fn(*qkv, ctx["layout"]), mods)
        return h[:n], h[n:]


class WanBlock(nn.Module):
    """Wan 2.1 block (Wan team 2025, sec. 3.1.2): adaLN-modulated 3-D self-attention over the
    video tokens, cross-attention to the caption, MLP."""

    def __init__(self, cfg: Full3DConfig):
        super().__init__()
        self.stream = Stream(cfg)
        self.norm_x = nn.LayerNorm(cfg.hidden)
        self.cross = nn.ModuleDict(
            {
                "q": nn.Linear(cfg.hidden, cfg.hidden, bias=False),
                "kv": nn.Linear(cfg.hidden, 2 * cfg.hidden, bias=False),
                "out": nn.Linear(cfg.hidden, cfg.hidden, bias=False),
            }
        )
        self.num_heads = cfg.num_heads
        self.attention_fn = joint_attention

    def forward(self, txt, img, ctx):
        qkv, mods = self.stream.qkv(img, ctx["time"], ctx["pos"])
        a = self.attention_fn(*qkv, ctx["layout"])
        h = img + mods[2] * self.stream.attn.out(a.reshape(img.shape))
        cq = self.cross["q"](self.norm_x(h)).reshape(h.shape[0], self.num_heads, -1)
        ck, cv = self.cross["kv"](txt).reshape(txt.shape[0], 2, self.num_heads, -1).unbind(1)
        h = h + self.cross["out"](cross_attention(cq, ck, cv, ctx["layout"]).reshape(h.shape))
        return txt, h + mods[5] * self.stream.mlp(modulate(self.stream.norm2(h), mods[3], mods[4]))


def block_context(layout: JointLayout, time: torch.Tensor) -> dict:
    """What every block of a Full3DDiT reads beside its two streams: the layout, the per-token
    time embedding of the video and text tokens (`time` [V, C], one row per sample) and their
    3-D RoPE positions."""
    idx = layout.index
    pos = (idx["frame"], idx["row"], idx["col"])
    ctx = {"layout": layout, "time": time[idx["sample"]], "pos": pos}
    ctx["text_time"] = time[idx["text_sample"]]
    # text tokens sit at position 0 of every axis (Flux's txt_ids): RoPE leaves them be
    zeros = idx["text_sample"].new_zeros(layout.text_shard)
    ctx["joint_pos"] = tuple(torch.cat([zeros, p]) for p in pos)
    return ctx


class Full3DDiT(nn.Module):
    """Video diffusion transformer with full attention over all F x H x W tokens of a sample
    (runtime/joint.py): predicts the noise of latent videos / images at their timesteps.

    - One sample (layout None): x [F, H, W, C_in], t a scalar, text [Tt, text_dim]; returns
      [F, H, W, C_in].
    - A packed micro-batch (joint.JointLayout, this member's share): x [Lv, C_in] (its video
      shard), t [V], text [sum Tt, text_dim] (every caption, back to back); returns [Lv, C_in].
    `joint`: text tokens join the attention sequence (MMDiT) or are cross-attention keys."""

    joint = True

    def __init__(self, cfg: Full3DConfig, blocks):
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.in_channels, cfg.hidden)
        self.time = MLP(cfg.hidden, cfg.hidden)
        self.text = nn.Linear(cfg.text_dim, cfg.hidden)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.in_channels)

    def forward(self, x, t, text, layout: JointLayout | None = None):
        if layout is None:
            shape = (tuple(x.shape[:3]),)
            one = JointLayout(shape, (text.shape[0],), joint=self.joint, device=x.device)
            return self.forward(x.reshape(-1, x.shape[-1]), t.reshape(1), text, one).reshape(
                x.shape
            )
        time = self.time(sinusoid(t * 1000.0, self.cfg.hidden, x.dtype))
        txt = self.text(layout.shard(text, layout.text_shard) if self.joint else text)
        ctx = block_context(layout, time)
        img = self.inp(x)
        for layer in self.layers:
            txt, img = layer(txt, img, ctx)
        return self.out(self.norm(img))


class TinyMMDiT(Full3DDiT):
    """MMDiT (SD3, Flux, HunyuanVideo, Open-Sora 2.0): double-stream then single-stream
    blocks, text joined to the video tokens' attention sequence."""

    joint = True

    def __init__(self, cfg: Full3DConfig = Full3DConfig()):
        blocks = [DoubleBlock(cfg) for _ in range(cfg.num_double)]
        super().__init__(cfg, blocks + [SingleBlock(cfg) for _ in range(cfg.num_single)])


class TinyWanDiT(Full3DDiT):
    """Wan-style DiT: 3-D self-attention over the video tokens, cross-attention to a fixed
    length caption."""

    joint = False

    def __init__(self, cfg: Full3DConfig = Full3DConfig()):
        super().__init__(cfg, [WanBlock(cfg) for _ in range(cfg.num_double + cfg.num_single)])


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
    if not isinstance(cfg, (LMConfig, DiTConfig, TinyLM, TinyDiT)):
        raise ValueError(
            f"cfg: {type(cfg).__name__} not allowed; allowed: LMConfig, DiTConfig, TinyLM, "
            "TinyDiT (the 3-D full-attention DiTs are not a 1d / 2d ModelSpec)"
        )
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
