"""Train a small decoder LM under DCP plans on variable-length batches.

    torchrun --nproc_per_node 2 examples/train_lm.py --steps 20
    torchrun --nproc_per_node 2 examples/train_lm.py --steps 20 --model hf-llama
    torchrun --nproc_per_node 2 examples/train_lm.py --steps 20 --sharding zero2 --dtype bf16
    torchrun --nproc_per_node 2 examples/train_lm.py --steps 20 --checkpoint-dir ckpt \
        --checkpoint-every 5         # run it again: it resumes from ckpt by itself

`--model hf-llama` trains an unmodified transformers `LlamaForCausalLM` (small config, random
weights, nothing downloaded) through dcp_opt.runtime.hf instead of the runtime's TinyLM.

The data path (dcp_opt.runtime.data.DcpLoader) cuts the dataset into global batches, plans
each one in a background thread (cpsat when built, else greedy) on rank 0, broadcasts the
plan, and hands each rank only the samples of its own groups. Every rank runs its part;
gradients are summed once over the world, then a normal optimizer step. The data are
arithmetic progressions (stride 1-3) mod the vocabulary: the loss falls fast.
"""

from __future__ import annotations

import argparse

import dcp_opt.runtime.checkpoint as checkpoint
import numpy as np
import torch
import torch.distributed as dist
from dcp_opt.runtime import GroupPool, LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.data import DcpLoader
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.sharding import shard

from dcp_opt.cost import SHARDING_MODES, runtime_reduce_bytes


class ProgressionDataset(torch.utils.data.Dataset):
    """Sample i: L_i + 1 tokens start, start + stride, ... (mod vocab); lengths long-tailed.
    `lengths` is known without building a sample (what the planner needs)."""

    def __init__(self, num_samples: int, max_len: int, vocab: int, seed: int):
        rng = np.random.default_rng(seed)
        raw = rng.lognormal(4.0, 0.8, num_samples).astype(int) + 2
        self.lengths = [int(n) for n in np.minimum(raw, max_len)]
        self.vocab, self.seed = vocab, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(self.vocab, (), generator=g))
        stride = 1 + int(torch.randint(3, (), generator=g))  # read it from the context
        return (start + stride * torch.arange(self.lengths[i] + 1)) % self.vocab


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--planner", default="auto", help="auto = cpsat if built, else greedy")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per global batch")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--num-samples", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("tiny", "hf-llama"), default="tiny")
    ap.add_argument("--checkpoint-dir", help="save here; resume from here when it holds one")
    ap.add_argument(
        "--sharding", choices=SHARDING_MODES, default=None,
        help="run under dcp_opt.runtime.sharding (FSDP2; the optimizer step inside the step); "
        "default: a plain replica and a separate AdamW step",
    )  # fmt: skip
    ap.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32",
        help="bf16: bf16 compute, fp32 gradients and master weights (needs --sharding)",
    )  # fmt: skip
    ap.add_argument("--checkpoint-every", type=int, default=0, help="steps between saves")
    return ap.parse_args()


def build_model(args, cfg: LMConfig, state: SPState, world: int):
    """(parallelized model, task, cost model) for `--model`; the cost model sizes the
    activations in the compute dtype (`--dtype bf16`: 2 bytes, not the fp32 masters' 4)."""
    # Memory for half the longest sequence per rank: long ones need SP (crude CPU costs).
    fit = 0.5 * args.max_len
    if args.model == "tiny":
        model = parallelize(TinyLM(cfg), state)  # Ulysses attention + per-layer recompute
        spec = model_spec(cfg, dtype=args.dtype)
        return model, LMTask(), cpu_cost_model(spec, world, fit_tokens=fit)
    from dcp_opt.runtime.hf import HFCausalLMTask, llama_spec, parallelize_hf, tiny_llama

    model = tiny_llama(
        num_layers=cfg.num_layers, hidden=cfg.hidden, num_heads=cfg.num_heads,
        vocab_size=cfg.vocab_size, intermediate=cfg.ffn_hidden, dtype=torch.float32,
        seed=args.seed,
    )  # fmt: skip
    model = parallelize_hf(model, state)  # registers and selects "dcp_ulysses" attention
    spec = llama_spec(model, dtype=args.dtype)
    return model, HFCausalLMTask(), cpu_cost_model(spec, world, fit_tokens=fit)


def main():
    args = parse_args()
    if args.dtype == "bf16" and not args.sharding:
        raise SystemExit(
            "--dtype: bf16 needs --sharding; allowed: --sharding none|zero1|zero2|zero3"
        )
    rank, world = init_distributed()
    torch.manual_seed(args.seed)  # same initial weights on every rank
    cfg = LMConfig(vocab_size=64, hidden=64, num_heads=4, num_layers=2, ffn_hidden=128)
    dataset = ProgressionDataset(args.num_samples, args.max_len, cfg.vocab_size, args.seed)

    # ---- the lines DCP adds to a training loop ----
    pool = GroupPool.create()  # every process group a plan may use, once
    state = SPState()
    model, task, cost = build_model(args, cfg, state, world)
    sharding = None
    if args.sharding:  # plan for the mode that runs; shard, then build AdamW over the shards
        # charge what runs: the mode's memory, and its step collectives in the step time
        cost = cost.with_(optimizer_sharding=args.sharding,
                          grad_reduce_bytes_per_param=runtime_reduce_bytes(args.sharding))  # fmt: skip
        dtype = "bf16" if args.dtype == "bf16" else None
        sharding = shard(model, lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                         mode=args.sharding, pool=pool, task=task, dtype=dtype)  # fmt: skip
        opt = sharding.optimizer
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DcpLoader(dataset, dataset.lengths, cost, batch_size=args.batch_size,
                       planner=args.planner, seed=args.seed)  # fmt: skip
    step = 0
    if args.checkpoint_dir and checkpoint.latest(args.checkpoint_dir) is not None:
        step = checkpoint.load(args.checkpoint_dir, model=model, optimizer=opt, loader=loader)
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {step}", flush=True)
    while step < args.steps:
        for b in loader:
            if sharding is None:
                opt.zero_grad(set_to_none=True)
            report = execute_step(b.plan, task, model, b.samples, pool=pool, state=state,
                                  step=step, sharding=sharding)  # fmt: skip
            if sharding is None:  # under sharding, execute_step did the optimizer step
                opt.step()
            if rank == 0:
                print(
                    f"step {step:3d} | {b.describe()} | predicted "
                    f"{b.plan.predicted_step_time_s:.3f}s measured {report.step_time_s:.3f}s "
                    f"| loss {report.loss:.4f}",
                    flush=True,
                )
            step += 1
            if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpoint.save(args.checkpoint_dir, model=model, optimizer=opt, loader=loader,
                                step=step)  # fmt: skip
            if step == args.steps:
                break
        loader.set_epoch(loader.epoch + 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
