"""Stage costs (dcp_opt/pipeline/stages.py), validate and simulate of a plan with a
pipeline, by hand and against the cost model without a pipeline."""

from dataclasses import replace

import numpy as np
import pytest

from dcp_opt import CostModel, cluster_preset, model_preset, simulate, validate
from dcp_opt.batch import Batch, Sequence
from dcp_opt.pipeline.build import pipeline_plan
from dcp_opt.pipeline.makespan import column_makespan
from dcp_opt.pipeline.stages import column_times, stage_layout
from dcp_opt.plan import Group, MicroBatch, Pipeline


def _cost(cluster="h200x8", model="llama-1b"):
    return CostModel(model_preset(model), cluster_preset(cluster))


def _batch(lengths):
    return Batch([Sequence(i, (n,)) for i, n in enumerate(lengths)])


def test_one_stage_sums_to_the_cost_model():
    cost = _cost()
    lay = stage_layout(cost, Pipeline((16,)))
    feats = cost.batch_features(_batch([8192, 1000, 300]))
    for d, r in [(1, 0), (2, 5), (8, 16)]:
        f, b, x = column_times(lay, feats, d, 0, "ulysses", np.full((3, 1), r))
        assert x.shape == (0, 3)
        want = cost.time(feats, d, r)
        np.testing.assert_allclose(f[0] + b[0], want, rtol=1e-12)


def test_stages_split_the_layers_and_the_head_rides_on_the_last():
    cost = _cost()
    lay = stage_layout(cost, Pipeline((8, 8)))
    feats = cost.batch_features(_batch([4096]))
    f, b, _ = column_times(lay, feats, 1, 0, "ulysses", np.zeros((1, 2), dtype=int))
    co = cost.coeffs
    head = 4096 * co.head_fwd_per_token_s
    assert f[1, 0] - f[0, 0] == pytest.approx(head, rel=1e-9)
    whole = cost.time(feats, 1, 0)[0] + co.microbatch_overhead_s  # two stages pay it
    assert (f + b).sum() == pytest.approx(whole, rel=1e-9)


def test_p2p_is_tokens_times_hidden_times_bytes_over_the_nic():
    # h200x32, p = 2: stage 0 is GPUs 0-15, stage 1 GPUs 16-31: every pair crosses nodes
    cost = _cost("h200x32")
    lay = stage_layout(cost, Pipeline((8, 8)))
    feats = cost.batch_features(_batch([65536]))
    _, _, x = column_times(lay, feats, 4, 0, "ulysses", np.zeros((1, 2), dtype=int))
    cl, m = cost.cluster, cost.model
    want = 65536 / 4 * m.hidden * m.dtype_bytes / cl.inter_node_bw + cl.inter_node_latency_s
    assert x[0, 0] == pytest.approx(want, rel=1e-12)


def test_p2p_inside_a_node_goes_at_nvlink():
    # h200x8, p = 2: stage 0 is GPUs 0-3, stage 1 GPUs 4-7: one node
    cost = _cost()
    lay = stage_layout(cost, Pipeline((8, 8)))
    feats = cost.batch_features(_batch([1024]))
    _, _, x = column_times(lay, feats, 1, 0, "ulysses", np.zeros((1, 2), dtype=int))
    cl, m = cost.cluster, cost.model
    want = 1024 * m.hidden * m.dtype_bytes / cl.intra_node_bw + cl.intra_node_latency_s
    assert x[0, 0] == pytest.approx(want, rel=1e-12)


TWO = Pipeline((8, 8))


def _plan(cost, batch, groups, pipe=TWO):
    return pipeline_plan([groups], batch, stage_layout(cost, pipe), planner="hand")


def test_simulate_is_the_slowest_column_plus_the_stage_sync():
    cost = _cost()
    batch = _batch([4096, 2048, 1024, 512, 8192])
    g0 = Group(0, 2, (MicroBatch((0,), 0, (0, 0)), MicroBatch((1, 2), 0, (0, 0))))
    g1 = Group(2, 1, (MicroBatch((3,), 0, (0, 0)), MicroBatch((4,), 0, (0, 0))))
    plan = _plan(cost, batch, [g0, g1])
    assert validate(plan, batch, cost) == []
    sim = simulate(plan, batch, cost)
    lay = stage_layout(cost, plan.pipeline)
    spans = []
    for g in (g0, g1):
        feats = np.array([cost.batch_features(batch)[list(mb.sequence_ids)].sum(axis=0)
                          for mb in g.micro_batches])  # fmt: skip
        f, b, x = column_times(lay, feats, g.degree, g.start_rank, "ulysses", np.zeros((2, 2)))
        spans.append(column_makespan(f, b, x, schedule="1f1b", num_stages=2).makespan_s)
    assert sim.finish_s == pytest.approx(max(spans), rel=1e-12)
    assert sim.step_time_s == pytest.approx(max(spans) + sim.grad_sync_s, rel=1e-12)
    assert len(sim.busy_s) == cost.cluster.num_gpus


def test_validate_names_each_pipeline_violation():
    cost = _cost()
    batch = _batch([1024, 2048])
    ok = Group(0, 1, (MicroBatch((0,), 1, (1, 0)), MicroBatch((1,), 0, (0, 0))))
    assert validate(_plan(cost, batch, [ok]), batch, cost) == []
    bad_sum = Group(0, 1, (MicroBatch((0,), 3, (1, 0)), MicroBatch((1,), 0, (0, 0))))
    codes = [v.code for v in validate(_plan(cost, batch, [bad_sum]), batch, cost)]
    assert codes == ["BAD_RECOMPUTE"]
    too_many = Group(0, 1, (MicroBatch((0,), 9, (9, 0)), MicroBatch((1,), 0, (0, 0))))
    codes = [v.code for v in validate(_plan(cost, batch, [too_many]), batch, cost)]
    assert codes == ["BAD_RECOMPUTE"]
    plan = replace(_plan(cost, batch, [ok]), pipeline=Pipeline((8, 7)))
    assert [v.code for v in validate(plan, batch, cost)] == ["BAD_PIPELINE"]
    plan = replace(_plan(cost, batch, [ok]), num_ranks=8)
    assert "WRONG_NUM_RANKS" in [v.code for v in validate(plan, batch, cost)]


def test_validate_checks_each_stages_memory_over_time():
    # llama-7b on 8 H200, p = 2 (4 GPUs a stage; 92.6 GB left after states): 32K tokens keep
    # 80.5 GB on each stage, the running one 5.0 (stage 0) or 11.3 GB (stage 1, the head).
    # Stage 0 holds two 32K-token micro-batches
    # at once under 1F1B and does not fit without recompute; stage 1 holds one and does.
    cost = _cost(model="llama-7b")
    batch = _batch([32768, 32768])
    mbs = tuple(MicroBatch((i,), 0, (0, 0)) for i in range(2))
    plan = _plan(cost, batch, [Group(0, 1, mbs)], Pipeline((16, 16)))
    bad = validate(plan, batch, cost)
    assert [v.code for v in bad] == ["OUT_OF_MEMORY"] and "stage 0" in bad[0].message
    mbs = tuple(MicroBatch((i,), 16, (16, 0)) for i in range(2))
    plan = _plan(cost, batch, [Group(0, 1, mbs)], Pipeline((16, 16)))
    assert validate(plan, batch, cost) == []
