"""Where each SP kind wins: Ulysses against cp over sequence length x degree (issue 16).

    doc = kind_map(cost)                        # default lengths: powers of two, 2K..1M
    doc = kind_map(cost, distribution_rows(dist))   # the rows a distribution spans
    dcp-opt whatif --lengths FILE --sp-kinds ulysses,cp --json out.json --plot out.png

One cell per (length, degree > 1): the predicted time of one sequence of that length alone in a
group of that degree, once per kind, each at its fewest recomputed layers that fit (the
planner's rule, solvers/kinds.py), and `cp_over_ulysses` = t_cp / t_ulysses: below 1 cp is
faster by that factor. The winner is cp only when faster by more than rounding (solvers/kinds.py
MARGIN), as the planner decides; a kind that does not fit has no time, and the other wins.
Groups use the cost model's per-degree default placement (a degree beyond a node spans
nodes). Why one sequence alone: the planner chooses per group, and a group's time is the sum
of its micro-batches', each dominated by its longest sequence; the map shows the terms the
planner compares (dcp_opt/cost/cp.py: cp's attention splits 1/d with no head limit, its K/V
all-gather moves the whole sequence's kv heads, its memory holds the gathered K/V).

`kind_shares(events)`: which kinds plans used, as shares of GPU-time (simulate's events,
degree x seconds).

JSON (the what-if document's `kind_map`): lengths, degrees, token_share (the distribution's
share of tokens in each row's power-of-two bin; null without a distribution), cells (rows x
degrees of {ulysses_s, cp_s, cp_over_ulysses, winner}; a time is null where the kind does not
fit, the ratio null unless both fit, winner null where neither fits).
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


def _cell(t_u: float | None, t_cp: float | None) -> dict:
    from dcp_opt.solvers.kinds import MARGIN  # the planner's own tie rule

    ratio = None if t_u is None or t_cp is None else t_cp / t_u
    if ratio is not None:
        winner = "cp" if ratio < 1 - MARGIN else "ulysses"
    else:
        winner = "ulysses" if t_u is not None else ("cp" if t_cp is not None else None)
    return {"ulysses_s": t_u, "cp_s": t_cp, "cp_over_ulysses": ratio, "winner": winner}


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
    cells = []
    for n in lengths:
        f = cost.features(Sequence(0, (n,)))
        row = [_cell(_time(cost, f, n, d, "ulysses"), _time(cost, f, n, d, "cp")) for d in degrees]
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
    """Plain text of a map: cp / Ulysses time per cell ("cp only": only cp fits,
    "ulys only": only Ulysses, "-": neither)."""
    head = f"{title + ' ' if title else ''}cp/ulysses " + " ".join(
        f"d={d:<7d}" for d in doc["degrees"]
    )
    lines = [head]
    for n, row in zip(doc["lengths"], doc["cells"], strict=True):
        texts = []
        for c in row:
            if c["cp_over_ulysses"] is not None:
                texts.append(f"{c['cp_over_ulysses']:<9.3f}")
            else:
                texts.append(
                    {"cp": "cp only  ", "ulysses": "ulys only", None: "-        "}[c["winner"]]
                )
        lines.append(f"{n:>8d} tokens    " + " ".join(texts))
    return lines


def whatif_kind_map(dist, cost: CostModel, best_outcomes) -> dict:
    """The what-if document's {"kind_map": ...} when `cost` offers cp, else {}: the map over
    the distribution's rows and the kinds of the best planner's outcomes (their .sim)."""
    if "cp" not in cost.sp_kinds:
        return {}
    doc = kind_map(cost, *distribution_rows(dist))
    events = [e for o in best_outcomes if o.sim is not None for e in o.sim.events]
    return {"kind_map": {**doc, "best_planner_kind_shares": kind_shares(events)}}
