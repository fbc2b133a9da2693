"""Scale the greedy planner to large clusters by splitting them into equal blocks.

A batch of thousands of sequences on hundreds of GPUs is, statistically, many copies of a
small problem. Sequences are dealt longest first in snake order to K aligned blocks of B
GPUs (B a multiple of the node size, so blocks never share a node); the full candidate
search runs on block 0 only, and its winning candidate is replayed on the other blocks.
Cost: about one assignment pass over the batch instead of one per candidate.
Used only where it is safe: a homogeneous cluster with its natural degrees, and no sequence
that needs a group wider than a block to meet the bound.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from dcp_opt.solvers.greedy.instance import Draft, Instance
from dcp_opt.solvers.greedy.search import replay, search

BLOCK_GPUS = 64  # GPUs per block
MIN_SEQS_PER_BLOCK = 256  # smaller batches are searched whole


def block_size(inst: Instance, cluster) -> int | None:
    """GPUs per block, or None where splitting does not apply."""
    n = inst.num_gpus
    if not cluster.homogeneous or cluster.degrees is not None:
        return None
    b = BLOCK_GPUS
    if n < 2 * b or n % b or b % cluster.gpus_per_node or b not in cluster.allowed_degrees:
        return None
    # a block's placements must repeat block by block: no fabric domain across a block edge
    if cluster.topology and any(b % s and s % b for s in cluster.topology.domain_sizes):
        return None
    if len(inst.ids) < MIN_SEQS_PER_BLOCK * 2:
        return None
    narrow = inst.degrees <= b
    fastest = np.where(narrow[None, :], inst.time, np.inf).min(axis=1)
    if not np.all(fastest <= inst.finish_lb):
        return None
    return b


def sub_instance(inst: Instance, rows: np.ndarray, b: int) -> Instance:
    cols = np.flatnonzero(inst.degrees <= b)
    time = inst.time[np.ix_(rows, cols)]
    marg = inst.marginal[np.ix_(rows, cols)]
    deg = inst.degrees[cols]
    work = np.min(np.where(np.isfinite(marg), marg * deg[None, :], np.inf), axis=1).sum()
    longest = float(np.min(time, axis=1).max())
    return replace(
        inst,
        ids=inst.ids[rows],
        degrees=deg,
        time=time,
        marginal=marg,
        feats=inst.feats[rows],
        r_min=inst.r_min[np.ix_(rows, cols)],
        tokens=inst.tokens[rows],
        const=inst.const[cols],
        cap0=inst.cap0[cols],
        num_gpus=b,
        finish_lb=max(float(work) / b, longest),
        _lists={},
    )


def deal(inst: Instance, k: int) -> list[np.ndarray]:
    """Row indices per block: longest (least-work time) first, snake order."""
    w = np.min(inst.time * inst.degrees[None, :], axis=1)
    order = np.argsort(-w, kind="stable")
    lane = np.arange(len(order)) % (2 * k)
    lane = np.where(lane < k, lane, 2 * k - 1 - lane)
    return [np.sort(order[lane == i]) for i in range(k)]


def search_blocks(inst: Instance, cluster) -> Draft | None:
    """One draft for the whole cluster, or None where splitting does not apply."""
    b = block_size(inst, cluster)
    if b is None:
        return None
    k = inst.num_gpus // b
    sub_cluster = cluster.with_(num_nodes=b // cluster.gpus_per_node, name=f"{cluster.name}/b")
    parts = deal(inst, k)
    drafts = []
    how = None
    for blk, rows in enumerate(parts):
        sub = sub_instance(inst, rows, b)
        if how is None:
            d = search(sub, sub_cluster)[0]
            how = d.how
        else:
            d = replay(sub, sub_cluster, how)
            if d is None:
                return None
        drafts.append(_shift(d, sub, inst, rows, blk * b))
    return Draft(
        [g for d in drafts for g in d.phase0],
        [g for d in drafts for g in d.groups],
        max(d.finish_s for d in drafts),
        ("blocks", b, *how),
    )


def _shift(d: Draft, sub: Instance, inst: Instance, rows: np.ndarray, offset: int) -> Draft:
    """Block-local groups -> cluster groups: rank offset, row and degree indices."""
    col = {
        j: int(np.flatnonzero(inst.degrees == sub.degrees[j])[0]) for j in range(len(sub.degrees))
    }

    rl = rows.tolist()  # plain ints: indexing a list, not a numpy array, per sequence

    def conv(part):
        return [
            (s + offset, col[j], [([rl[i] for i in idx], r) for idx, r in bins])
            for s, j, bins in part
        ]

    return Draft(conv(d.phase0), conv(d.groups), d.finish_s, d.how)
