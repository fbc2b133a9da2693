"""Megatron-Core's dynamic-CP scheduler as of dev, on lengths only (no plan, no cost model).

Source read: NVIDIA/Megatron-LM, branch dev at d48bd6be0a85 ("[dev] Replace DP balance
all-to-all rerouting with all-gather (#6378)"). Line numbers below are of that commit:
- D = megatron/core/datasets/data_schedule.py
- U = megatron/core/datasets/data_schedule_utils.py
Written from the rules, not copied; tests/test_megatron_schedule.py holds Megatron's own
unit-test expectations (tests/unit_tests/test_sequence_packing.py:693-725 there).

The rules, each where it lives:
1. The scheduler sees the dataset's padded lengths (U:576, `padded_seq_len`); Megatron's SFT
   dataset pads each to a multiple of 2 x DP x CP under dynamic CP
   (megatron/training/datasets/sft_dataset.py:92-113). The planner pads (megatron.py).
2. All sequences of the global batch, longest first, stable (D:428, U:626).
3. Micro-steps are formed one after another until none is left (D:430-437).
4. CP size needed: max(min_cp, 2^ceil(log2(s / M))), at least 1 (U:932-936, dcp_gpus_needed);
   M = max_seqlen_per_dp_cp_rank. Work of a sequence on c ranks: s^2 / c (U:623-624).
5. One micro-step (next_hdp_group_packing_aware, U:592-831):
   a. the longest sequence opens the first group on ranks 0..c-1 at its needed size; a size
      over the ranks is Megatron's assertion (U:640-657);
   b. the cap: longest x M x (1 + 0.05) (U:12, U:627-628);
   c. every other sequence in one longest-first pass tries CP sizes from its need upwards,
      doubling while <= the ranks (U:664-697); at each size, first every existing group of
      that size (creation order) whose packed tokens per rank stay <= M (U:668-680), then a
      new group on the lowest free ranks when enough are free (U:682-695); an option's value
      is the largest rank load after it; the least wins, a later option only if strictly
      less, and only options <= the cap count (U:679, U:694);
   d. a sequence with no option waits for the next micro-step (U:699-701);
   e. while a rank is empty: the first group of the smallest size whose ranks can grow to
      twice that size (at most the ranks) is doubled in place, the ranks after it shift up,
      its loads are recomputed at the new size (U:724-795, U:826-829); where the shifted
      ranks would run past the last rank (possible only on a non-power-of-two rank count)
      Megatron raises IndexError (U:772-776); here that group cannot grow;
   f. when no group can grow: the micro-step is thrown away and rebuilt as one group of all
      ranks packing this step's sequences longest first while their tokens per rank stay
      <= M, skipping the rest, which wait (U:797-824); none fitting is Megatron's assertion.
6. VPP: the number of micro-steps is raised to a multiple of microbatch_group_size_per_vp_stage
   by splitting micro-steps from the last backwards at the first group boundary at or past
   half the ranks, each half refilled by doubling groups (D:439-445, U:834-924).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dcp_opt.errors import InfeasibleError

CAP_DELTA = 0.05  # U:12, _DYNAMIC_CP_WORKLOAD_CAP_DELTA

# One micro-step: per rank, the sequence ids it holds (each id on the ranks of its group).
Step = list[list[int]]


def cp_size_needed(length: int, max_seqlen_per_rank: int, min_cp_size: int = 1) -> int:
    """Rule 4 (U:932-936): the power of two of ranks that hold `length` at most M a rank."""
    return max(min_cp_size, max(1, 2 ** math.ceil(math.log2(length / max_seqlen_per_rank))))


def schedule(
    seqs: list[tuple[int, int]],
    num_ranks: int,
    max_seqlen_per_rank: int,
    *,
    min_cp_size: int = 1,
    vpp_group: int | None = None,
) -> list[Step]:
    """Rules 2, 3 and 6: the micro-steps of `seqs` [(id, length)], each as per-rank ids."""
    todo = sorted(seqs, key=lambda x: x[1], reverse=True)
    steps = []
    while todo:
        step, left = micro_step(todo, num_ranks, max_seqlen_per_rank, min_cp_size)
        # a micro-step places a sequence at least, so at most len(seqs) of them (issue 29)
        if len(left) >= len(todo):
            raise RuntimeError("megatron_dynamic_cp: a micro-step placed no sequence")
        steps.append(step)
        todo = left
    if vpp_group is not None and vpp_group > 1:
        steps = align_to_vpp(steps, vpp_group)
    return steps


@dataclass
class _Group:
    ranks: list[int]
    ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    per_rank: float = 0.0  # packed tokens per rank


@dataclass
class _Step:
    """One micro-step being formed: groups in creation order, each rank's load."""

    num_ranks: int
    groups: list[_Group] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    used: int = 0  # ranks 0..used-1 are in groups (new groups take the lowest free ranks)

    def __post_init__(self) -> None:
        self.load = [0.0] * self.num_ranks

    def peak_with(self, ranks, work: float) -> float:
        return max(max(self.load), max(self.load[r] for r in ranks) + work)

    def add(self, g: _Group, sid: int, length: int) -> None:
        c = len(g.ranks)
        g.ids.append(sid)
        g.lengths.append(length)
        g.per_rank += length / c
        for r in g.ranks:
            self.load[r] += length * length / c

    def open(self, c: int) -> _Group:
        g = _Group(list(range(self.used, self.used + c)))
        self.used += c
        self.groups.append(g)
        return g

    def per_rank_ids(self) -> Step:
        out: Step = [[] for _ in range(self.num_ranks)]
        for g in self.groups:
            for r in g.ranks:
                out[r] = list(g.ids)
        return out


def micro_step(
    seqs: list[tuple[int, int]], num_ranks: int, m: int, min_cp: int = 1
) -> tuple[Step, list[tuple[int, int]]]:
    """Rule 5 on `seqs` sorted longest first: (the micro-step, the sequences that wait)."""
    seqs = sorted(seqs, key=lambda x: x[1], reverse=True)
    sid, tall = seqs[0]
    c = cp_size_needed(tall, m, min_cp)
    if c > num_ranks:  # U:642-645
        raise InfeasibleError(
            f"megatron: a sequence of {tall} tokens needs CP size {c} at max_seqlen_per_rank "
            f"{m}, over the {num_ranks} ranks (Megatron's assertion)"
        )
    cap = float(tall) * float(m) * (1.0 + CAP_DELTA)
    st = _Step(num_ranks)
    st.add(st.open(c), sid, tall)
    waiting = []
    for sid, s in seqs[1:]:
        best = _best_option(st, s, m, min_cp, cap)
        if best is None:
            waiting.append((sid, s))
            continue
        g = best if isinstance(best, _Group) else st.open(best)
        st.add(g, sid, s)
    while st.used < num_ranks:
        if not _double_smallest(st):
            return _whole_domain(seqs, num_ranks, m)
    return st.per_rank_ids(), waiting


def _best_option(st: _Step, s: int, m: int, min_cp: int, cap: float) -> _Group | int | None:
    """Rule 5c: an existing group, or the size of a new one, or None."""
    best, best_peak = None, math.inf
    c = cp_size_needed(s, m, min_cp)
    while c <= st.num_ranks:
        work = s * s / c
        for g in st.groups:
            if len(g.ranks) != c or g.per_rank + s / c > m:
                continue
            peak = st.peak_with(g.ranks, work)
            if peak <= cap and peak < best_peak:
                best, best_peak = g, peak
        if st.num_ranks - st.used >= c:
            peak = max(max(st.load), work)  # free ranks carry no load
            if peak <= cap and peak < best_peak:
                best, best_peak = c, peak
        c *= 2
    return best


def _double_smallest(st: _Step) -> bool:
    """Rule 5e: grow the first group of the smallest size in place; False if none can."""
    if not st.groups:
        return False
    small = min(len(g.ranks) for g in st.groups)
    target = min(2 * small, st.num_ranks)
    extra = target - small
    for g in st.groups:
        if len(g.ranks) != small:
            continue
        end = g.ranks[-1]
        if end + 1 > st.used or end + extra >= st.num_ranks:
            continue
        if st.used + extra > st.num_ranks:  # Megatron: IndexError (only on non-power-of-two)
            continue
        tail_load = st.load[end + 1 : st.used]
        for other in st.groups:
            if other is not g and other.ranks[0] > end:
                other.ranks = [r + extra for r in other.ranks]
        g.ranks = list(range(g.ranks[0], end + extra + 1))
        g.per_rank = sum(g.lengths) / target
        work = sum(x * x / target for x in g.lengths)
        for r in g.ranks:
            st.load[r] = work
        for k, w in enumerate(tail_load):
            st.load[end + extra + 1 + k] = w
        st.used += extra
        return True
    return False


def _whole_domain(seqs, num_ranks: int, m: int) -> tuple[Step, list[tuple[int, int]]]:
    """Rule 5f: one group of every rank, packed longest first under M tokens a rank."""
    chosen, waiting, per_rank = [], [], 0.0
    for sid, s in seqs:
        if per_rank + s / num_ranks <= m:
            chosen.append(sid)
            per_rank += s / num_ranks
        else:
            waiting.append((sid, s))
    if not chosen:  # U:812-815
        raise InfeasibleError(
            f"megatron: no sequence fits the whole {num_ranks}-rank group at "
            f"max_seqlen_per_rank {m} (Megatron's assertion)"
        )
    return [list(chosen) for _ in range(num_ranks)], waiting


def align_to_vpp(steps: list[Step], multiple: int) -> list[Step]:
    """Rule 6 (U:834-924): split micro-steps, last first, until their count divides by
    `multiple`; a split micro-step keeps its later groups, the earlier ones come last."""
    steps = list(steps)
    short = (-len(steps)) % multiple
    i, misses = len(steps) - 1, 0
    while short > 0:
        if i < 0:
            if misses >= len(steps):  # U:911-912
                raise InfeasibleError("megatron: no micro-step can be split for VPP alignment")
            i = len(steps) - 1
        halves = _split(steps[i])
        if halves is None:
            misses += 1
        else:
            steps[i] = halves[0]
            steps.append(halves[1])
            short, misses = short - 1, 0
        i -= 1
    return steps


def _split(step: Step) -> tuple[Step, Step] | None:
    """U:843-873: cut at the first group boundary at or past half the ranks; each half is
    padded with empty ranks and refilled by doubling groups. (later half, earlier half)."""
    n = len(step)
    cuts = [0]
    for start, size in group_spans(step):
        if len(cuts) > 1 and size > cuts[-1] - cuts[-2]:  # U:857-859
            raise InfeasibleError("megatron: VPP split needs CP sizes that do not grow")
        cuts.append(start + size)
    if len(cuts) == 2:
        return None
    k = next(k for k, c in enumerate(cuts) if c >= n // 2)
    early = step[: cuts[k]] + [[] for _ in range(n - cuts[k])]
    late = step[cuts[k] :] + [[] for _ in range(cuts[k])]
    return _refill(late), _refill(early)


def _refill(step: Step) -> Step:
    """U:875-906: while the last rank is empty, double one group and shift the rest up."""
    step = list(step)
    while not step[-1]:
        if not _double_once(step):  # Megatron would loop for ever here
            raise InfeasibleError("megatron: VPP split leaves ranks no group can fill")
    return step


def _double_once(step: Step) -> bool:
    """U:876-902, walking the groups from the last: the group after the first size step up
    is doubled; with none, the first group, if the empty ranks hold a copy of it."""
    n = len(step)
    empty = sum(1 for ids in step if not ids)
    top = n - empty  # ranks top.. are empty
    i, prev = top - 1, 0
    while i >= 0:
        head, size = step[i][0], 0
        while i >= 0 and head in step[i]:
            size, i = size + 1, i - 1
        if prev and size > prev:
            start = i + 1 + size
            step[start + 2 * prev : top + prev] = step[start + prev : top]
            step[start + prev : start + 2 * prev] = step[start : start + prev]
            return True
        if i == -1 and size <= empty:
            step[2 * size : top + size] = step[size:top]
            step[size : 2 * size] = step[0:size]
            return True
        prev = size
    return False


def groups_of(step: Step) -> list[tuple[int, list[int]]]:
    """(size, ids) of each CP group of a micro-step, in order of its first rank: the ranks
    holding the same ids (build_packed_microbatches' local_cp_size, U:505-519). Idle ranks
    (no ids) form no group."""
    sizes: dict[tuple[int, ...], int] = {}
    for ids in step:
        if ids:
            sizes[tuple(ids)] = sizes.get(tuple(ids), 0) + 1
    return [(size, list(ids)) for ids, size in sizes.items()]


def group_spans(step: Step) -> list[tuple[int, int]]:
    """(first rank, size) of each CP group of a micro-step, in rank order: consecutive ranks
    holding the same first id (build_packed_microbatches' local_cp_size, U:505-519)."""
    out, r, n = [], 0, len(step)
    while r < n:
        if not step[r]:
            out.append((r, 1))
            r += 1
            continue
        head, size = step[r][0], 1
        while r + size < n and step[r + size] and step[r + size][0] == head:
            size += 1
        out.append((r, size))
        r += size
    return out
