"""Train a small video DiT (spatial + temporal blocks) under DCP plans on videos of varied
frame counts and resolutions.

    torchrun --nproc_per_node 2 examples/train_video.py --steps 10

Rank 0 plans each global batch (greedy by default) and broadcasts the plan; every group runs
its videos with DSP (frames sharded for spatial blocks, patches for temporal ones). Noise and
timesteps come from generators seeded by (step, video id), so they agree inside each group.
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
    seeded_generator,
)
from dcp_opt.runtime.launch import (
    broadcast_plan,
    cpu_cost_model,
    describe_plan,
    init_distributed,
)
from dcp_opt.runtime.models import model_spec
from dcp_opt.solvers import run_planner

from dcp_opt import Batch

TEXT_TOKENS = 8


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--planner", default="greedy")
    ap.add_argument("--batch-size", type=int, default=6, help="videos per global batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def batch_for(step: int, args) -> Batch:
    rng = np.random.default_rng([args.seed, step])
    frames = rng.integers(1, 17, args.batch_size)
    sides = rng.choice([2, 4, 6, 8], args.batch_size)
    return Batch.from_shapes([(int(f), int(s), int(s)) for f, s in zip(frames, sides, strict=True)])


def sample(step: int, seq_id: int, shape, cfg: DiTConfig, seed: int) -> dict:
    """A smooth moving pattern as the 'latent' and a random caption embedding."""
    g = seeded_generator(step, seq_id, seed=seed, salt="data")
    f, h, w = shape
    phase = torch.rand(cfg.in_channels, generator=g) * 6.28
    t = torch.arange(f)[:, None, None]
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    wave = torch.sin(0.5 * (x + y)[None, :, :, None] + 0.3 * t[..., None] + phase)
    text = torch.randn(TEXT_TOKENS, cfg.text_dim, generator=g)
    return {"x": wave.reshape(f, h * w, cfg.in_channels).float(), "text": text}


def main():
    args = parse_args()
    rank, world = init_distributed()
    torch.manual_seed(args.seed)
    cfg = DiTConfig(in_channels=4, hidden=32, num_heads=4, num_layers=2, ffn_hidden=64)
    state = SPState()
    model = parallelize(TinyDiT(cfg), state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    pool = GroupPool.create()
    # Memory for half the biggest video per rank: big ones need SP (crude CPU costs).
    cost = cpu_cost_model(
        model_spec(cfg, text_tokens=TEXT_TOKENS), world, fit_tokens=0.5 * 16 * 8 * 8
    )
    task = DiffusionTask(seed=args.seed)
    for step in range(args.steps):
        batch = batch_for(step, args)
        plan = broadcast_plan(run_planner(args.planner, batch, cost).plan if rank == 0 else None)
        shapes = batch.by_id

        def data(sid, step=step, shapes=shapes):
            return sample(step, sid, shapes[sid].shape, cfg, args.seed)

        opt.zero_grad(set_to_none=True)
        report = execute_step(plan, task, model, data, pool=pool, state=state, step=step)
        opt.step()
        if rank == 0:
            print(
                f"step {step:3d} | {describe_plan(plan)} | tokens {batch.num_tokens} | "
                f"predicted {plan.predicted_step_time_s:.3f}s measured "
                f"{report.step_time_s:.3f}s | loss {report.loss:.4f}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
