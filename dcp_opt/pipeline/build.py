"""A Plan with a pipeline from the columns a planner chose (the plan of one stage's units,
make_plan on the stage's cost model, stamped with the job's fingerprint)."""

from __future__ import annotations

from dataclasses import replace

from ..batch import Batch
from ..build import cached_plan_fingerprint, make_plan
from ..cost import CostModel
from ..plan import Plan, fingerprint_inputs
from .stages import StageLayout, layout_cost


def pipeline_plan(phases, batch: Batch, layout: StageLayout, *, planner: str,
                  meta: dict | None = None) -> Plan:  # fmt: skip
    """`phases`: iterables of Groups on one stage's units; idle units filled."""
    cost: CostModel = layout.cost
    plan = make_plan(phases, batch, layout_cost(layout), planner=planner, meta=meta)
    return replace(
        plan,
        fingerprint=cached_plan_fingerprint(batch, cost),
        fingerprint_inputs=fingerprint_inputs(batch, cost),
        pipeline=layout.pipeline,
        tensor_parallel=layout.tensor_parallel,
        optimizer_sharding=cost.optimizer_sharding,
    )
