"""Samples of the full-attention video DiTs (ModelSpec kind "3d"): pixels and frames to latent
tokens, and their workloads (the standard mix `3d-*` and Open-Sora 2.0's published buckets).

Tokens: a causal video VAE keeps the first frame and compresses the rest `temporal` x, so
F frames give 1 + (F - 1) // temporal latent frames; the VAE divides height and width by
`spatial` and the transformer's patch by `patch`: ceil(H / (spatial x patch)) x
ceil(W / (spatial x patch)) tokens per latent frame (ceil as the 2d workloads). All four presets
compress 4 x 8 x 8 with a 1 x 2 x 2 patch, so one sample shape serves them all.

Published mixes (PUBLISHED_MIXES, workloads `3d-<name>`): Open-Sora 2.0's two stages (its
bucket_config), Wan 2.1's 720px stage and HunyuanVideo's 129-frame buckets (what each
publishes, and what is assumed, is cited where each is defined).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VideoTokenizer:
    """A video VAE's compression and the transformer's patch (each cited in VAES)."""

    temporal: int
    spatial: int
    patch_t: int
    patch: int

    def shape(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        """(latent frames / patch_t, height tokens, width tokens) of a clip."""
        latent = 1 + (frames - 1) // self.temporal
        side = self.spatial * self.patch
        return (math.ceil(latent / self.patch_t), math.ceil(height / side), math.ceil(width / side))


VAES = {
    # Wan-VAE: causal, 4x temporal, 8x spatial (diffusers pipelines/wan/pipeline_wan.py:154-155,
    # the VAE config's scale_factor_temporal / scale_factor_spatial, 4 and 8 without a VAE);
    # patch_size (1, 2, 2) (dit_spec.PUBLISHED).
    "wan2.1": VideoTokenizer(4, 8, 1, 2),
    # HunyuanVideo's causal 3D VAE: temporal_compression_ratio 4, spatial_compression_ratio 8
    # (diffusers models/autoencoders/autoencoder_kl_hunyuan_video.py:431-432); patch_size_t 1,
    # patch_size 2 (dit_spec.PUBLISHED).
    "hunyuanvideo": VideoTokenizer(4, 8, 1, 2),
    # Open-Sora 2.0 trains on the HunyuanVideo VAE (configs/diffusion/train/image.py,
    # ae.type "hunyuan_vae", 16 latent channels) with 2 x 2 patches packed into the
    # transformer's 64 input channels (in_channels 64 = 16 x 2 x 2).
    "opensora2": VideoTokenizer(4, 8, 1, 2),
}
TOKENIZER = VAES["wan2.1"]  # the standard mix's (all three are equal)

# The standard 3d mix: the 2d workloads' five resolutions at 9:16 (workloads.RESOLUTIONS)
# x five clip lengths of 4k + 1 frames (a causal 4x VAE's lengths) up to the 129 frames that
# HunyuanVideo and Open-Sora 2.0 train with (stage2.py's longest bucket).
FRAMES_3D = (1, 33, 65, 97, 129)


def opensora_px(px: int, aspect: tuple[int, int] = (16, 9)) -> tuple[int, int]:
    """(height, width) of Open-Sora 2.0's `{px}px` bucket at `aspect` (width:height): about
    px^2 pixels, sides multiples of 16, the nearest to px^2 of the +-16 neighbours
    (opensora/datasets/aspect.py, get_aspect_ratios_dict, training=True). 256px -> (192, 336),
    768px -> (576, 1024)."""
    total, d = px * px, 16
    wr, hr = aspect
    width = int(math.sqrt(total * (wr / hr)) // d) * d
    height = int((total / width) // d) * d
    diff = abs(height * width - total)
    for h, w in (
        (height - d, width),
        (height + d, width),
        (height, width - d),
        (height, width + d),
    ):
        if abs(h * w - total) < diff:
            height, width, diff = h, w, abs(h * w - total)
    return height, width


def _frames(first: int, last: int, bs: int) -> dict[int, int]:
    return {f: bs for f in range(first, last + 1, 4)}


# Open-Sora 2.0's bucket_config: {resolution: {frames: batch size}} (the keep probability of
# every listed bucket is 1.0, except stage1's 768px and 1024px images, 0.5).
# stage1: configs/diffusion/train/stage1.py (256px videos of 1-129 frames, 768px and
# 1024px images); stage2: configs/diffusion/train/stage2.py (256px and 768px, sp_size 4).
OPENSORA2_BUCKETS = {
    "256px": {
        256: {1: 45, **_frames(5, 33, 12), **_frames(37, 65, 6), **_frames(69, 97, 4),
              **_frames(101, 129, 3)},
        768: {1: 13},
        1024: {1: 7},
    },
    "768px": {
        256: {1: 130, **_frames(5, 33, 14), **_frames(37, 65, 10), **_frames(73, 97, 7),
              **_frames(101, 129, 6)},
        768: {1: 38, **_frames(5, 33, 6), **_frames(37, 65, 4), **_frames(69, 97, 3),
              **_frames(101, 129, 2)},
    },
}  # fmt: skip
OPENSORA2_KEEP = {("256px", 768): 0.5, ("256px", 1024): 0.5}


def opensora2_buckets(stage: str) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """(shapes, sample probabilities) of one Open-Sora 2.0 stage. Open-Sora forms each step
    from one bucket with its batch size, its batch sizes chosen so that a step of any bucket
    takes about as long; with no published share of clips per bucket, every bucket is taken
    equally often per step, so a sample's probability is its bucket's batch size x keep
    probability, normalised."""
    shapes, weights = [], []
    for px, by_frames in OPENSORA2_BUCKETS[stage].items():
        h, w = opensora_px(px)
        for frames, bs in by_frames.items():
            shapes.append(VAES["opensora2"].shape(h, w, frames))
            weights.append(bs * OPENSORA2_KEEP.get((stage, px), 1.0))
    p = np.array(weights, dtype=float)
    return shapes, p / p.sum()


# Wan 2.1, the last stage of its image-video joint pre-training (Wan team 2025, "Wan: Open and
# Advanced Large-Scale Video Generative Models", arXiv 2503.20314, pre-training, "Image-video joint
# training": stage 3 trains 720px images and 5-second clips). 5 s at 16 fps are 81 frames
# (Wan-Video/Wan2.1 generate.py:84-85, frame_num 81; wan/configs/shared_config.py:18,
# sample_fps 16); 720px is 1280 x 720 in both orientations (wan/configs/__init__.py:30-32,
# SIZE_CONFIGS); VAE stride (4, 8, 8) and patch (1, 2, 2) (wan/configs/wan_t2v_14B.py:17,20).
# Not published: batch sizes and the image:clip ratio. Assumed: every bucket is drawn equally
# often by sample, images and clips alike (so clips hold 95 % of the tokens).
WAN21_720PX = {(720, 1280): (1, 81), (1280, 720): (1, 81)}  # (height, width): frame counts
# HunyuanVideo's published (height, width, frames) settings (Tencent/HunyuanVideo
# README.md:312-317: 540p and 720p, each at 9:16, 16:9, 4:3, 3:4 and 1:1; a table of the sizes
# it generates), all of 129 frames (hyvideo/config.py:310-315, --video-length 129, "4n+1" for
# the 3D VAE); VAE "884-16c-hy" (hyvideo/constants.py:73:
# 4x temporal, 8x8 spatial, 16 channels; diffusers autoencoder_kl_hunyuan_video.py:431-432),
# patch 1 x 2 x 2 (dit_spec.PUBLISHED). The paper (arXiv 2412.03603, "Progressive
# video-image joint training") names its stages (low-resolution short clips, low-resolution
# long clips, high-resolution long clips) without their resolutions, frame counts, batch sizes
# or image share; assumed: its final high-resolution stage trains on these ten buckets, each drawn
# equally often (no images).
HUNYUANVIDEO_129F = {
    (544, 960): (129,), (960, 544): (129,), (624, 832): (129,), (832, 624): (129,),
    (720, 720): (129,), (720, 1280): (129,), (1280, 720): (129,), (1104, 832): (129,),
    (832, 1104): (129,), (960, 960): (129,),
}  # fmt: skip
_EQUAL_MIXES = {
    "wan2.1-720px": ("wan2.1", WAN21_720PX),
    "hunyuanvideo-129f": ("hunyuanvideo", HUNYUANVIDEO_129F),
}
PUBLISHED_MIXES = (*(f"opensora2-{s}" for s in OPENSORA2_BUCKETS), *_EQUAL_MIXES)


def published_mix(name: str) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """(shapes, sample probabilities) of the published mix `name` (PUBLISHED_MIXES)."""
    if name.startswith("opensora2-"):
        return opensora2_buckets(name.removeprefix("opensora2-"))
    vae, buckets = _EQUAL_MIXES[name]
    shapes = [VAES[vae].shape(h, w, f) for (h, w), frames in buckets.items() for f in frames]
    return shapes, np.full(len(shapes), 1.0 / len(shapes))
