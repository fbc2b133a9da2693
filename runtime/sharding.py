"""Sharded, mixed-precision training under any plan: the modes of CostModel.optimizer_sharding
(`none`, `zero1`, `zero2`, `zero3`) on FSDP2, with the optimizer step inside the executor's
step (design and measurements: docs/architecture.md, "Sharded, mixed-precision training").

Every world-wide collective happens at a step boundary, never inside the plan's phases, so
groups may run any number of micro-batches and ranks may be idle:

- `none`: `fully_shard` over the rank's own one-rank group (a full replica with FSDP2's
  mixed-precision casts); after the last phase the fp32 gradients are all-reduced.
- `zero1` / `zero2` / `zero3`: `fully_shard` over the world. The step starts with one
  `unshard()` (all-gather) per unit and keeps the parameters gathered; gradients accumulate
  unsharded with sync off; one closing empty micro-step (one token, loss x 0) with sync on
  makes FSDP2 reduce-scatter every unit, in the same order on every rank; the optimizer steps
  on the shards; `reshard()` frees the gathered copy.

    sharding = shard(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), mode="zero1",
                     pool=pool, task=LMTask(), dtype="bf16")
    execute_step(plan, task, sharding.model, data, pool=pool, state=state, step=i,
                 sharding=sharding)              # forward, backward, reduce, optimizer step
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dcp_opt.cost import SHARDING_MODES
from dcp_opt.errors import DcpOptError

from .groups import GroupPool
from .parallelize import SPState
from .sp import SPGroup
from .tasks import DiffusionTask, LMTask
from .tensor_parallel import fsdp_placement

# dtype: the compute dtype. None computes in the model's own dtype (fp32 or fp64, no casts);
# "bf16" is mixed precision: bf16 parameters and activations for compute, fp32 gradient
# accumulation and master weights (the model must be fp32: its parameters are the masters).
DTYPES = (None, "fp32", "bf16")
# Modes built with tensor parallelism (`shard(..., tp=)`): FSDP2 over the units' "dp" column;
# zero3 step-level or per layer (shard_domain in units). `none` (a replica per GPU) is not.
TP_MODES = ("zero1", "zero2", "zero3")


class ShardingModeError(DcpOptError):
    """The run's sharding mode differs from the mode the plan's cost model planned for."""


def _check_inputs(model: nn.Module, make_optimizer, mode: str, dtype) -> None:
    if mode not in SHARDING_MODES:
        raise DcpOptError(f"mode: {mode!r} not allowed; allowed: {list(SHARDING_MODES)}")
    if dtype not in DTYPES:
        raise DcpOptError(f"dtype: {dtype!r} not allowed; allowed: {list(DTYPES)}")
    if not callable(make_optimizer):
        raise DcpOptError(
            "make_optimizer: must be a callable params -> torch.optim.Optimizer, got "
            f"{type(make_optimizer).__name__}; allowed: e.g. lambda ps: torch.optim.AdamW(ps)"
        )
    params = list(model.parameters())
    if not params:
        raise DcpOptError("model: has no parameters; allowed: a module with parameters")
    bad = [(n, p.dtype) for n, p in model.named_parameters() if not p.is_floating_point()]
    if bad:
        raise DcpOptError(
            f"model parameters: {bad[0][0]!r} is {bad[0][1]}, not floating point; allowed: "
            "float32, float64 or bfloat16 parameters"
        )
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise DcpOptError(
            f"model parameters: mixed dtypes {sorted(map(str, dtypes))}; allowed: one dtype"
        )
    if dtype in ("fp32", "bf16") and params[0].dtype != torch.float32:
        raise DcpOptError(
            f"model parameters: {params[0].dtype} with dtype={dtype!r}; allowed: float32 "
            "(the parameters are the fp32 master weights), or dtype=None"
        )


def closing_sample(task, model: nn.Module):
    """A one-token sample for the closing micro-step. A task may define `closing_sample`;
    language-model tasks take two token ids, DiffusionTask a 1x1 latent and a 1-token caption
    shaped from the model's config."""
    own = getattr(task, "closing_sample", None)
    if callable(own):
        return own(model)
    if isinstance(task, LMTask) or type(task).__name__ == "HFCausalLMTask":
        return torch.zeros(2, dtype=torch.long)
    if isinstance(task, DiffusionTask) and hasattr(model, "cfg"):
        dt = next(model.parameters()).dtype
        cfg = model.cfg
        return {
            "x": torch.zeros(1, 1, cfg.in_channels, dtype=dt),
            "text": torch.zeros(1, cfg.text_dim, dtype=dt),
        }
    raise DcpOptError(
        f"task: {type(task).__name__} has no closing_sample(model); allowed: LMTask, "
        "HFCausalLMTask, DiffusionTask (TinyDiT), or a task that defines closing_sample"
    )


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units: each layer of the first `layers` ModuleList (TinyLM, TinyDiT, HF
    models' `model.layers`), then the root. Per-layer units bound the reduce-scatter buffer of
    the closing step to one layer's gradients."""
    for name, m in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(m, nn.ModuleList):
            return [*m, model]
    return [model]


@dataclass
class Sharding:
    """A model sharded under one mode, with its optimizer over the (sharded) fp32 params."""

    mode: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    units: list
    sample: object  # the closing micro-step's sample
    dtype: str | None
    # Called with this Sharding after the plan's last micro-batch, before the world reduces:
    # the step's peak of model states (benchmarks/bench_memory.py measures there).
    probe: Callable | None = None
    # The loss sum's group: None (the world), or under tensor parallelism the GPUs of this TP
    # rank (each GPU of a unit holds the unit's whole loss).
    loss_group: object = None
    # ZeRO-3 per layer (Plan.shard_domain): 0 is the step-level schedule above; s > 0 shards
    # over aligned blocks of s ranks and gathers each unit per micro-step (docs/architecture.md).
    shard_domain: int = 0
    # The closing micro-step, when not the task's one-token sample through the model: a
    # pipeline stage's own pass (runtime/pipeline/stages.py empty_pass), called with `state`.
    closing: Callable | None = None

    def check_plan(self, plan, model: nn.Module | None = None) -> None:
        """Fail (on every rank alike: they hold the same plan) if the plan was made for
        another mode, or `model` is not the sharded one. A plan without a recorded mode (made
        before plans recorded it) runs."""
        if model is not None and model is not self.model:
            raise DcpOptError(
                "model: not the model this Sharding wraps; allowed: the module passed to shard()"
            )
        domain = getattr(plan, "shard_domain", 0)
        if domain != self.shard_domain:
            raise ShardingModeError(
                f"shard_domain: the plan has {domain} but this run shards with "
                f"{self.shard_domain}; allowed: shard(..., shard_domain={domain})"
            )
        planned = getattr(plan, "optimizer_sharding", "")
        if planned and planned != self.mode:
            raise ShardingModeError(
                f"optimizer_sharding: the plan's cost model planned {planned!r} but this run "
                f"shards {self.mode!r}; allowed: a plan made with "
                f"CostModel(optimizer_sharding={self.mode!r}), or shard(mode={planned!r})"
            )

    def begin_step(self) -> None:
        """Gather every unit once (a world all-gather in the sharded modes) and keep it
        gathered through the step; no gradient sync inside the plan's phases. Per layer
        (shard_domain > 0): gather per unit and micro-step, reduce-scatter inside the domain
        every micro-step, all-reduce across domains only in the closing micro-step."""
        if self.shard_domain:
            for u in self.units:
                u.set_reshard_after_forward(True, recurse=False)
                u.set_reshard_after_backward(True, recurse=False)
                u.set_requires_gradient_sync(True, recurse=False)
                u.set_requires_all_reduce(False, recurse=False)
            return
        for u in self.units:
            u.set_reshard_after_forward(False, recurse=False)
            u.set_reshard_after_backward(False, recurse=False)
            u.set_requires_gradient_sync(self.mode == "none", recurse=False)
        for u in self.units:
            u.unshard()

    def finish_step(self, task, state: SPState, *, step: int, kind: str, loss: torch.Tensor):
        """Reduce the gradients over the world, step the optimizer, zero the gradients and
        free the gathered parameters. Returns the loss summed over the world."""
        if self.probe is not None:
            self.probe(self)
        if self.mode != "none":
            for u in self.units:
                u.set_requires_gradient_sync(True, recurse=False)
                u.set_requires_all_reduce(True, recurse=False)
            self.empty_micro_step(task, state, step=step, kind=kind)
        # While gathered, FSDP2 registers the unsharded parameters on the modules; resharding
        # puts back the sharded ones, which hold the gradients and which the optimizer steps.
        for u in self.units:
            u.reshard()
        if self.mode == "none":
            _all_reduce_grads(self.model)
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.loss_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def empty_micro_step(self, task, state: SPState, *, step: int, kind: str) -> None:
        """One token through every unit, loss x 0 (its gradient is exactly zero), SP degree
        1: it takes part in every per-unit gather and reduce-scatter and changes nothing."""
        if self.closing is not None:
            self.closing(state)
            return
        state.sp, state.recompute_layers = SPGroup.single(), 0
        task.run(self.model, [(-1, self.sample)], state, step=step, kind=kind, scale=0.0)

    def padding(self, plan, rank: int) -> tuple[int, ...]:
        """Per phase, the empty micro-steps this rank runs after its own micro-batches: up to
        the largest count in its shard domain, so every member of a domain calls the per-unit
        collectives equally often (none at the step-level schedule, shard_domain 0). Under
        TP `rank` is the plan rank, a unit (execute_step passes tp.unit): every GPU of a
        unit gets the same padding."""
        if not self.shard_domain:
            return (0,) * len(plan.phases)
        s = self.shard_domain
        first = rank - rank % s
        out = []
        for p in range(len(plan.phases)):
            counts = [len(plan.group_of(r, p).micro_batches) for r in range(first, first + s)]
            out.append(max(counts) - counts[rank - first])
        return tuple(out)


def _check_domain(shard_domain, mode: str, world: int, tp=None) -> None:
    """`world`: the ranks a domain is counted in: GPUs, or under `tp` the units."""
    if isinstance(shard_domain, bool) or not isinstance(shard_domain, int) or shard_domain < 0:
        raise DcpOptError(f"shard_domain: {shard_domain!r}; allowed: an integer >= 0")
    if shard_domain and mode != "zero3":
        raise DcpOptError(
            f"shard_domain: {shard_domain} needs mode 'zero3', got {mode!r}; allowed: "
            "shard_domain=0 with any mode, or mode='zero3'"
        )
    if shard_domain and world % shard_domain:
        where = f"world of {world} ranks"
        if tp is not None:
            where = f"{world} units of tensor_parallel {tp.degree} (a domain counts units)"
        raise DcpOptError(
            f"shard_domain: {shard_domain} does not divide the {where}; "
            f"allowed: {[d for d in range(1, world + 1) if world % d == 0]}"
        )


def _mesh(mode: str, pool: GroupPool, shard_domain: int) -> DeviceMesh:
    """none: this rank alone; the step-level schedule: the world; per layer: replicate across
    domains x shard inside each aligned block of `shard_domain` ranks (HSDP), 1-D when one
    domain is the world."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    world = dist.get_world_size()
    if shard_domain and shard_domain < world:
        grid = torch.arange(world).view(world // shard_domain, shard_domain)
        return DeviceMesh(device, grid, mesh_dim_names=("replicate", "shard"))
    group = pool.get(pool.rank, 1) if mode == "none" else dist.group.WORLD
    return DeviceMesh.from_group(group, device)


def _stage_mesh(stage, pool: GroupPool) -> DeviceMesh:
    """A pipeline stage's ranks (its units: rank // n is the stage, n = world / stages)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    n = dist.get_world_size() // stage.num_stages
    return DeviceMesh.from_group(pool.get(stage.stage * n, n), device)


def _tp_mesh(tp, shard_domain: int) -> DeviceMesh:
    """Under tensor parallelism FSDP2 shards over the data-parallel column of the TP mesh
    ("dp": the GPUs of this TP rank, one per unit), which must share the TP mesh's root so
    that FSDP2 can join them into its ("dp", "tp") or ("replicate", "shard", "tp") parameter
    mesh (torchtitan's 2-D FSDP + TP and HSDP + TP). Per layer over domains of s < units
    units, the column is split into (units / s) x s ("replicate" across domains, "shard"
    inside each) by `DeviceMesh._unflatten` (torch's own way to reshape one dimension of a
    mesh in place: same root, the sub-groups created collectively)."""
    dp = tp.mesh["dp"]
    if shard_domain and shard_domain < tp.num_units:
        shape = (tp.num_units // shard_domain, shard_domain)
        return dp._unflatten(0, shape, ("replicate", "shard"))
    return dp


def shard(
    model: nn.Module,
    make_optimizer: Callable,
    *,
    mode: str,
    pool: GroupPool,
    task,
    dtype: str | None = None,
    tp=None,
    shard_domain: int = 0,
) -> Sharding:
    """Shard `model` in place under `mode` (collective: every rank calls it alike) and build
    its optimizer with `make_optimizer(params)`. Bad input raises before the model changes.

    `tp` (runtime/groups.py TPGroups; the model already split by apply_tensor_parallel):
    zero1 / zero2 / zero3 shard over the units, FSDP2 on the "dp" dimension of the 2-D mesh
    (as torchtitan's 2-D FSDP + TP), so each GPU holds 1 / (units) of its TP shard.
    `shard_domain` > 0 (mode zero3, the plan's Plan.shard_domain): ZeRO-3 per layer over
    aligned blocks of that many ranks; under `tp` that many units (HSDP + TP: each GPU holds
    1 / s of its TP shard, replicated across the units / s domains; `_tp_mesh`).
    `model` a pipeline stage (build_stage's): zero1 / zero2 / zero3 over the stage's ranks
    (under `tp`, a PipelineTPGroups, its units of each TP rank), closing each step with the
    stage's own pass (docs/integration.md, "ZeRO under a pipeline")."""
    _check_inputs(model, make_optimizer, mode, dtype)
    stage = _stage_of(model, mode, tp, shard_domain)
    if tp is not None and mode not in TP_MODES:
        raise DcpOptError(
            f"mode: {mode!r} with tensor parallelism not built; allowed: {list(TP_MODES)} (or "
            "no shard(): execute_step sums the gradients over the units)"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    _check_domain(shard_domain, mode, world if tp is None else tp.num_units, tp)
    sample = None if stage else closing_sample(task, model)
    if not isinstance(pool, GroupPool):
        raise DcpOptError(
            f"pool: expected the GroupPool of this run, got {type(pool).__name__}; allowed: "
            "GroupPool.create() after torch.distributed.init_process_group"
        )
    if tp is not None:
        mesh = _tp_mesh(tp, shard_domain)
    else:
        mesh = _stage_mesh(model, pool) if stage else _mesh(mode, pool, shard_domain)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if dtype == "bf16" else None,
        reduce_dtype=torch.float32 if dtype == "bf16" else None,
    )
    units = shard_units(model)
    placement = None if tp is None else fsdp_placement
    for u in units:
        fully_shard(u, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    for u in units:
        # Sum, not mean: the plan's losses are already scaled by 1 / loss_normalizer, and
        # PREMUL_SUM (FSDP2's route for a custom factor) is not a gloo reduce op.
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    optimizer = make_optimizer(model.parameters())
    out = Sharding(mode, model, optimizer, units, sample, dtype, shard_domain=shard_domain)
    out.loss_group = None if tp is None or stage else tp.dp_group  # a stage: the world's
    # sum, the pipeline executor counting each unit's loss once (its TP rank 0's)
    if stage:
        from .pipeline.stages import empty_pass

        out.closing = functools.partial(empty_pass, model)
    return out


def _stage_of(model: nn.Module, mode: str, tp, shard_domain: int) -> bool:
    """Whether `model` is a pipeline stage (build_stage's), and if so that this sharding is
    built for stages: step-level zero1 / zero2 / zero3 over the stage's ranks (a `none`
    replica's world all-reduce and per-layer domains would cross stages); with `tp`, a
    runtime.groups.PipelineTPGroups, over the stage's units of this TP rank (its "dp" column,
    as FSDP2 + TP without a pipeline)."""
    from .groups import PipelineTPGroups
    from .pipeline.stages import PipelineStage

    if not isinstance(model, PipelineStage):
        return False
    if mode not in TP_MODES or shard_domain or (tp is not None and not isinstance(
            tp, PipelineTPGroups)):  # fmt: skip
        raise DcpOptError(
            f"model: a pipeline stage with mode {mode!r}, shard_domain {shard_domain}"
            f"{f', tp {type(tp).__name__}' if tp is not None else ''}; allowed: mode 'zero1', "
            "'zero2' or 'zero3' with shard_domain 0, tp None or PipelineTPGroups (the "
            "step-level schedule over the stage's ranks)"
        )
    return True


def _all_reduce_grads(model: nn.Module, bucket_bytes: int = 25 * 2**20) -> None:
    """Sum the (full, local) gradients of a `none`-mode replica over the world in flat
    buckets per dtype; a parameter without a gradient (an idle rank) sends zeros."""
    grads = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    buckets: list[list[torch.Tensor]] = []
    for g in grads:
        last = buckets[-1] if buckets else None
        if last and last[0].dtype == g.dtype and sum(x.nbytes for x in last) < bucket_bytes:
            last.append(g)
        else:
            buckets.append([g])
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _group(unit):
    """FSDP2's parameter group of a unit (torch 2.13 `FSDPParamGroup`), or None."""
    return unit._get_fsdp_state()._fsdp_param_group


def held_bytes(sharding: Sharding) -> dict[str, int]:
    """Model-state bytes this rank holds now, from tensor storage (each storage counted once):
    fp32 master shards (`params`), the gathered compute copy (`compute`), gradients (sharded,
    or FSDP2's unsharded accumulators during a step) and optimizer state. Reads FSDP2's
    per-parameter records (torch 2.13 `FSDPParam`): the one place that holds the gathered
    buffers and accumulators."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    fps, partial = [], []
    for u in sharding.units:
        group = _group(u)
        fps += group.fsdp_params if group is not None else []
        # per layer over several domains: the gradient shards wait here for the all-reduce
        partial.append(getattr(group, "_partial_reduce_output", None))
    out = {"params": size(fp.sharded_param for fp in fps)}
    # gathered: the units' copied-out buffers, and any all-gather still pending (a prefetch
    # issued but not yet waited on holds its whole output buffer)
    pending = [getattr(_group(u), "_all_gather_result", None) for u in sharding.units]
    gathered = [t for fp in fps for t in fp.all_gather_outputs]
    out["compute"] = size(gathered + [r.all_gather_output for r in pending if r is not None])
    grads = [fp.sharded_param.grad for fp in fps] + [fp.unsharded_accumulated_grad for fp in fps]
    grads += [fp._unsharded_param.grad for fp in fps if hasattr(fp, "_unsharded_param")]
    out["grads"] = size(grads + partial)
    state = sharding.optimizer.state.values()
    out["optimizer"] = size(
        v for st in state for v in st.values() if torch.is_tensor(v) and v.dim()
    )
    return out
