"""dcp_opt/dit_spec.py against diffusers (issue 27): the parameter count a ModelSpec gets from a
diffusers video transformer's config equals sum(p.numel()) of the model diffusers builds from
it, to the parameter. Tiny configs (hidden 16, 1-2 blocks of each kind), built on the meta
device, nothing downloaded; the published sizes are scripts/check_dit_params.py's."""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    FluxTransformer2DModel,
    HunyuanVideoTransformer3DModel,
    WanTransformer3DModel,
)

from dcp_opt.dit_spec import PUBLISHED, published_spec, spec_from_diffusers_config
from dcp_opt.errors import DcpOptError
from dcp_opt.model import MODEL_PRESETS

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
    out_channels=4, text_dim=12, freq_dim=8, ffn_dim=24, num_layers=2,
)  # fmt: skip
HUNYUAN = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
    num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
    text_embed_dim=12, pooled_projection_dim=10, rope_axes_dim=(2, 2, 4),
)  # fmt: skip
FLUX = dict(
    patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=10,
    axes_dims_rope=(2, 2, 4),
)  # fmt: skip
CASES = [
    (WanTransformer3DModel, WAN),
    (WanTransformer3DModel, {**WAN, "cross_attn_norm": False, "out_channels": 6}),
    (WanTransformer3DModel, {**WAN, "patch_size": (2, 2, 2)}),
    (HunyuanVideoTransformer3DModel, HUNYUAN),
    (HunyuanVideoTransformer3DModel, {**HUNYUAN, "guidance_embeds": False, "patch_size_t": 2}),
    (FluxTransformer2DModel, FLUX),
    (FluxTransformer2DModel, {**FLUX, "guidance_embeds": True, "out_channels": 6, "patch_size": 2}),
]


def built_params(cls, cfg) -> tuple[int, dict]:
    with torch.device("meta"):
        model = cls(**cfg)
    return sum(p.numel() for p in model.parameters()), dict(model.config)


@pytest.mark.parametrize(("cls", "cfg"), CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_parameter_count_equals_the_diffusers_model(cls, cfg):
    want, config = built_params(cls, cfg)
    spec = spec_from_diffusers_config(config, text_tokens=7, class_name=cls.__name__)
    assert spec.num_params == want
    assert spec.kind == "3d" and spec.hidden == 16 and spec.num_heads == 2


def test_the_spec_of_each_family_by_hand():
    _, wan = built_params(WanTransformer3DModel, WAN)
    s = spec_from_diffusers_config(wan, text_tokens=7, class_name="WanTransformer3DModel")
    assert (s.text_mode, s.num_layers, s.ffn_hidden, s.single_layers) == ("cross", 2, 24, 0)
    _, hy = built_params(HunyuanVideoTransformer3DModel, HUNYUAN)
    s = spec_from_diffusers_config(hy, text_tokens=7, class_name="HunyuanVideoTransformer3DModel")
    # 1 double + 2 single blocks; MLP 16 x 2.0 = 32
    assert (s.text_mode, s.num_layers, s.single_layers, s.ffn_hidden) == ("joint", 3, 2, 32)
    _, fx = built_params(FluxTransformer2DModel, FLUX)
    s = spec_from_diffusers_config(fx, text_tokens=7, class_name="FluxTransformer2DModel")
    assert (s.num_layers, s.single_layers, s.ffn_hidden, s.text_tokens) == (3, 2, 64, 7)


def test_presets_are_the_published_configs():
    for name in PUBLISHED:
        assert MODEL_PRESETS[name] == published_spec(name)


def test_unsupported_configs_are_refused_by_field():
    with pytest.raises(DcpOptError, match="config._class_name"):
        spec_from_diffusers_config({}, text_tokens=1, class_name="UNet2DModel")
    with pytest.raises(DcpOptError, match="config.image_dim"):
        spec_from_diffusers_config(
            {**WAN, "image_dim": 1280}, text_tokens=1, class_name="WanTransformer3DModel"
        )
    with pytest.raises(DcpOptError, match="config.image_condition_type"):
        spec_from_diffusers_config(
            {**HUNYUAN, "image_condition_type": "latent_concat"},
            text_tokens=1,
            class_name="HunyuanVideoTransformer3DModel",
        )
    with pytest.raises(DcpOptError, match="config.num_attention_heads"):
        spec_from_diffusers_config(
            {**WAN, "num_attention_heads": 0}, text_tokens=1, class_name="WanTransformer3DModel"
        )
