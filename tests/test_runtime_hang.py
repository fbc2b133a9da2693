"""A rank that hangs rather than dies (SIGSTOP) ends the job within the launcher's timeout
(issue 29): every process group the runtime creates (the GroupPool's SP groups, the loader's
plan-broadcast group) takes the world group's timeout, so the rank waiting for the stopped
one fails after `init_distributed(timeout_s=...)`, not after torch's 30-minute default."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "stop_rank_job.py"
TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(workdir: Path, where: str) -> list[subprocess.Popen]:
    """The job's two ranks with torchrun's environment (env:// rendezvous), started directly:
    torchrun would add its own grace (a stopped rank takes no SIGTERM, and torchrun 2.13
    SIGKILLs it only 30 s after the first failure, whatever --shutdown-timeout says)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = os.environ | {
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        }  # fmt: skip
        cmd = [sys.executable, str(JOB), "--dir", str(workdir), "--timeout", str(TIMEOUT_S),
               "--where", where]  # fmt: skip
        log = open(workdir / f"log-rank{rank}.txt", "w")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("where", ["sp", "plan"])
def test_stopped_rank_fails_the_others_within_the_launchers_timeout(tmp_path, where):
    ranks = start_ranks(tmp_path, where)
    try:
        # Before the fix rank 0 waited torch's default 30 minutes: this limit fails it.
        code = ranks[0].wait(timeout=60)
        ended = time.time()
    finally:
        for p in ranks:
            p.kill()  # rank 1 is stopped: SIGKILL is the one signal it takes
            p.wait()
    log = (tmp_path / "log-rank0.txt").read_text()
    stopped = float((tmp_path / "stopped-at").read_text())
    assert code != 0, log[-3000:]
    # rank 0 fails once its collective has waited the timeout (it may have started waiting a
    # little before rank 1 stopped), plus its exit
    assert TIMEOUT_S / 2 < ended - stopped < TIMEOUT_S + 15, (ended - stopped, log[-3000:])
    # The clear error: gloo names the wait and its length, in the group that waited.
    assert f"Timed out waiting {int(TIMEOUT_S * 1000)}ms" in log, log[-3000:]
    want = "all_to_all_single" if where == "sp" else "broadcast_json"  # runtime/wire.py
    assert want in log, log[-3000:]
