"""`megatron_dynamic_cp`: Megatron-Core's dynamic context parallelism as its users run it.

The decisions (which micro-step, which CP size, which sequences pack together) are dev's
`DefaultDynamicCPScheduler` at d48bd6be0a85, reimplemented from its rules in
megatron_schedule.py (each rule cited there with file:line) and checked against the real
functions (docs/baselines.md, "megatron_dynamic_cp"). The options are Megatron's:
- `max_seqlen_per_rank`: `--max-seqlen-per-dp-cp-rank` (data_schedule.py:415); None: the most
  tokens per rank that fit at every power-of-two degree with recompute off (or every layer
  recomputed if the longest sequence then needs more than the cluster), the value of issue 16,
  raised to at least the longest padded length over the largest power of two of ranks (so
  that Megatron's CP-size assertion cannot fire); a sweep sets it (tuned.py);
- `min_cp_size`: `--min-dynamic-context-parallel-size` (data_schedule.py:412, 526);
- `pad_to_multiple_of`: the scheduler sees padded lengths (data_schedule_utils.py:576);
  Megatron's SFT dataset pads each to 2 x DP x CP = 2 x ranks under dynamic CP
  (sft_dataset.py:92-113), the default; 1 turns it off;
- `recompute`: "none", "selective" or "full" (`--recompute-granularity`): full recomputes every
  layer (dcp_opt's recompute_layers = L); selective recomputes the core attention only, whose
  s^2 scores flash attention never stores, so in dcp_opt's activation model (linear in
  tokens, dcp_opt/cost/memory.py) it saves nothing and is priced as none (its extra
  attention forward is not charged: in Megatron's favour); None: derived with
  max_seqlen_per_rank above;
- `vpp_group`: `microbatch_group_size_per_vp_stage` (data_schedule.py:439-445); dcp_opt has
  no pipeline stages, so only the micro-step count changes;
- `kind`: the SP kind of every group. None is Megatron's own, ring attention (`KIND`:
  TransformerEngine's P2P ring, dcp_opt/cost/ring.py), where the cost model offers it, else
  "cp" (all-gather-KV) where offered, else "ulysses"; the stream and one-batch benchmarks
  offer ring and pass kind="ring" (dcp_opt/analysis/stream_frameworks.py,
  benchmarks/bench_cp.py).

What dcp_opt changes, each only where the plan needs it (docs/baselines.md, the table):
- sequences train unpadded: the schedule is made on padded lengths, the plan prices the
  real ones (at most pad - 1 tokens less a sequence);
- groups sit on aligned rank blocks, largest first (Megatron: consecutive ranks in creation
  order); the (micro-step, CP size, pack) of every sequence is unchanged;
- a group's pack over the memory at the setting's recompute (where Megatron runs out of
  memory) gets the fewest recomputed layers that fit, or runs as a chain of micro-batches
  that fit; `stats["oom_micro_batches"]` counts them, so a sweep can drop the setting;
- where the cost model's cp cannot hold a micro-batch even with every layer recomputed, and
  on 2D models (which Megatron does not serve), the same schedule runs with Ulysses groups.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, InfeasibleError
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult

from .megatron_schedule import groups_of, schedule

RECOMPUTE = ("none", "selective", "full")
# Megatron-Core's context parallelism: TransformerEngine's P2P ring (AttnFuncWithCPAndKVP2P,
# the default cp_comm_type "p2p"), dcp_opt's `ring` kind; the fallbacks where a cost model
# does not offer it, in order
KIND = "ring"
KIND_FALLBACKS = ("cp", "ulysses")


@dataclass(frozen=True)
class Settings:
    """A Megatron user's settings, resolved for one batch (module doc)."""

    max_seqlen_per_rank: int
    recompute: str
    pad_to_multiple_of: int
    kind: str

    def stats(self) -> dict:
        return {
            "max_seqlen_per_rank": self.max_seqlen_per_rank,
            "recompute": self.recompute,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "kind": self.kind,
        }


def resolve_settings(
    batch: Batch,
    cost: CostModel,
    *,
    max_seqlen_per_rank: int | None,
    recompute: str | None,
    pad_to_multiple_of: int | None,
    kind: str | None,
) -> Settings:
    """The options checked, with the defaults of the module doc filled in."""
    _check_options(max_seqlen_per_rank, 1, pad_to_multiple_of, recompute, None)
    kind = resolve_kind(cost, kind)
    pad = 2 * cost.cluster.num_gpus if pad_to_multiple_of is None else pad_to_multiple_of
    if max_seqlen_per_rank is None or recompute is None:
        longest = max(n for _, n in padded_lengths(batch, pad))  # the scheduler sees these
        r0, cap0 = _token_cap(cost, longest, kind)
        pow2 = 1 << (cost.cluster.num_gpus.bit_length() - 1)  # Megatron's widest CP size
        cap0 = max(cap0, -(-longest // pow2))  # so that Megatron's assertion cannot fire
        max_seqlen_per_rank = cap0 if max_seqlen_per_rank is None else max_seqlen_per_rank
        recompute = ("none" if r0 == 0 else "full") if recompute is None else recompute
    return Settings(max_seqlen_per_rank, recompute, pad, kind)


def padded_lengths(batch: Batch, pad: int) -> list[tuple[int, int]]:
    """[(id, length rounded up to a multiple of pad)] in batch order."""
    return [(s.id, -(-s.num_tokens // pad) * pad) for s in batch.sequences]


def plan_megatron_dynamic_cp(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_seqlen_per_rank: int | None = None,
    min_cp_size: int = 1,
    pad_to_multiple_of: int | None = None,
    recompute: str | None = None,
    vpp_group: int | None = None,
    kind: str | None = None,
) -> PlanResult:
    """Megatron-Core dev's dynamic CP schedule of `batch` (module doc). `seed` is unused."""
    t0 = time.perf_counter()
    _check_options(max_seqlen_per_rank, min_cp_size, pad_to_multiple_of, recompute, vpp_group)
    cost.check_fits(batch)
    st = resolve_settings(
        batch, cost, max_seqlen_per_rank=max_seqlen_per_rank, recompute=recompute,
        pad_to_multiple_of=pad_to_multiple_of, kind=kind,
    )  # fmt: skip
    steps = schedule(
        padded_lengths(batch, st.pad_to_multiple_of), cost.cluster.num_gpus,
        st.max_seqlen_per_rank, min_cp_size=min_cp_size, vpp_group=vpp_group,
    )  # fmt: skip
    stats = {"min_cp_size": min_cp_size, "vpp_group": vpp_group}
    return plan_of_steps(
        steps, batch, cost, st, planner="megatron_dynamic_cp", started=t0, stats=stats
    )


def plan_of_steps(
    steps, batch: Batch, cost: CostModel, st: Settings, *, planner: str, started: float,
    stats: dict | None = None,
) -> PlanResult:  # fmt: skip
    """A plan of Megatron's micro-steps (per rank, the ids it holds): one phase each, every
    CP group's pack one micro-batch at the setting's recompute (module doc)."""
    tokens = {s.id: s.num_tokens for s in batch.sequences}
    r = cost.model.num_layers if st.recompute == "full" else 0
    oom = [0]
    phases = [
        [_group(cost, g, tokens, r, st.kind, oom) for g in layout]
        for step in steps
        for layout in _layouts(step, cost, tokens, st.kind)
    ]
    stats = {**st.stats(), **(stats or {}), "micro_steps": len(steps), "oom_micro_batches": oom[0]}
    return finish(phases, batch, cost, planner=planner, started=started, stats=stats)


def _check_options(m, min_cp, pad, recompute, vpp) -> None:
    for name, v, none_ok in (
        ("max_seqlen_per_rank", m, True),
        ("min_cp_size", min_cp, False),
        ("pad_to_multiple_of", pad, True),
        ("vpp_group", vpp, True),
    ):
        if v is None and none_ok:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DcpOptError(f"{name}: {v!r} not allowed; allowed: an integer >= 1")
    if recompute is not None and recompute not in RECOMPUTE:
        raise DcpOptError(f"recompute: {recompute!r} not allowed; allowed: {list(RECOMPUTE)}")


def resolve_kind(cost: CostModel, kind: str | None) -> str:
    """`kind` checked against the cost model's SP kinds; None: Megatron's own where offered
    (KIND, ring), else the first of KIND_FALLBACKS offered (module doc)."""
    if kind is None:
        return next(k for k in (KIND, *KIND_FALLBACKS) if k in cost.sp_kinds)  # ulysses: always
    if kind not in cost.sp_kinds:
        raise DcpOptError(f"kind: {kind!r} not allowed; allowed: {list(cost.sp_kinds)}")
    return kind


def _layouts(step, cost: CostModel, tokens: dict, kind: str) -> list[list[tuple]]:
    """The micro-step's CP groups on aligned blocks, largest first: [[(start, size, ids)]],
    one phase. Power-of-two sizes summing to the ranks fit so on a power-of-two cluster.
    Where they do not (other clusters: Megatron's sizes are powers of two; or a placement
    too small for a sequence of its group, on uneven memory, where Megatron runs out of
    memory), each group gets the least allowed degree >= its size with a placement that
    holds its longest sequence, first-fit over as many phases as needed (module doc)."""
    groups = sorted(groups_of(step), key=lambda x: -x[0])  # stable: creation order kept
    cl = cost.cluster
    out, start = [], 0
    for size, ids in groups:
        if size not in cl.allowed_degrees or start not in cl.placements(size):
            break
        if not _holds(cost, tokens, ids, start, size, kind):
            break
        out.append((start, size, ids))
        start += size
    else:
        return [out]
    phases: list[list[tuple]] = []
    for size, ids in groups:
        options = [
            (d, p)
            for d in cl.allowed_degrees
            if d >= size or d == cl.allowed_degrees[-1]
            for p in cl.placements(d)
            if _holds(cost, tokens, ids, p, d, kind) or d == cl.allowed_degrees[-1]
        ]
        for ph in [*phases, []]:
            busy = {r for s0, d0, _ in ph for r in range(s0, s0 + d0)}
            free = [(d, p) for d, p in options if busy.isdisjoint(range(p, p + d))]
            if free:
                if not ph:
                    phases.append(ph)
                ph.append((free[0][1], free[0][0], ids))
                break
    return phases


def _holds(cost: CostModel, tokens: dict, ids, start: int, size: int, kind: str) -> bool:
    """Whether the group's longest sequence fits alone at this placement (every layer
    recomputed, its kind or Ulysses)."""
    cap, longest = cost.capacity(start, size), float(max(tokens[i] for i in ids))
    return any(cost.min_recompute(longest, size, cap, kind=k) >= 0 for k in (kind, "ulysses"))


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


def _group(cost: CostModel, g, tokens: dict, r: int, kind: str, oom: list) -> Group:
    """The group's pack as one micro-batch at r recomputed layers. Where Megatron would run
    out of memory (the pack needs more than r; counted in oom[0]): the fewest layers that
    fit, else its sequences in order as a chain of micro-batches that fit; Ulysses where
    `kind` never fits (module doc)."""
    start, size, ids = g
    cap = cost.capacity(start, size)
    need = int(cost.min_recompute(float(sum(tokens[i] for i in ids)), size, cap, kind=kind))
    if 0 <= need <= r:
        return Group(start, size, (MicroBatch(tuple(ids), r),), kind)
    oom[0] += 1
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
