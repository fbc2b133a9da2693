"""Every rank starts from the same weights: one checksum all-reduce at the point where the
runtime takes the model (`parallelize`, `parallelize_hf`), and rank 0's tensors broadcast to
every rank when they differ, as DDP does at construction (torch/nn/parallel/distributed.py,
`_sync_module_states`).

Why broadcast rather than refuse: without a seed every rank initialises its own random
weights, and under `mode="none"` (or no sharding) each replica then trains a model of its
own while the gradients are summed as if they were one (issue 28: parameter checksums 315.65
vs 314.68 after a step). The one right fix for that common case is rank 0's weights
everywhere, which is what users of DDP already expect; refusing would only make every
unseeded script add that line. It is not silent: rank 0 warns (`ReplicaMismatchWarning`),
naming the first tensor that differed and how many did, so a real mistake (ranks loading
different checkpoints) is visible. When the weights agree, the cost is one all-reduce of two
float64 numbers per tensor: no weight crosses the network.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn


class ReplicaMismatchWarning(UserWarning):
    """Ranks held different weights when the runtime took the model; rank 0's now hold."""


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) and buffers, except DTensors (already sharded: each rank
    holds another part) and meta tensors (no values yet)."""
    out = [(n, p) for n, p in model.named_parameters()] + list(model.named_buffers())
    return [
        (n, t) for n, t in out if not hasattr(t, "to_local") and t.device.type != "meta"
    ]  # fmt: skip


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """sum and L2 norm in float64: equal bits give equal sums on every rank (same kernels);
    independent random initialisations differ in both."""
    x = t.detach()
    x = x if x.is_floating_point() else x.double()
    return torch.stack(
        [torch.sum(x, dtype=torch.float64), torch.linalg.vector_norm(x, dtype=torch.float64)]
    ).cpu()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync_replicas(model: nn.Module) -> list[str]:
    """Collective (every rank calls it at the same point, like GroupPool.create): make this
    rank's parameters and buffers rank 0's. Returns the names of the tensors that differed
    (the same list on every rank; empty when they agreed). Nothing happens, and nothing is
    sent, without torch.distributed or on one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return []
    tensors = _named_tensors(model)
    if not tensors:
        return []
    device = _comm_device()
    sums = torch.stack([_checksum(t) for _, t in tensors])  # [n, 2]
    both = torch.cat([sums, -sums]).to(device)  # max and -min in one all-reduce
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    both = both.cpu()
    high, low = both[: len(tensors)], -both[len(tensors) :]
    differ = [i for i in range(len(tensors)) if not torch.equal(high[i], low[i])]
    for i in differ:
        t = tensors[i][1]
        buf = t.detach().to(device).contiguous()
        dist.broadcast(buf, src=0)
        with torch.no_grad():
            t.copy_(buf)
    names = [tensors[i][0] for i in differ]
    if names and dist.get_rank() == 0:
        warnings.warn(
            f"weights: {len(names)} of {len(tensors)} parameters and buffers differed across "
            f"ranks when the runtime took the model (first: {names[0]!r}); every rank now "
            "holds rank 0's (broadcast, as DDP does). Seed the initialisation "
            "(torch.manual_seed(seed) before building the model on every rank) or load the "
            "same weights everywhere to start identical without it (docs/integration.md, "
            "seeding)",
            ReplicaMismatchWarning,
            stacklevel=3,
        )
    return names
