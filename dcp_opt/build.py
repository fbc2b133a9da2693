"""Assemble a Plan from the groups a planner chose: idle ranks filled, fingerprint stamped."""

from __future__ import annotations

from collections.abc import Iterable

from .batch import Batch
from .cost import CostModel, combine_fingerprints, default_normalizer_kind, loss_normalizer
from .plan import Group, Phase, Plan, fingerprint_inputs


def fill_idle(groups: Iterable[Group], num_ranks: int) -> tuple[Group, ...]:
    """Add a degree-1 idle group for every rank no group covers; sort by start rank."""
    groups = list(groups)
    covered = {r for g in groups for r in g.ranks}
    groups += [Group(r, 1, ()) for r in range(num_ranks) if r not in covered]
    return tuple(sorted(groups, key=lambda g: g.start_rank))


def make_plan(
    phases: Iterable[Iterable[Group]],
    batch: Batch,
    cost: CostModel,
    *,
    planner: str,
    normalizer_kind: str | None = None,
    meta: dict | None = None,
    predicted_step_time_s: float | None = None,
) -> Plan:
    n = cost.cluster.num_gpus
    kind = normalizer_kind or default_normalizer_kind(cost.model)
    return Plan(
        phases=tuple(Phase(fill_idle(gs, n)) for gs in phases),
        num_ranks=n,
        loss_normalizer=loss_normalizer(batch, kind),
        normalizer_kind=kind,
        fingerprint=cached_plan_fingerprint(batch, cost),
        # readable, so a mismatch can name the part that differs (plan.fingerprint_differences)
        fingerprint_inputs=cost.memoised(
            ("fingerprint_inputs", batch.fingerprint(), *_identity(cost)),
            lambda: fingerprint_inputs(batch, cost),
        ),
        planner=planner,
        predicted_step_time_s=predicted_step_time_s,
        meta=meta or {},
        optimizer_sharding=cost.optimizer_sharding,
        tensor_parallel=cost.tensor_parallel,
        shard_domain=cost.shard_domain,
    )


def _identity(cost: CostModel) -> tuple:
    """The memo key of what a plan's fingerprint depends on (cached_plan_fingerprint)."""
    return (
        id(cost.model),
        id(cost.cluster),
        id(cost.coeffs),
        cost.optimizer_sharding,
        cost.usable_memory_fraction,
        cost.grad_reduce_bytes_per_param,
        cost.tensor_parallel,
        cost.shard_domain,
    )


def cached_plan_fingerprint(batch: Batch, cost: CostModel) -> str:
    """plan_fingerprint, cached in the cost model: hashing the cost model's JSON takes about
    0.3 ms, and make_plan and validate ask for it on every plan. The key holds the identity
    of the base model's inputs, so a copy made with dataclasses.replace (which shares the
    memo) with another model or cluster never sees this one's fingerprint; every other
    change goes through `CostModel.with_`, which starts a fresh memo."""
    ident = _identity(cost)
    key = ("plan_fingerprint", batch.fingerprint(), *ident)
    cost_key = ("cost_fingerprint", *ident)  # the same for every batch of a run
    return cost.memoised(
        key,
        lambda: combine_fingerprints(
            batch.fingerprint(), cost.memoised(cost_key, cost.fingerprint)
        ),
    )
