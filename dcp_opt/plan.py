"""The plan as data: the one thing the simulator reads and the runtime executes.

A Plan is frozen and JSON-serialisable (docs/plan-format.md). Its meaning:

- phases run in order; a rank enters its group of phase p+1 once it and the other members of
  that group have finished phase p (there is no global barrier between phases);
- the groups of a phase are disjoint, cover every rank, and sit on aligned rank ranges
  (`Cluster.placements(degree)`: start % degree == 0, plus, on a fabric with domains that
  the degree does not divide, starts aligned to a domain's start); a group with no
  micro-batches is idle in that phase;
- a group runs one sequence-parallel kind (`kind`): "ulysses" (all-to-all over heads),
  "cp" (all-gather-KV context parallelism with causal head-tail chunks, dcp_opt/cost/cp.py)
  or "ring" (ring attention over the same chunks, dcp_opt/cost/ring.py);
- a group processes its micro-batches in order (gradient accumulation); every micro-batch
  holds one or more whole sequences, sharded over the group's ranks, and recomputes the
  first `recompute_layers` layers in backward (pyramid checkpointing keeps the rest);
- after the last phase, gradients are summed once over the whole world; every loss is
  scaled by 1 / `loss_normalizer` so the result equals single-process training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any

from .cost import SHARDING_MODES
from .cost.cp import SP_KINDS
from .errors import PlanFormatError, is_real, loads_json, short_repr

# 2: a group carries its SP kind ("kind"). Version 1 documents (no kind: every group
# Ulysses) still load; they are written back as version 2.
# 3: the job's 4-D layout (docs/plan-format.md): tensor_parallel, shard_domain, pipeline and a
# micro-batch's stage_recompute. A plan that uses none of them is written as version 2, byte
# for byte as before (so its content_hash and every older reader are unchanged).
SCHEMA_VERSION = 3
MICRO_STEP_SCHEMA_VERSION = 4  # a pipeline whose phases are micro-steps (docs/plan-format.md)
BASE_SCHEMA_VERSION = 2  # what a plan without any 4-D layout field is written as
READABLE_VERSIONS = (1, 2, 3, 4)
NORMALIZERS = ("tokens", "samples")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")

if TYPE_CHECKING:
    from .batch import Batch
    from .cost import CostModel


@dataclass(frozen=True)
class MicroBatch:
    sequence_ids: tuple[int, ...]
    recompute_layers: int = 0
    # Under a pipeline: layers recomputed on each stage (entry s counts stage s's first
    # layers), one entry per stage; recompute_layers is then their sum. Empty without one.
    stage_recompute: tuple[int, ...] = ()


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism (issue 30): `len(stage_layers)` stages, stage s holding the next
    `stage_layers[s]` layers of the model (the embedding rides on the first stage, the head
    and loss on the last). Every stage runs the plan's DCP layout (its phases and groups) on
    its own units, so each group is a column of pipelines with its ordered micro-batches.
    `schedule`: "gpipe" (all forwards, then all backwards), "1f1b" (Narayanan et al. 2021,
    PipeDream-Flush) or "interleaved" (1F1B over `virtual_stages` model chunks per stage).
    `micro_steps`: the phases are the pipeline's micro-steps, each group holding at most one
    micro-batch, every unit running the schedule over them (Megatron dev's dynamic CP under
    PP re-forms groups per micro-step; docs/plan-format.md, schema 4)."""

    stage_layers: tuple[int, ...]
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_steps: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)


@dataclass(frozen=True)
class Group:
    start_rank: int
    degree: int
    micro_batches: tuple[MicroBatch, ...] = ()
    kind: str = "ulysses"  # the SP kind, one of cost.cp.SP_KINDS

    @property
    def ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.degree)


@dataclass(frozen=True)
class Phase:
    groups: tuple[Group, ...]


@dataclass(frozen=True)
class Plan:
    phases: tuple[Phase, ...]
    num_ranks: int
    loss_normalizer: float
    normalizer_kind: str = "tokens"
    fingerprint: str = ""
    planner: str = ""
    predicted_step_time_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    schema_version: int = BASE_SCHEMA_VERSION
    # The CostModel.optimizer_sharding the plan was made for (memory of every micro-batch
    # depends on it); the runtime refuses to run it under another mode. "" = not recorded
    # (plans written before the field existed): left out of the JSON, so they hash as before.
    optimizer_sharding: str = ""
    # What the fingerprint was made of, readable (fingerprint_inputs below: batch,
    # model, cluster, coefficients, optimizer sharding, each cost knob), so that a mismatch
    # names what differs. Metadata: not hashed, left out of the JSON when empty (older plans).
    fingerprint_inputs: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    # The job's 4-D layout (schema 3; defaults: none of it, written as schema 2). A plan rank
    # is a *unit*: `tensor_parallel` GPUs of one node running Megatron-style tensor
    # parallelism together. With a pipeline, `num_ranks` counts the units of one stage and
    # stage s holds units [s * num_ranks, (s + 1) * num_ranks) of the cluster; the GPU of
    # (stage s, unit u, TP rank j) is (s * num_ranks + u) * tensor_parallel + j.
    tensor_parallel: int = 1
    # ZeRO-3 per layer (issue 26): parameters sharded over aligned blocks of `shard_domain`
    # units and gathered per layer each micro-step, the micro-step counts aligned inside each
    # block; 0: the mode's step-level schedule (parameters gathered once per step).
    shard_domain: int = 0
    pipeline: Pipeline | None = None

    @property
    def uses_layout(self) -> bool:
        """Whether the plan needs schema 3 (any of the 4-D layout fields set)."""
        return self.tensor_parallel != 1 or self.shard_domain != 0 or self.pipeline is not None

    # ---- views -------------------------------------------------------------------------
    def micro_batches(self):
        """(phase index, group, micro-batch index, micro-batch) in execution order per group."""
        for p, phase in enumerate(self.phases):
            for g in phase.groups:
                for k, mb in enumerate(g.micro_batches):
                    yield p, g, k, mb

    def sequence_ids(self) -> list[int]:
        return [
            s
            for ph in self.phases
            for g in ph.groups
            for mb in g.micro_batches
            for s in mb.sequence_ids
        ]

    def group_of(self, rank: int, phase: int) -> Group:
        for g in self.phases[phase].groups:
            if g.start_rank <= rank < g.start_rank + g.degree:
                return g
        raise KeyError(f"rank {rank} has no group in phase {phase}")

    @property
    def num_micro_batches(self) -> int:
        return sum(len(g.micro_batches) for ph in self.phases for g in ph.groups)

    def content_hash(self) -> str:
        """Hash of what the runtime executes (not of predictions or metadata)."""
        d = self.to_dict()
        for k in ("planner", "predicted_step_time_s", "meta", "fingerprint_inputs"):
            d.pop(k, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = self._to_dict()
        if self.optimizer_sharding:
            d["optimizer_sharding"] = self.optimizer_sharding
        if self.fingerprint_inputs:
            d["fingerprint_inputs"] = dict(self.fingerprint_inputs)
        if self.uses_layout:
            d.update(self._layout_dict())
        return d

    def _layout_dict(self) -> dict:
        d: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        if self.tensor_parallel != 1:
            d["tensor_parallel"] = self.tensor_parallel
        if self.shard_domain:
            d["shard_domain"] = self.shard_domain
        if self.pipeline is not None:
            d["pipeline"] = {
                "stage_layers": list(self.pipeline.stage_layers),
                "schedule": self.pipeline.schedule,
                "virtual_stages": self.pipeline.virtual_stages,
            }
            if self.pipeline.micro_steps:  # a version 3 reader would take them for flushes
                d["pipeline"]["micro_steps"] = True
                d["schema_version"] = MICRO_STEP_SCHEMA_VERSION
        return d

    def _to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "num_ranks": self.num_ranks,
            "loss_normalizer": self.loss_normalizer,
            "normalizer_kind": self.normalizer_kind,
            "fingerprint": self.fingerprint,
            "planner": self.planner,
            "predicted_step_time_s": self.predicted_step_time_s,
            "meta": self.meta,
            "phases": [
                {
                    "groups": [
                        {
                            "start_rank": g.start_rank,
                            "degree": g.degree,
                            "kind": g.kind,
                            "micro_batches": [_micro_batch_dict(mb) for mb in g.micro_batches],
                        }
                        for g in ph.groups
                    ]
                }
                for ph in self.phases
            ],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> Plan:
        return _parse_plan(d)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return _parse_plan(loads_json(text, "plan", PlanFormatError))


def _micro_batch_dict(mb: MicroBatch) -> dict:
    d: dict[str, Any] = {
        "sequence_ids": list(mb.sequence_ids),
        "recompute_layers": mb.recompute_layers,
    }
    if mb.stage_recompute:
        d["stage_recompute"] = list(mb.stage_recompute)
    return d


def _need(d: Any, key: str, typ, where: str):
    if not isinstance(d, dict):
        raise PlanFormatError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise PlanFormatError(f"{where}.{key}: missing")
    v = d[key]
    ok = isinstance(v, typ) and not (isinstance(v, bool) and typ in (int, float, (int, float)))
    if not ok:
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise PlanFormatError(f"{where}.{key}: expected {name}, got {type(v).__name__}")
    return v


def _parse_micro_batch(d: Any, where: str) -> MicroBatch:
    ids = _need(d, "sequence_ids", list, where)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise PlanFormatError(f"{where}.sequence_ids: every entry must be an integer")
    rec = _need(d, "recompute_layers", int, where)
    stages = d.get("stage_recompute", [])
    if not (
        isinstance(stages, list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in stages)
    ):
        raise PlanFormatError(f"{where}.stage_recompute: expected a list of integers")
    return MicroBatch(tuple(ids), rec, tuple(stages))


def _parse_group(d: Any, where: str) -> Group:
    start = _need(d, "start_rank", int, where)
    degree = _need(d, "degree", int, where)
    mbs = _need(d, "micro_batches", list, where)
    kind = d.get("kind", "ulysses")  # version 1 documents have none: Ulysses
    if kind not in SP_KINDS:
        raise PlanFormatError(f"{where}.kind: {kind!r} not allowed; allowed: {list(SP_KINDS)}")
    return Group(
        start,
        degree,
        tuple(_parse_micro_batch(m, f"{where}.micro_batches[{k}]") for k, m in enumerate(mbs)),
        kind,
    )


def _parse_plan(d: Any) -> Plan:
    version = _need(d, "schema_version", int, "plan")
    if version not in READABLE_VERSIONS:
        raise PlanFormatError(
            f"plan.schema_version: {version} not supported; this dcp_opt reads "
            f"{list(READABLE_VERSIONS)}"
        )
    phases = []
    for p, ph in enumerate(_need(d, "phases", list, "plan")):
        groups = _need(ph, "groups", list, f"plan.phases[{p}]")
        phases.append(
            Phase(
                tuple(
                    _parse_group(g, f"plan.phases[{p}].groups[{i}]") for i, g in enumerate(groups)
                )
            )
        )
    kind = _need(d, "normalizer_kind", str, "plan")
    if kind not in NORMALIZERS:
        raise PlanFormatError(
            f"plan.normalizer_kind: {kind!r} not allowed; allowed: {list(NORMALIZERS)}"
        )
    pred = d.get("predicted_step_time_s")
    if pred is not None and not is_real(pred):  # is_real: no bool, no 400-digit integer
        raise PlanFormatError(
            f"plan.predicted_step_time_s: expected a finite number or null, got {short_repr(pred)}"
        )
    norm = _need(d, "loss_normalizer", (int, float), "plan")
    if not (is_real(norm) and norm > 0):  # also rejects NaN, which JSON parsers accept
        raise PlanFormatError(
            f"plan.loss_normalizer: must be a finite number > 0, got {short_repr(norm)}"
        )
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise PlanFormatError("plan.meta: expected an object")
    sharding = d.get("optimizer_sharding", "")
    if sharding != "" and sharding not in SHARDING_MODES:
        raise PlanFormatError(
            f"plan.optimizer_sharding: {sharding!r} not allowed; allowed: {list(SHARDING_MODES)}"
        )
    inputs = d.get("fingerprint_inputs", {})
    if not (isinstance(inputs, dict) and all(isinstance(v, str) for v in inputs.values())):
        raise PlanFormatError("plan.fingerprint_inputs: expected an object of strings")
    return Plan(
        **_parse_layout(d),
        phases=tuple(phases),
        num_ranks=_need(d, "num_ranks", int, "plan"),
        loss_normalizer=float(norm),
        normalizer_kind=kind,
        fingerprint=_need(d, "fingerprint", str, "plan"),
        planner=str(d.get("planner", "")),
        predicted_step_time_s=None if pred is None else float(pred),
        meta=meta,
        optimizer_sharding=sharding,
        fingerprint_inputs=inputs,
    )


def _positive_int(d: dict, key: str, default: int, low: int) -> int:
    v = d.get(key, default)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
        raise PlanFormatError(f"plan.{key}: must be an integer >= {low}, got {short_repr(v)}")
    return v


def _parse_layout(d: dict) -> dict:
    """The schema-3 fields (absent: no tensor parallelism, no shard domain, no pipeline).
    Their consistency with the cluster and model is validate()'s, not the parser's."""
    out: dict[str, Any] = {
        "tensor_parallel": _positive_int(d, "tensor_parallel", 1, 1),
        "shard_domain": _positive_int(d, "shard_domain", 0, 0),
    }
    pipe = d.get("pipeline")
    if pipe is not None:
        layers = _need(pipe, "stage_layers", list, "plan.pipeline")
        if not layers or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers
        ):
            raise PlanFormatError(
                "plan.pipeline.stage_layers: expected a non-empty list of integers >= 1"
            )
        schedule = pipe.get("schedule", "1f1b")
        if schedule not in PIPELINE_SCHEDULES:
            raise PlanFormatError(
                f"plan.pipeline.schedule: {short_repr(schedule)} not allowed; allowed: "
                f"{list(PIPELINE_SCHEDULES)}"
            )
        virtual = _positive_int(pipe, "virtual_stages", 1, 1)
        steps = pipe.get("micro_steps", False)
        if not isinstance(steps, bool):
            raise PlanFormatError(
                f"plan.pipeline.micro_steps: expected true or false, got {short_repr(steps)}"
            )
        if steps and d.get("schema_version") != MICRO_STEP_SCHEMA_VERSION:
            raise PlanFormatError(
                f"plan.pipeline.micro_steps: needs schema_version {MICRO_STEP_SCHEMA_VERSION}, "
                f"got {short_repr(d.get('schema_version'))}"
            )
        out["pipeline"] = Pipeline(tuple(layers), schedule, virtual, steps)
    return out


# ---- what a fingerprint was made of ----------------------------------------------------------
def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def fingerprint_inputs(batch: Batch, cost: CostModel) -> dict[str, str]:
    """What `cost.plan_fingerprint(batch, cost)` hashes, one readable entry per part: the
    batch, the model, the cluster, the coefficients (by name and digest), the optimizer
    sharding and each cost knob (by value). Recorded in a plan (`Plan.fingerprint_inputs`),
    it lets `fingerprint_differences` name what differs when the fingerprints do not match.
    Built from the same public fields CostModel.fingerprint() hashes."""
    knobs = {
        "usable_memory_fraction": cost.usable_memory_fraction,
        "grad_reduce_bytes_per_param": cost.grad_reduce_bytes_per_param,
        "sp_kinds": ",".join(cost.sp_kinds),
        "sp_compute_overhead": [list(x) for x in cost.sp_compute_overhead],
        "replicated_seq_s": cost.replicated_seq_s,
        "step_overhead_s": cost.step_overhead_s,
        "closing_step_s": cost.closing_step_s,
        "cp_comm": f"#{_digest([list(astuple(m)) for m in cost.cp_comm])}" if cost.cp_comm else "",
        "ring_comm": (
            f"#{_digest([list(astuple(m)) for m in cost.ring_comm])}" if cost.ring_comm else ""
        ),
    }
    # the GPUs' cluster and coefficients (a cost model under TP reads the units'); the
    # layout only where it is not the default, so a plan without TP is recorded as before
    gpus, coeffs = cost.gpu_cluster, cost.gpu_coeffs
    layout = {
        k: str(getattr(cost, k))
        for k, default in (("tensor_parallel", 1), ("shard_domain", 0))
        if getattr(cost, k) != default
    }
    return {
        "batch": f"{len(batch)} sequences, {batch.num_tokens} tokens #{batch.fingerprint()[:8]}",
        "model": f"{cost.model.name} #{_digest(cost.model.to_dict())}",
        "cluster": f"{gpus.name} #{_digest(gpus.fingerprint_dict())}",
        "coefficients": f"{coeffs.source} #{_digest(coeffs.to_dict())}",
        "optimizer_sharding": cost.optimizer_sharding,
        **layout,
        **{k: str(v) for k, v in knobs.items()},
    }


def fingerprint_differences(plan: Plan, batch: Batch, cost: CostModel) -> list[str]:
    """Why `plan.fingerprint` is not that of (batch, cost), one line per part that differs:
    from the plan's recorded inputs, or, for a plan that records none (older plans, plans from
    make_plan), what the plan itself tells (ranks, sharding, the batch's normaliser and ids).
    Empty when nothing can be told."""
    now = fingerprint_inputs(batch, cost)
    if plan.fingerprint_inputs:
        differ = [k for k, v in plan.fingerprint_inputs.items() if now.get(k) != v]
        derived = {plan.fingerprint_inputs.get("coefficients", ""), now["coefficients"]}
        if all(c.startswith("flops #") for c in derived) and {"model", "cluster"} & set(differ):
            differ = [
                k for k in differ if k != "coefficients"
            ]  # FLOP coefficients follow the model and cluster
        out = [
            f"{k}: plan made for {plan.fingerprint_inputs[k]!r}, inputs give {now.get(k, '')!r}"
            for k in differ
        ]
        return out or [
            "the recorded inputs agree with these: the difference is in a part of the cost "
            "model the plan does not record (another dcp_opt version, or a CostModel subclass)"
        ]
    out = []
    if plan.optimizer_sharding and plan.optimizer_sharding != cost.optimizer_sharding:
        out.append(
            f"optimizer_sharding: plan made for {plan.optimizer_sharding!r}, inputs give "
            f"{cost.optimizer_sharding!r}"
        )
    if plan.num_ranks != cost.cluster.num_gpus:
        out.append(
            f"cluster: plan made for {plan.num_ranks} GPUs, inputs give "
            f"{cost.cluster.name!r} with {cost.cluster.num_gpus}"
        )
    ids = set(plan.sequence_ids())
    norm = float(batch.num_tokens if plan.normalizer_kind == "tokens" else len(batch))
    if ids != set(batch.by_id) or plan.loss_normalizer != norm:
        out.append(
            f"batch: plan made for {len(ids)} sequences (normaliser {plan.loss_normalizer:g}), "
            f"inputs give {len(batch)} (normaliser {norm:g})"
        )
    return out
