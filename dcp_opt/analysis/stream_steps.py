"""One method over a stream's epoch (dcp_opt.analysis.stream): the published samplers' steps
timed, the project's planners on given steps, the stream bound, and the step former.

Every step is planned once per cost model (StepCache): the greedy planner is deterministic
(solvers/greedy/, plan_greedy), so a step it planned for the `greedy@size` row, for the
step former's proxy (solvers/stream/step_former.py) or for the `greedy+former@size` row has one time
whoever asks. The default run planned about 40 % of its greedy steps two or three times
before (cProfile, 2d-balanced and 1d-short at the default size: docs/stream.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..batch import Batch
from ..build import make_plan
from ..cost import CostModel
from ..errors import DcpOptError
from ..simulate import simulate
from ..validate import validate


@dataclass
class EpochRun:
    """What a method did with the epoch: per step, its sequence ids, time and planning."""

    steps: list[list[int]]
    step_times: list[float]
    dropped: list[int]
    planning_s: list[float]
    bound_s: float | None = None
    # the bound of these very steps as fixed (max_shift 0): bound_s itself unless samples
    # could move (the step former's rows), where bound_s holds for any reassignment
    steps_bound_s: float | None = None


def _sub_batch(epoch: Batch, ids) -> Batch:
    return Batch(tuple(epoch.sequences[i] for i in ids))


class StepCache:
    """Sub-batches and greedy plans of an epoch's steps under one cost model, by sequence ids
    (a step's sequences in id order: data order for a stream epoch, whose ids are 0..n-1)."""

    def __init__(self, epoch: Batch, cost: CostModel):
        self.epoch, self.cost = epoch, cost
        self._batches: dict[tuple, Batch] = {}
        self._greedy: dict[tuple, tuple[float, float]] = {}
        self._bounds: dict[tuple, float] = {}

    def batch(self, ids) -> Batch:
        key = tuple(sorted(ids))
        if key not in self._batches:
            self._batches[key] = _sub_batch(self.epoch, key)
        return self._batches[key]

    def greedy(self, ids) -> tuple[float, float]:
        """(predicted step time, planning seconds) of the greedy plan of this step."""
        key = tuple(sorted(ids))
        if key not in self._greedy:
            from dcp_opt.solvers import run_planner

            b = self.batch(key)
            t0 = time.perf_counter()
            res = run_planner("greedy", b, self.cost)
            wall = time.perf_counter() - t0
            if res.plan is None or not res.ok:
                raise DcpOptError(f"greedy: no plan for a step ({res.status}: {res.message})")
            self._greedy[key] = (res.predicted_step_time_s, wall)
        return self._greedy[key]

    def bound(self, ids, lp: bool = True) -> float:
        """The step's certified bound (solvers/stream_bound.step_lower_bound; lp=False: no
        LP refinement nor tree term), once per step: the former's steps repeat many of data
        order's."""
        key = (tuple(sorted(ids)), lp)
        if key not in self._bounds:
            from dcp_opt.solvers.bounds.stream import step_lower_bound

            kw = {} if lp else {"lp_time_limit_s": 0.0}
            self._bounds[key] = step_lower_bound(self.batch(key[0]), self.cost, **kw)
        return self._bounds[key]

    def proxy(self, batch: Batch) -> float:
        """The step former's proxy (form_steps(proxy=...)): the cached greedy step time."""
        return self.greedy([s.id for s in batch.sequences])[0]


def time_published_steps(epoch: Batch, cost: CostModel, groups_per_step) -> list[float]:
    """Each published step as a one-phase Plan: validated, then simulated."""
    out = []
    for groups in groups_per_step:
        ids = [i for g in groups for mb in g.micro_batches for i in mb.sequence_ids]
        b = _sub_batch(epoch, ids)
        plan = make_plan([groups], b, cost, planner="published")
        bad = validate(plan, b, cost)
        if bad:
            raise DcpOptError(f"published step invalid: {bad[0]}")
        out.append(simulate(plan, b, cost, events=False).step_time_s)
    return out


def run_published(epoch, cost, method, *, seed, drop_last, memory_cap, **kw) -> EpochRun:
    from dcp_opt.solvers.baselines.videosys.stream import published_epoch

    pub = published_epoch(
        epoch, cost, method, seed=seed, drop_last=drop_last, memory_cap=memory_cap, **kw
    )
    steps = [[i for g in st for mb in g.micro_batches for i in mb.sequence_ids] for st in pub.steps]
    times = time_published_steps(epoch, cost, pub.steps)
    per = pub.planning_s / max(len(steps), 1)
    bound = _bound(StepCache(epoch, cost), steps, 0, lp=False)
    return EpochRun(steps, times, pub.dropped, [per] * len(steps), bound, bound)


def run_fixed(
    epoch, cost, planner, steps, options, max_shift=0, bound="compute", cache=None
) -> EpochRun:
    """A project planner on each given step (sequence ids); nothing is dropped. `bound`: the
    stream bound of these steps when already known (another planner on the same steps);
    `cache`: a StepCache of (epoch, cost), shared with other runs on the same cost model."""
    from dcp_opt.solvers import get_planner

    cache = cache or StepCache(epoch, cost)
    fn = get_planner(planner)
    times, walls = [], []
    for ids in steps:
        if planner == "greedy" and not options:
            t, wall = cache.greedy(ids)
        else:
            t0 = time.perf_counter()
            res = fn(cache.batch(ids), cost, **options)
            wall = time.perf_counter() - t0
            if res.plan is None or not res.ok:
                raise DcpOptError(f"{planner}: no plan for a step ({res.status}: {res.message})")
            t = res.predicted_step_time_s
        times.append(t)
        walls.append(wall)
    if bound == "compute":
        bound = _bound(cache, steps, max_shift)
    own = bound if max_shift == 0 else _bound(cache, steps, 0)
    return EpochRun(steps, times, [], walls, bound, own)


def _bound(cache: StepCache, steps, max_shift, lp: bool = True) -> float | None:
    """The stream lower bound of these steps (solvers/bounds/stream.py). lp=False: the
    separable per-step bound only (no LP refinement; ~50 ms a step less), for the published
    methods, whose gap is large either way."""
    from dcp_opt.solvers.bounds.stream import stream_lower_bound

    if not steps:  # a published sampler may form no step at all from a small epoch
        return None
    if max_shift == 0:  # the sum of the per-step bounds (stream_lower_bound), memoised
        return float(sum(cache.bound(s, lp) for s in steps))
    kw = {} if lp else {"lp_time_limit_s": 0.0}
    batches = [cache.batch(s) for s in steps]
    return float(stream_lower_bound(batches, cache.cost, max_shift=max_shift, **kw))


def former_steps(
    epoch, cost, target: int, k: int, e: float, cache=None, budget_s=None
) -> list[list[int]]:
    """Steps chosen by the step former (solvers/stream/step_former.py), its proxy the cached greedy;
    `budget_s` its search budget (None: the former's default)."""
    from dcp_opt.solvers.stream.step_former import MAX_DEFAULT_BUDGET_S, form_steps

    cache = cache or StepCache(epoch, cost)
    if budget_s is not None:
        budget_s = min(budget_s, MAX_DEFAULT_BUDGET_S)
    return form_steps(
        list(epoch.sequences), target_tokens=target, max_shift=k, tolerance=e, cost=cost,
        proxy=cache.proxy, budget_s=budget_s,
    )  # fmt: skip
