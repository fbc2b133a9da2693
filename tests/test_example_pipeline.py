"""examples/train_pipeline.py runs under torchrun on 4 CPU ranks, as PP 2 x 2 units and as PP 2 x
TP 2, and both train exactly the same thing: the same batches give the same losses, step by
step (what a plan decides never changes what is trained)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def losses(*extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", "examples/train_pipeline.py", "--steps", "3", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 3, proc.stdout
    return [float(re.search(r"loss ([\d.]+)", ln).group(1)) for ln in steps]


@pytest.mark.slow
@pytest.mark.dist
def test_the_pipeline_example_trains_the_same_with_and_without_tensor_parallelism():
    sp = losses("--pp", "2")
    tp = losses("--pp", "2", "--tp", "2")
    assert sp == pytest.approx(tp, rel=1e-4)  # printed to 4 decimals
    assert sp[-1] < sp[0]
