"""Where each SP kind wins: Ulysses against cp (and ring, where the cost model offers it) over
sequence length x degree (issues 16, 25).

    doc = kind_map(cost)                        # default lengths: powers of two, 2K..1M
    doc = kind_map(cost, distribution_rows(dist))   # the rows a distribution spans
    dcp-opt whatif --lengths FILE --sp-kinds ulysses,cp --json out.json --plot out.png

One cell per (length, degree > 1): the predicted time of one sequence of that length alone in a
group of that degree, once per kind, each at its fewest recomputed layers that fit (the
planner's rule, solvers/kinds.py), and `cp_over_ulysses` = t_cp / t_ulysses: below 1 cp is
faster by that factor. The winner is cp only when faster by more than rounding (solvers/kinds.py
MARGIN), as the planner decides; a kind that does not fit has no time, and the other wins.
Where the cost model offers ring (`sp_kinds`), each cell also holds `ring_s` and
`ring_over_ulysses`, and the winner is taken over the three kinds in the planner's order
(ulysses, cp, ring: a kind replaces the best so far only when faster by more than MARGIN;
dcp_opt/cost/ring.py: ring's attention splits as cp's, its K/V steps overlap attention, its
memory holds two blocks in flight, not the gathered whole).
Groups use the cost model's per-degree default placement (a degree beyond a node spans
nodes). Why one sequence alone: the planner chooses per group, and a group's time is the sum
of its micro-batches', each dominated by its longest sequence; the map shows the terms the
planner compares (dcp_opt/cost/cp.py: cp's attention splits 1/d with no head limit, its K/V
all-gather moves the whole sequence's kv heads, its memory holds the gathered K/V).

`kind_shares(events)`: which kinds plans used, as shares of GPU-time (simulate's events,
degree x seconds).

JSON (the what-if document's `kind_map`): lengths, degrees, token_share (the distribution's
share of tokens in each row's power-of-two bin; null without a distribution), cells (rows x
degrees of {ulysses_s, cp_s, cp_over_ulysses, winner}, and ring_s, ring_over_ulysses where ring
is offered; a time is null where the kind does not fit, a ratio null unless both fit, winner
null where none fits).
"""

from __future__ import annotations

from ..batch import Sequence
from ..cost import CostModel
from ..errors import DcpOptError

DEFAULT_LENGTHS = tuple(2**k for k in range(11, 21))  # 2K .. 1M tokens


def distribution_rows(dist) -> tuple[list[int], list[float]]:
    """(lengths, token shares) for a 1D LengthDistribution: one row per power-of-two bin of
    its token histogram that holds tokens, at the bin's lower edge (the shortest sequence for
    the first bin, the longest for the last, so every row lies inside the distribution)."""
    h = dist.token_histogram()
    tok = dist.tokens
    lo, hi = int(tok.min()), int(tok.max())
    rows = [
        (min(max(int(e), lo), hi), s)
        for e, s in zip(h["edges"][:-1], h["token_share"], strict=True)
        if s > 0
    ]
    return [n for n, _ in rows], [s for _, s in rows]


def _time(cost: CostModel, feats, length: int, d: int, kind: str) -> float | None:
    r = int(cost.min_recompute(length, d, kind=kind))
    return None if r < 0 else float(cost.time(feats, d, r, kind=kind))


def _cell(times: dict) -> dict:
    """One cell from {kind: seconds or None}, Ulysses first (module doc)."""
    from dcp_opt.solvers.kinds import MARGIN  # the planner's own tie rule

    t_u = times["ulysses"]
    winner, best = None, None
    for k, t in times.items():  # in SP_KINDS order, as solvers/kinds.py chooses
        if t is not None and (best is None or t < best * (1 - MARGIN)):
            winner, best = k, t
    out = {"ulysses_s": t_u}
    for k, t in times.items():
        if k != "ulysses":
            out[f"{k}_s"] = t
            out[f"{k}_over_ulysses"] = None if t_u is None or t is None else t / t_u
    return {**out, "winner": winner}


def kind_map(cost: CostModel, lengths=DEFAULT_LENGTHS, token_share=None, degrees=None) -> dict:
    """The map (module doc) for `cost`'s model and cluster. `degrees`: default the cluster's
    allowed degrees above 1. Refused for a model cp does not serve (2D)."""
    if cost.model.kind != "1d":
        raise DcpOptError(
            f"kind map: cp is for 1D models; {cost.model.name!r} is {cost.model.kind}"
        )
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise DcpOptError(f"kind map lengths: must be integers >= 1, got {lengths}")
    degrees = [d for d in cost.cluster.allowed_degrees if d > 1] if degrees is None else degrees
    kinds = ("ulysses", "cp", "ring") if "ring" in cost.sp_kinds else ("ulysses", "cp")
    cells = []
    for n in lengths:
        f = cost.features(Sequence(0, (n,)))
        row = [_cell({k: _time(cost, f, n, d, k) for k in kinds}) for d in degrees]
        cells.append(row)
    return {
        "lengths": lengths,
        "degrees": list(degrees),
        "token_share": None if token_share is None else list(token_share),
        "cells": cells,
    }


def kind_shares(events) -> dict[str, float]:
    """GPU-time share per SP kind of simulate() events (degree x seconds), e.g. of every
    batch's plan of one planner chained together."""
    out: dict[str, float] = {}
    for e in events:
        out[e.kind] = out.get(e.kind, 0.0) + e.degree * (e.end_s - e.start_s)
    total = sum(out.values()) or 1.0
    return {k: v / total for k, v in sorted(out.items())}


def map_lines(doc: dict, title: str = "") -> list[str]:
    """Plain text of a map: cp / Ulysses time per cell, and ring / Ulysses after a bar where
    the map has ring ("<kind> only": only that kind fits, "ulys only": only Ulysses, "-":
    none)."""
    ring = bool(doc["cells"]) and "ring_s" in doc["cells"][0][0]
    others = ("cp", "ring") if ring else ("cp",)
    width = 19 if ring else 9
    head = f"{title + ' ' if title else ''}{'|'.join(others)}/ulysses " + " ".join(
        f"d={d:<{width - 2}d}" for d in doc["degrees"]
    )
    lines = [head]
    for n, row in zip(doc["lengths"], doc["cells"], strict=True):
        texts = []
        for c in row:
            ratios = [c[f"{k}_over_ulysses"] for k in others]
            if any(r is not None for r in ratios):
                text = "|".join("-" if r is None else f"{r:.3f}" for r in ratios)
            else:
                text = {"ulysses": "ulys only", None: "-"}.get(c["winner"], f"{c['winner']} only")
            texts.append(f"{text:<{width}}")
        lines.append(f"{n:>8d} tokens    " + " ".join(texts))
    return lines


def whatif_kind_map(dist, cost: CostModel, best_outcomes) -> dict:
    """The what-if document's {"kind_map": ...} when `cost` offers cp or ring, else {}: the
    map over the distribution's rows and the kinds of the best planner's outcomes (.sim)."""
    if len(cost.sp_kinds) == 1:
        return {}
    doc = kind_map(cost, *distribution_rows(dist))
    events = [e for o in best_outcomes if o.sim is not None for e in o.sim.events]
    return {"kind_map": {**doc, "best_planner_kind_shares": kind_shares(events)}}
