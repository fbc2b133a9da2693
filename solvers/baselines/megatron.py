"""`megatron_dynamic_cp`: Megatron-Core's dynamic context parallelism scheduler, emulated.

Source: NVIDIA/Megatron-LM (dev) at 00c51e1, megatron/core/datasets/data_schedule.py
(DefaultDynamicCPScheduler.get_groups_and_subsamples) and data_schedule_utils.py
(next_hdp_group, dcp_gpus_needed, dcp_get_total_workload, dcp_make_buckets_equal). What it does:
- sequences sorted longest first; each gets a CP size needed(s) = max(min_cp, 2^ceil(log2(s /
  max_seqlen_per_rank))) and a workload s^2 / needed(s);
- repeatedly one micro-step (next_hdp_group): the sequences are cut into buckets of about
  equal workload, one per distinct CP size; bucket heads are placed in bucket order: a new
  group of needed(s) free ranks while there are enough (free ranks carry no work, so a new
  group always wins over packing), else into the least-loaded group of that size whose packed
  tokens per rank stay <= max_seqlen_per_rank; the step ends when nothing fits or, once a
  smaller CP size appeared, when the ranks' loads are within delta = 5%; the rest waits for
  the next micro-step; empty ranks are filled by doubling the smallest group (fill_empty_gpus);
- every group packs its sequences into one micro-batch (build_packed_microbatches).
Each micro-step is one phase here; every group is of kind `cp`.

Deviations (docs/baselines.md, "megatron_dynamic_cp"):
- groups sit on aligned rank blocks (dcp_opt's plans; Megatron takes the free ranks in order,
  which is the same while CP sizes do not grow within a step);
- Megatron's CP is ring attention (TransformerEngine p2p); dcp_opt's `cp` is all-gather-KV:
  the same compute split, more memory for gathered K/V, no overlap (dcp_opt/cost/cp.py);
- max_seqlen_per_rank (a user setting) is the most tokens per rank that fit at every power-of-two
  degree with recompute off, or with every layer recomputed if the longest sequence then
  needs more than the cluster; a packed micro-batch over the memory gets the fewest recomputed
  layers that fit (Megatron would run out of memory);
- lengths are not padded to a multiple of 2 x DP x CP (Megatron's SFT dataset pads);
- CP sizes are rounded up to the cluster's allowed degrees (powers of two on power-of-two
  clusters: unchanged);
- groups are `cp` only where the cost model offers it (CostModel.sp_kinds, as the planners'
  tables and bounds do); otherwise, where cp cannot hold a micro-batch even with every layer
  recomputed, and on 2D models (which Megatron does not serve), the same schedule runs with
  Ulysses groups;
- a CP size whose weakest placement cannot hold the sequence is raised to one that can, and
  a pack over the memory runs as a chain of micro-batches that fit.
"""

from __future__ import annotations

import math
import time
from collections import deque

from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, InfeasibleError
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult

DELTA = 0.05  # next_hdp_group's balance tolerance
BUCKET_SLACK = 1.1  # dcp_make_buckets_equal closes a bucket past 1.1 x the target work


def plan_megatron_dynamic_cp(
    batch: Batch, cost: CostModel, *, seed: int = 0, min_cp_size: int = 1
) -> PlanResult:
    """Megatron-Core's dynamic CP schedule of `batch` (module doc). `seed` is unused."""
    t0 = time.perf_counter()
    if isinstance(min_cp_size, bool) or not isinstance(min_cp_size, int) or min_cp_size < 1:
        raise DcpOptError(f"min_cp_size: {min_cp_size!r} not allowed; allowed: an integer >= 1")
    cost.check_fits(batch)
    n = cost.cluster.num_gpus
    tokens = {s.id: s.num_tokens for s in batch.sequences}
    kind = "cp" if "cp" in cost.sp_kinds else "ulysses"  # the kinds the system has
    r, cap_tokens = _token_cap(cost, max(tokens.values()), kind)
    sched = _Sched(cost, cap_tokens, min_cp_size)
    todo = sorted(tokens.items(), key=lambda x: -x[1])  # stable: longest first
    phases = []
    while todo:
        groups, left = sched.micro_step(todo)
        # each micro-step places a sequence at least (so at most len(tokens) of them)
        assert len(left) < len(todo), "megatron_dynamic_cp: a micro-step placed nothing"
        todo = left
        phases.append([_group(cost, g, tokens, r, kind) for g in _layout(groups, n, cost)])
    stats = {"max_seqlen_per_rank": cap_tokens, "recompute": r, "micro_steps": len(phases)}
    return finish(phases, batch, cost, planner="megatron_dynamic_cp", started=t0, stats=stats)


def _token_cap(cost: CostModel, longest: int, kind: str) -> tuple[int, int]:
    """(recompute layers, max_seqlen_per_rank): recompute off if the longest sequence then
    fits on the cluster, else every layer (module doc); Ulysses' memory if cp's fits never."""
    n = cost.cluster.num_gpus
    degrees = [d for d in cost.cluster.allowed_degrees if d & (d - 1) == 0] or [1]
    tries = [(k, r) for k in dict.fromkeys((kind, "ulysses")) for r in (0, cost.model.num_layers)]
    for k, r in tries:
        per_rank = []
        for d in degrees:
            per = float(cost.memory(d, d, r, k)) - cost.fixed_bytes()  # one token per rank
            room = min(cost.capacity(s, d) for s in cost.cluster.placements(d))
            per_rank.append((room - cost.fixed_bytes()) / per)
        cap = int(min(per_rank))
        if cap >= 1 and math.ceil(longest / cap) <= n:
            return r, cap
    # uneven memory (a weak placement sets the least over degrees): the longest sequence
    # spread over the whole cluster, every layer recomputed; micro-batches then get their
    # own fewest layers (_group)
    return cost.model.num_layers, max(1, math.ceil(longest / max(cost.cluster.allowed_degrees)))


class _Sched:
    """next_hdp_group over sequences [(id, tokens)] sorted longest first."""

    def __init__(self, cost: CostModel, cap_tokens: int, min_cp: int):
        self.n, self.cap, self.min_cp = cost.cluster.num_gpus, cap_tokens, min_cp
        self.allowed = cost.cluster.allowed_degrees
        self.cost, self._need = cost, {}

    def needed(self, s: int) -> int:
        if s not in self._need:
            raw = max(1, 2 ** math.ceil(math.log2(s / self.cap)))  # dcp_gpus_needed
            want = max(self.min_cp, raw, self._fits_from(s))
            self._need[s] = min((d for d in self.allowed if d >= want), default=self.allowed[-1])
        return self._need[s]

    def _fits_from(self, s: int) -> int:
        """The smallest degree whose weakest placement holds s tokens (Ulysses, every layer
        recomputed): the token cap is a proxy that uneven memory can break (module doc)."""
        for d in self.allowed:
            cap = min(self.cost.capacity(p, d) for p in self.cost.cluster.placements(d))
            if self.cost.min_recompute(s, d, cap) >= 0 or d == self.allowed[-1]:
                return d
        return self.allowed[-1]

    def work(self, s: int) -> float:
        return s * s / self.needed(s)  # dcp_get_total_workload

    def buckets(self, seqs) -> list[deque]:
        """dcp_make_buckets_equal: about equal work, one bucket per distinct CP size."""
        k = len({self.needed(s) for _, s in seqs})
        target = sum(self.work(s) for _, s in seqs) / k
        out, cur, cur_work, left = [], [], 0.0, k
        for i, (sid, s) in enumerate(seqs):
            w = self.work(s)
            if cur and (cur_work + w > target * BUCKET_SLACK or len(seqs) - i <= left - len(out)):
                out.append(deque(cur))
                cur, cur_work, left = [], 0.0, left - 1
            cur.append((sid, s))
            cur_work += w
        if cur:
            out.append(deque(cur))
        return out

    def micro_step(self, seqs):
        """One micro-step: ([(size, [ids])] groups in creation order, sequences left)."""
        buckets = self.buckets(seqs)
        load = [0.0] * self.n
        owner: list[int | None] = [None] * self.n
        groups: list[dict] = []
        first = None
        balance = False
        while buckets:
            pick = self._pick(buckets, groups, owner)
            if pick is None:
                break
            b, (sid, s) = pick
            need = self.needed(s)
            first = need if first is None else first
            g = self._place(s, need, groups, owner, load)
            if g is None:
                break
            g["ids"].append(sid)
            g["packed"] += s / need
            for r in g["members"]:
                load[r] += self.work(s)
            buckets[b].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
            balance = balance or need < first
            if balance and buckets and max(load) - min(load) <= DELTA * max(load):
                break
        left = [x for b in buckets for x in b]
        return [(g["size"], g["ids"]) for g in groups], left

    def _pick(self, buckets, groups, owner):
        for b, bucket in enumerate(buckets):
            if not bucket:
                continue
            need = self.needed(bucket[0][1])
            if any(g["size"] == need for g in groups) or self._free_block(need, owner) is not None:
                return b, bucket[0]
        return None

    def _place(self, s, need, groups, owner, load):
        fits = [g for g in groups if g["size"] == need and g["packed"] + s / need <= self.cap]
        start = self._free_block(need, owner)
        if start is not None:  # free ranks carry no work: a new group beats any existing one
            g = {"size": need, "members": range(start, start + need), "ids": [], "packed": 0.0}
            for r in g["members"]:
                owner[r] = len(groups)
            groups.append(g)
            return g
        if not fits:
            return None
        return min(fits, key=lambda g: max(load[r] for r in g["members"]))

    def _free_block(self, need: int, owner) -> int | None:
        for start in range(0, self.n - need + 1, need):
            if all(owner[r] is None for r in range(start, start + need)):
                return start
        return None


def _layout(groups, n: int, cost: CostModel) -> list[tuple[int, int, list[int]]]:
    """fill_empty_gpus: double the first smallest group while ranks are empty, then place the
    groups on aligned blocks, largest first: [(start, size, ids)]."""
    sizes = [size for size, _ in groups]
    allowed = cost.cluster.allowed_degrees
    while sum(sizes) < n:
        k = sizes.index(min(sizes))
        bigger = min((d for d in allowed if d > sizes[k]), default=None)
        if bigger is None or sum(sizes) - sizes[k] + bigger > n:
            break
        sizes[k] = bigger
    out, start = [], 0
    for k in sorted(range(len(groups)), key=lambda k: -sizes[k]):
        out.append((start, sizes[k], groups[k][1]))
        start += sizes[k]
    return out


def _group(cost: CostModel, g, tokens: dict, r: int, kind: str) -> Group:
    """The group's pack as one micro-batch, at max(r, its fewest layers that fit); where it
    fits under no recompute, its sequences in order as a chain of micro-batches that fit
    (Megatron would run out of memory: module doc). Ulysses where cp never fits."""
    start, size, ids = g
    cap = cost.capacity(start, size)
    for k in dict.fromkeys((kind, "ulysses")):
        mbs = _fitting_chain(cost, ids, tokens, size, cap, r, k)
        if mbs is not None:
            return Group(start, size, mbs, k)
    raise InfeasibleError(
        f"megatron_dynamic_cp: a sequence of {max(tokens[i] for i in ids)} tokens fits no "
        f"micro-batch of its group (ranks {start}..{start + size - 1})"
    )


def _fitting_chain(cost, ids, tokens, size, cap, r, kind) -> tuple[MicroBatch, ...] | None:
    """Micro-batches of `ids` in order, each packed while it fits at some recompute level."""
    out, cur = [], []
    for i in [*ids, None]:
        trial = cur + [i] if i is not None else cur
        total = float(sum(tokens[j] for j in trial))
        need = int(cost.min_recompute(total, size, cap, kind=kind))
        if i is not None and need >= 0:
            cur = trial
            continue
        if cur:
            last = int(cost.min_recompute(float(sum(tokens[j] for j in cur)), size, cap, kind=kind))
            out.append(MicroBatch(tuple(cur), max(r, last)))
        if i is None:
            break
        if int(cost.min_recompute(float(tokens[i]), size, cap, kind=kind)) < 0:
            return None
        cur = [i]
    return tuple(out)
