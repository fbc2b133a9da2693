"""Training objectives as the executor runs them: shard a micro-batch over the active group,
forward, scale, backward. Each returns this rank's share of the (already scaled) loss; the
shares of all ranks sum to the single-process loss of the global batch.

Loss normalisation (the plan's `normalizer_kind`):
- "tokens": sum over all tokens of the batch of the per-token loss, / total tokens;
- "samples": sum over samples of the sample's mean per-token loss, / number of samples.
Either way a token's loss gets a fixed weight, so sharding and packing change nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cp import shard_for_group
from .joint import JointLayout
from .parallelize import SPState
from .sp import pad_dim, shard_bounds
from .video import VideoLayout

IGNORE = -100


def seeded_generator(
    step: int, sequence_id: int, *, seed: int = 0, salt: str = ""
) -> torch.Generator:
    """A generator every member of any group reproduces: seeded by (seed, step, sequence id),
    never by rank, so noise / timesteps / dropout masks agree inside a group and with
    single-process training."""
    key = f"{seed}:{step}:{sequence_id}:{salt}".encode()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
    return g


def token_weight(kind: str, length: int) -> float:
    if kind == "tokens":
        return 1.0
    if kind == "samples":
        return 1.0 / length
    raise ValueError(f"normalizer_kind: {kind!r} not allowed; allowed: ['tokens', 'samples']")


@dataclass(frozen=True)
class LMTask:
    """Next-token prediction. A sample is a LongTensor of L+1 token ids (inputs = first L,
    labels = last L), so a sequence of shape (L,) has exactly L loss tokens."""

    supports_cp = True  # shards by the group's SP kind, cp and ring too (cp.shard_for_group)

    def pack(self, samples, kind: str, degree: int):
        """Whole packed stream, padded to a multiple of `degree`."""
        cols = {"tokens": [], "labels": [], "positions": [], "segments": [], "weights": []}
        for i, (_, s) in enumerate(samples):
            n = s.shape[0] - 1
            cols["tokens"].append(s[:-1])
            cols["labels"].append(s[1:])
            cols["positions"].append(torch.arange(n))
            cols["segments"].append(torch.full((n,), i))
            cols["weights"].append(torch.full((n,), token_weight(kind, n), dtype=torch.float64))
        total = sum(x.shape[0] for x in cols["tokens"])
        size, _, _ = shard_bounds(total, degree, 0)
        pad = {"tokens": 0, "labels": IGNORE, "positions": 0, "segments": -1, "weights": 0.0}
        return {k: pad_dim(torch.cat(v), 0, size, pad[k]) for k, v in cols.items()}

    def run(self, model, samples, state: SPState, *, step: int, kind: str, scale: float):
        dev = next(model.parameters()).device
        # contiguous shards (Ulysses) or head-tail chunks (cp) of the packed stream
        part = {k: v.to(dev) for k, v in shard_for_group(self.pack, samples, kind, state).items()}
        state.segments = state.segments.to(dev)
        logits = model(part["tokens"], part["positions"], part["segments"])
        labels = part["labels"].clamp(min=0)
        per_token = F.cross_entropy(logits, labels, reduction="none")
        # Weighted sum keeps the graph connected even on a rank holding only padding, so
        # every member runs the same backward collectives.
        loss = (per_token * part["weights"].to(per_token.dtype)).sum() * scale
        loss.backward()
        return loss.detach()

    def reference_loss(self, model, sequence_id: int, sample, *, step: int, kind: str):
        """Unscaled loss of one whole sequence on one device (no packing, no padding)."""
        n, dev = sample.shape[0] - 1, next(model.parameters()).device
        sample = sample.to(dev)
        pos = torch.arange(n, device=dev)
        logits = model(sample[:-1], pos, torch.zeros_like(pos))
        return F.cross_entropy(logits, sample[1:], reduction="sum") * token_weight(kind, n)


@dataclass(frozen=True)
class DiffusionTask:
    """Noise prediction (Ho et al. 2020, DDPM, eq. 14) with a cosine schedule (Nichol &
    Dhariwal 2021, eq. 17). A sample is {"x": latent [F, S, C], "text": [Tt, text_dim]}.
    Noise and timestep come from `seeded_generator(step, sequence id)`."""

    seed: int = 0

    def noise(self, sample, step: int, sequence_id: int):
        g = seeded_generator(step, sequence_id, seed=self.seed, salt="diffusion")
        x = sample["x"].cpu()
        t = torch.rand((), generator=g, dtype=x.dtype)
        eps = torch.randn(x.shape, generator=g, dtype=x.dtype)
        abar = torch.cos(t * torch.pi / 2) ** 2
        return t, eps, abar.sqrt() * x + (1 - abar).sqrt() * eps

    def run(self, model, samples, state: SPState, *, step: int, kind: str, scale: float):
        # One forward+backward for the whole micro-batch: its videos are one packed stream
        # (runtime/video.py), so each attention and each DSP switch is one call for all.
        sp, dev = state.sp, next(model.parameters()).device
        # Noise is drawn on the CPU from the seeded generator, then moved: identical on every
        # member and on any device.
        drawn = [self.noise(sample, step, sid) for sid, sample in samples]
        texts = [sample["text"] for _, sample in samples]
        layout = VideoLayout(
            tuple(tuple(xt.shape[:2]) for _, _, xt in drawn),
            tuple(txt.shape[0] for txt in texts),
            sp.degree, sp.rank, device=dev,
        )  # fmt: skip
        xs, targets, weights = [], [], []
        for _, eps, xt in drawn:
            num_f, num_s, c = xt.shape
            f_pad, lo, hi = shard_bounds(num_f, sp.degree, sp.rank)
            xs.append(pad_dim(xt, 0, f_pad)[lo:hi].reshape(-1, c))
            targets.append(pad_dim(eps, 0, f_pad)[lo:hi].reshape(-1, c))
            weight = token_weight(kind, num_f * num_s)
            weights.append(torch.full(((hi - lo) * num_s,), weight, dtype=torch.float64))
        ts = torch.stack([t for t, _, _ in drawn]).to(dev)
        out = model(torch.cat(xs).to(dev), ts, torch.cat(texts).to(dev), layout)
        per_token = ((out - torch.cat(targets).to(dev)) ** 2).mean(-1)
        # padded frames weigh 0; the weighted sum keeps the graph connected on a member that
        # holds only padding, so every member runs the same backward collectives
        w = torch.cat(weights).to(device=dev, dtype=out.dtype) * layout.real.to(out.dtype)
        loss = (per_token * w).sum() * scale
        loss.backward()
        return loss.detach().to(torch.float64)

    def reference_loss(self, model, sequence_id: int, sample, *, step: int, kind: str):
        """Unscaled loss of one whole video on one device (no sharding, no padding)."""
        dev = next(model.parameters()).device
        t, eps, xt = (x.to(dev) for x in self.noise(sample, step, sequence_id))
        out = model(xt, t, sample["text"].to(dev))
        per_token = ((out - eps) ** 2).mean(-1)
        return per_token.sum() * token_weight(kind, per_token.numel())


@dataclass(frozen=True)
class JointDiffusionTask(DiffusionTask):
    """DiffusionTask for the 3-D full-attention DiTs (runtime/models.py Full3DDiT: TinyMMDiT,
    TinyWanDiT). A sample is {"x": latent [F, H, W, C] (an image: F = 1), "text":
    [Tt, text_dim]}; noise and timestep as DiffusionTask, from (step, sequence id). A
    micro-batch of images and videos of any shapes is one packed stream, each member
    holding a contiguous shard of it (runtime/joint.py)."""

    def run(self, model, samples, state: SPState, *, step: int, kind: str, scale: float):
        sp, dev = state.sp, next(model.parameters()).device
        drawn = [self.noise(sample, step, sid) for sid, sample in samples]
        texts = [sample["text"] for _, sample in samples]
        layout = JointLayout(
            tuple(tuple(xt.shape[:3]) for _, _, xt in drawn),
            tuple(txt.shape[0] for txt in texts),
            joint=model.joint, degree=sp.degree, rank=sp.rank, device=dev,
        )  # fmt: skip
        lv, c = layout.video_shard, drawn[0][2].shape[-1]
        x = layout.shard(torch.cat([xt.reshape(-1, c) for _, _, xt in drawn]), lv)
        eps = layout.shard(torch.cat([e.reshape(-1, c) for _, e, _ in drawn]), lv)
        weights = [
            torch.full((n,), token_weight(kind, n), dtype=torch.float64)
            for n in layout.video_tokens
        ]
        w = layout.shard(torch.cat(weights), lv).to(device=dev)
        ts = torch.stack([t for t, _, _ in drawn]).to(dev)
        out = model(x.to(dev), ts, torch.cat(texts).to(dev), layout)
        per_token = ((out - eps.to(dev)) ** 2).mean(-1)
        # padding weighs 0 and stays in the graph: every member runs the same collectives
        loss = (per_token * w.to(out.dtype)).sum() * scale
        loss.backward()
        return loss.detach().to(torch.float64)
