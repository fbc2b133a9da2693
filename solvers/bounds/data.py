"""The per-sequence data every relaxation of solvers/bounds/ reads (the LP's work rows,
the rank relaxation, its tree recursion, the stream bound's work term): each sequence's
time alone per degree, its marginal time, the per-degree micro-batch constants and its
least GPU-work, all at the fastest speed. The work row's derivation is in lp.py's
docstring."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.table import seq_table


@dataclass(frozen=True)
class BoundData:
    time: np.ndarray  # (n, D) alone, at the fastest speed; inf where it does not fit
    marg: np.ndarray  # (n, D) the same less every per-micro-batch constant
    c_min: float  # the smallest empty micro-batch time, at the fastest speed
    const: np.ndarray  # (D,) the empty micro-batch time per degree, at the fastest speed
    work: np.ndarray  # (n, D) GPU-seconds lower bound
    deg: np.ndarray
    capacity: float  # sum of rank weights
    n_gpus: int


def bound_data(batch: Batch, cost: CostModel) -> BoundData:
    """The bound's per-sequence data, memoised on the cost model (its bounded MemoCache):
    lp_bound, the stream bound's tree term and the planners' tree candidate read it for the
    same batch."""
    key = ("lp_bound_data", batch.fingerprint())
    return cost.memoised(key, lambda: _make_data(batch, cost))


def _make_data(batch: Batch, cost: CostModel) -> BoundData:
    tab = seq_table(batch, cost)
    c = cost.cluster
    deg = np.asarray(tab.degrees, dtype=float)
    w = np.maximum(np.asarray(c.speed_factors or (1.0,) * c.num_gpus), 1.0)
    zero = np.zeros(cost.num_features)
    # Several SP kinds (cost.sp_kinds): the table holds the least time over them, and each
    # term below is the least over the kinds, so the bound holds for plans of any kind.
    kws = [{} if k == "ulysses" else {"kind": k} for k in cost.sp_kinds]
    # (additive_time: a ring group's exposed transfers, which packing may hide, left out)
    const = np.array(
        [min(float(cost.additive_time(zero, int(d), 0, **kw)) for kw in kws) for d in tab.degrees]
    )
    cap = np.array([max(cost.capacity(s, int(d)) for s in c.placements(int(d))) for d in deg])
    shares = np.min([_shares(cost, tab, cap, **kw) for kw in kws], axis=0)
    work = deg[None, :] * (tab.time_marginal + shares)
    top = w.max()
    return BoundData(
        tab.time / top,
        tab.time_marginal / top,
        float(const.min()) / top,
        const / top,
        work,
        deg,
        float(w.sum()),
        c.num_gpus,
    )


def _shares(cost: CostModel, tab, cap: np.ndarray, **kind) -> np.ndarray:
    """(n, D) the least each sequence adds to a micro-batch beyond its marginal time: at
    recompute level r (r >= its own r_min, else it does not fit) a micro-batch holds at most
    K_d(r) tokens, so the sequence carries at least tok / K_d(r) of the empty micro-batch's
    time E_d(r), and (r - r_min) more recomputed layers of its own, rec each; the least over
    r. Every figure is the cost model's own (additive_time_by_degree: time_by_degree but for
    a ring group's exposed transfers; memory), so subclasses hold too.
    Time is affine in the features (table.py), so rec = features @ (the increment of one
    more recomputed layer per unit feature): one cost call per feature, not per sequence.
    `kind`: the SP kind's times (empty micro-batch, recompute) and its own r_min (a member
    of a kind's micro-batch at level r recomputes r - r_min of that kind beyond the
    marginal time the table holds; the table's r_min, Ulysses', would charge cp members
    for layers they already pay: a cp plan 5 % below the bound, tests/test_tree_bound.py);
    memory per token is Ulysses' at degree 1 (the least of the kinds): it can only lower
    the term."""
    L = cost.model.num_layers
    degrees = tab.degrees
    deg = np.asarray(degrees, dtype=float)
    nd, nf = len(degrees), cost.num_features
    levels = np.arange(L + 1)
    empty = cost.additive_time_by_degree(
        np.zeros((L + 1, nf)), degrees, np.broadcast_to(levels, (nd, L + 1)), **kind
    )
    per_tok = np.array([float(cost.memory(1.0, 1, r)) for r in levels]) - cost.fixed_bytes()
    room = np.maximum(cap - cost.fixed_bytes(), 1e-30)
    a = empty * per_tok[None, :] / (room * deg)[:, None]  # (D, L + 1): E_d(r) / K_d(r)
    r0 = tab.r_min
    if kind:  # this kind's fewest layers at the same (best) capacity, as the table's
        r0 = cost.min_recompute(tab.tokens[None, :], deg[:, None], cap[:, None], **kind).T
    ok = r0 >= 0
    r0c = np.where(ok, r0, 0)
    at_r0 = tab.tokens[:, None] * a[np.arange(nd)[None, :], r0c]
    if L == 0:
        return np.where(ok, at_r0, np.inf)
    eye = np.eye(nf)
    step = [
        cost.additive_time_by_degree(eye, degrees, np.full((nd, nf), r), **kind) for r in (0, 1)
    ]
    g = (step[1] - empty[:, 1:2]) - (step[0] - empty[:, 0:1])  # (D, F) per unit feature
    rec = np.maximum(tab.feats @ g.T, 0.0)  # (n, D) one more recomputed layer of it
    slopes = (empty[:, -1] - empty[:, 0]) * (per_tok[-1] - per_tok[0])
    if _affine(empty) and _affine(per_tok[None, :]) and np.all(slopes <= 0):
        # E_d(r) and the bytes per token are affine in r with slopes of opposite signs
        # (recompute adds time and frees memory), so E_d(r) / K_d(r) is a concave quadratic
        # in r and so is the whole term: its least on [r_min, L] is at an end
        at_l = tab.tokens[:, None] * a[:, L][None, :] + (L - r0c) * rec
        return np.where(ok, np.minimum(at_r0, at_l), np.inf)
    v = tab.tokens[:, None, None] * a[None] + (levels - r0c[..., None]) * rec[..., None]
    v[levels < r0c[..., None]] = np.inf
    return np.where(ok, v.min(axis=2), np.inf)


def _affine(x: np.ndarray) -> bool:
    """Rows of x are affine in their index (second differences within rounding)."""
    if x.shape[1] < 3:
        return True
    return bool(
        np.all(np.abs(np.diff(x, 2, axis=1)) <= 1e-9 * np.abs(x).max(axis=1, keepdims=True))
    )
