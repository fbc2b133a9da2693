"""The order of one column's micro-batches under the pipeline's schedule: named orders,
then local search, each scored by the exact makespan (makespan.batch_makespans: every
candidate of a round priced at once).

Named orders (by a micro-batch's seconds summed over the stages): data order; heaviest
first (Megatron dev's dynamic CP emits its groups so); lightest first; small at both ends
(verl's order: ascending to the middle, then descending); and "light ends, heavy early":
the two lightest first and last, the rest heaviest first (the bound's fill and drain,
dcp_opt/pipeline/bound.py, are short when the first and last micro-batches are); "heavy
middle, light ends" and its mirror; and the named orders of the micro-batches' stage-0
forward and last-stage backward (the fill and drain) where those rank differently.

Local search: over every swap of two positions and every move of one micro-batch to another
position, priced a chunk at a time (the best of the first chunk that improves), until no
move improves or the deadline passes."""

from __future__ import annotations

import time

import numpy as np

from dcp_opt.pipeline.makespan import batch_makespans

from .instance import Column, Instance


def small_at_both_ends(weights) -> list[int]:
    """verl's order (its balanced micro-batches' placement): sorted ascending, alternately
    to the front and back, so the heaviest sit in the middle."""
    idx = sorted(range(len(weights)), key=lambda k: weights[k])
    front, back = idx[0::2], idx[1::2]
    return front + back[::-1]


def named_orders(weights) -> dict[str, list[int]]:
    m = len(weights)
    asc = sorted(range(m), key=lambda k: weights[k])
    out = {"data": list(range(m)), "heaviest_first": asc[::-1], "lightest_first": asc,
           "small_both_ends": small_at_both_ends(weights)}  # fmt: skip
    if m >= 3:
        out["light_ends_heavy_early"] = [asc[0]] + asc[2:][::-1] + [asc[1]]
        out["light_ends_heavy_late"] = [asc[0]] + asc[2:] + [asc[1]]
        mid = small_at_both_ends(weights)
        out["small_both_ends_mirror"] = mid[::-1]
    return out


def candidate_orders(times) -> np.ndarray:
    """(K, m) the named orders of the micro-batches' total seconds, of their fill (stage 0's
    forward) and of their drain (stage 0's backward), without repeats."""
    f, b = times[0], times[1]
    seen, out = set(), []
    for w in ((f + b).sum(axis=0), f[0] + b[0], (f + b)[-1]):
        for order in named_orders(w.tolist()).values():
            if tuple(order) not in seen:
                seen.add(tuple(order))
                out.append(order)
    return np.array(out, dtype=np.intp)


def _price(inst: Instance, times, orders) -> np.ndarray:
    pipe = inst.layout.pipeline
    return batch_makespans(*times, orders, schedule=pipe.schedule, num_stages=pipe.num_stages,
                           virtual=pipe.virtual_stages)  # fmt: skip


def best_named(col: Column, inst: Instance, times) -> tuple[list[int], float]:
    orders = candidate_orders(times)
    v = _price(inst, times, orders)
    k = int(v.argmin())
    return orders[k].tolist(), float(v[k])


def neighbours(order: np.ndarray) -> np.ndarray:
    """Every swap of two positions and every move of one micro-batch to another position
    (no-op moves left out), one row each."""
    return np.vstack(list(neighbour_chunks(np.asarray(order, dtype=np.intp), 1 << 30)))


def neighbour_chunks(order: np.ndarray, size: int):
    """`neighbours`, built and yielded at most about `size` rows at a time (swaps of position
    i with every later one, then moves of the micro-batch at a to every other position), so
    a long order (hundreds of micro-steps: m^2 rows of m) is never built whole before a
    deadline can stop it."""
    m = len(order)
    rows, pending = 0, []
    pos = np.arange(m)[None, :]
    for i in range(m - 1):
        j = np.arange(i + 1, m)
        block = np.tile(order, (len(j), 1))
        block[np.arange(len(j)), i], block[np.arange(len(j)), j] = order[j], order[i]
        pending.append(block)
        rows += len(block)
        if rows >= size:
            yield np.vstack(pending)
            rows, pending = 0, []
    for a in range(m):
        c = np.array([c for c in range(m) if c != a and c != a - 1])[:, None]
        if not len(c):
            continue
        src = np.where(pos == c, a, pos + ((a < c) & (pos >= a) & (pos < c)) -
                       ((a > c) & (pos > c) & (pos <= a)))  # fmt: skip
        pending.append(order[src])
        rows += len(c)
        if rows >= size:
            yield np.vstack(pending)
            rows, pending = 0, []
    if pending:
        yield np.vstack(pending)


CHUNK, PROBE = 512, 32  # candidates priced per deadline check; the first few, to time a row


def local_search(col: Column, inst: Instance, times, order, value, deadline: float,
                 limit: float | None = None):  # fmt: skip
    """Best improvement over `neighbours`, priced CHUNK at a time (the first chunk that
    improves gives its best), until none improves or the deadline (time.process_time)
    passes, checked after each chunk. `limit` (default: none): no chunk starts that would
    end past it at the pace measured so far (the first PROBE rows time it): at hundreds
    of micro-steps one chunk costs over 10 ms of a 0.1 s budget, and the plan's
    validation, simulation and bound still have to run after."""
    order = np.asarray(list(order), dtype=np.intp)
    if len(order) < 2:
        return order.tolist(), value
    pace = None  # CPU seconds per priced row
    improved = True
    while improved and time.process_time() < deadline:
        improved = False
        for chunk in neighbour_chunks(order, CHUNK):
            for cand in (chunk[:PROBE], chunk[PROBE:]) if limit is not None and pace is None \
                    else (chunk,):  # fmt: skip
                now = time.process_time()
                if limit is not None and pace is not None and now + pace * len(cand) > limit:
                    return order.tolist(), value
                if not len(cand):
                    continue
                v = _price(inst, times, cand)
                pace = (time.process_time() - now) / len(cand)
                k = int(v.argmin())
                if v[k] < value * (1 - 1e-12):
                    order, value, improved = cand[k], float(v[k]), True
                    break
            if improved or time.process_time() > deadline:
                break
    return order.tolist(), value


def apply_order(col: Column, order) -> Column:
    return Column(col.degree, col.start, [col.mbs[k] for k in order], col.rec[np.array(order)])
