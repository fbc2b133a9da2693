"""Train a small decoder LM with pipeline parallelism under dcp_opt plans.

    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 2 --steps 10
    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 2 --tp 2 --steps 10
    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 4 --pp-form columns

The world is stages x units x TP: `--pp` stages, `--tp` GPUs a unit (Megatron-style tensor
parallelism with sequence parallelism inside each stage), the rest units, which form the
plan's sequence-parallel groups. Rank 0 plans each global batch with `pp_greedy` (micro-batch
composition, count, 1F1B order and per-stage recompute; columns or micro-steps whose groups
change, the faster) and broadcasts the plan; the first plan's layer split is kept for the
run (the stages are built once), every later batch is planned with it. Every rank runs its
stage's part (dcp_opt.runtime.pipeline), gradients are summed per stage, then AdamW on the
stage's parameters. The data are arithmetic progressions mod the vocabulary (stride 1-3),
lengths long-tailed: the loss falls fast.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from dcp_opt.runtime import GroupPool, LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.groups import PipelineTPGroups
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.pipeline import build_stage
from dcp_opt.runtime.pipeline.checks import stage_of
from dcp_opt.runtime.tensor_parallel import apply_tensor_parallel
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, Plan


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs a unit")
    ap.add_argument("--pp-form", choices=("best", "columns"), default="best")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=12, help="sequences per global batch")
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def sample(rng: np.random.Generator, n: int, max_len: int, vocab: int) -> tuple[Batch, dict]:
    """A global batch: long-tailed lengths, each sequence an arithmetic progression."""
    lengths = np.minimum(rng.lognormal(3.5, 0.9, n).astype(int) + 4, max_len).tolist()
    data = {}
    for i, length in enumerate(lengths):
        start, stride = int(rng.integers(vocab)), int(rng.integers(1, 4))
        data[i] = (start + stride * torch.arange(length + 1)) % vocab
    return Batch.from_lengths(lengths), data


def plan_on_rank0(rank: int, batch: Batch, cost, args, split) -> Plan:
    """Rank 0 plans, every rank gets the same plan (the runtime compares their hashes)."""
    box = [None]
    if rank == 0:
        r = run_planner("pp_greedy", batch, cost, pp=args.pp, tensor_parallel=args.tp,
                        stage_layers=split, micro_steps=args.pp_form == "best")  # fmt: skip
        box[0] = r.plan.to_json()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0])


def main():
    args = parse_args()
    rank, world = init_distributed()
    if world % (args.pp * args.tp):
        raise SystemExit(f"--pp {args.pp} x --tp {args.tp} must divide the world ({world})")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = LMConfig(vocab_size=64, hidden=64, num_heads=4, num_layers=4, ffn_hidden=128)

    # ---- the lines DCP adds to a training loop ----
    pool = GroupPool.create()  # every process group a plan may use, once
    tp = PipelineTPGroups.create(args.tp, args.pp) if args.tp > 1 else None
    state = SPState()
    model = parallelize(TinyLM(cfg), state)  # Ulysses attention + per-layer recompute
    if tp is not None:
        apply_tensor_parallel(model, tp)  # each unit's GPUs split every layer
    cost = cpu_cost_model(model_spec(cfg), world, fit_tokens=0.5 * args.max_len)
    rng = np.random.default_rng(args.seed)
    stage = optimizer = split = None
    for step in range(args.steps):
        batch, data = sample(rng, args.batch_size, args.max_len, cfg.vocab_size)
        plan = plan_on_rank0(rank, batch, cost, args, split)
        if stage is None:  # the first plan's split, for the whole run
            split = plan.pipeline.stage_layers
            stage = build_stage(model, split, stage_of(plan, rank))
            optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
        optimizer.zero_grad(set_to_none=True)
        report = execute_step(plan, LMTask(), stage, data, pool=pool, state=state, step=step,
                              batch=batch, tp=tp)  # fmt: skip
        optimizer.step()
        if rank == 0:
            form = "micro-steps" if plan.pipeline.micro_steps else "columns"
            print(f"step {step:3d} | {len(batch)} sequences, {plan.num_micro_batches} "
                  f"micro-batches ({form}), stages {list(split)} | predicted "
                  f"{plan.predicted_step_time_s:.3f}s measured {report.step_time_s:.3f}s | "
                  f"loss {report.loss:.4f}", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
