"""The checks of a plan that need no cost model, run by execute_step on every rank before any
collective (issue 29): a plan that `dcp_opt.validate` would reject must not train.

Each check is a pure function of the plan (and of the batch when the caller passes it), so
every rank holding the plan reaches the same verdict without communicating; the verdict is
cached by the plan's content hash, so a training loop pays it once per plan.

- ranks: every group inside the world (OUT_OF_RANGE), the groups of a phase disjoint
  (RANK_OVERLAP) and covering every rank (RANK_UNCOVERED), at least one phase (NO_PHASES);
- micro-batches: none empty (EMPTY_MICRO_BATCH), recompute_layers in [0, the model's
  layers] (BAD_RECOMPUTE; the lower bound alone when the layer count is unknown);
- coverage: no sequence twice (DUPLICATE_SEQUENCE); with the batch, none outside it
  (UNKNOWN_SEQUENCE) and none of it left out (MISSING_SEQUENCE);
- normaliser (BAD_NORMALIZER): with the batch, the batch's own (`dcp_opt.cost.loss_normalizer`,
  the value `validate` compares); without it, what the plan alone implies: "samples" is the
  number of sequences the plan trains, "tokens" at least that (every sequence has a token).

What needs the cost model (degrees, kinds, memory, fingerprint) stays with `validate`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from dcp_opt.batch import Batch
from dcp_opt.cost import loss_normalizer
from dcp_opt.plan import Plan
from dcp_opt.validate import InvalidPlanError, Violation

CACHE_SIZE = 256  # plans remembered (a loop holds one or two at a time)
_verdicts: OrderedDict[tuple, tuple[Violation, ...]] = OrderedDict()


def check_plan_once(
    plan: Plan,
    world: int,
    *,
    batch: Batch | None = None,
    num_layers: int | None = None,
    content_hash: str | None = None,
) -> None:
    """Raise InvalidPlanError naming every violation of `plan_violations`; the verdict is
    cached by (content hash, world, batch fingerprint, layers)."""
    key = (
        content_hash or plan.content_hash(),
        world,
        None if batch is None else batch.fingerprint(),
        num_layers,
    )
    found = _verdicts.get(key)
    if found is None:
        found = tuple(plan_violations(plan, world, batch=batch, num_layers=num_layers))
        _verdicts[key] = found
        if len(_verdicts) > CACHE_SIZE:
            _verdicts.popitem(last=False)
    else:
        _verdicts.move_to_end(key)
    if found:
        raise InvalidPlanError(list(found))


def plan_violations(
    plan: Plan, world: int, *, batch: Batch | None = None, num_layers: int | None = None
) -> list[Violation]:
    """Every violation of the checks above, in the codes of `dcp_opt.validate`."""
    return (
        _ranks(plan, world)
        + _micro_batches(plan, num_layers)
        + _coverage(plan, batch)
        + _normalizer(plan, batch)
    )


def _ranks(plan: Plan, world: int) -> list[Violation]:
    out = [] if plan.phases else [Violation("NO_PHASES", "the plan has no phase")]
    for p, phase in enumerate(plan.phases):
        owner: dict[int, int] = {}
        for i, g in enumerate(phase.groups):
            where = f"phase {p} group {i} (ranks {g.start_rank}..{g.start_rank + g.degree - 1})"
            if g.degree < 1 or g.start_rank < 0 or g.start_rank + g.degree > world:
                out.append(
                    Violation("OUT_OF_RANGE", f"{where}: the world has ranks 0..{world - 1}")
                )
                continue
            for r in g.ranks:
                if r in owner:
                    out.append(
                        Violation("RANK_OVERLAP", f"{where}: rank {r} also in group {owner[r]}")
                    )
                owner.setdefault(r, i)
        missing = sorted(set(range(world)) - set(owner))
        if missing:
            out.append(
                Violation("RANK_UNCOVERED", f"phase {p}: ranks {_short(missing)} in no group")
            )
    return out


def _micro_batches(plan: Plan, num_layers: int | None) -> list[Violation]:
    out = []
    top = "" if num_layers is None else f", {num_layers}]"
    for p, g, k, mb in plan.micro_batches():
        where = f"phase {p} group@{g.start_rank}x{g.degree} micro-batch {k}"
        if not mb.sequence_ids:
            out.append(Violation("EMPTY_MICRO_BATCH", f"{where}: no sequence"))
        r = mb.recompute_layers
        if r < 0 or (num_layers is not None and r > num_layers):
            bounds = f"[0{top}" if num_layers is not None else ">= 0"
            out.append(Violation("BAD_RECOMPUTE", f"{where}: {r} not in {bounds}"))
    return out


def _coverage(plan: Plan, batch: Batch | None) -> list[Violation]:
    counts = Counter(plan.sequence_ids())
    out = []
    dup = sorted(s for s, n in counts.items() if n > 1)
    if dup:
        out.append(Violation("DUPLICATE_SEQUENCE", f"ids {_short(dup)} appear more than once"))
    if batch is not None:
        known = batch.by_id
        unknown = sorted(s for s in counts if s not in known)
        if unknown:
            out.append(Violation("UNKNOWN_SEQUENCE", f"ids {_short(unknown)} not in the batch"))
        miss = sorted(s for s in known if s not in counts)
        if miss:
            out.append(Violation("MISSING_SEQUENCE", f"ids {_short(miss)} are never trained"))
    return out


def _normalizer(plan: Plan, batch: Batch | None) -> list[Violation]:
    kind, got = plan.normalizer_kind, plan.loss_normalizer
    if batch is not None:
        want = loss_normalizer(batch, kind)
        if abs(got - want) <= 1e-9:  # validate's tolerance
            return []
        why = f"the batch's is {want:g}"
    else:
        trained = len(set(plan.sequence_ids()))
        if kind == "samples" and got == trained or kind == "tokens" and got >= trained:
            return []
        need = "equal to" if kind == "samples" else "at least"
        why = (
            f"it must be {need} the {trained} sequences the plan trains (a sequence left out, "
            "or a wrong normaliser; pass batch= to execute_step to tell which)"
        )
    return [Violation("BAD_NORMALIZER", f"{kind} normaliser {got:g} does not match: {why}")]


def _short(xs: list[int]) -> str:
    return str(xs[:8])[:-1] + (", ...]" if len(xs) > 8 else "]")
