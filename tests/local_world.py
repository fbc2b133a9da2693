"""A torch.distributed world of threads inside this process (torch's threaded process group,
torch/testing/_internal/distributed/multi_threaded_pg.py): every rank is a thread, the
collectives are real (all_reduce, all_gather, all_to_all_single over any new_group), and
everything runs in the test's own process, where mutmut's per-mutant fork and its coverage
see the runtime's code (scripts/mutation.py's fast stage). The gloo worker processes of
runtime/testing.py stay the reference for what crosses a process boundary.

A rank that raises releases the others from their collectives (the threaded group's
terminate event), so a wrong program fails in bounded time instead of hanging.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from dcp_opt.runtime.groups import GroupPool
from torch.testing._internal.distributed import multi_threaded_pg as mtpg

GRACE_S = 2.0  # how long the other ranks may still run after one raised
_LOCK = threading.Lock()  # one threaded world at a time (the install is process-global)


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each rank's traceback."""

    def __init__(self, errors: dict[int, BaseException], texts: dict[int, str]):
        self.errors = errors
        detail = "\n".join(f"rank {r}:\n{t}" for r, t in sorted(texts.items()))
        super().__init__("rank failure:\n" + detail)


def run_world(world: int, fn: Callable, *args, timeout_s: float = 60.0) -> list:
    """fn(pool, *args) on `world` ranks (threads, each with its GroupPool); the return values
    by rank. Raises RankFailure when a rank raises, TimeoutError when one never returns."""
    with _LOCK:
        # per-thread registries of group names, as torch's own MultiThreadedTestCase sets
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        mtpg._install_threaded_pg()
        mtpg.ProcessLocalGroup.reset()
        store = dist.HashStore()
        out: dict[int, object] = {}
        errors: dict[int, BaseException] = {}
        texts: dict[int, str] = {}

        def rank_main(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
                try:
                    out[rank] = fn(GroupPool.create(), *args)
                finally:
                    dist.destroy_process_group()
            except BaseException as e:  # SystemExit: released by another rank's failure
                if not isinstance(e, SystemExit):
                    errors[rank], texts[rank] = e, traceback.format_exc()

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
        try:
            for t in threads:
                t.start()
            _wait(threads, errors, timeout_s)
        finally:
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        if errors:
            raise RankFailure(errors, texts)
        if len(out) < world:  # a rank left by SystemExit without any rank raising
            raise RuntimeError(f"threaded world: ranks {sorted(set(range(world)) - set(out))} quit")
        return [out[r] for r in range(world)]


def _wait(threads, errors, timeout_s: float) -> None:
    """Join the ranks. Once one has raised, the others get a grace period to finish (and
    raise their own errors) before the threaded group releases those left in a collective."""
    deadline, released = time.monotonic() + timeout_s, None
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if errors and released is None:
            released = now + GRACE_S
        if now > deadline or (released is not None and now > released):
            mtpg.ProcessLocalGroup.exception_handle(RuntimeError("released"))
            for t in threads:
                t.join(5.0)
            if now > deadline:
                raise TimeoutError(f"threaded world: a rank did not finish within {timeout_s} s")
            return
        time.sleep(0.005)


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]
