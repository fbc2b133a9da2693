"""Rank failures under torchrun: a rank killed (SIGKILL) in the middle of a step, the job
restarted by torchrun (--max-restarts 1) from its last checkpoint, one epoch interrupted twice
over two invocations; the sample ledger shows every sample trained exactly once, counting
from the checkpoint each attempt resumed from. (That resumed parameters equal an uninterrupted
run's is tests/test_checkpoint.py's; this test is about processes dying.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.resume_torchrun_job import LENGTHS

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "resume_torchrun_job.py"


def torchrun(
    workdir: Path,
    run: str,
    restarts: int,
    kills: list[str],
    *,
    rdzv: tuple[str, ...] = ("--standalone",),
    share_store: bool = False,
    job_args: tuple[str, ...] = (),
):
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc_per_node",
           "2", "--max-restarts", str(restarts), "--monitor-interval", "0.2", str(JOB),
           "--dir", str(workdir), "--tag", run, *job_args]  # fmt: skip
    for k in kills:
        cmd += ["--kill", k]
    # torchrun shares its rendezvous TCP store with the workers by default, and a restarted
    # worker can read the previous attempt's gloo addresses from it ("Connection refused";
    # pytorch/pytorch#135712): the documented switch gives each attempt a store of its own.
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def effective_steps(workdir: Path) -> dict[int, set[int]]:
    """step -> sample ids trained at it (union over ranks), keeping of every attempt only the
    steps before the checkpoint the next attempt resumed from."""
    entries = [
        json.loads(line)
        for path in sorted(workdir.glob("ledger-rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    attempts = list(dict.fromkeys((e["run"], e["attempt"]) for e in entries))  # in order
    resumed = {(e["run"], e["attempt"]): e["resumed_at"] for e in entries if "resumed_at" in e}
    out: dict[int, set[int]] = {}
    for i, key in enumerate(attempts):
        until = resumed[attempts[i + 1]] if i + 1 < len(attempts) else float("inf")
        for e in entries:
            if (e["run"], e["attempt"]) == key and "step" in e and e["step"] < until:
                out.setdefault(e["step"], set()).update(e["ids"])
    return out, entries, [resumed[a] for a in attempts]


@pytest.mark.slow
@pytest.mark.dist
def test_killed_ranks_resume_and_train_every_sample_once(tmp_path):
    job = tmp_path / "job"
    # Invocation p (no restarts left): rank 1 dies in step 3; the last checkpoint is step 2.
    first = torchrun(job, "p", 0, ["p:0:3:1"])
    assert first.returncode != 0 and "exitcode  : -9" in first.stderr, first.stderr[-3000:]
    # Invocation a (--max-restarts 1): resumes at 2; rank 0 dies in step 5 (checkpoint 4);
    # torchrun restarts it from step 4 and it finishes the epoch.
    second = torchrun(job, "a", 1, ["a:0:5:0"])
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "run a attempt 1: epoch done at step 8" in second.stdout
    steps, entries, resumed_at = effective_steps(job)
    assert resumed_at == [0, 2, 4]  # two interruptions, each resumed from its last checkpoint
    trained = Counter(i for ids in steps.values() for i in ids)
    assert sorted(steps) == list(range(8))
    assert sorted(trained) == list(range(len(LENGTHS))) and set(trained.values()) == {1}
    # Not vacuous: the raw ledger trained steps 2 and 4 twice (before the kills rolled back).
    runs = {s: {(e["run"], e["attempt"]) for e in entries if e.get("step") == s} for s in (2, 4)}
    assert len(runs[2]) == 2 and len(runs[4]) == 2, runs


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("how", ["master_port", "shared_store"])
def test_restart_connects_with_an_explicit_master_port_or_a_shared_store(tmp_path, how):
    """issue 29: with `--master_port` (torchrun's static rendezvous, whose store outlives
    every attempt) or without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (--standalone sharing its
    store), the restarted ranks read the previous attempt's gloo addresses: "Connection
    refused" or a hang (through init_distributed, on this machine: 4 of 4 with --master_port,
    2 of 2 shared). init_distributed initialises the world on the attempt's own store
    (runtime/elastic.py init_world), so the documented recipe restarts under both."""
    rdzv = ("--master_port", str(free_port())) if how == "master_port" else ("--standalone",)
    job = tmp_path / "job"
    # rank 1 dies in step 3; torchrun restarts both ranks, which resume from step 2
    got = torchrun(job, "a", 1, ["a:0:3:1"], rdzv=rdzv, share_store=how == "shared_store")
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    assert "run a attempt 1: epoch done at step 8" in got.stdout
    assert "Connection refused" not in got.stderr
    _, _, resumed_at = effective_steps(job)
    assert resumed_at == [0, 2]
