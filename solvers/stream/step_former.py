"""Step former: which samples of a stream train in each optimizer step (issue 13, item 4).

Off by default: nothing calls it unless asked. Given a stream in data order it returns the
sequence ids of each optimizer step, within three bounds that are never broken (an
assignment it cannot find is refused with a DcpOptError, a ValueError, naming the field):
- every sample trains exactly once per epoch;
- a sample's step index differs from its data-order step index (data_order_steps) by at most
  max_shift (K);
- every step but the last holds between (1 - e) and (1 + e) x target_tokens tokens (e =
  tolerance); the last step holds the remainder: at least one sample, at most (1 + e) x
  target. The former returns exactly as many steps as data order: the epoch keeps its
  optimizer-step count, only the membership of each step changes.

Data order (data_order_steps): samples in stream order; the next sample joins the open step
when that leaves the step nearer target_tokens than it is (ties join: have + t/2 <= target),
else the step closes; an empty step always takes the next sample. So every data-order step
but the last holds target +- half of its largest neighbour sample, and steps average the
target: when no sample is over 2 e x target, data order is already within the band.

Proxy for a step's time: the predicted step time of the greedy planner's plan of that step.
The certified per-step bound (dcp_opt.bounds) cannot guide the choice: its work term is a sum
over sequences, so its sum over the epoch is the same for every assignment, and only steps
whose longest sequence outlasts their work could gain. On 2D workloads at 2M-token steps on 32
H200 that never happens (the 432K-token video's critical path is 0.40 s, every step's work
bound >= 0.79 s: docs/stream.md), yet the greedy plans sit 3-12 % above the bound, mostly in
steps whose long videos do not divide evenly over the groups. Greedy sees that (~15 ms a step).

Algorithm:
1. data order; where a step is outside the band (a long sample at its edge), move samples
   between it and the next steps (within K) until it is in the band (repair);
2. local search under a budget: steps are visited by decreasing concentration of their work
   (sum of squared per-sequence work over squared step work: few heavy sequences are hard to
   balance over the groups); the visited step's heaviest sequences are exchanged with a set
   of lighter ones (similar tokens) from a step within reach, least concentrated first, and
   an exchange is kept when it lowers the two steps' summed greedy step time (a first pass
   plans only exchanges that lower the pair's larger concentration). On 2d-long the greedy
   step time grows with the count of 432K-token videos in a step (greedy / bound 1.04 with
   none, 1.14 with four: docs/stream.md), so spreading them is what pays. Every kept exchange
   lowers the proxy's epoch sum, so the result is never worse than the start (data order
   when data order is within the band). CP-SAT is not used: the objective is the greedy planner's output, which
   an assignment model cannot express, and the analytic bound it could express is invariant.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dcp_opt.batch import Batch, Sequence
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, require
from dcp_opt.table import seq_table

# Default search budget when budget_s is None: per step, capped (issue 13: an epoch of
# 250-1000 steps in seconds to a minute).
BUDGET_PER_STEP_S = 0.05
MAX_DEFAULT_BUDGET_S = 60.0
# Passes of the search, while budget lasts: (screen by work concentration, sequences of a
# visited step offered for exchange, heaviest first). Measured on 100 steps of 2d-long
# (h200x32): 2 heaviest gain most per greedy plan, 4 find 15 % more once 2 is exhausted.
PASSES = ((True, 2), (False, 2), (False, 4))
MAX_VISITS = 3  # times one step is visited (again after an exchange changed it)
REL = 1e-9  # an exchange must gain more than this share of the two steps' time


def data_order_steps(stream: list[Sequence], target_tokens: int) -> list[list[int]]:
    """Sequence ids per step in data order: the next sample joins the open step when that
    leaves it nearer target_tokens (have + t/2 <= target), else the step closes; a sample
    over twice the target forms its own step. Steps hold target +- half a sample."""
    _check_target(target_tokens)
    return [[stream[i].id for i in s] for s in _data_order(_tokens(stream), target_tokens)]


def _data_order(tokens: list[int], target: int) -> list[list[int]]:
    steps: list[list[int]] = []
    cur: list[int] = []
    have = 0
    for i, t in enumerate(tokens):
        if cur and 2 * have + t > 2 * target:  # integers: have + t/2 > target
            steps.append(cur)
            cur, have = [], 0
        cur.append(i)
        have += t
    if cur:
        steps.append(cur)
    return steps


@dataclass
class StepForming:
    """What form_steps_report found: the steps and how the search went."""

    steps: list[list[int]]  # sequence ids per step
    repaired: int = 0  # samples moved to bring data order into the token band
    exchanges: int = 0  # exchanges kept by the search
    evals: int = 0  # greedy plans made
    proxy_start_s: float | None = None  # summed greedy time of the visited steps, at start
    proxy_end_s: float | None = None  # the same steps after the search
    wall_s: float = 0.0


def form_steps(
    stream: list[Sequence],
    *,
    target_tokens: int,
    max_shift: int,
    tolerance: float,
    cost: CostModel | None = None,
    budget_s: float | None = None,
    max_evals: int | None = None,
    proxy: Callable[[Batch], float] | None = None,
) -> list[list[int]]:
    """Sequence ids per optimizer step (module docstring: bounds, proxy, algorithm).
    Without `cost` only the repair runs (no step time to predict). `budget_s`: seconds of
    search (None: 0.05 s a step, at most 60 s; 0: repair only); `max_evals`: a cap on greedy
    plans, for a result that does not depend on the machine's speed. `proxy`: a step's
    predicted time in seconds, from its Batch (None: the greedy planner's; the stream bench
    passes a cached greedy, dcp_opt.analysis.stream_steps.StepCache)."""
    return form_steps_report(
        stream,
        target_tokens=target_tokens,
        max_shift=max_shift,
        tolerance=tolerance,
        cost=cost,
        budget_s=budget_s,
        max_evals=max_evals,
        proxy=proxy,
    ).steps


def form_steps_report(
    stream: list[Sequence],
    *,
    target_tokens: int,
    max_shift: int,
    tolerance: float,
    cost: CostModel | None = None,
    budget_s: float | None = None,
    max_evals: int | None = None,
    proxy: Callable[[Batch], float] | None = None,
) -> StepForming:
    """form_steps, with what the search did."""
    started = time.perf_counter()
    _check_args(stream, target_tokens, max_shift, tolerance, budget_s, max_evals)
    require(proxy is None or callable(proxy), "proxy", f"must be None or callable, got {proxy!r}")
    tokens = _tokens(stream)
    # the band in whole tokens; the slack keeps e.g. (1 - 0.3) x 10 = 7.000000000000001 at 7
    lo = math.ceil((1 - tolerance) * target_tokens * (1 - 1e-12))
    hi = math.floor((1 + tolerance) * target_tokens * (1 + 1e-12))
    _check_sizes(stream, tokens, hi, tolerance)
    if cost is not None:  # refused up front, naming the sample: no step could hold it
        cost.check_fits(Batch(tuple(stream)))
    st = _State(tokens, _data_order(tokens, target_tokens), max_shift, lo, hi)
    repaired = st.repair()
    out = StepForming([], repaired=repaired)
    if cost is not None and len(st.steps) > 1 and budget_s != 0 and max_evals != 0:
        if budget_s is None:
            budget_s = min(MAX_DEFAULT_BUDGET_S, BUDGET_PER_STEP_S * len(st.steps))
        _Search(st, stream, cost, started + budget_s, max_evals, proxy).run(out)
    out.steps = [[stream[i].id for i in sorted(s)] for s in st.steps]
    out.wall_s = time.perf_counter() - started
    return out


# ---- arguments ----------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_target(target_tokens) -> None:
    require(
        _is_int(target_tokens) and target_tokens > 0,
        "target_tokens",
        f"must be an integer > 0, got {target_tokens!r}",
    )


def _check_args(stream, target_tokens, max_shift, tolerance, budget_s, max_evals) -> None:
    _check_target(target_tokens)
    require(
        _is_int(max_shift) and max_shift >= 0,
        "max_shift",
        f"must be an integer >= 0 (steps a sample may move), got {max_shift!r}",
    )
    require(
        isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool),
        "tolerance",
        f"must be a number in [0, 1), got {tolerance!r}",
    )
    require(0 <= tolerance < 1, "tolerance", f"must be in [0, 1), got {tolerance!r}")
    require(
        budget_s is None or (isinstance(budget_s, (int, float)) and budget_s >= 0),
        "budget_s",
        f"must be None or seconds >= 0, got {budget_s!r}",
    )
    require(
        max_evals is None or (_is_int(max_evals) and max_evals >= 0),
        "max_evals",
        f"must be None or an integer >= 0, got {max_evals!r}",
    )
    require(len(stream) > 0, "stream", "is empty; give at least one sequence")
    Batch(tuple(stream))  # unique ids, one kind: Batch names the fault


def _tokens(stream: list[Sequence]) -> list[int]:
    for i, s in enumerate(stream):
        if not isinstance(s, Sequence):  # the message only when it fails: 155K reprs cost 2 s
            require(False, f"stream[{i}]", f"must be a Sequence, got {s!r}")
    return [s.num_tokens for s in stream]


def _check_sizes(stream, tokens: list[int], hi: int, tolerance: float) -> None:
    for i, t in enumerate(tokens):
        require(
            t <= hi,
            f"stream[{i}]",
            f"sequence {stream[i].id} holds {t} tokens, more than (1 + tolerance) x "
            f"target_tokens = {hi}: no step within the tolerance {tolerance} can hold it; "
            "raise target_tokens or tolerance",
        )


# ---- the assignment and its repair ---------------------------------------------------------
class _State:
    """Steps as sets of stream indices, their tokens, and every sample's data-order step."""

    def __init__(self, tokens, data_steps, max_shift: int, lo: int, hi: int):
        self.tok = tokens
        self.k = max_shift
        self.lo, self.hi = lo, hi
        self.home = [0] * len(tokens)
        for j, s in enumerate(data_steps):
            for i in s:
                self.home[i] = j
        self.steps = [set(s) for s in data_steps]
        self.step_tok = [sum(tokens[i] for i in s) for s in data_steps]

    def band(self, k: int) -> tuple[int, int]:
        """Tokens step k may hold: the last step at least one token (one sample)."""
        return (1 if k == len(self.steps) - 1 else self.lo), self.hi

    def reach(self, i: int, k: int) -> bool:
        return abs(k - self.home[i]) <= self.k

    def move(self, i: int, src: int, dst: int) -> None:
        self.steps[src].remove(i)
        self.steps[dst].add(i)
        self.step_tok[src] -= self.tok[i]
        self.step_tok[dst] += self.tok[i]

    def repair(self) -> int:
        """Bring every step but the last into the band, first to last: one under it pulls
        samples from the next K steps, one over it pushes samples to the next step, each
        time the sample that leaves it nearest the target (so the steps keep data order's
        pace and the last one is left the remainder). The last step keeps a sample at least:
        the step count never changes. Samples moved."""
        moved = 0
        last = len(self.steps) - 1
        for k in range(last):
            while self.step_tok[k] < self.lo or self.step_tok[k] > self.hi:
                pick = self._pull(k) if self.step_tok[k] < self.lo else self._push(k)
                if pick is None:
                    raise self._stuck(k)
                self.move(*pick)
                moved += 1
        if self.step_tok[last] > self.hi:
            raise self._stuck(last)
        return moved

    def _nearest(self, k: int, cands, sign: int):
        """The candidate whose move leaves step k nearest the target (ties: lowest index)."""
        target = (self.lo + self.hi) / 2
        return min(cands, key=lambda i: (abs(self.step_tok[k] + sign * self.tok[i] - target), i))

    def _pull(self, k: int):
        last = len(self.steps) - 1
        room = self.hi - self.step_tok[k]
        for q in range(k + 1, min(last, k + self.k) + 1):
            if q == last and len(self.steps[q]) == 1:
                continue
            ok = [i for i in self.steps[q] if self.tok[i] <= room and self.reach(i, k)]
            if ok:
                return self._nearest(k, ok, +1), q, k
        return None

    def _push(self, k: int):
        ok = [i for i in self.steps[k] if self.reach(i, k + 1)]
        return (self._nearest(k, ok, -1), k, k + 1) if len(ok) and len(self.steps[k]) > 1 else None

    def _stuck(self, k: int) -> DcpOptError:
        return DcpOptError(
            f"tolerance: step {k} holds {self.step_tok[k]} tokens and no sample within "
            f"max_shift = {self.k} steps brings it into [{self.lo}, {self.hi}] "
            "((1 -+ tolerance) x target_tokens); raise tolerance or max_shift"
        )


# ---- the search -----------------------------------------------------------------------------
class _Search:
    """Exchanges between steps, kept when the greedy planner's summed step time drops."""

    def __init__(self, st: _State, stream, cost: CostModel, deadline: float, max_evals, proxy):
        self.st, self.stream, self.cost = st, stream, cost
        self.proxy = proxy or self.greedy_time
        self.deadline, self.max_evals = deadline, max_evals
        tab = seq_table(Batch(tuple(stream)), cost)
        deg = np.asarray(tab.degrees, dtype=float)
        # least GPU-seconds of each sequence (dcp_opt.bounds: the per-sequence work term)
        self.work = np.min(tab.time_marginal * deg[None, :], axis=1).tolist()
        self.memo: dict[frozenset, float] = {}
        self.start_t: dict[int, float] = {}
        self.evals = 0
        self.screen, self.heaviest = PASSES[0]

    def out_of_budget(self) -> bool:
        if self.max_evals is not None and self.evals >= self.max_evals:
            return True
        return time.perf_counter() > self.deadline

    def step_time(self, members) -> float:
        key = frozenset(members)
        if key not in self.memo:
            batch = Batch(tuple(self.stream[i] for i in sorted(key)))
            self.memo[key] = float(self.proxy(batch))
            self.evals += 1
        return self.memo[key]

    def greedy_time(self, batch: Batch) -> float:
        from dcp_opt.solvers import run_planner  # noqa: PLC0415 (solvers/__init__ imports lazily)

        return run_planner("greedy", batch, self.cost).predicted_step_time_s

    def time_of(self, k: int) -> float:
        t = self.step_time(self.st.steps[k])
        self.start_t.setdefault(k, t)
        return t

    def concentration(self, k: int) -> float:
        return self.conc_of(self.st.steps[k])

    def conc_of(self, members) -> float:
        w = [self.work[i] for i in members]
        return sum(x * x for x in w) / max(sum(w), 1e-30) ** 2

    def run(self, out: StepForming) -> None:
        """PASSES in turn: first only exchanges that lower the pair's larger work
        concentration (no plan made for the others: most gains per plan), then every
        exchange, then with more of each step's heaviest sequences offered."""
        for screen, heaviest in PASSES:
            self.screen, self.heaviest = screen, heaviest
            out.exchanges += self.one_pass()
        out.evals = self.evals
        out.proxy_start_s = sum(self.start_t.values())
        out.proxy_end_s = sum(self.step_time(self.st.steps[k]) for k in self.start_t)

    def one_pass(self) -> int:
        heap = [(-self.concentration(k), k) for k in range(len(self.st.steps))]
        heapq.heapify(heap)
        visits = [0] * len(self.st.steps)
        kept = 0
        while heap and not self.out_of_budget():
            _, p = heapq.heappop(heap)
            if visits[p] >= MAX_VISITS:
                continue
            visits[p] += 1
            q = self.improve(p)
            if q is not None:
                kept += 1
                for k in (p, q):
                    heapq.heappush(heap, (-self.concentration(k), k))
        return kept

    def improve(self, p: int) -> int | None:
        """Try the visited step's heaviest sequences against steps within reach, least
        concentrated first (a heavy sequence is best spread to a step of light ones); keep
        the first exchange that lowers the pair's time. The step it was kept with, or None."""
        st = self.st
        heavy = sorted(st.steps[p], key=lambda i: (-self.work[i], i))[: self.heaviest]
        for a in heavy:
            lo_q = max(0, st.home[a] - st.k)
            hi_q = min(len(st.steps) - 1, st.home[a] + st.k)
            for q in sorted(range(lo_q, hi_q + 1), key=lambda q: (self.concentration(q), q)):
                if q == p or self.out_of_budget():
                    continue
                if self.try_exchange(a, p, q):
                    return q
        return None

    def try_exchange(self, a: int, p: int, q: int) -> bool:
        st = self.st
        b_set = self.partners(a, p, q)
        if b_set is None:
            return False
        new_p = (st.steps[p] - {a}) | set(b_set)
        new_q = (st.steps[q] - set(b_set)) | {a}
        if self.screen and max(self.conc_of(new_p), self.conc_of(new_q)) >= max(
            self.concentration(p), self.concentration(q)
        ):
            return False
        before = self.time_of(p) + self.time_of(q)
        after = self.step_time(new_p) + self.step_time(new_q)
        if after >= before * (1 - REL):
            return False
        st.move(a, p, q)
        for b in b_set:
            st.move(b, q, p)
        return True

    def partners(self, a: int, p: int, q: int) -> list[int] | None:
        """Lighter samples of step q that may go to step p, whose tokens keep both steps in
        their band once a goes to q (largest first, aiming at a's tokens); None if none do."""
        st = self.st
        lo_p, hi_p = st.band(p)
        lo_q, hi_q = st.band(q)
        ta, tp, tq = st.tok[a], st.step_tok[p], st.step_tok[q]
        x_lo = max(lo_p - tp + ta, tq + ta - hi_q, 0)
        x_hi = min(hi_p - tp + ta, tq + ta - lo_q)
        if x_lo > x_hi:
            return None
        goal = min(max(ta, x_lo), x_hi)
        pool = [b for b in st.steps[q] if self.work[b] < self.work[a] and st.reach(b, p)]
        pool.sort(key=lambda b: (-st.tok[b], b))
        chosen, total = [], 0
        for b in pool:
            if total >= goal:
                break
            if total + st.tok[b] <= x_hi:
                chosen.append(b)
                total += st.tok[b]
        if total < x_lo or (len(chosen) == 0 and len(st.steps[p]) == 1):
            return None
        return chosen
