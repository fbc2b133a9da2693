"""Plan batch k+1 while batch k trains: a worker thread with a bounded queue.

    planner = AsyncPlanner(cost, "cpsat", time_limit_s=0.5, depth=2)
    planner.submit(step, batch)           # blocks only when `depth` plans are already pending
    ...
    ticket = planner.result(step)         # PlannedBatch: plan JSON, summary, wall time
    plan = ticket.plan()

Two ways for the ranks of a job to agree on a plan (the runtime chooses, see runtime/data.py):
- plan on one rank and broadcast: `PlannedBatch.to_json()` is a small serialisable record
  (plan JSON + summary) that `broadcast_object_list` can carry; `PlannedBatch.from_json`
  restores it on the other ranks;
- plan deterministically everywhere: `deterministic=True` runs the planner in its
  deterministic mode (greedy always is; cpsat with one worker, a fixed seed and a
  deterministic-time limit), so every rank computes the byte-identical plan, and
  `PlannedBatch.plan_hash` lets the ranks compare cheaply before the step.
A worker thread suffices because CP-SAT and numpy release the GIL for the heavy parts; the
training step's Python time is unaffected except for the planner's own Python work.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.plan import Plan


@dataclass(frozen=True)
class PlannedBatch:
    """A planner's answer for one step, as plain data."""

    step: int
    plan_json: str
    summary: dict
    queued_s: float  # from submit() to the start of planning
    planning_s: float

    def plan(self) -> Plan:
        return Plan.from_json(self.plan_json)

    @property
    def plan_hash(self) -> str:
        return self.plan().content_hash()

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "plan": json.loads(self.plan_json),
                "summary": self.summary,
                "queued_s": self.queued_s,
                "planning_s": self.planning_s,
            },
            sort_keys=True,
            default=float,
        )

    @classmethod
    def from_json(cls, text: str) -> PlannedBatch:
        d = json.loads(text)
        plan = Plan.from_dict(d["plan"])
        return cls(d["step"], plan.to_json(), d["summary"], d["queued_s"], d["planning_s"])


_STOP = object()


class AsyncPlanner:
    """Plans submitted batches in order on one worker thread; at most `depth` pending."""

    def __init__(
        self,
        cost: CostModel,
        planner: str = "cpsat",
        *,
        depth: int = 2,
        deterministic: bool = False,
        **options,
    ):
        if depth < 1:
            raise DcpOptError(f"depth: must be >= 1, got {depth}")
        from dcp_opt.solvers import check_options, get_planner  # noqa: PLC0415

        self._plan = get_planner(planner)  # fails now, not in the worker, if unknown
        self.cost = cost
        self.name = planner
        self.options = dict(options)
        if deterministic and planner == "cpsat":
            self.options.update(deterministic=True, num_workers=1)
        check_options(planner, self._plan, self.options)  # a misspelt option fails now too
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="dcp-planner", daemon=True)
        self._thread.start()

    def submit(self, step: int, batch: Batch) -> Future:
        """Queue `batch` for `step` (blocks while `depth` batches wait). Returns a Future."""
        fut: Future = Future()
        with self._lock:
            if step in self._futures:
                raise DcpOptError(f"step: {step} already submitted")
            self._futures[step] = fut
        self._queue.put((step, batch, time.perf_counter(), fut))
        return fut

    def result(self, step: int, timeout: float | None = None) -> PlannedBatch:
        """The plan of `step` (waits for it); raises what the planner raised."""
        with self._lock:
            fut = self._futures.get(step)
        if fut is None:
            raise DcpOptError(f"step: {step} was never submitted")
        out = fut.result(timeout)
        with self._lock:
            self._futures.pop(step, None)
        return out

    def close(self) -> None:
        """Finish the queued batches, then stop the worker."""
        self._queue.put(_STOP)
        self._thread.join()

    def __enter__(self) -> AsyncPlanner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            step, batch, queued, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                res = self._plan(batch, self.cost, **self.options)
                fut.set_result(
                    PlannedBatch(
                        step,
                        res.plan.to_json(),
                        res.summary(),
                        start - queued,
                        time.perf_counter() - start,
                    )
                )
            except BaseException as e:  # noqa: BLE001 (handed to the caller via the future)
                fut.set_exception(e)
