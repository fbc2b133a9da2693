"""Even micro-step counts inside zero3 shard domains (cost/zero3.py): under per-layer zero3
every unit of a domain runs the phase's largest micro-step count of its domain, the short
ones padding with empty micro-steps (simulate charges them). A group short of its domain's
count may instead split a packed micro-batch: the split pays one micro-batch constant and
the per-layer gathers, which the padding step pays anyway, and halves the tokens of the
micro-batch split (so its memory never grows). `align_domains` is greedy's post-pass; the
caller keeps the aligned plan only where simulate finds it faster."""

from __future__ import annotations

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
