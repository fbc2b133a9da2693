"""Point-to-point transfers between neighbouring stages, with the shape sent first.

Micro-batches have different token counts, so the receiver cannot know a transfer's shape in
advance. As Megatron-LM's `variable_seq_lengths` (NVIDIA/Megatron-LM@d98e8a6,
megatron/core/pipeline_parallel/p2p_communication.py:191-275 `_communicate_shapes`: a small
int64 shape tensor exchanged with `batch_isend_irecv` before the tensor, and :327, where
`_communicate` allocates the receive buffer from the shape it received), every transfer here is
two messages in order: a fixed-size shape header, then the tensor.

Sends are posted and not waited for (the handles are kept, with the tensors they read, until
`Channel.finish`); a receive blocks. A stage therefore never waits on its own send, and the
schedules of dcp_opt/pipeline.py (a stage's order consistent with the dependency graph) cannot
deadlock. Messages between one pair of ranks in one direction arrive in posting order, and
each direction carries one kind only (activations forward, gradients backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 3  # header: (ndim, dim 0, ..., dim MAX_DIMS-1), int64


class Channel:
    """This rank's transfers; `device` and `dtype` of the activations it receives."""

    def __init__(self, *, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.pending: list = []  # (work handles, tensors they read): alive until finish()

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Post the shape header and the tensor to global rank `peer`; returns at once."""
        tensor = tensor.detach().contiguous()
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"tensor: {tensor.dim()} dims; allowed: at most {MAX_DIMS}")
        header = [tensor.dim(), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
        header = torch.tensor(header, dtype=torch.int64, device=self.device)
        ops = [dist.P2POp(dist.isend, header, peer), dist.P2POp(dist.isend, tensor, peer)]
        self.pending.append((dist.batch_isend_irecv(ops), (header, tensor)))

    def recv(self, peer: int, *, expect: tuple[int, ...], what: str) -> torch.Tensor:
        """Receive the shape header from `peer`, check it against `expect` (the shape this
        rank computes from its own share of the micro-batch), then the tensor."""
        header = torch.empty(1 + MAX_DIMS, dtype=torch.int64, device=self.device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, peer)]))
        got = tuple(int(x) for x in header[1 : 1 + int(header[0])].tolist())
        out = torch.empty(got, dtype=self.dtype, device=self.device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, peer)]))
        if got != tuple(expect):  # raised after the tensor is drained: the sender is not held
            raise RuntimeError(
                f"{what}: rank {peer} sent shape {list(got)}, this rank expected "
                f"{list(expect)} (the two ranks run different plans or data)"
            )
        return out

    def finish(self) -> None:
        """Wait for every posted send (their receivers are in the same schedule)."""
        for works, _ in self.pending:
            _wait(works)
        self.pending.clear()


def _wait(works) -> None:
    for w in works:
        w.wait()
