"""The test pool itself (runtime/testing.py): a pool with a dead rank fails at once."""

import time

import pytest
from dcp_opt.runtime.testing import DistWorkers


def job_rank(ctx):
    return ctx.rank


def test_a_pool_with_a_dead_rank_fails_at_once_naming_it():
    w = DistWorkers(2, timeout_s=20.0)
    try:
        assert w.run(job_rank) == [0, 1]
        w.procs[1].kill()
        w.procs[1].join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no longer running \(exit codes \{1: "):
            w.run(job_rank)
        assert time.monotonic() - t0 < 5  # not the 4 x timeout_s deadline
    finally:
        w.close()
