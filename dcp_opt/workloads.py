"""Standard workloads (REFERENCE.md sec. 4), seeded and reproducible, and batch files.

2D / video: 25 Open-Sora buckets = {144p, 240p, 360p, 480p, 720p} at 9:16 x frames
{1, 51, 102, 204, 408}; latent frames = 1 for images else frames*5//17 (the VAE's temporal
compression, as VideoSys); tokens = latent frames x ceil(H/16) x ceil(W/16) (VAE /8, patch 2).
Bucket probabilities over buckets sorted by tokens: short = Zipf(alpha 3, offset 5) as in
VideoSys' dummy dataset, balanced = uniform, long = the short Zipf reversed.
3D / full-attention video DiTs (dcp_opt/video3d.py): `3d-short|balanced|long` are the same
five resolutions x frames {1, 33, 65, 97, 129} through a 4x8x8 causal VAE and 2x2 patches,
with the 2d distributions; `3d-opensora2-256px` and `3d-opensora2-768px` are Open-Sora 2.0's
published buckets of its two stages, `3d-wan2.1-720px` Wan 2.1's 720px stage and
`3d-hunyuanvideo-129f` HunyuanVideo's 129-frame buckets (video3d.PUBLISHED_MIXES). Their samples are (frames, height, width) shapes, as 2d.
1D / text: log-normal lengths with median 2K / 8K / 32K (sigma 1.0), clipped to [128, 131072].
A global batch draws sequences until the token budget is reached (the last one may cross it).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .batch import MAX_SEQUENCES, Batch, Sequence, check_num_sequences
from .errors import DcpOptError, is_int, loads_json, read_text
from .video3d import FRAMES_3D, PUBLISHED_MIXES, TOKENIZER, published_mix

RESOLUTIONS = {
    "144p": (144, 256),
    "240p": (240, 426),
    "360p": (360, 640),
    "480p": (480, 854),
    "720p": (720, 1280),
}
FRAMES = (1, 51, 102, 204, 408)
DISTRIBUTIONS = ("short", "balanced", "long")
TEXT_MEDIANS = {"short": 2048, "balanced": 8192, "long": 32768}
TEXT_SIGMA = 1.0
TEXT_CLIP = (128, 131072)
DEFAULT_TOKENS_PER_GPU = 65536
# Tokens per GPU of a drawn global batch: 2**24 (16M) is 256x the default and more than any GPU
# holds; `--tokens-per-gpu 10000000000000` drew sequences for ever (issue 29).
MAX_TOKENS_PER_GPU = 2**24


def video_shape(resolution: str, frames: int) -> tuple[int, int, int]:
    h, w = RESOLUTIONS[resolution]
    latent_frames = 1 if frames == 1 else frames * 5 // 17
    return (latent_frames, math.ceil(h / 16), math.ceil(w / 16))


def video_buckets(kind: str = "2d") -> list[tuple[str, int, tuple[int, int, int]]]:
    """(resolution, frames, shape) for the 25 buckets, sorted by token count: Open-Sora 1.2's
    (2d) or the full-attention DiTs' (3d: FRAMES_3D through video3d.TOKENIZER)."""
    if kind == "3d":
        out = [(r, f, TOKENIZER.shape(*RESOLUTIONS[r], f)) for r in RESOLUTIONS for f in FRAMES_3D]
    else:
        out = [(r, f, video_shape(r, f)) for r in RESOLUTIONS for f in FRAMES]
    return sorted(out, key=lambda x: (int(np.prod(x[2])), x[0], x[1]))


def bucket_probabilities(distribution: str, num_buckets: int = 25) -> np.ndarray:
    if distribution not in DISTRIBUTIONS:
        raise DcpOptError(
            f"distribution: {distribution!r} not allowed; allowed: {list(DISTRIBUTIONS)}"
        )
    if distribution == "balanced":
        p = np.ones(num_buckets)
    else:
        p = 1.0 / (np.arange(num_buckets) + 5.0) ** 3  # Zipf, alpha 3, offset 5
        if distribution == "long":
            p = p[::-1]
    return p / p.sum()


@dataclass(frozen=True)
class Workload:
    """A named standard workload: `2d-short`, `1d-long`, ..."""

    kind: str
    distribution: str

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.distribution}"

    @property
    def input_kind(self) -> str:
        """The kind of its samples: "1d" lengths, else "2d" shapes (3d workloads too)."""
        return "1d" if self.kind == "1d" else "2d"

    @classmethod
    def parse(cls, name: str) -> Workload:
        parts = name.split("-", 1)
        if name in EXTRA_WORKLOADS or name in DOCUMENT_WORKLOADS or name in VIDEO_3D_WORKLOADS:
            return cls(*parts)
        if len(parts) != 2 or parts[0] not in ("1d", "2d") or parts[1] not in DISTRIBUTIONS:
            allowed = [w.name for w in STANDARD_WORKLOADS]
            allowed += [*EXTRA_WORKLOADS, *DOCUMENT_WORKLOADS, *VIDEO_3D_WORKLOADS]
            raise DcpOptError(f"workload: {name!r} not allowed; allowed: {allowed}")
        return cls(parts[0], parts[1])

    def sample_shape(self, rng: np.random.Generator) -> tuple[int, ...]:
        if self.distribution == IMAGE_HEAVY:
            return _image_heavy_shape(rng)
        if self.kind == "3d" and self.distribution in PUBLISHED_MIXES:
            shapes, p = published_mix(self.distribution)
            return shapes[rng.choice(len(shapes), p=p)]
        if self.distribution in DOCUMENT_SAMPLES:
            sample = document_lengths(self.distribution)
            return (int(sample[rng.integers(len(sample))]),)
        if self.kind in ("2d", "3d"):
            buckets = video_buckets(self.kind)
            i = rng.choice(len(buckets), p=bucket_probabilities(self.distribution, len(buckets)))
            return buckets[i][2]
        n = rng.lognormal(math.log(TEXT_MEDIANS[self.distribution]), TEXT_SIGMA)
        return (int(np.clip(round(n), *TEXT_CLIP)),)

    def batch(self, seed: int, token_budget: int) -> Batch:
        """Sequences drawn until `token_budget` tokens are reached."""
        if not is_int(token_budget) or token_budget < 1:
            raise DcpOptError(f"token_budget: must be an integer >= 1, got {token_budget!r}")
        if not (is_int(seed) or isinstance(seed, np.integer)) or seed < 0:
            raise DcpOptError(f"seed: must be an integer >= 0, got {seed!r}")
        rng = np.random.default_rng(seed)
        seqs, total = [], 0
        while total < token_budget:
            if len(seqs) == MAX_SEQUENCES:  # the budget needs more: refuse, saying how to split
                check_num_sequences(int(len(seqs) * token_budget / total) + 1)
            shape = self.sample_shape(rng)
            seqs.append(Sequence(len(seqs), shape))
            total += int(np.prod(shape))
        return Batch(tuple(seqs))


STANDARD_WORKLOADS = tuple(Workload(k, d) for k in ("2d", "1d") for d in DISTRIBUTIONS)

# The image-heavy video mix of the VideoSys benchmark dataset (REFERENCE.md sec. 5): 100,000
# images and 2,000 videos, so 98 % of samples are single images; images Zipf (alpha 3,
# offset 5) over the 5 image buckets, videos the same over the 20 video buckets (both sorted
# by tokens). Images hold ~74 % of the tokens (REFERENCE: 71 % counting latent voxels); a
# 16M-token batch holds ~16,500 samples and on average one 432K-token 720p 408-frame video.
IMAGE_HEAVY = "imageheavy"
IMAGE_SHARE = 100_000 / 102_000
EXTRA_WORKLOADS = ("2d-imageheavy",)
# Real document lengths (dcp_opt/data/NOTICE: WLB-LLM's sample and ProLong's, as shipped by
# hao-ai-lab/distca, Apache-2.0): each sequence is a uniform draw from the sample. Their tails
# are far heavier than the lognormal mixes: documents of 32K tokens or more are 0.9 % of the
# WLB sample but most of its attention work (issue 30).
DOCUMENT_SAMPLES = {"wlbllm": "wlbllm_lengths.json", "prolong": "prolong_lengths.json"}
DOCUMENT_WORKLOADS = tuple(f"1d-{k}" for k in DOCUMENT_SAMPLES)
# Full-attention video DiTs (dcp_opt/video3d.py): the standard mix and the published mixes
# (Open-Sora 2.0's stages, Wan 2.1's 720px stage, HunyuanVideo's buckets).
VIDEO_3D_WORKLOADS = (*(f"3d-{d}" for d in DISTRIBUTIONS), *(f"3d-{m}" for m in PUBLISHED_MIXES))


@functools.cache
def document_lengths(name: str) -> np.ndarray:
    """The document-length sample `name` of DOCUMENT_SAMPLES, as shipped in dcp_opt/data."""
    text = (resources.files("dcp_opt") / "data" / DOCUMENT_SAMPLES[name]).read_text()
    return np.array(json.loads(text), dtype=np.int64)


def _image_heavy_shape(rng: np.random.Generator) -> tuple[int, int, int]:
    shapes, p = _image_heavy_parts()[rng.random() < IMAGE_SHARE]
    return shapes[rng.choice(len(shapes), p=p)]


@functools.cache
def _image_heavy_parts() -> dict[bool, tuple[list, np.ndarray]]:
    """image? -> (shapes sorted by tokens, Zipf probabilities): made once (18K draws)."""
    out = {}
    for image in (False, True):
        shapes = [b[2] for b in video_buckets() if (b[1] == 1) == image]
        p = 1.0 / (np.arange(len(shapes)) + 5.0) ** 3
        out[image] = (shapes, p / p.sum())
    return out


def standard_batch(
    name: str, seed: int, *, num_gpus: int = 32, tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU
) -> Batch:
    check_tokens_per_gpu(tokens_per_gpu)
    return Workload.parse(name).batch(seed, num_gpus * tokens_per_gpu)


def check_tokens_per_gpu(tokens_per_gpu, field: str = "tokens_per_gpu") -> None:
    """An integer in [1, MAX_TOKENS_PER_GPU]."""
    if not is_int(tokens_per_gpu) or not 1 <= tokens_per_gpu <= MAX_TOKENS_PER_GPU:
        raise DcpOptError(
            f"{field}: must be an integer in [1, {MAX_TOKENS_PER_GPU}] (2**24), got "
            f"{tokens_per_gpu!r}"
        )


def load_batch(path: str | Path) -> Batch:
    """One length per line (1D), `frames,height,width` per line (2D), or JSON: a list of
    lengths, a list of [f, h, w], or {"sequences": [{"id":..,"shape":[..]}]}. '#' starts a
    comment. Numbers are exact integers (no 1.9, no true); at most MAX_SEQUENCES lines."""
    p = Path(path)
    text = read_text(p, f"lengths file {str(p)!r}")
    if p.suffix == ".json" or text.lstrip().startswith(("[", "{")):
        return _batch_from_json(text, p)
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            vals = [int(v) for v in line.replace(",", " ").split()]
        except ValueError:
            raise DcpOptError(f"{p.name}:{lineno}: expected integers, got {line[:80]!r}") from None
        if len(vals) not in (1, 3) or min(vals) < 1:
            raise DcpOptError(
                f"{p.name}:{lineno}: expected one length >= 1 or frames,height,width "
                f">= 1, got {line[:80]!r}"
            )
        rows.append(vals)
        if len(rows) > MAX_SEQUENCES:  # count the rest without keeping them
            check_num_sequences(
                len(rows) + sum(1 for x in text.splitlines()[lineno:] if x.split("#", 1)[0].strip())
            )
    if not rows:
        raise DcpOptError(f"lengths file {p.name}: no sequences")
    if len({len(r) for r in rows}) > 1:
        raise DcpOptError(f"lengths file {p.name}: mixes 1D lengths and 2D shapes")
    return Batch(tuple(Sequence(i, tuple(r)) for i, r in enumerate(rows)))


def _batch_from_json(text: str, p: Path) -> Batch:
    d = loads_json(text, p.name)
    if isinstance(d, dict):
        return Batch.from_dict(d)
    if not isinstance(d, list) or not d:
        raise DcpOptError(f"{p.name}: expected a non-empty list of lengths or shapes")
    check_num_sequences(len(d))
    if all(is_int(x) for x in d):
        return Batch.from_lengths(d)
    if all(isinstance(x, list) and all(is_int(v) for v in x) for x in d):
        return Batch.from_shapes(d)
    raise DcpOptError(f"{p.name}: entries must all be integers (1D) or all [f, h, w] lists (2D)")


def save_batch(batch: Batch, path: str | Path) -> None:
    lines = [",".join(str(v) for v in s.shape) for s in batch.sequences]
    Path(path).write_text("\n".join(lines) + "\n")
