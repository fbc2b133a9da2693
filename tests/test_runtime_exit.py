"""A process that ends while it still holds a loader iterator exits cleanly (issue 28 item 5):
`it = iter(loader); next(it)` and the end of the script used to leave the plan-ahead thread
inside CP-SAT while the interpreter finalised, and OR-Tools' threads aborted the process
("terminate called without an active exception", SIGABRT; torchrun reported rc 1 after the
work was done). runtime/batches.py closes that thread at exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import time
import numpy as np
import torch
from dcp_opt.runtime import LMConfig
from dcp_opt.runtime.data import DcpBatchSampler, DcpLoader, collate_samples
from dcp_opt.runtime.launch import cpu_cost_model
from dcp_opt.runtime.models import model_spec

# 400 samples in batches of 32: the thread plans the next batches while the script ends,
# each a CP-SAT search of its whole 1 s budget.
lengths = [int(n) for n in np.random.default_rng(0).integers(2, 60, 400)]
dataset = [torch.arange(n + 1) % 32 for n in lengths]
cfg = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=32)
# one rank (no torch.distributed needed); memory for 40 tokens: the longer ones recompute
cost = cpu_cost_model(model_spec(cfg), 1, fit_tokens=40)
options = dict(batch_size=32, planner="cpsat", planner_options={"time_limit_s": 1.0})
if sys.argv[1] == "dataloader":
    sampler = DcpBatchSampler(lengths, cost, **options)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_samples, num_workers=2,
        persistent_workers=True,
    )
    it = iter(loader)
else:
    it = iter(DcpLoader(dataset, lengths, cost, **options))
batch = next(it)
print("got a batch", flush=True)
time.sleep(0.3)  # the work of a step; the thread is inside a CP-SAT search at the exit
"""


@pytest.mark.parametrize("loader", ["dataloader", "dcploader"])
def test_exit_while_a_loader_iterator_is_held_is_clean(loader):
    pytest.importorskip("ortools")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, loader], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert "got a batch" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
