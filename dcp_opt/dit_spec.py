"""The cost-model view (ModelSpec, kind "3d") of a diffusers video transformer, from its config
alone: no torch or diffusers import (dcp_opt core), as dcp_opt/hf_spec.py does for
transformers.

Covers the text-to-video forms of `WanTransformer3DModel` (cross-attention to the text),
`HunyuanVideoTransformer3DModel` and `FluxTransformer2DModel` (joint MMDiT: double- then
single-stream blocks; Open-Sora 2.0's MMDiT is Flux's, hpcaitech/Open-Sora
opensora/models/mmdit/model.py). `num_params` is counted from the config exactly as diffusers
0.42 builds the model (src/diffusers/models/transformers/transformer_{wan,hunyuan_video,flux}.py;
tests/test_dit_spec.py checks tiny configs against sum(p.numel()), and
scripts/check_dit_params.py the published ones on the meta device).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .errors import DcpOptError
from .model import ModelSpec

CLASSES = (
    "FluxTransformer2DModel",
    "HunyuanVideoTransformer3DModel",
    "WanTransformer3DModel",
)


def _lin(i: int, o: int, bias: bool = True) -> int:
    """Parameters of nn.Linear(i, o)."""
    return i * o + (o if bias else 0)


def _two_layer(i: int, d: int) -> int:
    """TimestepEmbedding(i, d) and PixArtAlphaTextProjection(i, d): Linear(i, d), Linear(d, d)
    (src/diffusers/models/embeddings.py)."""
    return _lin(i, d) + _lin(d, d)


def _int(cfg: Mapping, key: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise DcpOptError(f"config.{key}: must be an integer >= 1, got {v!r}")
    return v


def _none(cfg: Mapping, key: str, what: str) -> None:
    if cfg.get(key) is not None:
        raise DcpOptError(f"config.{key}: {cfg[key]!r} not supported; allowed: None ({what})")


def count_wan(cfg: Mapping) -> int:
    """WanTransformer3DModel, text-to-video (no image_dim, no added_kv_proj_dim)."""
    _none(cfg, "image_dim", "text-to-video; the image branch is not modelled")
    _none(cfg, "added_kv_proj_dim", "text-to-video; the image branch is not modelled")
    h = _int(cfg, "num_attention_heads") * _int(cfg, "attention_head_dim")
    f, p = _int(cfg, "ffn_dim"), math.prod(cfg.get("patch_size", (1, 2, 2)))
    c_in, c_out = _int(cfg, "in_channels"), cfg.get("out_channels") or cfg["in_channels"]
    embed = c_in * h * p + h  # Conv3d patch embedding
    cond = _two_layer(cfg.get("freq_dim", 256), h) + _lin(h, 6 * h)
    cond += _two_layer(_int(cfg, "text_dim"), h)  # text_embedder
    attn = 4 * _lin(h, h) + 2 * h  # q k v o, RMSNorm of q and k across heads
    norm2 = 2 * h if cfg.get("cross_attn_norm", True) else 0
    block = 2 * attn + norm2 + _lin(h, f) + _lin(f, h) + 6 * h  # + scale_shift_table
    out = _lin(h, c_out * p) + 2 * h
    return embed + cond + _int(cfg, "num_layers") * block + out


def _joint_block(h: int, head: int, f: int) -> int:
    """A double-stream block (Flux, HunyuanVideo): two AdaLayerNormZero (h -> 6h), q k v o and
    their added (text) twins, RMSNorm of q and k per head for each stream, two MLPs."""
    return 2 * _lin(h, 6 * h) + 8 * _lin(h, h) + 4 * head + 2 * (_lin(h, f) + _lin(f, h))


def _single_block(h: int, head: int, f: int) -> int:
    """A single-stream block: AdaLayerNormZeroSingle (h -> 3h), q k v, q/k RMSNorm, the MLP's
    input projection and the output projection of [attention, MLP]."""
    return _lin(h, 3 * h) + 3 * _lin(h, h) + 2 * head + _lin(h, f) + _lin(h + f, h)


def count_flux(cfg: Mapping) -> int:
    """FluxTransformer2DModel (mlp_ratio 4 in both block types)."""
    head = _int(cfg, "attention_head_dim")
    h = _int(cfg, "num_attention_heads") * head
    c_in = _int(cfg, "in_channels")
    c_out = cfg.get("out_channels") or c_in
    p = cfg.get("patch_size", 1)
    time_text = _two_layer(256, h) + _two_layer(_int(cfg, "pooled_projection_dim"), h)
    if cfg.get("guidance_embeds", False):
        time_text += _two_layer(256, h)
    embed = _lin(_int(cfg, "joint_attention_dim"), h) + _lin(c_in, h)
    blocks = cfg.get("num_layers", 19) * _joint_block(h, head, 4 * h)
    blocks += cfg.get("num_single_layers", 38) * _single_block(h, head, 4 * h)
    return time_text + embed + blocks + _lin(h, 2 * h) + _lin(h, p * p * c_out)


def count_hunyuan(cfg: Mapping) -> int:
    """HunyuanVideoTransformer3DModel, text-to-video (image_condition_type None)."""
    _none(cfg, "image_condition_type", "text-to-video")
    head = _int(cfg, "attention_head_dim")
    h = _int(cfg, "num_attention_heads") * head
    f = int(h * cfg.get("mlp_ratio", 4.0))
    c_in, text = _int(cfg, "in_channels"), _int(cfg, "text_embed_dim")
    c_out = cfg.get("out_channels") or c_in
    p, pt = cfg.get("patch_size", 2), cfg.get("patch_size_t", 1)
    embed = c_in * h * pt * p * p + h  # Conv3d patch embedding
    # the token refiner: its own time/text embedding, proj_in, refiner blocks (LayerNorms 2h,
    # q k v o with bias, a 4h MLP, AdaNorm h -> 2h)
    refiner_block = 2 * 2 * h + 4 * _lin(h, h) + _lin(h, 4 * h) + _lin(4 * h, h) + _lin(h, 2 * h)
    refiner = _two_layer(256, h) + _two_layer(text, h) + _lin(text, h)
    refiner += cfg.get("num_refiner_layers", 2) * refiner_block
    cond = _two_layer(256, h) + _two_layer(_int(cfg, "pooled_projection_dim"), h)
    if cfg.get("guidance_embeds", True):
        cond += _two_layer(256, h)
    blocks = cfg.get("num_layers", 20) * _joint_block(h, head, f)
    blocks += cfg.get("num_single_layers", 40) * _single_block(h, head, f)
    return embed + refiner + cond + blocks + _lin(h, 2 * h) + _lin(h, pt * p * p * c_out)


def count_params(cfg: Mapping, class_name: str) -> int:
    """Parameters of the diffusers model `class_name` built from `cfg`."""
    counts = {
        "FluxTransformer2DModel": count_flux,
        "HunyuanVideoTransformer3DModel": count_hunyuan,
        "WanTransformer3DModel": count_wan,
    }
    if class_name not in counts:
        raise DcpOptError(f"config._class_name: {class_name!r} not supported; allowed: {CLASSES}")
    return counts[class_name](cfg)


def spec_from_diffusers_config(
    cfg: Mapping, *, text_tokens: int, class_name: str | None = None, name: str | None = None
) -> ModelSpec:
    """ModelSpec of a diffusers video transformer config (a mapping, e.g. `model.config` or a
    transformer/config.json). `text_tokens`: the caption length the model is trained with (not
    in the transformer's config: the text encoder's max length). `class_name`: the diffusers
    class, by default the config's `_class_name`."""
    cls = class_name or cfg.get("_class_name")
    num_params = count_params(cfg, cls)  # refuses an unknown class first
    head = _int(cfg, "attention_head_dim")
    heads = _int(cfg, "num_attention_heads")
    h = heads * head
    common = {"text_tokens": text_tokens, "causal": False, "num_params": float(num_params)}
    if cls == "WanTransformer3DModel":
        layers = _int(cfg, "num_layers")
        return ModelSpec(
            name or "diffusers-wan",
            "3d",
            layers,
            h,
            heads,
            _int(cfg, "ffn_dim"),
            text_mode="cross",
            **common,
        )
    double = cfg.get("num_layers", 19 if cls == CLASSES[0] else 20)
    single = cfg.get("num_single_layers", 38 if cls == CLASSES[0] else 40)
    f = 4 * h if cls == CLASSES[0] else int(h * cfg.get("mlp_ratio", 4.0))
    return ModelSpec(
        name or f"diffusers-{cls}",
        "3d",
        double + single,
        h,
        heads,
        f,
        text_mode="joint",
        single_layers=single,
        **common,
    )


# The published transformer configs (diffusers' conversion scripts, which build the released
# checkpoints) and the caption lengths they train with:
# - Wan 2.1 T2V: scripts/convert_wan_to_diffusers.py:329-368 ("Wan-T2V-1.3B", "Wan-T2V-14B");
#   umT5 captions of 512 tokens (Wan-Video/Wan2.1 wan/configs/shared_config.py, text_len).
# - HunyuanVideo: scripts/convert_hunyuan_video_to_diffusers.py:146-164
#   ("HYVideo-T/2-cfgdistill"); 256 text tokens (Tencent/HunyuanVideo hyvideo/config.py,
#   --text-len).
# - Open-Sora 2.0: hpcaitech/Open-Sora configs/diffusion/train/image.py (model: flux,
#   in_channels 64, vec_in_dim 768, context_in_dim 4096, hidden 3072, 24 heads, depth 19,
#   depth_single_blocks 38, guidance_embed False) in diffusers' Flux names; T5 captions of
#   512 tokens (the same file, t5.max_length).
PUBLISHED = {
    "wan2.1-1.3b": ("WanTransformer3DModel", 512, {
        "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
        "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "in_channels": 16,
        "num_attention_heads": 12, "num_layers": 30, "out_channels": 16,
        "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "text_dim": 4096,
    }),
    "wan2.1-14b": ("WanTransformer3DModel", 512, {
        "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
        "eps": 1e-06, "ffn_dim": 13824, "freq_dim": 256, "in_channels": 16,
        "num_attention_heads": 40, "num_layers": 40, "out_channels": 16,
        "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "text_dim": 4096,
    }),
    "hunyuanvideo-13b": ("HunyuanVideoTransformer3DModel", 256, {
        "in_channels": 16, "out_channels": 16, "num_attention_heads": 24,
        "attention_head_dim": 128, "num_layers": 20, "num_single_layers": 40,
        "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 2, "patch_size_t": 1,
        "qk_norm": "rms_norm", "guidance_embeds": True, "text_embed_dim": 4096,
        "pooled_projection_dim": 768, "rope_theta": 256.0, "rope_axes_dim": [16, 56, 56],
        "image_condition_type": None,
    }),
    "opensora2-11b": ("FluxTransformer2DModel", 512, {
        "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19,
        "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
        "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": False,
        "axes_dims_rope": [16, 56, 56],
    }),
}  # fmt: skip


def published_spec(name: str) -> ModelSpec:
    """The ModelSpec of a published model of PUBLISHED, counted from its config."""
    cls, text, cfg = PUBLISHED[name]
    return spec_from_diffusers_config(cfg, text_tokens=text, class_name=cls, name=name)
