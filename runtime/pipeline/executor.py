"""Run one training step of a pipeline plan on this rank (docs/architecture.md, runtime).

Rank r holds stage s = r // num_ranks and unit u = r % num_ranks (plan-format, the 4-D
layout, with tensor_parallel 1). In each phase, u's group runs on every stage's copy of the
same units, so the group is a column of stages through which its micro-batches flow in the
group's order. Stage s runs exactly `dcp_opt.pipeline.stage_actions(schedule, p, m, s)` for
the column's m micro-batches, the one order the simulator prices: a forward receives the
previous stage's activations (member j of the group from member j of the same group on stage
s - 1: every stage cuts the micro-batch into the same shards), a backward the next stage's
gradient (runtime/pipeline/p2p.py, shapes first). Inside a stage the group's SP collectives run
as without a pipeline, on the pool's group at the stage's ranks.

Recompute (checkpointing) replays a layer's forward during backward, where it reads the
active group and the stream's segments from SPState; under 1F1B other micro-batches' forwards
run in between, so each forward keeps a snapshot of SPState and its backward restores it.

End of step: each stage's gradients are summed over the ranks that hold that stage (its
units: the stage's data-parallel ranks), one all-reduce per dtype on every one of them, then
the loss (nonzero on the last stage only) over the world, once on every rank: every
collective is called equally often by each member of its group, idle groups included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from dcp_opt.pipeline import stage_actions
from dcp_opt.plan import Plan

from ..cp import shard_for_group
from ..parallelize import SPState
from ..plan_check import check_plan_once
from ..sp import SPGroup
from ..tasks import LMTask
from ..tensor_parallel import check_plan_heads, reduce_partial_grads
from .checks import check_groups, check_pipeline_plan, check_task, stage_of
from .p2p import Channel
from .stages import PipelineStage


@dataclass(frozen=True)
class ActionTime:
    phase: int
    start_rank: int  # the group's first unit
    degree: int
    stage: int
    action: str  # "F3": forward of the group's micro-batch 3 (dcp_opt.pipeline.Action)
    sequence_ids: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class PipelineStepReport:
    loss: float
    step_time_s: float
    grad_sync_s: float
    predicted_step_time_s: float | None
    actions: tuple[ActionTime, ...]
    check_s: float = 0.0

    def summary(self) -> dict:
        return {
            "loss": self.loss,
            "step_time_s": self.step_time_s,
            "grad_sync_s": self.grad_sync_s,
            "predicted_step_time_s": self.predicted_step_time_s,
            "num_actions": len(self.actions),
        }


@dataclass
class _Record:  # one micro-batch in flight on this stage: forward done, backward pending
    x: torch.Tensor
    out: torch.Tensor
    snapshot: dict


@dataclass
class _Run:  # what one rank's step needs, gathered once
    plan: Plan
    stage: PipelineStage
    state: SPState
    pool: object
    get: Callable
    channel: Channel
    rank: int
    loss: torch.Tensor
    times: list
    tp: object = None  # runtime.groups.PipelineTPGroups under tensor parallelism

    @property
    def unit(self) -> int:
        """This GPU's unit on its stage (its plan rank)."""
        if self.tp is not None:
            return self.tp.unit
        return self.rank - self.stage.stage * self.plan.num_ranks


def execute_pipeline_step(
    plan: Plan,
    task,
    stage: PipelineStage,
    data: Mapping[int, object] | Callable[[int], object],
    *,
    pool,
    state: SPState,
    step: int,
    check_hashes: Callable | None = None,
    sharding=None,
    batch=None,
    tp=None,
) -> PipelineStepReport:
    """This rank's part of a plan with a pipeline (plan.pipeline set): `stage` is
    `build_stage(model, plan.pipeline.stage_layers, stage_of(plan, rank))` of a model
    prepared by `parallelize` / `parallelize_hf` with `state` (and, with tensor parallelism,
    split by `apply_tensor_parallel(model, tp)`, `tp` a runtime.groups.PipelineTPGroups).
    Gradients accumulate into the stage's parameters' `.grad`, summed over the stage's units
    (per TP rank under TP). Every check runs before any collective, on every rank alike;
    `check_hashes(content_hash, world, group)` (the executor's plan all-gather) then compares
    the plans."""
    t_check = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_task(task, sharding, stage, tp)
    check_pipeline_plan(plan, world, rank, stage, tp)
    content_hash = plan.content_hash()
    check_plan_once(
        plan,
        plan.num_ranks,
        batch=batch,
        num_layers=stage.total_layers,
        content_hash=content_hash,
    )
    if tp is None:
        check_groups(plan, pool)
    else:  # its own groups: each SP group of units is one per TP rank
        tp.check_plan(plan)
        check_plan_heads(plan, stage.model)
    if check_hashes is not None:
        check_hashes(content_hash, world, None)
    state.tp_degree = plan.tensor_parallel  # the task pads a unit's tokens to a multiple
    param = next(stage.parameters())
    run = _Run(
        plan, stage, state, pool,
        data if callable(data) else data.__getitem__,
        Channel(device=param.device, dtype=param.dtype), rank,
        torch.zeros((), dtype=torch.float64, device=param.device), [], tp,
    )  # fmt: skip
    started = time.perf_counter()
    if sharding is not None:
        sharding.check_plan(plan, stage)
        sharding.begin_step()  # the stage's parameters gathered once, over its ranks
    if plan.pipeline.micro_steps:
        _run_micro_steps(run, step)
    else:
        for p in range(len(plan.phases)):
            _run_phase(run, p, step)
    run.channel.finish()
    t_sync = time.perf_counter()
    if sharding is None:
        total = _reduce(run)
    else:  # reduce-scatter over the stage's ranks, optimizer step, loss over the world
        kind = plan.normalizer_kind
        loss = run.loss if tp is None or not tp.tp_rank else torch.zeros_like(run.loss)
        total = sharding.finish_step(task, state, step=step, kind=kind, loss=loss)
    _sync()
    end = time.perf_counter()
    state.sp, state.recompute_layers, state.kind = SPGroup.single(), 0, "ulysses"
    state.tp_degree = 1
    return PipelineStepReport(
        float(total),
        end - started,
        end - t_sync,
        plan.predicted_step_time_s,
        tuple(run.times),
        started - t_check,
    )


def _run_phase(run: _Run, p: int, step: int) -> None:
    plan, s = run.plan, run.stage.stage
    group = plan.group_of(run.unit, p)
    mbs = group.micro_batches
    if not mbs:
        return  # this column idles in this phase, on every stage alike
    sp = _sp_group(run, group)
    live: dict[int, _Record] = {}
    for action in stage_actions(plan.pipeline.schedule, plan.pipeline.num_stages, len(mbs), s):
        t0 = time.perf_counter()
        k = action.micro_batch
        if action.kind == "F":
            live[k] = _forward(run, group, sp, k, step)
        else:
            _backward(run, live.pop(k), k)
        _sync()
        run.times.append(
            ActionTime(
                p, group.start_rank, group.degree, s, str(action), mbs[k].sequence_ids,
                time.perf_counter() - t0,
            )
        )  # fmt: skip
    assert not live, f"stage {s}: micro-batches {sorted(live)} never ran backward"


def _run_micro_steps(run: _Run, step: int) -> None:
    """A plan whose phases are micro-steps (docs/plan-format.md, version 4): this unit walks
    the schedule's actions over all K micro-steps, running its group of micro-step k where
    it has one (every stage's copy of the unit idles in the same ones, so the neighbour it
    sends to or receives from runs the same k), as lockstep.lockstep_makespan prices it."""
    plan, s = run.plan, run.stage.stage
    unit = run.unit
    K = len(plan.phases)
    mine = [plan.group_of(unit, k) for k in range(K)]
    live: dict[int, _Record] = {}
    for action in stage_actions(plan.pipeline.schedule, plan.pipeline.num_stages, K, s):
        k, group = action.micro_batch, mine[action.micro_batch]
        if not group.micro_batches:
            continue  # this unit idles in micro-step k, on every stage alike
        t0 = time.perf_counter()
        if action.kind == "F":
            live[k] = _forward(run, group, _sp_group(run, group), 0, step, label=k)
        else:
            _backward(run, live.pop(k), k)
        _sync()
        run.times.append(
            ActionTime(
                k, group.start_rank, group.degree, s, str(action),
                group.micro_batches[0].sequence_ids, time.perf_counter() - t0,
            )
        )  # fmt: skip
    assert not live, f"stage {s}: micro-steps {sorted(live)} never ran backward"


def _sp_group(run: _Run, group) -> SPGroup:
    """This rank's SP group for `group` on its stage (a single rank's for degree 1; under TP
    the group's GPUs of this TP rank, one per unit)."""
    if group.degree == 1:
        return SPGroup.single()
    if run.tp is not None:
        handle = run.tp.sp_handle(group.start_rank, group.degree)
        return SPGroup(handle, group.degree, run.unit - group.start_rank)
    start = run.stage.stage * run.plan.num_ranks + group.start_rank
    return SPGroup(run.pool.get(start, group.degree), group.degree, run.rank - start)


def _forward(run: _Run, group, sp: SPGroup, k: int, step: int, label: int | None = None) -> _Record:
    """Micro-batch k of `group`; `label`: its number in messages (default k)."""
    plan, stage, state = run.plan, run.stage, run.state
    mb = group.micro_batches[k]
    label = k if label is None else label
    state.sp, state.kind = sp, group.kind
    mine = mb.stage_recompute[stage.stage] if mb.stage_recompute else 0
    state.recompute_layers = stage.layer_offset + mine  # the stage's first `mine` layers
    samples = [(sid, run.get(sid)) for sid in mb.sequence_ids]
    part = shard_for_group(LMTask().pack, samples, plan.normalizer_kind, state)
    snapshot = {f.name: getattr(state, f.name) for f in fields(state)}
    if stage.first:
        x = part["tokens"].to(run.channel.device)
    else:
        # a unit's tokens, padded to a multiple of t, split over its t GPUs (SequenceParallel)
        expect = (part["tokens"].shape[0] // plan.tensor_parallel, stage.hidden)
        x = run.channel.recv(_peer(run, -1), expect=expect, what=_what(run, label, "F"))
        x.requires_grad_()
    out = stage(x, part)
    if stage.last:
        out = out * (1 / plan.loss_normalizer)
        run.loss += out.detach().to(run.loss.dtype)
    else:
        run.channel.send(out, _peer(run, +1))
    return _Record(x, out, snapshot)


def _backward(run: _Run, rec: _Record, k: int) -> None:
    stage = run.stage
    for name, value in rec.snapshot.items():  # what a recomputed layer reads
        setattr(run.state, name, value)
    if stage.last:
        rec.out.backward()
    else:
        what = _what(run, k, "B")
        grad = run.channel.recv(_peer(run, +1), expect=tuple(rec.out.shape), what=what)
        torch.autograd.backward(rec.out, grad)
    if not stage.first:
        run.channel.send(rec.x.grad, _peer(run, -1))


def _peer(run: _Run, direction: int) -> int:
    """The same GPU of the same unit on the previous (-1) or next (+1) stage: rank r of group
    g on stage s talks to rank r of group g on s +- 1 (under TP, TP rank j to TP rank j: each
    holds its token shard of the stream)."""
    return run.rank + direction * run.plan.num_ranks * run.plan.tensor_parallel


def _what(run: _Run, k: int, kind: str) -> str:
    sent = "activations" if kind == "F" else "gradient"
    return f"stage {run.stage.stage}, {sent} of micro-batch {k}"


def _reduce(run: _Run) -> torch.Tensor:
    """Sum the stage's gradients over its units (one all-reduce per dtype; under TP each TP
    rank its own shards, over the stage's GPUs of its TP rank, after giving every gradient
    its parameter's placement), then the loss over the world, once on every rank (under TP
    each TP rank of a unit holds the unit's whole loss: TP rank 0's counts)."""
    n, s = run.plan.num_ranks, stage_of(run.plan, run.rank)
    if run.tp is not None:
        reduce_partial_grads(run.stage)
    params = [p for p in run.stage.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if n > 1:
        handle = run.pool.get(s * n, n) if run.tp is None else run.tp.dp_group
        for dtype in dict.fromkeys(p.dtype for p in params):
            same = [_local(p.grad) for p in params if p.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=handle)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
    total = run.loss.clone()
    if run.tp is not None and run.tp.tp_rank:
        total.zero_()
    dist.all_reduce(total)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
