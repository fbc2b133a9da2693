"""Plans and other small values between ranks as bytes, never pickle (issue 29): a JSON text
travels as its length (one int64) then its UTF-8 bytes (uint8), with torch.distributed
broadcast / all_gather. What a rank receives is parsed as JSON, so a peer can send only
data, never code (`broadcast_object_list` and `all_gather_object` unpickle what they
receive)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def broadcast_text(text: str | None, *, src: int, group=None) -> str:
    """Rank `src` (a global rank) passes `text`, the others anything (None); every rank of
    `group` returns `src`'s text. Two broadcasts: the byte length, then the bytes."""
    device = _device(group)
    sending = dist.get_rank() == src
    data = text.encode() if sending else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if sending:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if n else None
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device) if n else None
    if buf is not None:
        dist.broadcast(buf, src=src, group=group)
    return data.decode() if sending else (bytes(buf.cpu().numpy()).decode() if n else "")


def broadcast_json(value, *, src: int, group=None):
    """`broadcast_text` of json.dumps(value) from `src`; every rank returns the parsed value.
    numpy scalars are sent as numbers; anything else JSON cannot hold, as its str()."""
    text = json.dumps(value, default=_plain) if dist.get_rank() == src else None
    return json.loads(broadcast_text(text, src=src, group=group))


def all_gather_json(value, *, group=None) -> list:
    """Every rank's `value` (JSON-serialisable), by rank: each rank's byte length first,
    then the bytes, padded to the longest."""
    device, world = _device(group), dist.get_world_size(group)
    data = json.dumps(value, default=_plain).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    every = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(every, buf, group=group)
    return [
        json.loads(bytes(b[:n].cpu().numpy()).decode()) for b, n in zip(every, lengths, strict=True)
    ]


def _plain(x):
    item = getattr(x, "item", None)
    return item() if callable(item) else str(x)


def _device(group) -> torch.device:
    """NCCL groups move CUDA tensors; gloo (and the sampler's own channel) CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
