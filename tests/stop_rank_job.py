"""A job whose rank 1 stops itself (SIGSTOP: alive, silent, holding its sockets open), for
tests/test_runtime_hang.py; run under torchrun. The loop is the documented one
(docs/integration.md): `init_distributed(timeout_s=T)`, `GroupPool.create()`, DcpLoader,
execute_step, with no timeout passed anywhere else.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/stop_rank_job.py \\
        --dir D --timeout 10 --where sp

`--where sp`: rank 1 stops inside its first micro-batch of a degree-2 group, so rank 0 waits
in that SP group's all-to-all (a GroupPool group). `--where plan`: rank 1 stops after step 0,
so rank 0 waits in the loader's plan broadcast (the sampler's own group). Rank 1 writes the
time it stopped to D/stopped-at.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from dcp_opt.runtime import GroupPool, LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.data import DcpLoader
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec

CFG = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)
# fit_tokens 20: the 40-token sample needs the degree-2 group in every plan.
LENGTHS = [40, 5, 3, 17, 9, 2, 33, 12, 7, 21, 4, 28]


def stop_here(root: Path) -> None:
    (root / "stopped-at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


class StoppingTask(LMTask):
    """LMTask that stops this process at its first micro-batch in a group of degree 2."""

    def __init__(self, root: Path | None):
        super().__init__()
        self.root = root

    def run(self, model, samples, state, **kw):
        if self.root is not None and state.sp.degree == 2:
            stop_here(self.root)
        return super().run(model, samples, state, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--timeout", type=float, required=True, help="init_distributed's timeout_s")
    ap.add_argument("--where", choices=("sp", "plan"), required=True)
    args = ap.parse_args()
    root = Path(args.dir)
    rank, world = init_distributed(timeout_s=args.timeout)
    torch.manual_seed(0)
    pool = GroupPool.create()
    state = SPState()
    model = parallelize(TinyLM(CFG).double(), state)
    cost = cpu_cost_model(model_spec(CFG), world, fit_tokens=20)
    dataset = [torch.arange(n + 1) % CFG.vocab_size for n in LENGTHS]
    loader = DcpLoader(dataset, LENGTHS, cost, batch_size=4, planner="greedy", shuffle=False)
    stopper = rank == 1 and args.where == "sp"
    task = StoppingTask(root if stopper else None)
    for step, b in enumerate(loader):
        execute_step(b.plan, task, model, b.samples, pool=pool, state=state, step=step)
        print(f"rank {rank} step {step} done", flush=True)
        if rank == 1 and args.where == "plan":
            stop_here(root)  # rank 0 asks for the next plan while this rank is stopped
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
