"""Train a small decoder LM under DCP plans on variable-length batches.

    torchrun --nproc_per_node 2 examples/train_lm.py --steps 20

Every step: rank 0 plans the global batch (greedy by default) and broadcasts the plan; every
rank runs its part; gradients are summed once over the world, then a normal optimizer step.
The data are arithmetic progressions (stride 1-3) mod the vocabulary: the loss falls fast.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from dcp_opt.runtime import (
    GroupPool,
    LMConfig,
    LMTask,
    SPState,
    TinyLM,
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


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--planner", default="greedy")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per global batch")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def batch_for(step: int, args) -> Batch:
    # Every rank derives the same shapes; the contents are generated per sequence on demand.
    rng = np.random.default_rng([args.seed, step])
    lengths = np.minimum(rng.lognormal(4.0, 0.8, args.batch_size).astype(int) + 2, args.max_len)
    return Batch.from_lengths([int(n) for n in lengths])


def sample(step: int, seq_id: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = seeded_generator(step, seq_id, seed=seed, salt="data")
    start = int(torch.randint(vocab, (), generator=g))
    stride = 1 + int(torch.randint(3, (), generator=g))  # 1, 2 or 3: read it from the context
    return (start + stride * torch.arange(length + 1)) % vocab


def main():
    args = parse_args()
    rank, world = init_distributed()
    torch.manual_seed(args.seed)  # same initial weights on every rank
    cfg = LMConfig(vocab_size=64, hidden=64, num_heads=4, num_layers=2, ffn_hidden=128)
    state = SPState()
    model = parallelize(TinyLM(cfg), state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    pool = GroupPool.create()
    # Memory for half the longest sequence per rank: long ones need SP (crude CPU costs).
    cost = cpu_cost_model(model_spec(cfg), world, fit_tokens=0.5 * args.max_len)
    for step in range(args.steps):
        batch = batch_for(step, args)
        plan = run_planner(args.planner, batch, cost).plan if rank == 0 else None
        plan = broadcast_plan(plan)
        shapes = batch.by_id

        def data(sid, step=step, shapes=shapes):
            return sample(step, sid, shapes[sid].shape[0], cfg.vocab_size, args.seed)

        opt.zero_grad(set_to_none=True)
        report = execute_step(plan, LMTask(), model, data, pool=pool, state=state, step=step)
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
