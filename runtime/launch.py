"""Start-up helpers for scripts run with torchrun: process group from the environment, one
plan broadcast from rank 0 (planners need not be deterministic), a one-line plan summary."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dcp_opt.plan import Plan


def init_distributed(*, backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """init_process_group from torchrun's environment (gloo on CPU, NCCL with GPUs).

    The timeout bounds every collective, so a failed rank makes the others fail, not hang."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def broadcast_plan(plan: Plan | None, *, src: int = 0) -> Plan:
    """Rank `src` passes its plan, the others None; every rank returns the same Plan."""
    box = [plan.to_json() if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return Plan.from_json(box[0])


def describe_plan(plan: Plan) -> str:
    """e.g. 'greedy: 2 phase(s) | p0: 0x2[3 mb] 2x1[1 mb] 3x1[-] | p1: ...'"""
    parts = []
    for p, phase in enumerate(plan.phases):
        groups = " ".join(
            f"{g.start_rank}x{g.degree}[{len(g.micro_batches)} mb]"
            if g.micro_batches
            else f"{g.start_rank}x{g.degree}[-]"
            for g in phase.groups
        )
        parts.append(f"p{p}: {groups}")
    return f"{plan.planner or 'plan'}: {len(plan.phases)} phase(s) | " + " | ".join(parts)
