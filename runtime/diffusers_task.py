"""The training objective for a diffusers transformer under `parallelize_diffusers`
(runtime/diffusers.py): the model's inputs per family, a sample's token count, and
`DiffusersTask`, the executor's task."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .parallelize import SPState
from .tasks import DiffusionTask, token_weight


def predict(model: nn.Module, sample: dict, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The model's prediction for one noised latent `xt` at timestep t in [0, 1), same shape.
    Wan / HunyuanVideo: xt [C, F, H, W]; Flux: xt [S, C] packed tokens with sample["img_ids"]
    [S, 3]. sample["text"] [Tt, D] the caption's embeddings; sample["pooled"] [P] (Flux,
    HunyuanVideo)."""
    name, text = type(model).__name__, sample["text"][None]
    kw = {"hidden_states": xt[None], "encoder_hidden_states": text, "return_dict": False}
    step = (t * 1000.0).reshape(1)
    guidance = {"guidance": torch.full_like(step, 3500.0)}
    if not model.config.get("guidance_embeds", False):
        guidance = {}
    if name == "WanTransformer3DModel":
        kw.update(timestep=step)
    elif name == "HunyuanVideoTransformer3DModel":
        mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
        kw.update(timestep=step, encoder_attention_mask=mask, **guidance)
        kw.update(pooled_projections=sample["pooled"][None])
    else:
        txt_ids = text.new_zeros(text.shape[1], 3)
        kw.update(timestep=t.reshape(1), img_ids=sample["img_ids"], txt_ids=txt_ids, **guidance)
        kw.update(pooled_projections=sample["pooled"][None])
    return model(**kw)[0][0]


def num_tokens(model: nn.Module, x: torch.Tensor) -> int:
    """Latent tokens of a sample after patchifying: what a dcp_opt Batch counts."""
    cfg = model.config
    if type(model).__name__ == "FluxTransformer2DModel":
        return x.shape[0]
    if type(model).__name__ == "WanTransformer3DModel":
        pt, ph, pw = cfg.patch_size
    else:
        pt, ph, pw = cfg.patch_size_t, cfg.patch_size, cfg.patch_size
    return (x.shape[1] // pt) * (x.shape[2] // ph) * (x.shape[3] // pw)


@dataclass(frozen=True)
class DiffusersTask:
    """Noise prediction as runtime/tasks.py DiffusionTask (noise and timestep from
    `seeded_generator(step, sequence id)`), for a diffusers model of FAMILIES: a sample's loss
    is its mean squared error times its token weight times its tokens (per-token mean squared
    error, summed). Each sample of a micro-batch is one forward and backward, its tokens
    sharded over the group; group member 0 reports the loss, every member back-propagates it
    (the gathered output is the same on every member)."""

    seed: int = 0

    def noise(self, sample, step: int, sequence_id: int):
        return DiffusionTask(self.seed).noise(sample, step, sequence_id)

    def sample_loss(self, model, sequence_id, sample, *, step: int, kind: str):
        dev = next(model.parameters()).device
        sample = {k: v.to(dev) for k, v in sample.items()}
        t, eps, xt = (x.to(dev) for x in self.noise(sample, step, sequence_id))
        n = num_tokens(model, sample["x"])
        err = ((predict(model, sample, xt, t) - eps) ** 2).mean()
        return err * n * token_weight(kind, n)

    def run(self, model, samples, state: SPState, *, step: int, kind: str, scale: float):
        total = torch.zeros((), dtype=torch.float64)
        for sid, sample in samples:
            loss = self.sample_loss(model, sid, sample, step=step, kind=kind) * scale
            loss.backward()
            if state.sp.rank == 0:
                total += loss.detach().cpu().to(torch.float64)
        return total

    def reference_loss(self, model, sequence_id: int, sample, *, step: int, kind: str):
        """Unscaled loss of one whole sample on one device (the unmodified model)."""
        return self.sample_loss(model, sequence_id, sample, step=step, kind=kind)
