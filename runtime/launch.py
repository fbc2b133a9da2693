"""Start-up helpers for scripts run with torchrun: process group from the environment, one
plan broadcast from rank 0 (planners need not be deterministic), a one-line plan summary."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dcp_opt.cluster import Cluster
from dcp_opt.cost import CostModel, Efficiency, flops_coefficients
from dcp_opt.model import ModelSpec
from dcp_opt.plan import Plan

from .elastic import init_world
from .wire import broadcast_text


def cpu_cost_model(
    spec: ModelSpec, world: int, *, fit_tokens: float, peak_flops: float = 3e9
) -> CostModel:
    """FLOP-derived costs for a CPU 'cluster' of `world` ranks (1 node), with memory for
    `fit_tokens` tokens per rank at degree 1 without recompute, so longer sequences need SP
    groups or recompute. Crude (no profile): planners need relative costs; scripts print
    predicted beside measured times."""
    cluster = Cluster("cpu", 1, world, 1e9, peak_flops, 2e9, 2e9)
    eff = Efficiency(reserved_bytes=1e6, block_launch_s=3e-4, microbatch_overhead_s=5e-3)
    cost = CostModel(spec, cluster, flops_coefficients(spec, cluster, eff))
    per_token = float(cost.memory(1, 1, 0)) - cost.fixed_bytes()
    memory = (cost.fixed_bytes() + fit_tokens * per_token) / cost.usable_memory_fraction
    return CostModel(spec, cluster.with_(memory_bytes=memory), cost.coeffs)


def init_distributed(*, backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """init_process_group from torchrun's environment (gloo on CPU, NCCL with GPUs).

    The timeout bounds every collective, so a failed rank makes the others fail, not hang."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_world(backend, timeout_s)  # the attempt's own store under torchrun (elastic.py)
    return dist.get_rank(), dist.get_world_size()


def broadcast_plan(plan: Plan | None, *, src: int = 0) -> Plan:
    """Rank `src` passes its plan, the others None; every rank returns the same Plan. The
    plan travels as its JSON bytes (runtime/wire.py), never pickle, and is parsed (checked)
    on every rank."""
    text = plan.to_json(indent=None) if dist.get_rank() == src else None
    return Plan.from_json(broadcast_text(text, src=src))


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
