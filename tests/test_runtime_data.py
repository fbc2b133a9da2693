"""The data path (runtime/data.py): batches by count and by token budget, every sequence of an
epoch trained exactly once, each rank reading only its own samples, and the two agreement
modes (plan on rank 0 + broadcast, plan everywhere deterministically) giving the same plans.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dcp_opt.runtime.data import (
    DcpBatchSampler,
    DcpLoader,
    PlannedBatch,
    collate_samples,
    form_batches,
    local_ids,
)
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch, Cluster, CostModel, DcpOptError, ModelSpec, make_plan
from dcp_opt.plan import Group, MicroBatch, Plan

SPEC = ModelSpec("tiny-lm", "1d", 2, 16, 4, 32, vocab_size=32, dtype_bytes=4)
# 13 samples: lengths vary 2..40 so memory-bound plans mix degree-1 and degree-2 groups.
LENGTHS = [5, 40, 3, 17, 9, 2, 33, 12, 7, 21, 4, 28, 6]


class CountingDataset(torch.utils.data.Dataset):
    """Token sequences; records every index it is asked for."""

    def __init__(self, lengths):
        self.lengths = list(lengths)
        self.calls: list[int] = []

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        self.calls.append(i)
        return torch.arange(self.lengths[i] + 1) % 32


def cost_for(world: int, *, fit_tokens: float = 15.0) -> CostModel:
    """1 node x `world` ranks; memory holds `fit_tokens` tokens at degree 1 without
    recompute. With 15, longer samples need recompute, and the 40-token one does not fit on
    one rank even recomputing both layers (cost.min_recompute(40, 1) == -1): it needs the
    degree-2 group, which both ranks read."""
    base = CostModel(SPEC, Cluster("cpu", 1, world, 1e12, 1e12, 1e10, 1e10))
    per_token = float(base.memory(1, 1, 0)) - base.fixed_bytes()
    memory = (base.fixed_bytes() + fit_tokens * per_token) / base.usable_memory_fraction
    return CostModel(SPEC, base.cluster.with_(memory_bytes=memory))


# ---- batch forming ---------------------------------------------------------------------------
def test_form_batches_by_count():
    order = list(range(10))
    # 10 samples in batches of 4: 4 + 4 + 2; drop_last drops the short 2.
    assert form_batches([(1,)] * 10, order, batch_size=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert form_batches([(1,)] * 10, order, batch_size=4, drop_last=True) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_form_batches_by_token_budget():
    shapes = [(5,), (3,), (4,), (9,), (2,), (2, 1, 2)]
    # budget 8: 5+3 = 8 fits; 4 then 9 would be 13 > 8; 9 alone exceeds the budget but forms
    # a batch by itself; 2 then the 2x1x2 video (4 tokens): 6 <= 8.
    got = form_batches(shapes, [0, 1, 2, 3, 4, 5], max_tokens=8)
    assert got == [[0, 1], [2], [3], [4, 5]]


def test_form_batches_rejects_bad_options():
    with pytest.raises(DcpOptError, match="exactly one"):
        form_batches([(1,)], [0], batch_size=2, max_tokens=4)
    with pytest.raises(DcpOptError, match="batch_size"):
        form_batches([(1,)], [0], batch_size=0)
    with pytest.raises(DcpOptError, match="sizes\\[1\\]"):
        DcpLoader([0, 1], [3, (2, 2)], cost_for(1), batch_size=1, rank=0, world_size=1)
    with pytest.raises(DcpOptError, match="agree"):
        DcpLoader([0], [3], cost_for(1), batch_size=1, agree="vote", rank=0, world_size=1)


def test_local_ids_follow_group_membership():
    batch = Batch.from_lengths([4, 4, 4, 4])
    cost = CostModel(SPEC, Cluster("cpu", 1, 4, 1e12, 1e12, 1e10, 1e10))
    g = [Group(0, 2, (MicroBatch((2,)), MicroBatch((0, 3)))), Group(2, 1, (MicroBatch((1,)),))]
    plan = make_plan([g], batch, cost, planner="hand")
    # Ranks 0 and 1 share the degree-2 group; rank 2 has sequence 1; rank 3 is idle.
    assert [local_ids(plan, r) for r in range(4)] == [[2, 0, 3], [2, 0, 3], [1], []]


def test_local_ids_are_the_units_under_tensor_and_pipeline_parallelism():
    # a plan rank is a unit: GPU u t + j is TP rank j of unit u; with a pipeline, every
    # stage's copy of unit u reads u's micro-batches (docs/plan-format.md, the rank map)
    import dataclasses

    from dcp_opt.plan import Pipeline

    batch = Batch.from_lengths([4, 4, 4, 4])
    cost = CostModel(SPEC, Cluster("cpu", 1, 4, 1e12, 1e12, 1e10, 1e10))
    g = [Group(0, 2, (MicroBatch((2,)),)), Group(2, 1, (MicroBatch((1, 0)),)), Group(3, 1)]
    plan = make_plan([g], batch, cost, planner="hand")
    units = [[2], [2], [1, 0], []]
    tp = dataclasses.replace(plan, tensor_parallel=2)  # 8 GPUs: 4 units of 2
    assert [local_ids(tp, r) for r in range(8)] == [u for u in units for _ in (0, 1)]
    pp = dataclasses.replace(plan, pipeline=Pipeline((1, 1)))  # 2 stages x 4 units
    assert [local_ids(pp, r) for r in range(8)] == units + units
    both = dataclasses.replace(pp, tensor_parallel=2)  # 2 stages x 4 units x TP 2
    assert [local_ids(both, r) for r in range(16)] == [u for u in units for _ in (0, 1)] * 2
    assert local_ids(plan, 5) == []  # a rank past a plain plan's ranks holds nothing


def test_single_process_epoch_covers_every_sample_once():
    data = CountingDataset(LENGTHS)
    loader = DcpLoader(
        data, LENGTHS, cost_for(1, fit_tokens=64), max_tokens=60, planner="greedy", seed=1
    )
    got = list(loader)
    assert all(isinstance(b, PlannedBatch) for b in got)
    trained = [sid for b in got for sid in b.plan.sequence_ids()]
    assert sorted(trained) == list(range(len(LENGTHS)))
    assert sorted(data.calls) == list(range(len(LENGTHS)))  # each sample read exactly once
    for b in got:  # the token budget holds for every batch of more than one sample
        assert len(b.batch) == 1 or b.batch.num_tokens <= 60
        assert b.plan.loss_normalizer == b.batch.num_tokens
        assert b.describe().startswith("greedy:")
    # Another epoch, another order, still every sample once.
    loader.set_epoch(1)
    assert loader.batches() != [[s.id for s in b.batch.sequences] for b in got]
    assert sorted(i for ids in loader.batches() for i in ids) == list(range(len(LENGTHS)))


# ---- several ranks ---------------------------------------------------------------------------
def job_epoch(ctx, agree: str, batch_size: int, planner: str = "greedy"):
    """On every rank: one epoch through the loader; per batch the plan JSON, the sample ids
    delivered, and the dataset reads of this rank."""
    data = CountingDataset(LENGTHS)
    loader = DcpLoader(
        data,
        LENGTHS,
        cost_for(ctx.world_size),
        batch_size=batch_size,
        agree=agree,
        seed=3,
        planner=planner,  # greedy: deterministic and fast; "auto" picks cpsat when built
    )
    out = []
    for b in loader:
        out.append((b.plan.to_json(), sorted(b.samples), list(b.batch.to_dict()["sequences"])))
    return out, data.calls


def job_failing_plan(ctx):
    """Memory too small for any sample: planning fails on rank 0; every rank must raise."""
    loader = DcpLoader(
        CountingDataset(LENGTHS),
        LENGTHS,
        cost_for(ctx.world_size, fit_tokens=0.5),
        batch_size=4,
        planner="greedy",
    )
    try:
        next(iter(loader))
    except DcpOptError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(2, timeout_s=30.0)
    yield w
    w.close()


@pytest.mark.dist
def test_data_epoch_each_rank_reads_only_its_samples(workers):
    by_mode = {agree: workers.run(job_epoch, agree, 5) for agree in ("broadcast", "deterministic")}
    for agree, ranks in by_mode.items():
        (steps0, _), (steps1, _) = ranks
        plans = [Plan.from_json(text) for text, _, _ in steps0]
        assert [p.content_hash() for p in plans] == [
            Plan.from_json(t).content_hash() for t, _, _ in steps1
        ], agree
        assert len(plans) == 3  # 13 samples in batches of 5: 5 + 5 + 3
        trained = sorted(sid for p in plans for sid in p.sequence_ids())
        assert trained == list(range(len(LENGTHS))), agree  # every sample exactly once
        for rank, (steps, calls) in enumerate(ranks):
            want = [sid for p in plans for sid in local_ids(p, rank)]
            assert sorted(calls) == sorted(want), (agree, rank)  # reads only its own samples
            assert [ids for _, ids, _ in steps] == [sorted(local_ids(p, rank)) for p in plans]
        # The 40-token sample goes to a degree-2 group (read by both ranks), the rest is
        # split, so neither rank reads the whole epoch.
        assert any(
            g.degree == 2 and g.micro_batches for p in plans for ph in p.phases for g in ph.groups
        )
        assert all(len(calls) < len(LENGTHS) for _, calls in ranks), agree
    # Both agreement modes give the same plans (greedy is deterministic).
    hashes = {
        agree: [Plan.from_json(t).content_hash() for t, _, _ in ranks[0][0]]
        for agree, ranks in by_mode.items()
    }
    assert hashes["broadcast"] == hashes["deterministic"]


@pytest.mark.dist
def test_data_planning_failure_reaches_every_rank(workers):
    messages = workers.run(job_failing_plan)
    assert all("planning failed" in m for m in messages), messages


def test_planning_runs_ahead_in_a_background_thread():
    import threading
    import time

    loader = DcpLoader(
        CountingDataset(LENGTHS), LENGTHS, cost_for(1, fit_tokens=64), batch_size=2,
        planner="greedy", prefetch=2,
    )  # fmt: skip
    seen: list[str] = []
    plan_batch = loader.sampler.plan_batch

    def recording(ids):
        seen.append(threading.current_thread().name)
        return plan_batch(ids)

    loader.sampler.plan_batch = recording
    it = iter(loader)
    next(it)  # batch 0 out; batch 1 agreed (look-ahead); the thread fills a queue of 2 more
    deadline = time.monotonic() + 10
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    # 0 and 1 were taken; 2 and 3 fill the queue while "batch 0 trains"; 4 may be planned
    # and wait to be queued; 5 and 6 (of 7 batches) wait for the consumer.
    assert 4 <= len(seen) <= 5, seen
    assert set(seen) == {"dcp-plan-ahead"}
    it.close()


# ---- the documented integration, run for real -------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
SNIPPET_SETUP = """
import torch
import torch.distributed as dist
from dcp_opt.runtime import LMConfig, TinyLM
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed
from dcp_opt.runtime.models import model_spec

rank, world = init_distributed()
torch.manual_seed(0)
cfg = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=32)
model = TinyLM(cfg)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
lengths = [5, 40, 3, 17, 9, 2, 33, 12, 7, 21, 4, 28, 6, 11, 8, 19]
dataset = [torch.arange(n + 1) % 32 for n in lengths]
cost = cpu_cost_model(model_spec(cfg), world, fit_tokens=20)
"""
SNIPPET_END = """
print(f"rank {rank} ran {step + 1} steps", flush=True)
dist.destroy_process_group()
"""


def torchrun(args: list[str], *, timeout_s: float = 120.0) -> str:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    proc = subprocess.run(
        cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def doc_snippet(path: Path) -> str:
    text = path.read_text()
    block = text.split("<!-- snippet:start -->")[1].split("<!-- snippet:end -->")[0]
    return block.split("```python")[1].split("```")[0]


@pytest.mark.slow
@pytest.mark.dist
def test_integration_snippet_runs_under_torchrun(tmp_path):
    snippet = doc_snippet(ROOT / "docs" / "integration.md")
    lines = [ln for ln in snippet.splitlines() if ln.strip()]
    assert len(lines) <= 10, lines  # the promise: at most 10 added lines
    assert snippet in (ROOT / "examples" / "README.md").read_text()  # one snippet, two places
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPET_SETUP + snippet + SNIPPET_END)
    out = torchrun(["2", str(script)])
    # 16 samples in batches of 8: 2 steps on every rank.
    assert "rank 0 ran 2 steps" in out and "rank 1 ran 2 steps" in out, out


FULL_LOOP_SETUP = """
import sys
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from dcp_opt.runtime.hf import model_spec
from dcp_opt.runtime.launch import cpu_cost_model, init_distributed

rank, world = init_distributed()
ckpt_dir, num_epochs, every = sys.argv[1], int(sys.argv[2]), 1
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = LlamaForCausalLM(cfg)
lengths = [5, 40, 3, 17, 9, 2, 33, 12, 7, 21, 4, 28, 6, 11, 8, 19]
dataset = [torch.arange(n + 1) % 64 for n in lengths]
cost = cpu_cost_model(model_spec(model), world, fit_tokens=20).with_(optimizer_sharding="zero2")
def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
"""
FULL_LOOP_END = """
print(f"rank {rank} stopped at step {step}", flush=True)
dist.destroy_process_group()
"""


def full_loop_snippet() -> str:
    text = (ROOT / "docs" / "integration.md").read_text()
    block = text.split("<!-- full-loop:start -->")[1].split("<!-- full-loop:end -->")[0]
    return block.split("```python")[1].split("```")[0]


@pytest.mark.slow
@pytest.mark.dist
def test_the_full_loop_snippet_trains_checkpoints_and_resumes(tmp_path):
    snippet = full_loop_snippet()
    lines = [ln for ln in snippet.splitlines() if ln.strip()]
    imports = [ln for ln in lines if ln.startswith(("from ", "import "))]
    assert (len(lines), len(imports)) == (23, 5), lines  # what the docs state
    assert snippet in (ROOT / "README.md").read_text()  # one loop, two places
    script = tmp_path / "full_loop.py"
    script.write_text(FULL_LOOP_SETUP + snippet + FULL_LOOP_END)
    ckpt = tmp_path / "ckpt"
    # 16 samples in batches of 8: 2 steps an epoch, a checkpoint after each step
    first = torchrun(["2", str(script), str(ckpt), "1"], timeout_s=300)
    assert "rank 0 stopped at step 2" in first and "rank 1 stopped at step 2" in first, first
    again = torchrun(["2", str(script), str(ckpt), "2"], timeout_s=300)  # resumes at step 2
    assert "rank 0 stopped at step 4" in again and "rank 1 stopped at step 4" in again, again
    # A run that started over instead would have saved step 1 below the folder's step 2,
    # which checkpoint.save refuses: the second run continued from step 2.
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert (ckpt / "latest").read_text().strip() == "step-00000004"


@pytest.mark.slow
@pytest.mark.dist
def test_example_train_lm_runs_under_torchrun_and_resumes_by_itself(tmp_path):
    ckdir = tmp_path / "ckpt"
    args = ["examples/train_lm.py", "--steps", "4", "--num-samples", "32", "--max-len", "64",
            "--planner", "greedy", "--checkpoint-dir", str(ckdir), "--checkpoint-every", "2"]  # fmt: skip
    out = torchrun(["2", *args])
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 4 and "resumed" not in out, out
    for line in steps:  # plan summary, predicted and measured time, loss on every step
        assert re.search(r"phases \[.+\].*predicted [\d.]+s measured [\d.]+s \| loss [\d.]+", line)
    # Without its last checkpoint (step 4) the same command resumes from step 2 by itself and
    # trains steps 2 and 3 to the same losses (same world, same plans: bitwise).
    shutil.rmtree(ckdir / "step-00000004")
    (ckdir / "latest").unlink()
    again = torchrun(["2", *args])
    assert f"resumed from {ckdir} at step 2" in again, again

    def losses(text):
        return dict(re.findall(r"^step +(\d+) .*\| loss ([\d.]+)$", text, re.M))

    assert losses(again) == {s: v for s, v in losses(out).items() if int(s) >= 2}
    assert len(losses(again)) == 2


@pytest.mark.dist
def test_data_deterministic_cpsat_agrees_across_ranks(workers):
    # agree="deterministic" runs cpsat in its deterministic mode on every rank (one worker,
    # fixed seed, deterministic-time limit): both ranks must compute the same plans.
    (steps0, _), (steps1, _) = workers.run(job_epoch, "deterministic", 5, "cpsat")
    hashes = [[Plan.from_json(t).content_hash() for t, _, _ in steps] for steps in (steps0, steps1)]
    assert hashes[0] == hashes[1]
    assert len(hashes[0]) == 3


def test_deterministic_agreement_asks_cpsat_for_its_deterministic_mode():
    kw = dict(batch_size=2, planner="cpsat", rank=0, world_size=1)
    det = DcpLoader([0], [3], cost_for(1), agree="deterministic", **kw)
    assert det.sampler.planner_options == {"deterministic": True}
    assert DcpLoader([0], [3], cost_for(1), agree="broadcast", **kw).sampler.planner_options == {}


def test_deterministic_agreement_refuses_the_planners_timed_in_cpu_seconds():
    # pp_greedy's and pp_cpsat's plans depend on the CPU time they get: ranks planning alone
    # could disagree (the executor's hash check would stop the step; this says why up front)
    for planner in ("pp_greedy", "pp_cpsat"):
        kw = dict(batch_size=2, planner=planner, planner_options={"pp": 2}, rank=0, world_size=1)
        with pytest.raises(
            DcpOptError,
            match=f"agree: 'deterministic' with planner '{planner}'.*allowed: agree='broadcast'",
        ):
            DcpLoader([0], [3], cost_for(1), agree="deterministic", **kw)
        assert DcpLoader([0], [3], cost_for(1), agree="broadcast", **kw).sampler.planner == planner


# ---- torch DataLoader workers ----------------------------------------------------------------
class LoggingDataset(torch.utils.data.Dataset):
    """Token sequences; every read appends 'pid index' to a file (DataLoader workers are other
    processes, so a list in memory would not see their reads)."""

    def __init__(self, lengths, log_path):
        self.lengths, self.log_path = list(lengths), str(log_path)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        with open(self.log_path, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return (3 * i + torch.arange(self.lengths[i] + 1)) % 32


def train_epochs(ctx, batches, epochs: int):
    """Two epochs of TinyLM steps over `batches` (an iterable factory of PlannedBatch per
    epoch); per step the plan hash, this rank's sample ids and the summed gradients."""
    from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize

    from tests.test_runtime_equiv import make_model

    state = SPState()
    model = parallelize(make_model("1d", 0), state)
    out = []
    for epoch in range(epochs):
        for b in batches(epoch):
            model.zero_grad(set_to_none=True)
            execute_step(
                b.plan, LMTask(), model, b.samples, pool=ctx.pool, state=state, step=len(out)
            )
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            out.append((b.plan.content_hash(), sorted(b.samples), grads))
    return out


def job_dataloader(ctx, log_dir: str):
    """The same 2 epochs through DataLoader(num_workers=2) and through DcpLoader; the reads of
    this rank's workers; the state mid-epoch under prefetching, and a resume from it."""
    import multiprocessing

    from dcp_opt.runtime.data import DcpBatchSampler, collate_samples
    from torch.utils.data import DataLoader

    # DistWorkers ranks are daemons (which may not have children) started by a forkserver
    # (whose children start workers by forkserver too, importing torch again: ~5 s each);
    # a torchrun rank is neither, and forks its workers.
    multiprocessing.current_process().daemon = False
    fork = {"multiprocessing_context": "fork"}
    log = Path(log_dir) / f"rank{ctx.rank}.log"
    kw = dict(batch_size=5, seed=3, planner="greedy")
    sampler = DcpBatchSampler(LENGTHS, cost_for(ctx.world_size), **kw)
    loader = DataLoader(
        LoggingDataset(LENGTHS, log), batch_sampler=sampler, collate_fn=collate_samples,
        num_workers=2, pin_memory=True, persistent_workers=True, **fork,
    )  # fmt: skip

    def with_workers(epoch):
        sampler.set_epoch(epoch)
        return sampler.planned(loader)

    got = train_epochs(ctx, with_workers, 2)
    reads = [tuple(map(int, ln.split())) for ln in log.read_text().splitlines()]
    inproc = DcpLoader(
        LoggingDataset(LENGTHS, f"{log}.inproc"), LENGTHS, cost_for(ctx.world_size), **kw
    )

    def in_process(epoch):
        inproc.set_epoch(epoch)
        return inproc

    want = train_epochs(ctx, in_process, 2)
    # Mid-epoch state under prefetching (2 workers x 2 batches ahead), then a resume.
    sampler.set_epoch(2)
    it = sampler.planned(loader)
    first = next(it)
    ahead = len(sampler._sent)  # batches the DataLoader already took from the sampler
    state = sampler.state_dict()
    it.close()
    again = DcpBatchSampler(LENGTHS, cost_for(ctx.world_size), **kw)
    again.load_state_dict(state)
    rest = DataLoader(LoggingDataset(LENGTHS, log), batch_sampler=again,
                      collate_fn=collate_samples, num_workers=2, **fork)  # fmt: skip
    resumed = [first.step] + [b.step for b in again.planned(rest)]
    return got, want, reads, state, resumed, len(sampler.batches()), ahead


@pytest.mark.dist
def test_dataloader_workers_read_only_this_ranks_samples(workers, tmp_path):
    ranks = workers.run(job_dataloader, str(tmp_path))
    for got, want, reads, state, resumed, num_batches, ahead in ranks:
        # The same plans, samples and gradients as the in-process loader, bitwise.
        assert len(got) == len(want) == 6  # 13 samples in batches of 5: 3 per epoch, 2 epochs
        for (h, ids, g), (h2, ids2, g2) in zip(got, want, strict=True):
            assert (h, ids) == (h2, ids2)
            assert torch.equal(g, g2)
        # Reads happened in worker processes, and only of this rank's sample ids.
        first_two_epochs = reads[: sum(len(ids) for _, ids, _ in got)]
        assert os.getpid() not in {pid for pid, _ in first_two_epochs}
        assert len({pid for pid, _ in first_two_epochs}) == 2  # both workers loaded
        assert sorted(i for _, i in first_two_epochs) == sorted(i for _, ids, _ in got for i in ids)
        assert len(first_two_epochs) < 2 * len(LENGTHS)  # not every sample: the rank's share
        # State counts batches handed to the loop (1), not those prefetched by the workers.
        assert state["batches_done"] == 1 and state["epoch"] == 2
        assert ahead == num_batches - 1  # 2 workers x 2: the rest of the epoch was prefetched
        assert resumed == list(range(num_batches))  # resumed at batch 1: nothing lost or repeated
    assert ranks[0][3] == ranks[1][3]  # the state is the same on every rank


def test_sampler_state_follows_the_statefuldataloader_conventions():
    kw = dict(batch_size=3, seed=1, planner="greedy", rank=0, world_size=1)
    s = DcpBatchSampler(LENGTHS, cost_for(1, fit_tokens=64), **kw)
    loader = torch.utils.data.DataLoader(CountingDataset(LENGTHS), batch_sampler=s,
                                         collate_fn=collate_samples)  # fmt: skip
    full = [b.step for b in s.planned(loader)]
    assert full == list(range(5)) and s.state_dict()["batches_done"] == 5
    done = s.state_dict()  # saved at the end of the epoch: the next pass resumes with nothing
    t = DcpBatchSampler(LENGTHS, cost_for(1, fit_tokens=64), **{**kw, "seed": 9})
    t.load_state_dict(done)
    assert t.seed == 1 and len(t) == 0 and list(t) == []
    t.set_epoch(1)  # a new epoch starts at its first batch
    assert len(t) == 5 and t.state_dict()["batches_done"] == 0
    # A collate_fn that stacks is refused with the fix named.
    bad = torch.utils.data.DataLoader(CountingDataset(LENGTHS), batch_sampler=t,
                                      collate_fn=lambda xs: len(xs))  # fmt: skip
    with pytest.raises(DcpOptError, match="collate_fn: gave int"):
        next(t.planned(bad))


def job_ranks_on_other_epochs(ctx):
    """Rank 1 iterates epoch 1 while rank 0 plans and broadcasts epoch 0."""
    # The sampler (not DcpLoader, which agrees on one batch ahead: rank 0 would wait for a
    # second broadcast that rank 1, failed, never joins).
    sampler = DcpBatchSampler(LENGTHS, cost_for(ctx.world_size), batch_size=5, planner="greedy")
    sampler.set_epoch(ctx.rank)
    try:
        next(iter(sampler))
    except DcpOptError as e:
        return str(e)
    return "ok"


@pytest.mark.dist
def test_ranks_iterating_differently_get_a_clear_error(workers):
    # Every broadcast names its (epoch, batch): a rank on another epoch (or another
    # DataLoader prefetch) fails at once instead of training another batch's plan.
    sent, wanted = workers.run(job_ranks_on_other_epochs)
    assert sent == "ok"
    assert "rank 1 wants the plan of epoch 1 batch 0, the planning rank sent epoch 0" in wanted


def test_a_dataloader_without_collate_samples_is_refused_before_its_workers_start():
    # issue 28 item 4: torch's default_collate stacks the samples, and in a worker that
    # failed as "Trying to resize storage that is not resizable", naming neither.
    sampler = DcpBatchSampler(LENGTHS, cost_for(1, fit_tokens=100), batch_size=4,
                              planner="greedy")  # fmt: skip
    loader = torch.utils.data.DataLoader(CountingDataset(LENGTHS), batch_sampler=sampler,
                                         num_workers=2)  # fmt: skip
    with pytest.raises(DcpOptError, match=r"collate_fn: the DataLoader has torch's default_co"):
        next(sampler.planned(loader))
    assert not sampler._sent  # refused before the DataLoader asked the sampler for a batch
