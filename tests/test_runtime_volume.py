"""The runtime moves what the cost model charges: the bytes every rank hands to its
all-to-alls during one executor step equal the cost model's own communication formula
(CostModel.microbatch_time(...).comm_s, recomputed layers included), read with a bandwidth
of 1 byte/s and no latency so that seconds are bytes.

The cost model charges each rank the bytes it sends to its d - 1 peers, (d - 1)/d of the
tensor it hands to all_to_all_single (DeepSpeed-Ulysses eq. 1), so the handed bytes are
comm_s * d / (d - 1). TinyLM runs Ulysses attention (1d), TinyDiT DSP switches (2d).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist
from dcp_opt.runtime import SPState, execute_step, parallelize
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch, Cluster, CostModel, Group, MicroBatch, make_plan
from dcp_opt.plan import Plan
from tests.test_runtime_equiv import SPECS, TASKS, cost_for, make_data, make_model

WORLD = 2
# Micro-batches (1d) and videos' frames and patches (2d, DSP shards each video alone) of whole
# multiples of the degree: no padding, which the cost model does not charge. Recompute 0, 1,
# 2 and every layer.
CASES = {
    "1d": (Batch.from_lengths([5, 7, 6, 4]), [((0, 1), 1), ((2,), 0), ((3,), 3)]),
    "2d": (Batch.from_shapes([(2, 2, 1), (4, 1, 2), (2, 2, 2)]), [((0, 1), 0), ((2,), 0)]),
    "2d-recompute": (
        Batch.from_shapes([(2, 2, 1), (4, 1, 2), (2, 2, 2)]),
        [((0, 1), 2), ((2,), 1)],
    ),
}


def job_a2a_bytes(ctx, kind: str, plan_json: str, batch_dict: dict) -> int:
    """Bytes this rank hands to all_to_all_single during one executor step."""
    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    model, state, handed = make_model(kind, 1), SPState(), []
    parallelize(model, state)
    real = dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        handed.append(inp.numel() * inp.element_size())
        return real(out, inp, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        data = make_data(kind, batch, 1)
        execute_step(plan, TASKS[kind], model, data, pool=ctx.pool, state=state, step=0)
    finally:
        dist.all_to_all_single = real
    return sum(handed)


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(WORLD, timeout_s=120.0)
    yield w
    w.close()


def charged_bytes(kind: str, batch: Batch, mbs) -> float:
    """Bytes per rank the cost model charges for these micro-batches on one group of WORLD."""
    unit = Cluster("bytes", 1, WORLD, 1e15, 1e12, 1.0, 1.0, 0.0, 0.0)
    # The test models run in float64: 8-byte activations (the 1d spec says so already).
    cost = CostModel(replace(SPECS[kind], dtype_bytes=8), unit)
    seqs = batch.by_id
    sent = sum(cost.microbatch_time([seqs[i] for i in ids], WORLD, r).comm_s for ids, r in mbs)
    return sent * WORLD / (WORLD - 1)


# A recomputed DiT layer re-runs both its DSP switches: they gather by index (runtime/video.py),
# and non-reentrant checkpointing (use_reentrant=False) recomputes until every saved tensor,
# the trailing switch's index included, is back; the cost model charges (2L + r) layers'
# all-to-alls (cost.py time_parts_from). (Before 2D micro-batches were packed, the trailing
# switch saved nothing and was skipped: this case was a strict xfail.)


@pytest.mark.parametrize("case", ["1d", "2d", "2d-recompute"])
def test_all_to_all_bytes_are_the_cost_models(workers, case):
    kind = case[:2]
    batch, mbs = CASES[case]
    group = Group(0, WORLD, tuple(MicroBatch(ids, r) for ids, r in mbs))
    plan = make_plan([[group]], batch, cost_for(kind, WORLD), planner="hand")
    want = charged_bytes(kind, batch, mbs)
    assert want > 0
    if any(r for _, r in mbs):  # the recomputed forwards are charged
        assert charged_bytes(kind, batch, [(ids, 0) for ids, _ in mbs]) < want
    got = workers.run(job_a2a_bytes, kind, plan.to_json(), batch.to_dict())
    assert got == [pytest.approx(want, rel=1e-12)] * WORLD
