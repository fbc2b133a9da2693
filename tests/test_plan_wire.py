"""Plans between ranks travel as JSON bytes, never pickle (issue 29): the loader's plan
broadcast (runtime/data.py), `launch.broadcast_plan` and the checkpoint's agreement
(runtime/checkpoint.py) send a length then UTF-8 JSON, parsed on receipt. World 2, gloo.

Each job replaces torch's pickling collectives with ones that fail, and records what
`torch.distributed.broadcast` carries: the code before this change called
`broadcast_object_list` / `all_gather_object` and failed here."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from dcp_opt.runtime import checkpoint, launch
from dcp_opt.runtime.data import DcpLoader
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import DcpOptError
from dcp_opt.plan import Plan
from tests.test_runtime_data import LENGTHS, CountingDataset, cost_for

PICKLING = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


class NoPickle:
    """Inside a job: pickling collectives raise; broadcasts are recorded (dtype, bytes)."""

    def __enter__(self):
        self.real = {n: getattr(dist, n) for n in (*PICKLING, "broadcast")}
        self.sent: list[tuple[str, bytes]] = []

        def refuse(*a, **k):
            raise AssertionError("a pickling collective was called")

        def broadcast(t, *a, **k):
            out = self.real["broadcast"](t, *a, **k)
            self.sent.append((str(t.dtype), bytes(t.cpu().numpy().tobytes())))
            return out

        for n in PICKLING:
            setattr(dist, n, refuse)
        dist.broadcast = broadcast
        return self

    def __exit__(self, *exc):
        for n, f in self.real.items():
            setattr(dist, n, f)

    def texts(self) -> list[str]:
        """The uint8 payloads, decoded (each follows its int64 length)."""
        return [b.decode() for dtype, b in self.sent if dtype == "torch.uint8"]


def job_broadcast_plan(ctx, plan_json: str):
    with NoPickle() as wire:
        got = launch.broadcast_plan(Plan.from_json(plan_json) if ctx.rank == 0 else None)
    lengths = [int.from_bytes(b, "little") for d, b in wire.sent if d == "torch.int64"]
    return got.to_json(), lengths, wire.texts()


def job_loader_epoch(ctx):
    with NoPickle() as wire:
        loader = DcpLoader(
            CountingDataset(LENGTHS), LENGTHS, cost_for(ctx.world_size), batch_size=5,
            planner="greedy", seed=3,
        )  # fmt: skip
        plans = [b.plan.to_json() for b in loader]
    return plans, wire.texts()


def job_failing_plan(ctx):
    with NoPickle():
        loader = DcpLoader(
            CountingDataset(LENGTHS), LENGTHS, cost_for(ctx.world_size, fit_tokens=0.5),
            batch_size=4, planner="greedy",
        )  # fmt: skip
        try:
            next(iter(loader))
        except DcpOptError as e:
            return str(e)
    return "no error"


def job_checkpoint_agreement(ctx):
    """The checkpoint's own exchanges (each rank's file sums, the first rank's error); DCP's
    internals are torch's and run outside this check."""
    with NoPickle():
        sums = checkpoint._gather({f"file{ctx.rank}": {"bytes": ctx.rank}})
        try:
            checkpoint._agree_on("checkpoint D", None if ctx.rank == 0 else "rank 1 saw it")
        except DcpOptError as e:
            return sums, str(e)
    return sums, None


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(2, timeout_s=30.0)
    yield w
    w.close()


@pytest.mark.dist
def test_broadcast_plan_sends_the_plan_json_as_bytes(workers):
    from tests.test_executor_plan_check import valid

    plan = valid()
    ranks = workers.run(job_broadcast_plan, plan.to_json())
    for got, lengths, texts in ranks:
        assert Plan.from_json(got) == plan
        assert texts == [plan.to_json(indent=None)]  # exactly the JSON, nothing else
        assert lengths == [len(texts[0].encode())]


@pytest.mark.dist
def test_the_loader_broadcasts_json_and_every_rank_parses_it(workers):
    (plans0, texts0), (plans1, texts1) = workers.run(job_loader_epoch)
    assert plans0 == plans1 and len(plans0) == 3  # 13 samples in batches of 5
    assert texts0 == texts1 and len(texts0) == 3
    for text, plan in zip(texts0, plans0, strict=True):
        epoch, index, plan_text, summary = json.loads(text)  # data only: a JSON array
        assert (epoch, Plan.from_json(plan_text)) == (0, Plan.from_json(plan))
        assert summary["planner"] == "greedy"
    assert [json.loads(t)[1] for t in texts0] == [0, 1, 2]


@pytest.mark.dist
def test_a_planning_failure_still_reaches_every_rank(workers):
    messages = workers.run(job_failing_plan)
    assert all("planning failed on the planning rank" in m for m in messages), messages


@pytest.mark.dist
def test_checkpoint_agreement_needs_no_pickle(workers):
    want = {"file0": {"bytes": 0}, "file1": {"bytes": 1}}
    assert workers.run(job_checkpoint_agreement) == [(want, "checkpoint D: rank 1 saw it")] * 2
