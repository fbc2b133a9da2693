"""Exhaustive single-phase optimum for tiny instances (<= 4 sequences, <= 4 GPUs): the
reference the property tests hold planners and bounds to."""

from __future__ import annotations

import itertools

from dcp_opt import Batch, Cluster, CostModel, Group, MicroBatch, Plan, make_plan


def brute_force(batch: Batch, cost: CostModel) -> tuple[float, Plan]:
    """Best single-phase plan: every aligned layout, every assignment of sequences to groups,
    every split of a group's sequences into micro-batches, fewest recomputed layers that fit
    (recompute only adds time). Exponential: <= 4 sequences, <= 4 GPUs."""
    seqs = batch.sequences
    n = len(seqs)
    best = (float("inf"), None)
    for layout in _all_layouts(cost.cluster):
        tables = [_subset_table(seqs, cost, g) for g in layout]
        for owner in itertools.product(range(len(layout)), repeat=n):
            masks = [sum(1 << i for i in range(n) if owner[i] == k) for k in range(len(layout))]
            times = [tables[k][m][0] for k, m in enumerate(masks)]
            if max(times) < best[0]:
                groups = [
                    Group(*g, tables[k][m][1])
                    for k, (g, m) in enumerate(zip(layout, masks, strict=True))
                ]
                best = (max(times), groups)
    plan = make_plan([best[1]], batch, cost, planner="brute")
    return best[0] + cost.grad_sync_time(), plan


def _all_layouts(cluster: Cluster, r: int = 0):
    if r == cluster.num_gpus:
        yield []
        return
    g = cluster.gpus_per_node
    for d in cluster.allowed_degrees:
        if r % d == 0 and r + d <= cluster.num_gpus and (d > g or not cluster.spans_nodes(r, d)):
            for rest in _all_layouts(cluster, r + d):
                yield [(r, d), *rest]


def _subset_table(seqs, cost: CostModel, group: tuple[int, int]):
    """mask -> (best time of those sequences on the group, their micro-batches)."""
    start, d = group
    c = cost.cluster
    spans, speed = c.spans_nodes(start, d), c.group_speed(start, d)
    n = len(seqs)
    one = {}
    for m in range(1, 1 << n):
        members = [s for i, s in enumerate(seqs) if m >> i & 1]
        r = int(cost.min_recompute(sum(s.num_tokens for s in members), d, cost.capacity(start, d)))
        if r >= 0:
            t = cost.microbatch_time(members, d, r, spans_nodes=spans, speed=speed).total_s
            one[m] = (t, MicroBatch(tuple(s.id for s in members), r))
    table = {0: (0.0, ())}
    for m in range(1, 1 << n):
        low = m & -m
        best = (float("inf"), ())
        sub = m
        while sub:
            if sub & low and sub in one and table[m ^ sub][0] < float("inf"):
                t = one[sub][0] + table[m ^ sub][0]
                if t < best[0]:
                    best = (t, (one[sub][1], *table[m ^ sub][1]))
            sub = (sub - 1) & m
        table[m] = best
    return table
