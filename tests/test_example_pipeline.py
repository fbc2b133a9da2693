"""examples/train_pipeline.py runs under torchrun on 4 CPU ranks, as PP 2 x 2 units and as PP 2 x
TP 2, and both train exactly the same thing: the same batches give the same losses, step by
step (what a plan decides never changes what is trained). Sharded with zero1 over each
stage's ranks, stopped after a checkpoint and started again, it prints the losses of the
plain uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def losses(*extra: str, steps: int = 3, printed: int | None = None) -> list[float]:
    """The losses the example prints, one a step (`printed` of them: a resumed run prints
    only the steps it runs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", "examples/train_pipeline.py", "--steps", str(steps), *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    want = steps if printed is None else printed
    assert len(lines) == want, proc.stdout
    return [float(re.search(r"loss ([\d.]+)", ln).group(1)) for ln in lines]


@pytest.mark.slow
@pytest.mark.dist
def test_the_pipeline_example_trains_the_same_with_and_without_tensor_parallelism():
    sp = losses("--pp", "2")
    tp = losses("--pp", "2", "--tp", "2")
    assert sp == pytest.approx(tp, rel=1e-4)  # printed to 4 decimals
    assert sp[-1] < sp[0]


@pytest.mark.slow
@pytest.mark.dist
def test_the_pipeline_example_shards_stages_and_resumes_from_its_checkpoint(tmp_path):
    plain = losses("--pp", "2", steps=4)
    run = ("--pp", "2", "--sharding", "zero1", "--checkpoint-dir", str(tmp_path),
           "--checkpoint-every", "2")  # fmt: skip
    first = losses(*run, steps=2)  # saves after step 2, then stops
    rest = losses(*run, steps=4, printed=2)  # resumes at step 2
    assert first + rest == pytest.approx(plain, rel=1e-4)  # printed to 4 decimals
    assert (tmp_path / "step-00000004").is_dir()
