"""What each pipeline stage runs, in order: the one list of actions the simulator prices and
the runtime executes (a schedule as data, as torch.distributed.pipelining's `_Action`s).

An action is (pass, micro-batch, chunk): "F" the forward or "B" the backward of micro-batch
`mb` (its index in the group's ordered list) through model chunk `chunk` of the stage (0
unless the schedule is interleaved). The lists below fix only each stage's order; when an
action may start is the dependency graph's (a forward needs the previous stage's forward of
the same micro-batch and chunk, a backward the next stage's backward), which the simulator
walks and the runtime obeys by blocking on its receives.

- "gpipe" (Huang et al. 2019): every forward, then every backward in reverse order;
- "1f1b" (PipeDream-Flush, Narayanan et al. 2021, sec. 2.2; Megatron-LM
  schedules.forward_backward_pipelining_without_interleaving): stage s runs
  min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards; at most p - s micro-batches are in flight on stage s;
- "interleaved" (Narayanan et al. 2021, sec. 2.2.1; Megatron-LM
  schedules.forward_backward_pipelining_with_interleaving): stage s holds v model chunks,
  chunk j being virtual stage j * p + s. Forwards go in rounds of p micro-batches per chunk:
  the i-th forward is micro-batch (i // (p v)) p + i % p of chunk (i // p) % v, the i-th
  backward the same micro-batch of chunk v - 1 - (i // p) % v. Warm-up: every forward when
  m = p, else min(2 (p - s - 1) + (v - 1) p, m v); then one forward and one backward
  alternate, then the remaining backwards drain. As Megatron (before its
  microbatch_group_size_per_vp_stage), m must be a multiple of p.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import DcpOptError


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:  # compact text form, as torch's pipelining actions
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


@functools.cache
def _action(kind: str, micro_batch: int, chunk: int = 0) -> Action:
    """One Action object per (kind, micro-batch, chunk), shared by every schedule: the
    simulators keep the schedules they walk (makespan.column_actions, cached), and with an
    object per action each, 160,000 of them after the pipeline benchmark's rows made a full
    collection of that process's heap take 50 ms (session 11). A few thousand are made."""
    return Action(kind, micro_batch, chunk)


def _check(num_stages: int, num_micro_batches: int, stage: int) -> None:
    if num_stages < 1:
        raise DcpOptError(f"num_stages: must be >= 1, got {num_stages}")
    if num_micro_batches < 0:
        raise DcpOptError(f"num_micro_batches: must be >= 0, got {num_micro_batches}")
    if not 0 <= stage < num_stages:
        raise DcpOptError(f"stage: must be in 0..{num_stages - 1}, got {stage}")


def gpipe_actions(num_stages: int, num_micro_batches: int, stage: int) -> tuple[Action, ...]:
    _check(num_stages, num_micro_batches, stage)
    m = num_micro_batches
    return tuple(_action("F", k) for k in range(m)) + tuple(
        _action("B", k) for k in reversed(range(m))
    )


def one_f_one_b_actions(num_stages: int, num_micro_batches: int, stage: int) -> tuple[Action, ...]:
    _check(num_stages, num_micro_batches, stage)
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    out = [_action("F", k) for k in range(warmup)]
    for k in range(m - warmup):  # steady state: one forward, then the oldest backward
        out += [_action("F", warmup + k), _action("B", k)]
    out += [_action("B", k) for k in range(m - warmup, m)]
    return tuple(out)


def interleaved_actions(
    num_stages: int, num_micro_batches: int, stage: int, virtual_stages: int = 2
) -> tuple[Action, ...]:
    _check(num_stages, num_micro_batches, stage)
    p, m, v = num_stages, num_micro_batches, virtual_stages
    if v < 1:
        raise DcpOptError(f"virtual_stages: must be >= 1, got {v}")
    if m % p:
        raise DcpOptError(
            f"num_micro_batches: the interleaved schedule needs a multiple of num_stages={p}, "
            f"got {m}"
        )
    total = m * v

    def at(i: int, kind: str) -> Action:
        j = (i // p) % v
        return _action(kind, (i // (p * v)) * p + i % p, j if kind == "F" else v - 1 - j)

    warmup = total if m == p else min(2 * (p - stage - 1) + (v - 1) * p, total)
    out = [at(i, "F") for i in range(warmup)]
    for i in range(total - warmup):
        out += [at(warmup + i, "F"), at(i, "B")]
    out += [at(i, "B") for i in range(total - warmup, total)]
    return tuple(out)


SCHEDULES = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions, "interleaved": None}


def stage_actions(
    schedule: str,
    num_stages: int,
    num_micro_batches: int,
    stage: int,
    *,
    virtual_stages: int = 1,
) -> tuple[Action, ...]:
    """The actions stage `stage` runs, in order, for `num_micro_batches` micro-batches
    (`virtual_stages`: model chunks per stage, interleaved only)."""
    if schedule not in SCHEDULES:
        raise DcpOptError(f"schedule: {schedule!r} not allowed; allowed: {list(SCHEDULES)}")
    if schedule == "interleaved":
        return interleaved_actions(num_stages, num_micro_batches, stage, virtual_stages)
    if virtual_stages != 1:
        raise DcpOptError(
            f"virtual_stages: {virtual_stages} needs schedule 'interleaved', got {schedule!r}"
        )
    return SCHEDULES[schedule](num_stages, num_micro_batches, stage)
