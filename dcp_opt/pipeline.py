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
  drains the remaining backwards; at most p - s micro-batches are in flight on stage s.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DcpOptError


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:  # compact text form, as torch's pipelining actions
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


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
    return tuple(Action("F", k) for k in range(m)) + tuple(
        Action("B", k) for k in reversed(range(m))
    )


def one_f_one_b_actions(num_stages: int, num_micro_batches: int, stage: int) -> tuple[Action, ...]:
    _check(num_stages, num_micro_batches, stage)
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    out = [Action("F", k) for k in range(warmup)]
    for k in range(m - warmup):  # steady state: one forward, then the oldest backward
        out += [Action("F", warmup + k), Action("B", k)]
    out += [Action("B", k) for k in range(m - warmup, m)]
    return tuple(out)


SCHEDULES = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions}


def stage_actions(
    schedule: str, num_stages: int, num_micro_batches: int, stage: int
) -> tuple[Action, ...]:
    """The actions stage `stage` runs, in order, for `num_micro_batches` micro-batches."""
    if schedule not in SCHEDULES:
        raise DcpOptError(f"schedule: {schedule!r} not allowed; allowed: {list(SCHEDULES)}")
    return SCHEDULES[schedule](num_stages, num_micro_batches, stage)
