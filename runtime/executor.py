"""Run one training step of a Plan on this rank (Runtime contract in docs/architecture.md).

Every rank walks the plan's phases; in each phase it looks up its group in the pool and runs
the group's micro-batches in order (forward, loss / plan.loss_normalizer, backward). After
the last phase the gradients are summed once over the whole world, so the result equals
single-process training on the global batch whatever the plan. There is no barrier between
phases: members of a group meet in their first all-to-all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan

from .groups import GroupPool, PipelineTPGroups, TPGroups
from .parallelize import SPState
from .pipeline import execute_pipeline_step
from .plan_check import check_plan_once
from .sp import SPGroup
from .tensor_parallel import check_plan_heads, reduce_partial_grads

# The gradient sum's default bucket (one all-reduce per bucket), as in PyTorch DDP's
# bucket_cap_mb=25 (torch/nn/parallel/distributed.py).
DEFAULT_BUCKET_BYTES = 25 * 2**20


class PlanMismatchError(DcpOptError):
    """Ranks hold different plans; raised on every rank before any step collective."""


class MicroBatchOutOfMemoryError(RuntimeError):
    """A micro-batch ran out of device memory; the message names the plan entry, so the user
    can lower `CostModel.usable_memory_fraction` (the safety margin) or re-profile."""


def _oom_error(rank: int, phase: int, group, index: int, mb, cause: BaseException):
    last = group.start_rank + group.degree - 1
    return MicroBatchOutOfMemoryError(
        f"rank {rank}: out of memory in phase {phase}, group ranks {group.start_rank}..{last} "
        f"(degree {group.degree}), micro-batch {index}: sequences {list(mb.sequence_ids)}, "
        f"recompute_layers {mb.recompute_layers}; lower CostModel.usable_memory_fraction or "
        f"re-profile the model ({type(cause).__name__}: {str(cause)[:200]})"
    )


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower()
    )


@dataclass(frozen=True)
class MicroBatchTime:
    phase: int
    start_rank: int
    degree: int
    index: int
    sequence_ids: tuple[int, ...]
    recompute_layers: int
    seconds: float


@dataclass(frozen=True)
class StepReport:
    loss: float
    step_time_s: float
    grad_sync_s: float
    predicted_step_time_s: float | None
    micro_batches: tuple[MicroBatchTime, ...]
    # Seconds of the plan checks before the step clock starts (the plan-hash all-gather and
    # the pool check): paid every step, not part of step_time_s.
    check_s: float = 0.0
    # ZeRO-3 per layer (Plan.shard_domain > 0): per phase, the empty micro-steps this rank ran
    # to match the largest micro-batch count of its shard domain; () otherwise.
    padding: tuple[int, ...] = ()

    def summary(self) -> dict:
        return {
            "loss": self.loss,
            "step_time_s": self.step_time_s,
            "grad_sync_s": self.grad_sync_s,
            "predicted_step_time_s": self.predicted_step_time_s,
            "num_micro_batches": len(self.micro_batches),
        }


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_plan(plan: Plan, *, group=None) -> None:
    """All-gather plan.content_hash() (16 hex digits) and fail on every rank if they differ.

    Run before any collective of the step: ranks with different plans would otherwise issue
    mismatched collectives and hang or corrupt gradients."""
    world = dist.get_world_size(group)
    _check_world(plan, world)
    _gather_hashes(plan.content_hash(), world, group)


def _check_world(plan: Plan, world: int) -> int:
    """The plan's units (ranks of the plan: tensor_parallel GPUs each) in this world."""
    if plan.num_ranks * plan.tensor_parallel != world:
        units = f" units of tensor_parallel {plan.tensor_parallel}" * (plan.tensor_parallel > 1)
        raise PlanMismatchError(
            f"plan.num_ranks: {plan.num_ranks}{units} but the world has {world} ranks; "
            "allowed: a plan made for exactly this world"
        )
    return plan.num_ranks


def _check_tp(plan: Plan, tp: TPGroups | None, model: nn.Module) -> None:
    if tp is None and plan.tensor_parallel != 1:
        raise DcpOptError(
            f"plan.tensor_parallel: {plan.tensor_parallel} needs tp=TPGroups.create("
            f"{plan.tensor_parallel}) and a model split by apply_tensor_parallel; allowed: "
            "tensor_parallel 1 without tp"
        )
    if tp is not None:
        tp.check_plan(plan)
        check_plan_heads(plan, model)


def _gather_hashes(content_hash: str, world: int, group) -> None:
    mine = torch.tensor(list(bytes.fromhex(content_hash)), dtype=torch.uint8)
    mine = mine.to(_device())
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    hashes = [bytes(t.cpu().tolist()).hex() for t in every]
    if len(set(hashes)) > 1:
        by = {h: [r for r, x in enumerate(hashes) if x == h] for h in dict.fromkeys(hashes)}
        detail = "; ".join(f"ranks {rs}: plan {h}" for h, rs in by.items())
        raise PlanMismatchError(f"plan: ranks hold different plans ({detail})")


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (tensor parallelism), a plain tensor as it is."""
    return x.to_local() if hasattr(x, "to_local") else x


def sum_gradients(
    model: nn.Module,
    *,
    extra: torch.Tensor | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group=None,
) -> torch.Tensor | None:
    """Sum every parameter's gradient over the whole world (or `group`: under tensor
    parallelism the GPUs of this TP rank, TPGroups.dp_group) in flat buckets (one all-reduce
    per bucket). Parameters without a gradient (a rank with no work) send zeros. `extra`, a
    scalar riding in the first bucket of its dtype, comes back summed too. A DTensor
    parameter's local shard is summed: each TP rank sums its own shard."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[nn.Parameter]] = []
    for p in params:
        last = buckets[-1] if buckets else None
        fits = last and last[0].dtype == p.dtype and last[0].device == p.device
        if fits and sum(_local(q).nbytes for q in last) < bucket_bytes:
            last.append(p)
        else:
            buckets.append([p])
    out = None
    for bucket in buckets:
        parts = [_local(p.grad).reshape(-1) for p in bucket]
        carry = extra is not None and out is None and extra.dtype == bucket[0].dtype
        if carry:
            parts.append(extra.reshape(1).to(bucket[0].device))
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=group)
        if carry:
            out, flat = flat[-1].clone(), flat[:-1]
        offset = 0
        for p in bucket:
            g = _local(p.grad)
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    if extra is not None and out is None:
        out = extra.clone().to(_device())
        dist.all_reduce(out, group=group)
    return out


def execute_step(
    plan: Plan,
    task,
    model: nn.Module,
    data: Mapping[int, object] | Callable[[int], object],
    *,
    pool: GroupPool,
    state: SPState,
    step: int,
    check_plan: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    sharding=None,
    batch=None,
    tp: TPGroups | PipelineTPGroups | None = None,
) -> StepReport:
    """Run this rank's part of `plan` and sum gradients over the world.

    `data[sequence_id]` (or `data(sequence_id)`) is read only for this rank's micro-batches.
    Gradients accumulate into `.grad`: zero them before the step as in any training loop.
    `bucket_bytes`: a bucket of the gradient sum closes once it holds at least this many
    bytes (whole parameters; the same value on every rank).
    `sharding` (runtime/sharding.py `shard(...)`): run under its mode, then reduce, step its
    optimizer and zero the gradients: one step of the plan is one step of training.
    `batch`: the dcp_opt Batch the plan was made for (`b.batch` of the data path); given, the
    plan must also train exactly its sequences with its loss normaliser.

    Before any collective, on every rank alike, the plan is checked without a cost model
    (runtime/plan_check.py: ranks, coverage, normaliser, recompute; once per plan) and
    refused with `dcp_opt.InvalidPlanError` naming each violation; then every rank's plan
    hash is compared (`check_plan`, one all-gather).

    `tp` (runtime/groups.py TPGroups, for a plan with tensor_parallel t > 1 and a model split
    by runtime/tensor_parallel.apply_tensor_parallel): this GPU runs its unit's plan rank with
    the unit's other GPUs (the same micro-batches), in the plan's groups formed by the GPUs of
    its TP rank, and the gradients are summed over the units (the "dp" mesh dimension).

    A plan with a pipeline runs through runtime/pipeline (`model` is then this rank's
    `build_stage(...)`, the report a `PipelineStepReport`)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: {bucket_bytes!r}; allowed: an integer >= 1")
    if plan.pipeline is not None:  # stages and P2P transfers: runtime/pipeline/executor.py
        if tp is not None and not isinstance(tp, PipelineTPGroups):
            raise DcpOptError(
                f"tp: {type(tp).__name__} with a pipeline plan; allowed: "
                "PipelineTPGroups.create(tensor_parallel, stages) (its stages' own groups)"
            )
        return execute_pipeline_step(
            plan, task, model, data, pool=pool, state=state, step=step, sharding=sharding,
            check_hashes=_gather_hashes if check_plan else None, batch=batch, tp=tp,
        )  # fmt: skip
    t_check = time.perf_counter()
    world = dist.get_world_size()
    units = _check_world(plan, world)
    content_hash = plan.content_hash()
    check_plan_once(
        plan, units, batch=batch, num_layers=_num_layers(model), content_hash=content_hash
    )
    if check_plan:
        _gather_hashes(content_hash, world, None)
    _check_tp(plan, tp, model)
    if tp is None:
        pool.check_plan(plan)  # identical verdict on every rank: none enters a collective alone
    check_kinds(plan, task)
    rank = pool.rank if tp is None else tp.unit
    state.tp_degree = 1 if tp is None else tp.degree
    if sharding is not None:
        sharding.check_plan(plan, model)
        sharding.begin_step()
    get = data if callable(data) else data.__getitem__
    started = time.perf_counter()
    loss = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    times: list[MicroBatchTime] = []
    # A sharding without `padding` (duck-typed, step-level) pads nothing.
    pad = getattr(sharding, "padding", None)
    padding = pad(plan, rank) if pad is not None else ()
    for p in range(len(plan.phases)):
        group = plan.group_of(rank, p)
        if group.micro_batches:  # idle: nothing to wait for, no barrier between phases
            state.sp, state.kind = _sp_group(pool, group, tp, rank), group.kind
            _run_group(plan, p, group, task, model, get, state, loss, times, step=step)
        for _ in range(padding[p] if padding else 0):
            sharding.empty_micro_step(task, state, step=step, kind=plan.normalizer_kind)

    t_sync = time.perf_counter()
    if sharding is None:
        dtype = next(model.parameters()).dtype
        if tp is not None:
            reduce_partial_grads(model)
        dp = None if tp is None else tp.dp_group  # each TP rank holds its unit's whole loss
        total = sum_gradients(model, extra=loss.to(dtype), bucket_bytes=bucket_bytes, group=dp)
    else:
        total = sharding.finish_step(task, state, step=step, kind=plan.normalizer_kind, loss=loss)
    _sync()
    end = time.perf_counter()
    state.sp, state.recompute_layers, state.kind = SPGroup.single(), 0, "ulysses"
    return StepReport(
        float(total),
        end - started,
        end - t_sync,
        plan.predicted_step_time_s,
        tuple(times),
        started - t_check,
        padding,
    )


def _run_group(plan, p, group, task, model, get, state, loss, times, *, step: int) -> None:
    """This rank's micro-batches of `group` in phase `p`, in order: loss added into `loss`
    (in place), one MicroBatchTime each appended to `times`."""
    for k, mb in enumerate(group.micro_batches):
        t0 = time.perf_counter()
        state.recompute_layers = mb.recompute_layers
        samples = [(sid, get(sid)) for sid in mb.sequence_ids]
        kw = {"step": step, "kind": plan.normalizer_kind, "scale": 1 / plan.loss_normalizer}
        try:
            loss += task.run(model, samples, state, **kw).to(loss.dtype)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if _is_oom(e):
                raise _oom_error(dist.get_rank(), p, group, k, mb, e) from e
            raise
        _sync()
        seconds = time.perf_counter() - t0
        times.append(
            MicroBatchTime(
                p, group.start_rank, group.degree, k, mb.sequence_ids,
                mb.recompute_layers, seconds,
            )
        )  # fmt: skip


def _num_layers(model: nn.Module) -> int | None:
    """Layers that recompute_layers counts: TinyLM / TinyDiT `layers`, a transformers
    model's config; None when neither says (then only recompute >= 0 is checked)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return len(layers)
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def check_kinds(plan: Plan, task) -> None:
    """Refuse, before any collective, cp and ring groups for a task that cannot shard for
    them (its class sets `supports_cp`: LMTask, HFCausalLMTask; runtime/cp.py, ring.py)."""
    if getattr(task, "supports_cp", False):
        return
    kinds = {g.kind for ph in plan.phases for g in ph.groups if g.degree > 1} - {"ulysses"}
    if kinds:
        kind = sorted(kinds)[0]
        raise ValueError(
            f"plan: a group of kind {kind!r} needs a 1D task that runs it (LMTask, "
            f"HFCausalLMTask); {type(task).__name__} runs only 'ulysses'"
        )


def _sp_group(pool: GroupPool, group, tp: TPGroups | None, rank: int) -> SPGroup:
    if group.degree == 1:
        return SPGroup.single()  # no collective at all inside a one-rank group
    if tp is not None:  # the group's GPUs of this TP rank, one per unit
        handle = tp.sp_handle(group.start_rank, group.degree)
    else:
        handle = pool.get(group.start_rank, group.degree)
    return SPGroup(handle, group.degree, rank - group.start_rank)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
