"""dcp_opt.runtime: execute a Plan with torch.distributed.

Depends on the dcp_opt core and torch, never on dcp_opt.solvers (it receives a Plan).

    pool = GroupPool.create()                   # once, on every rank, after init_process_group
    model = parallelize(TinyLM(cfg), state)     # swap in SP attention, per-layer checkpointing
    report = execute_step(plan, task, model, data, pool=pool, state=state, step=i)
"""

from .executor import (
    MicroBatchOutOfMemoryError,
    PlanMismatchError,
    StepReport,
    check_same_plan,
    execute_step,
    sum_gradients,
)
from .groups import GroupPool, runtime_cluster
from .models import DiTConfig, Full3DConfig, LMConfig, TinyDiT, TinyLM, TinyMMDiT, TinyWanDiT
from .parallelize import SPState, parallelize
from .replicas import ReplicaMismatchWarning, sync_replicas
from .sharding import Sharding, ShardingModeError, shard
from .sp import SPGroup, all_to_all, ulysses_attention
from .tasks import DiffusionTask, JointDiffusionTask, LMTask, seeded_generator

__all__ = [
    "DiTConfig",
    "DiffusionTask",
    "Full3DConfig",
    "GroupPool",
    "JointDiffusionTask",
    "LMConfig",
    "LMTask",
    "MicroBatchOutOfMemoryError",
    "PlanMismatchError",
    "ReplicaMismatchWarning",
    "SPGroup",
    "SPState",
    "Sharding",
    "ShardingModeError",
    "StepReport",
    "TinyDiT",
    "TinyLM",
    "TinyMMDiT",
    "TinyWanDiT",
    "all_to_all",
    "check_same_plan",
    "execute_step",
    "parallelize",
    "runtime_cluster",
    "seeded_generator",
    "shard",
    "sum_gradients",
    "sync_replicas",
    "ulysses_attention",
]
