"""Checking a parallel run against plain training: a single-process reference step and a
small pool of persistent worker processes (torch.multiprocessing spawn, gloo) that tests and
benchmarks reuse for many plans, so process start-up is paid once."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .groups import GroupPool


def reference_step(
    task, model, items: Iterable[tuple[int, object]], *, step: int, kind: str, normalizer: float
):
    """Single-process training on the whole batch: every sequence alone, unpacked, unpadded.
    Accumulates gradients into `model` and returns the loss."""
    total = sum(
        task.reference_loss(model, sid, sample, step=step, kind=kind) for sid, sample in items
    )
    loss = total / normalizer
    loss.backward()
    return float(loss.detach())


def flat_grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def max_relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over parameters of ||got - want|| / ||want|| (absolute where want is zero)."""
    out = 0.0
    for g, w in zip(got, want, strict=True):
        scale = float(w.norm()) or 1.0
        out = max(out, float((g - w).norm()) / scale)
    return out


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    pool: GroupPool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, commands, results, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        ctx = WorkerContext(rank, world, GroupPool.create(timeout_s=timeout_s))
        results.put((rank, "ready", None))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = commands.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, "ok", fn(ctx, *args)))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))


class DistWorkers:
    """`world_size` gloo ranks that run module-level functions `fn(ctx, *args)` on demand."""

    def __init__(self, world_size: int, *, timeout_s: float = 30.0):
        # forkserver: one clean server process imports torch (and torch._dynamo, which the
        # first non-reentrant checkpoint pulls in) once; every worker forks from it, so a
        # pool starts in about a second instead of paying ~5 s of imports per rank.
        mpc = mp.get_context("forkserver")
        mpc.set_forkserver_preload(["torch", "torch._dynamo", "dcp_opt.runtime"])
        self.world_size, self.timeout_s = world_size, timeout_s
        self.errors: dict[int, str] = {}
        self.results = mpc.Queue()
        self.commands = [mpc.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            mpc.Process(
                target=_worker,
                args=(r, world_size, port, self.commands[r], self.results, timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._collect(wait_s=120.0)

    def _collect(self, wait_s: float) -> list:
        """One answer per rank; a rank whose process died counts as a failure."""
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while len(out) + len(errors) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers: no answer within {wait_s} s")
            try:
                rank, status, value = self.results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if r not in out and r not in errors and not p.is_alive():
                        errors[r] = f"process exited with code {p.exitcode}"
                continue
            if status == "error":
                errors[rank] = value
            else:
                out[rank] = value
        if errors:
            self.errors = errors
            detail = "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))
            raise RuntimeError("worker failure:\n" + detail)
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, wait_s: float | None = None) -> list:
        """Run fn(ctx, *args) on every rank; its return values, by rank. A pool with a dead
        rank fails at once, naming it (a later job would wait out its deadline on the ranks
        left in a broken group, 4 x timeout_s per test)."""
        dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
        if dead:
            raise RuntimeError(
                "workers: rank(s) no longer running (exit codes "
                f"{dead}); earlier errors: {sorted(self.errors)}"
            )
        for q in self.commands:
            q.put((fn, args))
        return self._collect(wait_s or 4 * self.timeout_s)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=2)
        for p in self.procs:  # a rank stuck in a broken group after a fault test
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
