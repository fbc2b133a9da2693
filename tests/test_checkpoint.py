"""Checkpoint and resume (runtime/checkpoint.py): a resumed run reaches the parameters of an
uninterrupted one (bitwise on the same world, to <= 1e-9 relative on another world size,
where the epoch's remaining batches are replanned for the new cluster), saves are atomic, and
a checkpoint that does not fit (another model, another dataset, a missing or corrupted file)
is refused with a message naming the difference, with nothing changed."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import LMTask, SPState, TinyLM, checkpoint, execute_step, parallelize
from dcp_opt.runtime.data import DcpLoader
from dcp_opt.runtime.testing import DistWorkers, max_relative_error

from dcp_opt import DcpOptError
from tests.test_runtime_data import SPEC, cost_for
from tests.test_runtime_equiv import LM_CFG

# 14 samples in batches of 4: 4 batches per epoch (4, 4, 4, 2); the 40-token one needs a
# degree-2 group (cost_for: memory for 15 tokens per rank).
LENGTHS = [5, 40, 3, 17, 9, 2, 33, 12, 7, 21, 4, 28, 6, 11]
STOP = 7  # steps: crosses the end of epoch 0 (4 batches) into epoch 1
SAVE_AT = 3  # mid-epoch
assert SPEC.vocab_size == LM_CFG.vocab_size


def sample(i: int) -> torch.Tensor:
    return (3 * i + (1 + i % 3) * torch.arange(LENGTHS[i] + 1)) % LM_CFG.vocab_size


DATA = [sample(i) for i in range(len(LENGTHS))]


def build(world: int, *, init_seed: int = 0, lengths=LENGTHS, cfg=LM_CFG, opt_cls=None):
    torch.manual_seed(init_seed)
    state = SPState()
    model = parallelize(TinyLM(cfg).double(), state)
    opt = (opt_cls or torch.optim.AdamW)(model.parameters(), lr=0.05)
    data = [DATA[i % len(DATA)] for i in range(len(lengths))]
    loader = DcpLoader(data, lengths, cost_for(world), batch_size=4, planner="greedy", seed=5)
    return model, opt, loader, state


def train(pool, world: int, ckdir, *, stop: int, save_at=(), resume=False, init_seed=0):
    """Train to `stop` steps (resuming from `ckdir` first if asked); per step the
    (epoch, batch index, sequence ids, plan's world); the final parameters."""
    model, opt, loader, state = build(world, init_seed=init_seed)
    step = checkpoint.load(ckdir, model=model, optimizer=opt, loader=loader) if resume else 0
    log = []
    while step < stop:
        for b in loader:
            opt.zero_grad(set_to_none=True)
            execute_step(b.plan, LMTask(), model, b.samples, pool=pool, state=state, step=step)
            opt.step()
            log.append((b.epoch, b.step, sorted(b.plan.sequence_ids()), b.plan.num_ranks))
            step += 1
            if step in save_at:
                checkpoint.save(ckdir, model=model, optimizer=opt, loader=loader, step=step)
            if step == stop:
                break
        else:
            loader.set_epoch(loader.epoch + 1)
    return log, [p.detach().clone() for p in model.parameters()]


def job_train(ctx, ckdir, stop, save_at, resume, init_seed):
    return train(
        ctx.pool, ctx.world_size, ckdir, stop=stop, save_at=save_at, resume=resume,
        init_seed=init_seed,
    )  # fmt: skip


class Pools:
    """One DistWorkers pool per world size, started on first use, closed at module end."""

    def __init__(self):
        self.pools: dict[int, DistWorkers] = {}

    def run(self, world: int, *args, job=None):
        if world not in self.pools:
            self.pools[world] = DistWorkers(world, timeout_s=60.0)
        return self.pools[world].run(job or job_train, *args)

    def close(self):
        for w in self.pools.values():
            w.close()


@pytest.fixture(scope="module")
def pools():
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="module")
def uninterrupted(pools, tmp_path_factory):
    """world -> (checkpoint dir saved after SAVE_AT steps, log, final params) of a run that
    goes on to STOP steps: the reference its resumed runs must reach."""
    out = {}

    def get(world: int):
        if world not in out:
            ckdir = tmp_path_factory.mktemp(f"ckpt_w{world}")
            ranks = pools.run(world, str(ckdir), STOP, (SAVE_AT,), False, 0)
            (log, params), *_ = ranks
            assert all(torch.equal(a, b) for r in ranks for a, b in zip(params, r[1], strict=True))
            out[world] = (ckdir, log, params)
        return out[world]

    return get


@pytest.mark.dist
def test_resume_on_the_same_world_is_bitwise(pools, uninterrupted):
    ckdir, log, want = uninterrupted(2)
    # A fresh run (other initial weights) loads step 3 and trains steps 3..6.
    (got_log, got), _ = pools.run(2, str(ckdir), STOP, (), True, 1)
    assert got_log == log[SAVE_AT:]  # same batches, same plans' worlds
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # Not vacuous: the parameters moved after the checkpoint.
    at_save = build(1)[0]
    checkpoint.load(ckdir, model=at_save)
    assert not any(torch.equal(a, b) for a, b in zip(at_save.parameters(), want, strict=True))


@pytest.mark.dist
@pytest.mark.parametrize(("saved", "resumed"), [(4, 2), (2, 3)])
def test_resume_on_another_world_replans_the_rest_of_the_epoch(
    pools, uninterrupted, saved, resumed
):
    ckdir, log, want = uninterrupted(saved)
    (got_log, got), *_ = pools.run(resumed, str(ckdir), STOP, (), True, 1)
    # The same global batches, now planned for `resumed` ranks.
    assert [x[:3] for x in got_log] == [x[:3] for x in log[SAVE_AT:]]
    assert {x[3] for x in got_log} == {resumed}
    err = max_relative_error(got, want)
    assert err <= 1e-9, err
    # Only the summation order differs: not bitwise (or the test would not need a tolerance).
    assert err > 0 or saved == resumed


# ---- single process: errors and atomicity -----------------------------------------------------
def test_save_is_atomic_and_keeps_the_newest(tmp_path, monkeypatch):
    model, opt, loader, _ = build(1)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000003",
    ]
    # A save that dies before it is published leaves the last checkpoint in place.
    monkeypatch.setattr(checkpoint, "_publish", lambda *a: (_ for _ in ()).throw(OSError("kill")))
    with pytest.raises(OSError, match="kill"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=4)
    assert (tmp_path / ".tmp-step-00000004").is_dir()
    assert checkpoint.latest(tmp_path).step == 3
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"


def test_bad_checkpoints_are_named_and_change_nothing(tmp_path):
    model, opt, loader, _ = build(1)
    checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=2, extra={"a": 1})
    assert checkpoint.latest(tmp_path).extra == {"a": 1}

    def refused(match, **kw):
        m, o, ld, _ = build(1, init_seed=9, **kw)
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(DcpOptError, match=match):
            checkpoint.load(tmp_path, model=m, optimizer=o, loader=ld)
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
        assert not o.state and ld.state_dict()["batches_done"] == 0

    wider = type(LM_CFG)(**{**LM_CFG.__dict__, "ffn_hidden": 32})
    refused(
        r"another model \(.*mlp.0.weight: \(24, 16\) float64 in the checkpoint, \(32, 16\)",
        cfg=wider,
    )
    refused("optimizer: AdamW in the checkpoint, SGD here", opt_cls=torch.optim.SGD)
    refused("loader state: num_samples is 14 in the checkpoint but 15 here", lengths=LENGTHS + [3])
    folder = checkpoint.latest(tmp_path).path
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    refused(f"file {shard.name} is corrupted: {len(data)} bytes, crc32")
    shard.unlink()
    refused(f"file {shard.name} is missing")
    with pytest.raises(DcpOptError, match="no complete checkpoint"):
        checkpoint.load(tmp_path / "empty", model=model)


def test_loader_state_rejects_other_batches():
    kw = dict(max_tokens=40, planner="greedy", rank=0, world_size=1, seed=2)
    a = DcpLoader(DATA, LENGTHS, cost_for(1), **kw)
    state = a.state_dict()
    other = LENGTHS[:-1] + [LENGTHS[-1] + 20]  # same count, other sizes: other token batches
    b = DcpLoader(DATA, other, cost_for(1), **kw)
    with pytest.raises(DcpOptError, match="epoch 0 has .* batches .* in the checkpoint but"):
        b.load_state_dict(state)
    with pytest.raises(DcpOptError, match="'batches_done' is None"):
        b.load_state_dict({**state, "batches_done": None})
    with pytest.raises(DcpOptError, match="batching is"):
        DcpLoader(DATA, LENGTHS, cost_for(1), **{**kw, "max_tokens": 50}).load_state_dict(state)


def test_a_damaged_manifest_is_named(tmp_path):
    model, opt, loader, _ = build(1)
    folder = checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=1)
    manifest = folder / checkpoint.MANIFEST
    text = manifest.read_text()
    manifest.write_text(text.replace('"step": 1', '"step": "one"'))
    with pytest.raises(DcpOptError, match="field 'step' is 'one'; allowed: int"):
        checkpoint.load(tmp_path, model=model, optimizer=opt, loader=loader)
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(DcpOptError, match="dcp_opt.json is not valid JSON"):
        checkpoint.load(tmp_path, model=model, optimizer=opt, loader=loader)


# ---- sharded models (runtime/sharding.py) ------------------------------------------------------
def sharded_cost(world: int, mode: str, fit_tokens: float = 15.0):
    """cost_for's cluster (memory for `fit_tokens` tokens at degree 1) under `mode`."""
    from dcp_opt import Cluster, CostModel

    base = CostModel(
        SPEC, Cluster("cpu", 1, world, 1e12, 1e12, 1e10, 1e10), optimizer_sharding=mode
    )
    per_token = float(base.memory(1, 1, 0)) - base.fixed_bytes()
    memory = (base.fixed_bytes() + fit_tokens * per_token) / base.usable_memory_fraction
    return CostModel(SPEC, base.cluster.with_(memory_bytes=memory), optimizer_sharding=mode)


def job_train_sharded(ctx, ckdir, mode, stop, save_at, resume, init_seed):
    """`train` under shard(mode): the optimizer steps inside execute_step on FSDP2 shards;
    checkpoint.save / load get the sharded model and optimizer as they are."""
    from dcp_opt.runtime.sharding import shard

    torch.manual_seed(init_seed)
    state = SPState()
    model = parallelize(TinyLM(LM_CFG).double(), state)
    sh = shard(model, lambda ps: torch.optim.AdamW(ps, lr=0.05), mode=mode, pool=ctx.pool,
               task=LMTask())  # fmt: skip
    cost = sharded_cost(ctx.world_size, mode)
    loader = DcpLoader(DATA, LENGTHS, cost, batch_size=4, planner="greedy", seed=5)
    kw = dict(model=sh.model, optimizer=sh.optimizer, loader=loader)
    step = checkpoint.load(ckdir, **kw) if resume else 0
    log = []
    while step < stop:
        for b in loader:
            execute_step(b.plan, LMTask(), sh.model, b.samples, pool=ctx.pool, state=state,
                         step=step, sharding=sh)  # fmt: skip
            log.append((b.epoch, b.step, sorted(b.plan.sequence_ids())))
            step += 1
            if step in save_at:
                checkpoint.save(ckdir, step=step, **kw)
            if step == stop:
                break
        else:
            loader.set_epoch(loader.epoch + 1)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in sh.model.parameters()]
    return log, [p.detach().clone() for p in full]


@pytest.fixture(scope="module")
def uninterrupted_sharded(pools, tmp_path_factory):
    """(mode, world) -> (checkpoint dir after SAVE_AT steps, log, final full parameters)."""
    out = {}

    def get(mode: str, world: int):
        if (mode, world) not in out:
            ckdir = tmp_path_factory.mktemp(f"ckpt_{mode}_w{world}")
            args = (str(ckdir), mode, STOP, (SAVE_AT,), False, 0)
            (log, params), *_ = pools.run(world, *args, job=job_train_sharded)
            out[(mode, world)] = (ckdir, log, params)
        return out[(mode, world)]

    return get


@pytest.mark.dist
@pytest.mark.parametrize(
    ("mode", "saved", "resumed"),
    [("zero3", 2, 2), ("zero3", 2, 3), ("zero1", 4, 2), ("none", 2, 3)],
)
def test_sharded_training_resumes_on_any_world(pools, uninterrupted_sharded, mode, saved, resumed):
    # FSDP2 shards (DTensor parameters and optimizer states) are saved as they are and
    # resharded by DCP for the new world; `none` is a replica on per-rank one-rank meshes.
    ckdir, log, want = uninterrupted_sharded(mode, saved)
    args = (str(ckdir), mode, STOP, (), True, 1)
    (got_log, got), *_ = pools.run(resumed, *args, job=job_train_sharded)
    assert got_log == log[SAVE_AT:]
    err = max_relative_error(got, want)
    if saved == resumed:
        assert err == 0.0 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert err <= 1e-9, err
