"""Even micro-step counts inside zero3 shard domains (cost/zero3.py): under per-layer zero3
every unit of a domain runs the phase's largest micro-step count of its domain, the short
ones padding with empty micro-steps (simulate charges them). A group short of its domain's
count may instead split a packed micro-batch: the split pays one micro-batch constant and
the per-layer gathers, which the padding step pays anyway, and halves the tokens of the
micro-batch split (so its memory never grows). `align_domains` is greedy's post-pass; the
caller keeps the aligned plan only where simulate finds it faster.

`repack_groups` is the other half: per-layer gathers make every micro-step cost the
gathers the compute does not hide, so fewer, larger micro-batches (more layers recomputed)
may pay; each group's sequences are re-split into k balanced micro-batches for every k up
to its count, the fastest kept where it fits."""

from __future__ import annotations

import numpy as np

from dcp_opt.plan import Group, MicroBatch


def align_domains(phases: list[list[Group]], batch, s: int) -> list[list[Group]]:
    """Each phase's groups of degree <= s with their packed micro-batches split, largest
    first, until their count reaches their domain's largest or nothing is left to split."""
    tokens = {q.id: q.num_tokens for q in batch.sequences}
    out = []
    for groups in phases:
        top: dict[int, int] = {}
        for g in groups:
            dom = g.start_rank // s
            top[dom] = max(top.get(dom, 0), len(g.micro_batches))
        out.append(
            [_split_to(g, top[g.start_rank // s], tokens) if g.degree <= s else g for g in groups]
        )
    return out


def _split_to(g: Group, target: int, tokens: dict) -> Group:
    mbs = list(g.micro_batches)
    if not mbs:  # an idle unit stays idle: it pads (splitting needs sequences)
        return g
    while len(mbs) < target:
        k = max(range(len(mbs)), key=lambda i: (len(mbs[i].sequence_ids), -i))
        mb = mbs[k]
        if len(mb.sequence_ids) < 2:
            break
        a, b = _halves(mb.sequence_ids, tokens)
        mbs[k : k + 1] = [
            MicroBatch(a, mb.recompute_layers),
            MicroBatch(b, mb.recompute_layers),
        ]
    return Group(g.start_rank, g.degree, tuple(mbs), kind=g.kind)


def _halves(ids: tuple[int, ...], tokens: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two non-empty parts of about equal tokens: longest first, each to the lighter part."""
    parts: list[list[int]] = [[], []]
    load = [0, 0]
    for i in sorted(ids, key=lambda x: -tokens[x]):
        j = 0 if load[0] <= load[1] else 1
        parts[j].append(i)
        load[j] += tokens[i]
    return tuple(sorted(parts[0])), tuple(sorted(parts[1]))


def repack_groups(phases: list[list[Group]], batch, cost) -> list[list[Group]]:
    """Each group's sequences in the k balanced micro-batches (longest first, to the
    lightest) whose summed time is least, k = 1..its count, each micro-batch with the fewest
    recomputed layers that fit (CostModel.min_recompute); a k where one does not fit is
    skipped."""
    tokens = {q.id: q.num_tokens for q in batch.sequences}
    return [[_repack(g, tokens, batch, cost) for g in groups] for groups in phases]


def _repack(g: Group, tokens: dict, batch, cost) -> Group:
    if len(g.micro_batches) < 2:
        return g
    ids = sorted((i for mb in g.micro_batches for i in mb.sequence_ids), key=lambda x: -tokens[x])
    cap = cost.capacity(g.start_rank, g.degree)
    best, best_s = g, _group_time(g, batch, cost)
    for k in range(1, len(g.micro_batches)):
        bins: list[list[int]] = [[] for _ in range(k)]
        load = np.zeros(k)
        for i in ids:
            j = int(np.argmin(load))
            bins[j].append(i)
            load[j] += tokens[i]
        r = cost.min_recompute(load, g.degree, cap, kind=g.kind)
        if (r < 0).any():
            continue
        mbs = tuple(MicroBatch(tuple(sorted(b)), int(x)) for b, x in zip(bins, r, strict=True))
        cand = Group(g.start_rank, g.degree, mbs, kind=g.kind)
        t = _group_time(cand, batch, cost)
        if t < best_s:
            best, best_s = cand, t
    return best


def _group_time(g: Group, batch, cost) -> float:
    pc = cost.phase_costs([g], batch)
    return float((pc.compute_s + pc.recompute_s + pc.comm_s).sum())
