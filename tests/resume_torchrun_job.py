"""One epoch of a job that checkpoints and resumes by itself, for tests/test_resume_torchrun.py
(run under torchrun). Samples come through a torch DataLoader with 2 workers over
DcpBatchSampler; every rank appends to a ledger what it trained at each step; `--kill
TAG:ATTEMPT:STEP:RANK` kills that rank (SIGKILL) in the middle of that step.

    python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1 \\
        tests/resume_torchrun_job.py --dir D --tag a --kill a:0:3:1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from dcp_opt.runtime import GroupPool, LMConfig, LMTask, SPState, TinyLM, checkpoint, execute_step
from dcp_opt.runtime import parallelize as parallelize_model
from dcp_opt.runtime.data import DcpBatchSampler, collate_samples
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec

CFG = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)
LENGTHS = [5, 40, 3, 17, 9, 2, 33, 12, 7, 21, 4, 28, 6, 11, 8, 19, 25, 3, 14, 10, 30, 6, 9, 15]
BATCH = 3  # 24 samples: 8 steps


class Progressions(torch.utils.data.Dataset):
    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        return (i + (1 + i % 3) * torch.arange(LENGTHS[i] + 1)) % CFG.vocab_size


class KillingTask(LMTask):
    """LMTask that SIGKILLs this process at its first micro-batch when `armed`."""

    armed = False

    def run(self, model, samples, state, **kw):
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().run(model, samples, state, **kw)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="checkpoints, ledger and final parameters")
    ap.add_argument("--tag", required=True, help="a name for this torchrun invocation")
    ap.add_argument("--kill", action="append", default=[], help="TAG:ATTEMPT:STEP:RANK")
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    return ap.parse_args()


def record(path: Path, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main():
    args = parse_args()
    rank, world = init_distributed(timeout_s=60)  # the attempt's own store (runtime/elastic.py)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = {
        tuple(int(x) for x in k.split(":")[1:]) for k in args.kill if k.split(":")[0] == args.tag
    }
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    ledger = root / f"ledger-rank{rank}.jsonl"
    torch.manual_seed(0)
    state = SPState()
    model = parallelize_model(TinyLM(CFG).double(), state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    pool = GroupPool.create()
    cost = cpu_cost_model(model_spec(CFG), world, fit_tokens=20)
    sampler = DcpBatchSampler(LENGTHS, cost, batch_size=BATCH, planner="greedy", seed=4)
    loader = torch.utils.data.DataLoader(
        Progressions(), batch_sampler=sampler, collate_fn=collate_samples, num_workers=2,
        pin_memory=True, persistent_workers=True,
    )  # fmt: skip
    ckdir = root / "ckpt"
    step = 0
    if checkpoint.latest(ckdir) is not None:
        step = checkpoint.load(ckdir, model=model, optimizer=opt, loader=sampler)
    record(ledger, {"run": args.tag, "attempt": attempt, "resumed_at": step})
    task = KillingTask()
    for b in sampler.planned(loader):
        task.armed = (attempt, step, rank) in kills
        opt.zero_grad(set_to_none=True)
        execute_step(b.plan, task, model, b.samples, pool=pool, state=state, step=step)
        if task.armed:  # this rank had no micro-batch: die before the update instead
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        record(
            ledger, {"run": args.tag, "attempt": attempt, "step": step, "ids": sorted(b.samples)}
        )
        step += 1
        if step % args.every == 0:
            checkpoint.save(ckdir, model=model, optimizer=opt, loader=sampler, step=step)
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], root / f"params-{args.tag}.pt")
        print(f"run {args.tag} attempt {attempt}: epoch done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
