"""What ZeRO-3 per layer holds and sends (runtime/sharding.py, shard_domain s > 0), bf16 TinyLM
on 4 gloo ranks, domains of 2 and 4, counted at torch.distributed and from tensor storage:

- per micro-step (the plan's, the padding's and the closing one), on every rank: an
  all-gather of every unit's bf16 parameters in forward and again in backward (2 x 2 B x P of
  gathered buffer) and a reduce-scatter of the fp32 gradients (4 B x P of input buffer), inside
  the domain; once per step, when there are several domains, an all-reduce of the fp32 gradient
  shards across them (4 B x P / s); the loss all-reduce (8 B). Ring traffic per rank is
  (s - 1) / s of each buffer.
- between micro-steps (after the plan's last micro-batch): 16 B x P / s (fp32 master 4, fp32
  gradient 4, Adam moments 8), nothing gathered (a domain idle all step: no gradient yet).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dcp_opt.runtime import LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.sharding import held_bytes, shard
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, Cluster, CostModel
from dcp_opt.plan import Plan

# Every parameter's first dimension divides by 4: FSDP2 pads none of them.
CFG = LMConfig(vocab_size=64, hidden=32, num_heads=4, num_layers=2, ffn_hidden=64)
LENGTHS = [5, 17, 9, 30, 2, 11, 40, 3]
WORLD = 4


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(WORLD, timeout_s=60.0)
    yield w
    w.close()


def job_count(ctx, plan_json: str, batch_dict: dict):
    """Two bf16 steps; in the second, bytes per collective kind and group size, and
    held_bytes after the plan's last micro-batch."""
    import torch.distributed as dist

    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    torch.manual_seed(0)
    state, task = SPState(), LMTask()
    model = parallelize(TinyLM(CFG), state)
    sh = shard(model, torch.optim.AdamW, mode="zero3", pool=ctx.pool, task=task, dtype="bf16",
               shard_domain=plan.shard_domain)  # fmt: skip
    data = {q.id: torch.randint(64, (q.shape[0] + 1,)) for q in batch.sequences}
    counts, held = {}, {}
    which = {"all_gather_single": 0, "reduce_scatter_single": 1, "all_reduce": 0}
    inner = {n: getattr(dist, n) for n in which}

    def wrap(name):
        def counted(*args, **kw):
            t = args[which[name]] if len(args) > which[name] else list(kw.values())[which[name]]
            key = f"{name}/{dist.get_world_size(kw.get('group'))}"
            counts[key] = counts.get(key, 0) + t.numel() * t.element_size()
            return inner[name](*args, **kw)

        return counted

    try:
        for name in which:
            setattr(dist, name, wrap(name))
        for step in range(2):
            counts.clear()
            sh.probe = (lambda s: held.update(held_bytes(s))) if step else None
            report = execute_step(plan, task, model, data, pool=ctx.pool, state=state,
                                  step=step, sharding=sh)  # fmt: skip
    finally:
        for name in which:
            setattr(dist, name, inner[name])
    micro_steps = len(report.micro_batches) + sum(report.padding) + 1
    return counts, held, micro_steps


@pytest.mark.parametrize("s", [2, 4])
def test_per_layer_traffic_and_states_are_the_formula(workers, s):
    p = sum(q.numel() for q in TinyLM(CFG).parameters())
    batch = Batch.from_lengths(LENGTHS)
    cluster = Cluster("cpu", 1, WORLD, 1e12, 1e12, 1e10, 1e10)
    cost = CostModel(model_spec(TinyLM(CFG), dtype="bf16"), cluster, None, "zero3")
    plan = dataclasses.replace(run_planner("dcp_inter_pac", batch, cost).plan, shard_domain=s)
    out = workers.run(job_count, plan.to_json(), batch.to_dict())
    steps = [m for _, _, m in out]
    for first in range(0, WORLD, s):  # every rank of a domain ran as many micro-steps
        assert len(set(steps[first : first + s])) == 1, steps
    for counts, held, m in out:
        want = {f"all_gather_single/{s}": 2 * 2 * p * m, f"reduce_scatter_single/{s}": 4 * p * m}
        if s < WORLD:
            want[f"all_reduce/{WORLD // s}"] = 4 * p // s
        want[f"all_reduce/{WORLD}"] = 8  # the loss
        assert counts.keys() == want.keys(), counts
        for k, v in want.items():
            assert abs(counts[k] / v - 1) <= 0.01, (k, counts[k], v)
        assert held["compute"] == 0  # nothing gathered between micro-steps
        assert abs((held["params"] + held["optimizer"]) / (12 * p / s) - 1) <= 0.01, held
        # fp32 gradient shards exist once a micro-step ran (a whole idle domain ran none)
        assert abs(held["grads"] - (4 * p / s if m > 1 else 0)) <= 0.01 * 4 * p / s, held
