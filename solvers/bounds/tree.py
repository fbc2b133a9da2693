"""The rank-assignment relaxation (solvers/bounds/rank.py rank_bound) solved exactly by dynamic
programming over the buddy tree, for few sequences on a homogeneous power-of-two cluster.

Where every allowed degree d's placements are exactly the aligned blocks [s, s + d) with
s a multiple of d (equal speeds and memory; on a fabric each degree is priced at its
cheapest placement, dcp_opt/table.py seq_table, a bound wherever a group lands), a
placement is a node of the binary tree of rank blocks: level l holds the blocks of 2^l
ranks. A rank's load in the relaxation is the sum of the loads of the nodes on its
leaf-to-root path, where a node holding the sequences S0 at degree d = 2^l carries
(rank_bound's rows)

    load_l(S0) = sum_{i in S0} m_i(d) + max(c_d [S0 non-empty], sum_{i in S0} share_i(d))

(m_i its marginal time, c_d the empty micro-batch, share_i its least share of micro-batch
constants, all at the fastest speed: solvers/bounds/data.py). The relaxation's optimum is
then the least over assignments of the largest root-to-leaf sum, and because every node
of a level is alike it depends only on the multiset of sequences under a node:

    f_0(S) = load_0(S)
    g_l(S) = min over S = A + B of max(f_l(A), f_l(B))          (two children)
    f_l(S) = min over S = S0 + R of load_l(S0) + g_{l-1}(R)

with f_H(all) the optimum (H = log2 N). The work row of rank_bound is implied (the mean
over ranks of their path loads is the work over N). Sequences with identical rows are one
class, so a multiset is a vector of counts c_k; the recursion visits every pair of
sub-multisets, prod_k (c_k + 1)(c_k + 2) / 2 of them per level, vectorised with numpy:
milliseconds where HiGHS' branch and bound takes 0.5-5 s (2d-long steps of 5-11 videos on
32 GPUs). Exact for the integer program (every class integer: rank_milp with
integer_share = 0), so it is at least rank_bound's value and a bound in the same sense.
The argmin assignment is a plan's group layout (solvers/bounds/rank_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp_opt.cost import CostModel

MAX_PAIRS = 1 << 21  # sub-multiset pairs per level: above this the MILP is used instead


@dataclass(frozen=True)
class TreeSolution:
    finish_s: float  # the relaxation's optimum (no gradient sync)
    groups: tuple[tuple[int, int, tuple[int, ...]], ...]  # (start, degree, sequence indices)


def applicable(cost: CostModel) -> bool:
    """Whether the cluster's placements are the aligned buddy blocks of a power-of-two
    world with equal ranks (the recursion's premise)."""
    c = cost.cluster
    n = c.num_gpus
    if not c.homogeneous or n & (n - 1):
        return False
    return all(
        d & (d - 1) == 0 and tuple(c.placements(d)) == tuple(range(0, n, d))
        for d in c.allowed_degrees
    )


def pairs(counts) -> int:
    """Sub-multiset pairs the recursion visits a level, for these class sizes (exact ints:
    a product of 64 factors overflows int64)."""
    return math.prod((c + 1) * (c + 2) // 2 for c in counts)


def solve(dat, cls: list[list[int]], n_gpus: int, max_pairs: int = MAX_PAIRS):
    """The relaxation's optimum and an assignment reaching it, from solvers/lp_bound's data
    `dat` (BoundData) and classes `cls` of a batch on an applicable() cluster of `n_gpus`; None
    where the recursion would visit more than `max_pairs` pairs a level."""
    count = np.array([len(m) for m in cls])
    if pairs(count.tolist()) > max_pairs:
        return None
    dp = _Tree(dat, cls, count, n_gpus)
    value = float(dp.f[-1][-1])
    if not np.isfinite(value):
        return None
    return TreeSolution(value, tuple(dp.assign(cls)))


class _Tree:
    """The recursion of the module docstring on count vectors in mixed radix: a state is
    sum_k v_k * stride_k, so index(A) + index(B) = index(A + B) whenever A + B <= counts."""

    def __init__(self, dat, cls: list[list[int]], count: np.ndarray, n_gpus: int):
        self.count = count
        self.stride = np.concatenate([[1], np.cumprod(count[:-1] + 1)]).astype(np.int64)
        self.vec = self._vectors()  # (M, K) counts of every state
        self.ia, self.ib = self._pairs()
        self.isum = self.ia + self.ib
        order = np.argsort(self.isum, kind="stable")
        self.ia, self.ib, self.isum = self.ia[order], self.ib[order], self.isum[order]
        self.starts = np.searchsorted(self.isum, np.arange(len(self.vec)))
        self.levels = n_gpus.bit_length() - 1
        first = [m[0] for m in cls]
        self.loads = [self._load(dat, first, 1 << lv) for lv in range(self.levels + 1)]
        self.f: list[np.ndarray] = [self.loads[0]]
        self.g: list[np.ndarray] = []
        for lv in range(1, self.levels + 1):
            below = self.f[-1]
            self.g.append(self._reduce(np.maximum(below[self.ia], below[self.ib])))
            self.f.append(self._reduce(self.loads[lv][self.ia] + self.g[-1][self.ib]))

    def _vectors(self) -> np.ndarray:
        idx = np.arange(int(np.prod(self.count + 1)), dtype=np.int64)[:, None]
        return (idx // self.stride[None, :]) % (self.count + 1)[None, :]

    def _pairs(self) -> tuple[np.ndarray, np.ndarray]:
        ia, ib = np.zeros(1, np.int64), np.zeros(1, np.int64)
        for c, s in zip(self.count.tolist(), self.stride.tolist(), strict=True):
            # (a, b) with a + b <= c, a outer: a list of tuples took 1 s at c = 2000
            runs = np.arange(c + 1, 0, -1)
            a = np.repeat(np.arange(c + 1), runs)
            b = np.arange(runs.sum()) - np.repeat(np.cumsum(runs) - runs, runs)
            ia = (ia[:, None] + a[None, :] * s).ravel()
            ib = (ib[:, None] + b[None, :] * s).ravel()
        return ia, ib

    def _reduce(self, vals: np.ndarray) -> np.ndarray:
        return np.minimum.reduceat(vals, self.starts)

    def _load(self, dat, first: list[int], d: int) -> np.ndarray:
        """load_l of every state at degree d (inf where a member does not fit)."""
        hit = np.flatnonzero(dat.deg == d)
        if len(hit) == 0:
            return np.where(self.vec.sum(1) == 0, 0.0, np.inf)
        j = int(hit[0])
        m = dat.marg[first, j]
        with np.errstate(invalid="ignore"):  # inf - inf where a class does not fit
            share = np.maximum(dat.work[first, j] / d - m, 0.0)  # equal speeds: top = 1
        share = np.where(np.isfinite(share), share, 0.0)
        with np.errstate(invalid="ignore"):  # 0 * inf: a class absent from the state
            marg = np.where(self.vec > 0, self.vec * m[None, :], 0.0).sum(1)
        const = np.where(self.vec.sum(1) > 0, dat.const[j], 0.0)
        return marg + np.maximum(const, self.vec @ share)

    def _arg(self, s: int, value) -> tuple[int, int]:
        """The pair (A, B) with A + B = s of least value(ia, ib)."""
        lo = self.starts[s]
        hi = self.starts[s + 1] if s + 1 < len(self.starts) else len(self.isum)
        ia, ib = self.ia[lo:hi], self.ib[lo:hi]
        k = int(np.argmin(value(ia, ib)))
        return int(ia[k]), int(ib[k])

    def assign(self, cls: list[list[int]]):
        """(start, degree, sequence indices) of every non-empty node of an optimal
        assignment, read back from the recursion's tables."""
        left = [list(m) for m in cls]
        out = []

        def take(state: int) -> tuple[int, ...]:
            v = self.vec[state]
            return tuple(left[k].pop() for k in range(len(v)) for _ in range(int(v[k])))

        def node(lv: int, state: int, start: int) -> None:
            if lv == 0:
                if state:
                    out.append((start, 1, take(state)))
                return
            load, g, below = self.loads[lv], self.g[lv - 1], self.f[lv - 1]
            here, rest = self._arg(state, lambda a, b: load[a] + g[b])
            if here:
                out.append((start, 1 << lv, take(here)))
            a, b = self._arg(rest, lambda a, b: np.maximum(below[a], below[b]))
            node(lv - 1, a, start)
            node(lv - 1, b, start + (1 << (lv - 1)))

        node(self.levels, len(self.vec) - 1, 0)
        return out
