"""Micro-step drafts: plans whose phases are the pipeline's micro-steps (Pipeline.micro_steps,
docs/plan-format.md, schema 4). Megatron dev's dynamic CP runs this shape (groups re-formed
every micro-step); here with the project's composition, recompute and order.

Composition, two layouts. The sequences longer than a threshold t (one of lo's token caps,
window.token_caps, up to its window) go to micro-steps of n / hi groups of degree hi (hi >
lo; the longest sequence fits alone at hi), the rest to micro-steps of n / lo groups of
degree lo: each sequence at the lower, cheaper degree where memory lets it. Each part is
packed (compose.pack, LPT by seconds) into K (n / d) micro-batches of at most the part's
token cap (pack opens more when a sequence fits none: a sequence over the cap gets a
micro-batch of its own), then the micro-batches, sorted by seconds, are cut into
micro-steps of n / d consecutive ones: a micro-step lasts as long as its slowest group, and
the sum over micro-steps of their slowest is least when similar loads share one. lo = hi is
one layout (a column plan of equal counts). Then the two lightest micro-steps of the low
degree are re-cut into four each (`taper`): 1F1B fills and drains one micro-step at a time,
so small ones at the ends shorten both (1-2 % on the benchmark's 256-GPU rows, session 10).

Recompute, per micro-batch and stage, whatever the order: a unit of stage s holds at most
w = p - s micro-batches in flight under 1F1B (all K under GPipe) plus the running pass's
working set, so each micro-batch kept within the share (room_s - the largest working set on
s) / w fits every unit in every order; r is the fewest of the stage's layers with which its
stored bytes per unit are within the share (stages.column_memory's bytes).

Order: the micro-steps' named orders (order.candidate_orders), then (`improve`, on the draft
kept) local search, each priced
as one column whose micro-batch times are each micro-step's slowest group. That is an upper
bound of the lockstep finish: with every group of a micro-step as slow as its slowest, every
unit runs in step, and lengthening a pass never shortens a schedule of fixed orders. The
plan's step time is simulate()'s exact lockstep finish.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from dcp_opt.pipeline.makespan import batch_makespans
from dcp_opt.pipeline.stages import column_times
from dcp_opt.plan import Group, MicroBatch

from .compose import pack
from .instance import Instance
from .order import candidate_orders, local_search
from .window import (
    estimate,
    fits_alone,
    split_summary,
    stage_room,
    token_caps,
    window_tokens,
)


def split_ids(inst: Instance, lo_tokens: float) -> tuple[np.ndarray, np.ndarray]:
    """(ids over lo_tokens tokens: the high layout's, the rest: the low layout's)."""
    long = inst.tokens > lo_tokens
    return np.flatnonzero(long), np.flatnonzero(~long)


def compose(inst: Instance, d: int, ids, tokens: float, k: int) -> list[list[list[int]]]:
    """Micro-steps of n / d groups of degree d holding `ids`: LPT into k (n / d) micro-batches
    of at most `tokens` tokens, sorted by seconds, cut into runs of n / d."""
    n = inst.layout.num_units
    per = n // d
    mbs = pack(inst, d, min(k * per, len(ids)), tokens, ids)
    a = inst.additive(d)
    mbs.sort(key=lambda mb: -float(a[mb].sum()))
    return [mbs[i : i + per] for i in range(0, len(mbs), per)]


TAPER = (2, 4)  # the lightest micro-steps re-cut, and into how many each


def taper(inst: Instance, steps: list, spec) -> list:
    """Re-cut the `spec[0]` lightest micro-steps of the lowest degree into `spec[1]` each (the
    same sequences, 1 / spec[1] of the tokens a micro-batch): the named orders put small
    micro-steps first and last, where 1F1B's fill and drain run one micro-step at a time
    (bound.py (1): head and tail), at a micro-batch constant each."""
    count, ways = spec
    if count <= 0 or ways <= 1:
        return steps
    d = min(dd for dd, _ in steps)
    a = inst.additive(d)
    mine = sorted((k for k, (dd, _) in enumerate(steps) if dd == d),
                  key=lambda k: sum(float(a[mb].sum()) for mb in steps[k][1]))  # fmt: skip
    light = set(mine[:count])
    if len(mine) <= count:
        return steps
    out = [st for k, st in enumerate(steps) if k not in light]
    for k in sorted(light):
        ids = np.array([i for mb in steps[k][1] for i in mb])
        tokens = max(float(inst.tokens[mb].sum()) for mb in steps[k][1]) / ways
        out += [(d, st) for st in compose(inst, d, ids, tokens, ways)]
    return out


def share_recompute(inst: Instance, d: int, tokens: np.ndarray, work_max: np.ndarray,
                    in_flight: np.ndarray):  # fmt: skip
    """(m, p) the fewest layers each micro-batch of `tokens` tokens at degree d recomputes on
    each stage to stay within its share (room_s - work_max_s) / in_flight_s; None if a
    micro-batch cannot even with every layer recomputed."""
    co = inst.layout.cost.coeffs
    L = np.array(inst.layout.pipeline.stage_layers, dtype=float)
    act, ckpt = co.act_bytes_per_token_layer, co.ckpt_bytes_per_token_layer
    share = (stage_room(inst, 1) - work_max) / in_flight  # (p,) per unit
    local = np.asarray(tokens, dtype=float)[:, None] / d  # (m, 1)
    over = local * L * act - share  # bytes over the share with nothing recomputed
    save = local * max(act - ckpt, 1e-30)
    r = np.maximum(np.ceil(over / save - 1e-9), 0.0)
    if (r > L).any():
        return None
    return r.astype(int)


def working_set(inst: Instance, d: int, tokens: np.ndarray) -> np.ndarray:
    """(p,) the largest working set per unit on each stage of micro-batches of `tokens`
    tokens at degree d (stages.column_memory: a pass's activations, the head's on the last)."""
    co = inst.layout.cost.coeffs
    p = inst.layout.num_stages
    per_token = np.full(p, co.act_bytes_per_token_layer)
    per_token[-1] += co.head_bytes_per_token
    return float(np.max(tokens, initial=0.0)) / d * per_token


def draft(inst: Instance, parts: tuple, limit: float | None = None):
    """parts: ((d, ids, token cap, k), ...) each composed into micro-steps; then recompute
    and the best named order (the module docstring; `improve` searches further). (upper
    bound of the finish, [(d, [(mb, rec)])] in order, their (F, B, X)) or None when a
    micro-batch cannot fit its share. limit: the search's, unused (this draft is a few
    array passes, 12-17 ms at 256 GPUs: not worth interrupting)."""
    del limit
    steps = [(d, st) for d, ids, tokens, k in parts if len(ids)
             for st in compose(inst, d, ids, tokens, k)]  # fmt: skip
    if not steps:
        return None
    steps = taper(inst, steps, TAPER)
    lay = inst.layout
    p, K, V = lay.num_stages, len(steps), lay.num_virtual
    in_flight = np.full(p, float(K)) if lay.pipeline.schedule == "gpipe" else \
        np.minimum(np.arange(p, 0, -1), K).astype(float)  # fmt: skip
    # every micro-batch, flat: its micro-step, degree, tokens, features
    owner = np.array([k for k, (_, st) in enumerate(steps) for _ in st])
    deg = np.array([d for d, st in steps for _ in st])
    mbs = [mb for _, st in steps for mb in st]
    tok = np.array([float(inst.tokens[mb].sum()) for mb in mbs])
    feats = np.add.reduceat(inst.feats[np.concatenate(mbs)], np.cumsum(
        [0] + [len(mb) for mb in mbs[:-1]]), axis=0)  # fmt: skip
    work_max = np.zeros(p)
    for d in set(deg.tolist()):
        work_max = np.maximum(work_max, working_set(inst, d, tok[deg == d]))
    rec = np.zeros((len(mbs), p), dtype=int)
    F, B, X = np.zeros((V, K)), np.zeros((V, K)), np.zeros((V - 1, K))
    for d in set(deg.tolist()):
        at = np.flatnonzero(deg == d)
        r = share_recompute(inst, d, tok[at], work_max, in_flight)
        if r is None:
            return None
        rec[at] = r
        f, b, x = column_times(lay, feats[at], d, 0, "ulysses", r)  # aligned groups price alike
        for T, t in ((F, f), (B, b), (X, x)):
            np.maximum.at(T.T, owner[at], t.T)  # each micro-step: its slowest group
    out, i = [], 0
    for d, st in steps:
        out.append((d, [(mb, rec[i + j]) for j, mb in enumerate(st)]))
        i += len(st)
    order, value = best_order(inst, (F, B, X))
    return value, [out[k] for k in order], tuple(t[:, order] for t in (F, B, X))


def best_order(inst: Instance, times) -> tuple[list[int], float]:
    """The best named order of the micro-steps (their slowest groups' times)."""
    pipe = inst.layout.pipeline
    kw = {"schedule": pipe.schedule, "num_stages": pipe.num_stages, "virtual": 1}
    orders = candidate_orders(times)
    v = batch_makespans(*times, orders, **kw)
    k = int(v.argmin())
    return orders[k].tolist(), float(v[k])


def improve(inst: Instance, drafted, times, value: float, deadline: float,
            limit: float | None = None):  # fmt: skip
    """Local search (order.local_search, with its deadline and limit) on a draft's
    micro-step order: (value, micro-steps in the new order). Its recompute fits in any
    order."""
    order, v = local_search(None, inst, times, range(len(drafted)), value, deadline, limit)
    return v, [drafted[k] for k in order]


def candidates(inst: Instance, degrees, cap: float) -> list:
    """(estimate, thunk) of each micro-step draft: each single degree d whose longest
    sequence fits alone, at each token cap of window.token_caps; and each pair lo < hi (hi / 8
    <= lo), the sequences over a threshold t (each of lo's caps) on hi, the rest on lo, at
    each hi cap and each lo cap up to t; every part with the fewest micro-steps its cap
    allows. The lo cap below the threshold is what the memory-bound rows need: on 70B p = 4
    over 256 H200s (10 GB of room on stage 0) micro-batches of ~3K tokens at degree 8 with
    the 12K-token documents alone in theirs recompute 4 of stage 0's 20 layers, where
    micro-batches cut at the 12K threshold recompute 16 (26.1 s -> 25.4 s, session 11)."""
    n = inst.layout.num_units
    fit = [d for d in degrees if n % d == 0 and fits_alone(inst, d)]
    everything = np.arange(len(inst.tokens))

    def summ(d, side, t):  # a side of the split at t: the longest j or the rest
        return split_summary(inst, d, int((inst.tokens > t).sum()), side)

    out = []
    for hi in fit:
        whole = split_summary(inst, hi, 0, 1)  # all but the 0 longest: the whole batch
        for t in token_caps(inst, hi, cap):
            out.append(_candidate(inst, ((hi, everything, t),), {hi: whole}))
        for lo in [d for d in degrees if n % d == 0 and hi // 8 <= d < hi]:
            for t_lo in token_caps(inst, lo, min(cap, window_tokens(inst, lo))):
                ids_hi, ids_lo = split_ids(inst, t_lo)
                if not len(ids_hi) or not len(ids_lo):
                    continue
                sums = {hi: summ(hi, 0, t_lo), lo: summ(lo, 1, t_lo)}
                for c_lo, t_hi in itertools.product(token_caps(inst, lo, t_lo),
                                                    token_caps(inst, hi, cap)):  # fmt: skip
                    parts = ((hi, ids_hi, t_hi), (lo, ids_lo, c_lo))
                    out.append(_candidate(inst, parts, sums))
    return out


def _candidate(inst: Instance, parts, sums):
    """(estimate, thunk) of parts ((d, ids, token cap), ...), each at its fewest
    micro-steps: the parts' column estimates (window.estimate) less the fills and drains
    counted twice."""
    n = inst.layout.num_units
    full = tuple((d, ids, t, max(1, math.ceil(float(inst.tokens[ids].sum()) / t / (n // d))))
                 for d, ids, t in parts)  # fmt: skip
    est = sum(estimate(inst, d, ids, n, k, t, sums[d]) for d, ids, t, k in full)
    est -= (len(full) - 1) * bubble_share(inst, full, sums)
    return est, functools.partial(draft, inst, full)


def bubble_share(inst: Instance, parts, sums) -> float:
    """What summing two parts' estimates counts twice: the smaller part's fill and drain
    ((p - 1) / p of its longest micro-batch; one pipeline fills once)."""
    p = inst.layout.num_stages
    tops = [sums[d][1] + inst.per_micro_batch(d) for d, _, _, _ in parts]
    return (p - 1) * min(tops) / p


def slowest_groups(parts, V: int) -> tuple:
    """(F, B) (V, K) and X (V - 1, K): each micro-step of check.micro_step_parts priced as its
    slowest group (0 where every unit idles): the column the order search prices."""
    K = len(parts)
    F, B, X = np.zeros((V, K)), np.zeros((V, K)), np.zeros((V - 1, K))
    for k, ps in enumerate(parts):
        for _, f, b, x, _, _ in ps:
            F[:, k], B[:, k], X[:, k] = np.maximum(F[:, k], f), np.maximum(B[:, k], b), \
                np.maximum(X[:, k], x)  # fmt: skip
    return F, B, X


def to_phases(inst: Instance, steps) -> list[list[Group]]:
    """A draft's micro-steps as phases of Groups on one stage's units (aligned from unit 0)."""
    ids = np.array(inst.ids, dtype=object)

    def one(mb, r) -> MicroBatch:
        rec = tuple(r.tolist())
        return MicroBatch(tuple(ids[np.asarray(mb, dtype=int)].tolist()), sum(rec), rec)

    return [[Group(j * d, d, (one(mb, r),)) for j, (mb, r) in enumerate(st)]
            for d, st in steps]  # fmt: skip
