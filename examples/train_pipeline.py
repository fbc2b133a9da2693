"""Train a small decoder LM with pipeline parallelism under dcp_opt plans.

    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 2 --steps 10
    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 2 --tp 2 --steps 10
    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 4 --pp-form columns
    torchrun --nproc_per_node 4 examples/train_pipeline.py --pp 2 --sharding zero1 \
        --checkpoint-dir ckpt --checkpoint-every 5   # stop it, run it again: it resumes

The world is stages x units x TP: `--pp` stages, `--tp` GPUs a unit (Megatron-style tensor
parallelism with sequence parallelism inside each stage), the rest units, which form the
plan's sequence-parallel groups. Rank 0 plans each global batch with `pp_greedy` (micro-batch
composition, count, 1F1B order and per-stage recompute; columns or micro-steps whose groups
change, the faster) and broadcasts the plan; the first plan's layer split is kept for the
run (the stages are built once), every later batch is planned with it. Every rank runs its
stage's part (dcp_opt.runtime.pipeline), gradients are summed per stage, then AdamW on the
stage's parameters; with `--sharding zero1|zero2|zero3` each stage is sharded over its own
ranks with FSDP2 (`shard(stage, ...)`: gather once, reduce-scatter once, AdamW on the
shards). With `--checkpoint-dir` each rank saves its stage under the whole model's names
every `--checkpoint-every` steps, with the layer split in the checkpoint's `extra`, and a
run started again resumes from the newest checkpoint (docs/integration.md, "Checkpoints of a
pipeline run"). Step k's batch is a function of (seed, k), so a resumed run trains the same
batches. The data are arithmetic progressions mod the vocabulary (stride 1-3), lengths
long-tailed: the loss falls fast.
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
    checkpoint,
    execute_step,
    parallelize,
)
from dcp_opt.runtime.groups import PipelineTPGroups
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.pipeline import build_stage
from dcp_opt.runtime.pipeline.checks import stage_of
from dcp_opt.runtime.sharding import shard
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
    ap.add_argument("--sharding", choices=("none", "zero1", "zero2", "zero3"), default="none",
                    help="ZeRO over each stage's ranks (FSDP2; with --tp, 2-D)")  # fmt: skip
    ap.add_argument("--checkpoint-dir", default=None, help="save here; resume from here")
    ap.add_argument("--checkpoint-every", type=int, default=5)
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


def make_optimizer(stage, args, pool, tp):
    """(stage, AdamW over its parameters, its Sharding or None). Sharded: FSDP2 over the
    stage's ranks (with --tp, its units of each TP rank), the optimizer over the shards,
    stepped by execute_step."""
    make = lambda ps: torch.optim.AdamW(ps, lr=args.lr)  # noqa: E731
    if args.sharding == "none":
        return stage, make(stage.parameters()), None
    sharding = shard(stage, make, mode=args.sharding, pool=pool, task=LMTask(), tp=tp)
    return stage, sharding.optimizer, sharding


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
    if args.sharding != "none":  # the plan records the mode; the run refuses another
        cost = cost.with_(optimizer_sharding=args.sharding)
    saved = checkpoint.latest(args.checkpoint_dir) if args.checkpoint_dir else None
    split = None if saved is None else tuple(saved.extra["stage_layers"])  # the run's split
    stage = optimizer = sharding = None
    step = 0
    while step < args.steps:
        rng = np.random.default_rng((args.seed, step))  # step k's batch: (seed, k) alone
        batch, data = sample(rng, args.batch_size, args.max_len, cfg.vocab_size)
        plan = plan_on_rank0(rank, batch, cost, args, split)
        if stage is None:  # the first plan's split, for the whole run
            split = plan.pipeline.stage_layers
            stage = build_stage(model, split, stage_of(plan, rank))
            stage, optimizer, sharding = make_optimizer(stage, args, pool, tp)
            if args.checkpoint_dir:  # 0 on the first run
                done = checkpoint.resume(args.checkpoint_dir, model=stage, optimizer=optimizer)
                if done > step:
                    step = done
                    continue  # plan the resumed step's batch
        if sharding is None:
            optimizer.zero_grad(set_to_none=True)
        report = execute_step(plan, LMTask(), stage, data, pool=pool, state=state, step=step,
                              batch=batch, tp=tp, sharding=sharding)  # fmt: skip
        if sharding is None:  # a sharding steps its optimizer itself
            optimizer.step()
        if rank == 0:
            form = "micro-steps" if plan.pipeline.micro_steps else "columns"
            print(f"step {step:3d} | {len(batch)} sequences, {plan.num_micro_batches} "
                  f"micro-batches ({form}), stages {list(split)} | predicted "
                  f"{plan.predicted_step_time_s:.3f}s measured {report.step_time_s:.3f}s | "
                  f"loss {report.loss:.4f}", flush=True)  # fmt: skip
        step += 1
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, model=stage, optimizer=optimizer, step=step,
                            extra={"stage_layers": list(split)})  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
