"""The process-group pool: every group a plan may use, created once at start-up.

torch.distributed requires every rank to call `new_group` for every group, in the same order,
even for groups it is not a member of. So all ranks walk the cluster's allowed degrees and
aligned placements in one fixed order (degree ascending, start ascending) and keep the handles;
activating a group between phases is then a dictionary lookup, never a collective.

Timeouts: `new_group` without a timeout takes torch's default (30 min for gloo), not the
world group's, so a rank that hangs (stopped, deadlocked) would hold every other rank for
30 minutes. Every group the runtime creates takes the world group's timeout instead
(`world_timeout_s`: what `init_process_group(timeout=...)` was given, 120 s through
runtime/launch.py's init_distributed), unless the caller passes its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dcp_opt.cluster import Cluster
from dcp_opt.errors import DcpOptError

from .elastic import raise_with_restart_hint


def world_timeout_s() -> float | None:
    """The timeout (seconds) the default process group was initialised with, read from its
    backend's options; None when torch.distributed is not initialised or the backend does
    not expose one (then new groups keep torch's default)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    try:
        timeout = dist.group.WORLD._get_backend(torch.device(device)).options._timeout
    except (AttributeError, RuntimeError):  # a backend without options (torch's threaded pg)
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def group_timeout(timeout_s: float | None) -> dict:
    """`new_group` keyword arguments for a group bounded by `timeout_s`, or by the world
    group's timeout when None (see the module docstring)."""
    if timeout_s is None:
        timeout_s = world_timeout_s()
    return {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}


def runtime_cluster(world_size: int, gpus_per_node: int | None = None) -> Cluster:
    """A Cluster whose ranks match the torch world (only its shape matters to the pool)."""
    per = gpus_per_node or world_size
    if world_size % per:
        raise DcpOptError(
            f"gpus_per_node: {per} must divide the world size {world_size}; "
            "allowed: a divisor of the world size"
        )
    return Cluster("runtime", world_size // per, per, 1.0, 1.0, 1.0, 1.0)


@dataclass(frozen=True)
class GroupPool:
    """Process groups keyed by (start rank, degree); `rank` is this process's global rank."""

    groups: dict
    rank: int
    world_size: int
    degrees: tuple[int, ...]

    @classmethod
    def create(
        cls,
        cluster: Cluster | None = None,
        *,
        backend: str | None = None,
        timeout_s: float | None = None,
    ) -> GroupPool:
        """Collective: every rank must call this with the same cluster, in the same order
        relative to its other new_group calls. `timeout_s` bounds every collective of every
        group, so a rank that dies or hangs makes the others fail instead of waiting; None
        (the default) takes the world group's timeout (`world_timeout_s`), not torch's 30
        minutes."""
        if not dist.is_initialized():
            raise DcpOptError("GroupPool.create: call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        cluster = cluster or runtime_cluster(world)
        if cluster.num_gpus != world:
            raise DcpOptError(
                f"cluster: has {cluster.num_gpus} ranks but the torch world has {world}; "
                "allowed: a cluster of exactly world_size ranks"
            )
        kw = group_timeout(timeout_s)
        if backend is not None:
            kw["backend"] = backend
        groups = {}
        for degree in cluster.allowed_degrees:
            for start in cluster.placements(degree):
                ranks = list(range(start, start + degree))
                try:
                    groups[(start, degree)] = dist.new_group(ranks, **kw)
                except RuntimeError as e:  # a torchrun restart reading stale addresses
                    raise_with_restart_hint(e)
                    raise
        return cls(groups, dist.get_rank(), world, tuple(cluster.allowed_degrees))

    def get(self, start: int, degree: int):
        try:
            return self.groups[(start, degree)]
        except KeyError:
            raise DcpOptError(
                f"group: no process group at start {start} with degree {degree}; allowed "
                f"degrees {list(self.degrees)} at the cluster's placements (Cluster.placements)"
            ) from None

    def member_of(self, start: int, degree: int) -> bool:
        return start <= self.rank < start + degree

    def check_plan(self, plan) -> None:
        """Fail on every rank alike (no collective) if a plan needs a group the pool lacks."""
        if plan.num_ranks != self.world_size:
            raise DcpOptError(
                f"plan.num_ranks: {plan.num_ranks} but the world has {self.world_size} ranks"
            )
        for p, phase in enumerate(plan.phases):
            for g in phase.groups:
                if (g.start_rank, g.degree) not in self.groups:
                    raise DcpOptError(
                        f"plan.phases[{p}]: group at start {g.start_rank} with degree "
                        f"{g.degree} is not in the pool; allowed degrees {list(self.degrees)} "
                        "at the cluster's placements (Cluster.placements)"
                    )


@dataclass(frozen=True)
class TPGroups:
    """The process groups of a tensor-parallel run (plan.tensor_parallel = `degree` = t).

    A plan rank is a unit of t GPUs: GPU `u t + j` is TP rank j of unit u (docs/plan-format.md,
    schema 3). `mesh` is the 2-D DeviceMesh ("dp", "tp") of shape (units, t): its "tp" rows are
    the units (parallelize_module runs over them), its "dp" columns the GPUs of equal TP rank
    (the gradient sum and FSDP2 run over them). A plan group of d units at start unit s is, for
    TP rank j, the GPUs `(s + i) t + j` for i < d: its Ulysses all-to-alls run between GPUs of
    equal TP rank, each carrying H / (t d) heads. Every such group exists once per (s, d, j),
    created in one fixed order on every rank (degree, start, TP rank ascending)."""

    degree: int
    mesh: object  # torch DeviceMesh ("dp", "tp")
    groups: dict  # (start unit, unit degree) -> [handle for TP rank j]
    rank: int  # this GPU's global rank
    num_units: int
    degrees: tuple[int, ...]

    @property
    def unit(self) -> int:
        return self.rank // self.degree

    @property
    def tp_rank(self) -> int:
        return self.rank % self.degree

    @property
    def dp_group(self):
        """The GPUs of this TP rank across all units (the data-parallel dimension)."""
        return self.mesh.get_group("dp")

    @classmethod
    def create(
        cls, degree: int, *, gpus_per_node: int | None = None, timeout_s: float | None = None
    ) -> TPGroups:
        """Collective: every rank calls it with the same arguments, in the same order relative
        to its other new_group calls. `gpus_per_node` (default: the world) must divide by
        `degree`: a unit never spans nodes."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise DcpOptError("TPGroups.create: call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        per = gpus_per_node or world
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or per % degree:
            raise DcpOptError(
                f"tensor_parallel: {degree!r} not allowed; allowed: an integer >= 1 dividing "
                f"the GPUs of a node ({per})"
            )
        units = runtime_cluster(world // degree, per // degree)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (world // degree, degree), mesh_dim_names=("dp", "tp"))
        kw = group_timeout(timeout_s)
        groups = {}
        for d in units.allowed_degrees:
            for start in units.placements(d):
                groups[(start, d)] = [
                    dist.new_group([(start + i) * degree + j for i in range(d)], **kw)
                    if d > 1
                    else None
                    for j in range(degree)
                ]
        return cls(degree, mesh, groups, dist.get_rank(), units.num_gpus, units.allowed_degrees)

    def sp_handle(self, start: int, degree: int):
        """The process group of plan group (start unit, degree) for this GPU's TP rank."""
        try:
            return self.groups[(start, degree)][self.tp_rank]
        except KeyError:
            raise DcpOptError(
                f"group: no unit group at start {start} with degree {degree}; allowed degrees "
                f"{list(self.degrees)} at the unit cluster's placements"
            ) from None

    def check_plan(self, plan) -> None:
        """Fail on every rank alike (no collective) if a plan does not fit these groups."""
        if plan.tensor_parallel != self.degree or plan.num_ranks != self.num_units:
            raise DcpOptError(
                f"plan.tensor_parallel: {plan.tensor_parallel} with num_ranks {plan.num_ranks}; "
                f"allowed: tensor_parallel {self.degree} with {self.num_units} units (the "
                "TPGroups of this run)"
            )
        for p, phase in enumerate(plan.phases):
            for g in phase.groups:
                if (g.start_rank, g.degree) not in self.groups:
                    raise DcpOptError(
                        f"plan.phases[{p}]: group at unit {g.start_rank} with degree "
                        f"{g.degree} is not in the pool; allowed degrees {list(self.degrees)}"
                    )


@dataclass(frozen=True)
class PipelineTPGroups(TPGroups):
    """The process groups of a pipeline run with tensor parallelism (plan.pipeline set,
    plan.tensor_parallel = `degree` = t > 1): GPU `(s n + u) t + j` is TP rank j of unit u of
    stage s (docs/plan-format.md, the rank map; stages outermost, TP innermost).

    `mesh` is the 3-D DeviceMesh ("pp", "dp", "tp") of shape (stages, units, t): its "tp" rows
    are a stage's units (apply_tensor_parallel splits over them, as with TPGroups), its "dp"
    columns the GPUs of one stage and one TP rank (each stage's gradients are summed over
    them). A plan group of d units at start unit a is, on stage s for TP rank j, the GPUs
    `(s n + a + i) t + j` for i < d (Ulysses between GPUs of equal TP rank, H / (t d) heads
    each). Every such group exists once per (s, a, d, j), created in one fixed order on every
    rank (stage, degree, start, TP rank ascending). `degree`, `mesh`, `unit`, `tp_rank`,
    `dp_group`, `sp_handle` and `check_plan` answer as TPGroups' do, for this GPU's stage:
    `mesh` is ("pp", "dp", "tp"), `groups` keyed (stage, start unit, unit degree),
    `num_units` a stage's."""

    num_stages: int = 1

    @property
    def stage(self) -> int:
        return self.rank // (self.num_units * self.degree)

    @property
    def unit(self) -> int:
        return (self.rank // self.degree) % self.num_units

    @classmethod
    def create(cls, degree: int, num_stages: int, *, gpus_per_node: int | None = None,
               timeout_s: float | None = None) -> PipelineTPGroups:  # fmt: skip
        """Collective: every rank calls it with the same arguments, in the same order relative
        to its other new_group calls. The world must be stages x units x degree, and
        `gpus_per_node` (default: a stage's GPUs) must divide by `degree`."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise DcpOptError(
                "PipelineTPGroups.create: call torch.distributed.init_process_group first"
            )
        world = dist.get_world_size()
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1 \
                or world % num_stages:  # fmt: skip
            raise DcpOptError(f"num_stages: {num_stages!r} not allowed; allowed: an integer "
                              f">= 1 dividing the world ({world})")  # fmt: skip
        per_stage = world // num_stages
        per = gpus_per_node or per_stage
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1 or per % degree \
                or per_stage % degree:  # fmt: skip
            raise DcpOptError(
                f"tensor_parallel: {degree!r} not allowed; allowed: an integer >= 1 dividing "
                f"the GPUs of a node ({per}) and of a stage ({per_stage})"
            )
        n = per_stage // degree
        units = runtime_cluster(n, max(1, min(n, per // degree)))
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (num_stages, n, degree), mesh_dim_names=("pp", "dp", "tp"))
        kw = group_timeout(timeout_s)
        groups = {}
        for s in range(num_stages):
            for d in units.allowed_degrees:
                for start in units.placements(d):
                    groups[(s, start, d)] = [
                        dist.new_group([((s * n) + start + i) * degree + j for i in range(d)],
                                       **kw) if d > 1 else None
                        for j in range(degree)
                    ]  # fmt: skip
        return cls(degree, mesh, groups, dist.get_rank(), n, units.allowed_degrees, num_stages)

    def sp_handle(self, start: int, degree: int):
        """The process group of plan group (start unit, degree) on this GPU's stage, for this
        GPU's TP rank."""
        try:
            return self.groups[(self.stage, start, degree)][self.tp_rank]
        except KeyError:
            raise DcpOptError(
                f"group: no unit group at start {start} with degree {degree}; allowed degrees "
                f"{list(self.degrees)} at the unit cluster's placements"
            ) from None

    def check_plan(self, plan) -> None:
        """Fail on every rank alike (no collective) if a plan does not fit these groups."""
        pipe = plan.pipeline
        stages = 0 if pipe is None else pipe.num_stages
        if (plan.tensor_parallel, plan.num_ranks, stages) != (self.degree, self.num_units,
                                                              self.num_stages):  # fmt: skip
            raise DcpOptError(
                f"plan.tensor_parallel: {plan.tensor_parallel} with num_ranks {plan.num_ranks} "
                f"and {stages} stages; allowed: tensor_parallel {self.degree} with "
                f"{self.num_units} units and {self.num_stages} stages (the PipelineTPGroups of "
                "this run)"
            )
        for p, phase in enumerate(plan.phases):
            for g in phase.groups:
                if g.degree > 1 and (0, g.start_rank, g.degree) not in self.groups:
                    raise DcpOptError(
                        f"plan.phases[{p}]: group at unit {g.start_rank} with degree "
                        f"{g.degree} is not in the pool; allowed degrees {list(self.degrees)}"
                    )
