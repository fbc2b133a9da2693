"""Samples of the full-attention video DiTs (ModelSpec kind "3d"): pixels and frames to latent
tokens, and their workloads (the standard mix `3d-*` and Open-Sora 2.0's published buckets).

Tokens: a causal video VAE keeps the first frame and compresses the rest `temporal` x, so
F frames give 1 + (F - 1) // temporal latent frames; the VAE divides height and width by
`spatial` and the transformer's patch by `patch`: ceil(H / (spatial x patch)) x
ceil(W / (spatial x patch)) tokens per latent frame (ceil as the 2d workloads). All four presets
compress 4 x 8 x 8 with a 1 x 2 x 2 patch, so one sample shape serves them all.
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
