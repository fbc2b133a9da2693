"""Hard constraints of a plan, checked without any solver. Returns every violation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .build import cached_plan_fingerprint
from .cost import CostModel, loss_normalizer
from .errors import DcpOptError, format_bytes
from .plan import NORMALIZERS, Plan

CODES = {
    "NO_PHASES": "the plan has no phase",
    "WRONG_NUM_RANKS": "plan.num_ranks differs from the cluster's unit count (GPUs / TP)",
    "WRONG_LAYOUT": "plan.tensor_parallel or plan.shard_domain differs from the cost model's",
    "BAD_DEGREE": "a group's degree is not an allowed SP degree",
    "BAD_KIND": "a group's SP kind is not one of the cost model's (CostModel.sp_kinds)",
    "MISALIGNED": "a group does not start at a multiple of its degree",
    "OUT_OF_RANGE": "a group reaches past the last rank",
    "NODE_STRADDLE": "a group smaller than a node spans two nodes",
    "RANK_OVERLAP": "two groups of a phase share a rank",
    "RANK_UNCOVERED": "a rank belongs to no group of a phase",
    "EMPTY_MICRO_BATCH": "a micro-batch holds no sequence",
    "UNKNOWN_SEQUENCE": "a micro-batch names a sequence that is not in the batch",
    "DUPLICATE_SEQUENCE": "a sequence is trained more than once",
    "MISSING_SEQUENCE": "a sequence of the batch is never trained",
    "BAD_RECOMPUTE": "recompute_layers is outside [0, num_layers]",
    "OUT_OF_MEMORY": "a micro-batch needs more memory than a member of its group has",
    "FINGERPRINT_MISMATCH": "the plan was made for another batch, cluster, model or cost model",
    "BAD_NORMALIZER": "the loss normaliser does not match the batch",
    "BAD_PIPELINE": "the pipeline does not fit the model or cluster, or its schedule the counts",
}


@dataclass(frozen=True)
class Violation:
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidPlanError(DcpOptError):
    def __init__(self, violations: list[Violation]):
        self.violations = violations
        head = "; ".join(str(v) for v in violations[:3])
        more = f" (+{len(violations) - 3} more)" if len(violations) > 3 else ""
        super().__init__(f"plan: {len(violations)} violation(s): {head}{more}")


def validate(
    plan: Plan, batch: Batch, cost: CostModel, *, check_fingerprint: bool = True
) -> list[Violation]:
    out: list[Violation] = []
    if plan.pipeline is not None:  # each stage's layout, then per-stage memory over time
        out += _check_pipeline(plan, batch, cost)
    else:
        out += _check_structure(plan, cost)
        out += _check_coverage(plan, batch)
        out += _check_micro_batches(plan, batch, cost)
    if check_fingerprint:
        out += _check_fingerprint(plan, batch, cost)
    return out


def ensure_valid(plan: Plan, batch: Batch, cost: CostModel, **kw) -> Plan:
    v = validate(plan, batch, cost, **kw)
    if v:
        raise InvalidPlanError(v)
    return plan


def _check_pipeline(plan: Plan, batch: Batch, cost: CostModel) -> list[Violation]:
    """A plan with a pipeline (dcp_opt/pipeline/check.py): its layout on one stage's units,
    coverage, then per micro-batch its per-stage recompute and per column and stage the
    memory of the in-flight micro-batches over time."""
    from .pipeline.check import pipeline_violations
    from .pipeline.stages import layout_cost, stage_layout

    try:
        layout = stage_layout(cost, plan.pipeline, plan.tensor_parallel)
    except DcpOptError as e:
        return [Violation("BAD_PIPELINE", str(e))]
    out = _check_structure(plan, layout_cost(layout)) + _check_coverage(plan, batch)
    return out + [Violation(c, m) for c, m in pipeline_violations(plan, batch, layout)]


def _check_structure(plan: Plan, cost: CostModel) -> list[Violation]:
    c = cost.cluster
    n = c.num_gpus
    out = []
    if not plan.phases:
        out.append(Violation("NO_PHASES", CODES["NO_PHASES"]))
    if plan.num_ranks != n:
        out.append(Violation("WRONG_NUM_RANKS", f"plan has {plan.num_ranks} ranks, cluster {n}"))
    for name in ("tensor_parallel", "shard_domain"):  # the job's layout (cost/units, zero3)
        mine, theirs = getattr(plan, name), getattr(cost, name)
        if mine != theirs:
            out.append(
                Violation("WRONG_LAYOUT", f"plan.{name} is {mine}; the cost model's is {theirs}")
            )
    for p, phase in enumerate(plan.phases):
        owner: dict[int, int] = {}
        for i, g in enumerate(phase.groups):
            where = f"phase {p} group {i} (ranks {g.start_rank}..{g.start_rank + g.degree - 1})"
            if g.degree not in c.allowed_degrees:
                out.append(
                    Violation(
                        "BAD_DEGREE",
                        f"{where}: degree {g.degree}; allowed {list(c.allowed_degrees)}",
                    )
                )
            if g.kind not in cost.sp_kinds:  # bounds and tables hold over these kinds only
                allowed = list(cost.sp_kinds)
                out.append(Violation("BAD_KIND", f"{where}: kind {g.kind!r}; allowed {allowed}"))
            if g.degree < 1 or g.start_rank < 0 or g.start_rank + g.degree > n:
                out.append(Violation("OUT_OF_RANGE", f"{where}: cluster has ranks 0..{n - 1}"))
                continue
            if c.topology is not None:  # aligned to the start of its domain (placements())
                if not c.is_placement(g.start_rank, g.degree):
                    ok = _short(list(c.aligned_starts(g.degree)))
                    out.append(
                        Violation(
                            "MISALIGNED",
                            f"{where}: start {g.start_rank} is not a placement of degree "
                            f"{g.degree} (aligned inside the fabric's domains: {ok})",
                        )
                    )
            elif g.start_rank % g.degree:
                out.append(
                    Violation(
                        "MISALIGNED",
                        f"{where}: start {g.start_rank} is not a multiple of degree {g.degree}",
                    )
                )
            if c.straddles(g.start_rank, g.degree) and not (
                c.topology is not None and c.is_placement(g.start_rank, g.degree)
            ):  # with a topology: its domains, where placements() do not allow it
                what = "nodes" if c.topology is None else "fabric domains"
                out.append(Violation("NODE_STRADDLE", f"{where}: spans two {what}"))
            for r in g.ranks:
                if r in owner:
                    out.append(
                        Violation("RANK_OVERLAP", f"{where}: rank {r} also in group {owner[r]}")
                    )
                owner[r] = i
        missing = sorted(set(range(n)) - set(owner))
        if missing:
            out.append(
                Violation("RANK_UNCOVERED", f"phase {p}: ranks {_short(missing)} in no group")
            )
    return out


def _check_coverage(plan: Plan, batch: Batch) -> list[Violation]:
    out = []
    ids = plan.sequence_ids()
    counts = Counter(ids)
    known = batch.by_id
    if len(ids) == len(counts) == len(known) and counts.keys() == known.keys():
        return out  # every sequence exactly once: the common case, checked with sets
    unknown = sorted(s for s in counts if s not in known)
    if unknown:
        out.append(Violation("UNKNOWN_SEQUENCE", f"ids {_short(unknown)} not in the batch"))
    dup = sorted(s for s, k in counts.items() if k > 1 and s in known)
    if dup:
        out.append(Violation("DUPLICATE_SEQUENCE", f"ids {_short(dup)} appear more than once"))
    miss = sorted(s for s in known if s not in counts)
    if miss:
        out.append(Violation("MISSING_SEQUENCE", f"ids {_short(miss)} are never trained"))
    return out


def _check_micro_batches(plan: Plan, batch: Batch, cost: CostModel) -> list[Violation]:
    """Empty micro-batches, recompute out of range, and memory: one vectorised memory check
    over every well-formed micro-batch of an in-range group (the Python work is one walk
    over the micro-batches and one over their sequence ids)."""
    L = cost.model.num_layers
    out: list[Violation] = []
    blocks = []  # (phase, group, indices of its well-formed micro-batches)
    for p, phase in enumerate(plan.phases):
        for g in phase.groups:
            mbs = g.micro_batches
            if not mbs:
                continue
            good = [
                k for k, mb in enumerate(mbs) if mb.sequence_ids and 0 <= mb.recompute_layers <= L
            ]
            if len(good) < len(mbs):
                ok = set(good)
                out += [_bad_micro_batch(mb, L, p, g, k) for k, mb in enumerate(mbs) if k not in ok]
            if good and _in_range(g, cost.cluster.num_gpus):
                blocks.append((p, g, good))
    if blocks:
        out += _check_memory(blocks, batch, cost)
    return out


def _in_range(g, n: int) -> bool:
    return g.degree >= 1 and g.start_rank >= 0 and g.start_rank + g.degree <= n


def _check_memory(blocks: list, batch: Batch, cost: CostModel) -> list[Violation]:
    """OUT_OF_MEMORY for every micro-batch of `blocks` that needs more than its group has."""
    mbs = [g.micro_batches[k] for _, g, ks in blocks for k in ks]
    counts = [len(ks) for _, _, ks in blocks]
    tok = batch.tokens_by_id
    per_seq = np.array([tok.get(s, 0) for mb in mbs for s in mb.sequence_ids], dtype=float)
    firsts = np.cumsum([0] + [len(mb.sequence_ids) for mb in mbs[:-1]])
    tokens = np.add.reduceat(per_seq, firsts)  # every micro-batch here holds a sequence
    rec = np.array([mb.recompute_layers for mb in mbs])
    deg = np.repeat([g.degree for _, g, _ in blocks], counts)
    cap = np.repeat([cost.capacity(g.start_rank, g.degree) for _, g, _ in blocks], counts)
    kinds = np.repeat([g.kind for _, g, _ in blocks], counts)
    need = cost.micro_batch_memory(tokens, deg, rec, kinds)  # a kind not offered: BAD_KIND
    over = np.flatnonzero(need > cap * (1 + 1e-9)).tolist()
    if not over:
        return []
    block_of = np.searchsorted(np.cumsum(counts), over, side="right").tolist()
    ends = np.cumsum([0] + counts).tolist()
    out = []
    for i, b in zip(over, block_of, strict=True):
        p, g, ks = blocks[b]
        k = ks[i - ends[b]]
        out.append(
            Violation(
                "OUT_OF_MEMORY",
                f"{_Where(p, g.start_rank, g.degree, k)}: sequences "
                f"{_short(list(mbs[i].sequence_ids))} need {format_bytes(need[i])} per GPU, "
                f"capacity {format_bytes(cap[i])}",
            )
        )
    return out


def _bad_micro_batch(mb, L: int, p: int, g, k: int) -> Violation | None:
    if not mb.sequence_ids:
        return Violation(
            "EMPTY_MICRO_BATCH", f"{_Where(p, g.start_rank, g.degree, k)}: no sequence"
        )
    if not 0 <= mb.recompute_layers <= L:
        where = _Where(p, g.start_rank, g.degree, k)
        return Violation("BAD_RECOMPUTE", f"{where}: {mb.recompute_layers} not in [0, {L}]")
    return None


@dataclass(frozen=True)
class _Where:
    phase: int
    start: int
    degree: int
    index: int

    def __str__(self) -> str:
        return f"phase {self.phase} group@{self.start}x{self.degree} micro-batch {self.index}"


def _check_fingerprint(plan: Plan, batch: Batch, cost: CostModel) -> list[Violation]:
    out = []
    want = cached_plan_fingerprint(batch, cost)
    if plan.fingerprint != want:
        out.append(Violation("FINGERPRINT_MISMATCH", f"plan {plan.fingerprint!r}, inputs {want!r}"))
    if (
        plan.normalizer_kind not in NORMALIZERS
        # `not <=` so that a NaN normaliser is a violation too
        or not abs(plan.loss_normalizer - loss_normalizer(batch, plan.normalizer_kind)) <= 1e-9
    ):
        out.append(
            Violation(
                "BAD_NORMALIZER",
                f"{plan.normalizer_kind} normaliser "
                f"{plan.loss_normalizer} does not match the batch",
            )
        )
    return out


def _short(xs: list[int]) -> str:
    return str(xs[:8])[:-1] + (", ...]" if len(xs) > 8 else "]")
