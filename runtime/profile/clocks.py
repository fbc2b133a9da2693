"""Clocks and memory meters of the profiler (runtime/profile/measure.py).

CPU: `CpuClock` (thread CPU time by default, or wall time). CUDA: `CudaClock` (event pairs,
allocator peak). `SavedBytes` counts the bytes autograd saves for backward (docs/profiler.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch


class CpuClock:
    """`mode="thread"` (default): CPU time of the calling thread (`time.thread_time`). With
    one intra-op thread, forward and backward of a CPU tensor run on the calling thread, so
    this is the compute time, immune to other processes sharing the cores; on an idle
    machine it equals wall time. `mode="wall"`: `time.perf_counter`."""

    device = torch.device("cpu")

    def __init__(self, mode: str = "thread"):
        if mode not in ("thread", "wall"):
            raise ValueError(f"clock mode: {mode!r} not allowed; allowed: thread, wall")
        self.mode = mode
        self._now = time.thread_time if mode == "thread" else time.perf_counter

    def mark(self):
        return self._now()

    def seconds(self, a, b) -> float:
        return b - a

    def memory_run(self):
        return contextlib.nullcontext(None)


class CudaClock:
    """torch.cuda.Event timing and allocator statistics (unit-tested on CPU with fakes)."""

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3  # elapsed_time is in milliseconds

    @contextlib.contextmanager
    def memory_run(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        box = {"peak": None}
        yield box
        torch.cuda.synchronize(self.device)
        box["peak"] = float(torch.cuda.max_memory_allocated(self.device) - base)


def default_clock():
    return CudaClock() if torch.cuda.is_available() else CpuClock()


class SavedBytes:
    """Bytes of the tensors autograd saves for backward (each storage once, no parameters)."""

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: set[int] = set()
        self.total = 0

    def include(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += st.nbytes()

    def _pack(self, t: torch.Tensor):
        self.include(t)
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
