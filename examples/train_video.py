"""Train a small video DiT (spatial + temporal blocks) under DCP plans on videos of varied
frame counts and resolutions.

    torchrun --nproc_per_node 2 examples/train_video.py --steps 10

The data path (dcp_opt.runtime.data.DcpLoader) plans each global batch in a background
thread on rank 0 and broadcasts the plan; each rank loads only the videos of its groups.
Every group runs its videos with DSP (frames sharded for spatial blocks, patches for temporal
ones). Noise and timesteps come from generators seeded by (step, video id), so they agree
inside each group. The loss normaliser counts videos (each video's mean loss weighs 1).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from dcp_opt.runtime import (
    DiffusionTask,
    DiTConfig,
    GroupPool,
    SPState,
    TinyDiT,
    execute_step,
    parallelize,
)
from dcp_opt.runtime.data import DcpLoader
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec

TEXT_TOKENS = 8


class WaveVideos(torch.utils.data.Dataset):
    """Video i: a smooth moving pattern of shape (frames, side x side patches, channels) as
    the 'latent', and a random caption embedding. `shapes` are known without loading."""

    def __init__(self, num_videos: int, cfg: DiTConfig, seed: int):
        rng = np.random.default_rng(seed)
        frames = rng.integers(1, 17, num_videos)
        sides = rng.choice([2, 4, 6, 8], num_videos)
        self.shapes = [(int(f), int(s), int(s)) for f, s in zip(frames, sides, strict=True)]
        self.cfg, self.seed = cfg, seed

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        f, h, w = self.shapes[i]
        c = self.cfg.in_channels
        phase = torch.rand(c, generator=g) * 6.28
        t = torch.arange(f)[:, None, None]
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        wave = torch.sin(0.5 * (x + y)[None, :, :, None] + 0.3 * t[..., None] + phase)
        text = torch.randn(TEXT_TOKENS, self.cfg.text_dim, generator=g)
        return {"x": wave.reshape(f, h * w, c).float(), "text": text}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--planner", default="auto", help="auto = cpsat if built, else greedy")
    ap.add_argument("--batch-size", type=int, default=6, help="videos per global batch")
    ap.add_argument("--num-videos", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = parse_args()
    rank, world = init_distributed()
    torch.manual_seed(args.seed)
    cfg = DiTConfig(in_channels=4, hidden=32, num_heads=4, num_layers=2, ffn_hidden=64)
    model = TinyDiT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = WaveVideos(args.num_videos, cfg, args.seed)
    # Memory for half the biggest video per rank: big ones need SP (crude CPU costs).
    spec = model_spec(cfg, text_tokens=TEXT_TOKENS)
    cost = cpu_cost_model(spec, world, fit_tokens=0.5 * 16 * 8 * 8)
    task = DiffusionTask(seed=args.seed)

    pool = GroupPool.create()
    state = SPState()
    model = parallelize(model, state)
    loader = DcpLoader(dataset, dataset.shapes, cost, batch_size=args.batch_size,
                       planner=args.planner, seed=args.seed)  # fmt: skip
    step = 0
    while step < args.steps:
        for b in loader:
            opt.zero_grad(set_to_none=True)
            report = execute_step(b.plan, task, model, b.samples, pool=pool, state=state,
                                  step=step)  # fmt: skip
            opt.step()
            if rank == 0:
                print(
                    f"step {step:3d} | {b.describe()} | predicted "
                    f"{b.plan.predicted_step_time_s:.3f}s measured {report.step_time_s:.3f}s "
                    f"| loss {report.loss:.4f}",
                    flush=True,
                )
            step += 1
            if step == args.steps:
                break
        loader.set_epoch(loader.epoch + 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
