"""Every rank starts from the same weights (issue 28 item 2): `parallelize` and
`parallelize_hf` check the weights across the world (one checksum all-reduce) and give every
rank rank 0's when they differ, with a warning on rank 0 (runtime/replicas.py). Before, an
unseeded `mode="none"` run trained one model per rank while summing their gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from dcp_opt.runtime import DiTConfig, LMConfig, LMTask, SPState, TinyDiT, TinyLM, parallelize
from dcp_opt.runtime import execute_step as run_step
from dcp_opt.runtime.sharding import shard
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch, Cluster, CostModel, ModelSpec, make_plan
from dcp_opt.plan import Group, MicroBatch

CFG = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(2, timeout_s=30.0)
    yield w
    w.close()


def flat(model) -> torch.Tensor:
    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1).double() for p in ps])


def build(kind: str, seed: int):
    """A model initialised from `seed` (each rank passes its own: an unseeded script)."""
    torch.manual_seed(seed)
    if kind == "lm":
        return TinyLM(CFG)
    if kind == "dit":
        return TinyDiT(DiTConfig())
    from dcp_opt.runtime.hf import tiny_llama

    return tiny_llama(num_layers=2, hidden=16, num_heads=4, vocab_size=32, seed=seed)


def take(kind: str, model):
    if kind == "hf":
        from dcp_opt.runtime.hf import parallelize_hf

        return parallelize_hf(model, SPState())
    return parallelize(model, SPState())


def job_take(ctx, kind: str, same_seed: bool):
    """(weights before, weights after, warnings) when the runtime takes this rank's model."""
    model = build(kind, 0 if same_seed else 1 + ctx.rank)
    before = flat(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        take(kind, model)
    got = [(type(w.message).__name__, str(w.message)) for w in caught]
    return before, flat(model), got


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["lm", "dit", "hf"])
def test_ranks_start_from_rank_0s_weights(workers, kind):
    (b0, a0, w0), (b1, a1, w1) = workers.run(job_take, kind, False)
    assert not torch.equal(b0, b1)  # not vacuous: each rank initialised its own weights
    assert torch.equal(a0, a1) and torch.equal(a0, b0)  # rank 0's, bitwise, on every rank
    mismatch = [m for name, m in w0 if name == "ReplicaMismatchWarning"]
    assert len(mismatch) == 1 and "differed across ranks" in mismatch[0], w0
    first = next(iter(build(kind, 0).state_dict()))  # the first tensor is named
    assert f"(first: {first!r})" in mismatch[0] and "torch.manual_seed" in mismatch[0]
    assert w1 == []  # one warning for the job, from rank 0


@pytest.mark.dist
def test_agreeing_weights_are_left_alone_without_a_warning(workers):
    (b0, a0, w0), (b1, a1, w1) = workers.run(job_take, "lm", True)
    assert torch.equal(b0, b1) and torch.equal(a0, b0) and torch.equal(a1, b1)
    assert w0 == [] and w1 == []


SPEC = ModelSpec("tiny-lm", "1d", 2, 16, 4, 24, vocab_size=32, dtype_bytes=4)


def job_none_step(ctx):
    """The issue's case: unseeded models, mode="none", one training step on a plan where
    each rank trains its own sequence; the weights after the step, this rank's."""
    model, state, task = build("lm", 1 + ctx.rank), SPState(), LMTask()
    parallelize(model, state)
    sh = shard(model, lambda ps: torch.optim.SGD(ps, lr=0.1), mode="none", pool=ctx.pool, task=task)
    batch = Batch.from_lengths([6, 9])
    cost = CostModel(SPEC, Cluster("cpu", 1, 2, 1e15, 1e12, 1e10, 1e10), optimizer_sharding="none")
    phase = [Group(0, 1, (MicroBatch((0,), 0),)), Group(1, 1, (MicroBatch((1,), 0),))]
    plan = make_plan([phase], batch, cost, planner="hand")
    data = {i: torch.arange(n + 1) % CFG.vocab_size for i, n in enumerate((6, 9))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_step(plan, task, model, data, pool=ctx.pool, state=state, step=0, sharding=sh)
    return flat(model)


@pytest.mark.dist
def test_unseeded_none_mode_replicas_stay_one_model(workers):
    p0, p1 = workers.run(job_none_step)
    assert torch.equal(p0, p1)
