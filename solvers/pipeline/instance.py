"""One batch on one pipeline, as the pipeline planners see it: per-sequence features and
additive seconds at a degree, a column's exact times and makespan, per-stage memory.

A draft column is (degree, start unit, micro-batches as lists of sequence indices, per-stage
recompute per micro-batch); `Column.evaluate` prices it with dcp_opt.pipeline's functions,
the same the simulator uses, so a draft's makespan is the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.pipeline.bound import recompute_gpu_seconds
from dcp_opt.pipeline.makespan import column_makespan
from dcp_opt.pipeline.stages import (
    StageLayout,
    column_memory,
    column_times,
    stage_capacity,
    stage_fixed_bytes,
)
from dcp_opt.plan import Pipeline


def balanced_stage_layers(model, num_stages: int) -> tuple[int, ...]:
    """Layers per stage so that each stage's layers + its share of the embedding (stage 0)
    and head (the last) in layer-equivalents of parameters are as even as they go: the
    first and last stages hold fewer layers (as Megatron-LM's
    decoder_first/last_pipeline_num_layers let users set), which evens both memory and,
    on the last stage, the head's time; ties go to later stages, which hold fewer
    micro-batches in flight under 1F1B. Each stage holds at least one layer."""
    L = model.num_layers
    if not 1 <= num_stages <= L:
        raise DcpOptError(f"pp: must be in 1..num_layers={L}, got {num_stages}")
    emb = float(model.vocab_size * model.hidden)
    per_layer = max(model.total_params - 2 * emb, 1.0) / L
    extra = [0.0] * num_stages
    extra[0] += emb / per_layer
    extra[-1] += emb / per_layer
    layers = [1] * num_stages
    for _ in range(L - num_stages):
        s = min(range(num_stages), key=lambda s: (layers[s] + extra[s], -s))
        layers[s] += 1
    return tuple(layers)


def make_pipeline(cost: CostModel, pp: int, schedule: str = "1f1b", virtual: int = 1):
    return Pipeline(balanced_stage_layers(cost.model, pp), schedule, virtual)


@dataclass
class Instance:
    layout: StageLayout
    batch: Batch
    feats: np.ndarray = field(init=False)  # (S, F) per sequence, batch order
    ids: list = field(init=False)
    _memo: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.feats = self.layout.cost.batch_features(self.batch)
        self.ids = [s.id for s in self.batch.sequences]

    def memo(self, key, make):
        """make()'s value for `key`, computed once per instance (a batch on a layout)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def sibling(self, layout: StageLayout) -> Instance:
        """This batch on `layout`, a layout of the same costs (the same split, schedule and
        cost model; another plan form), sharing every memoised value."""
        twin = Instance(layout, self.batch)
        twin._memo = self._memo
        return twin

    def known(self, key) -> bool:
        """Whether `memo` holds `key` already."""
        return key in self._memo

    @property
    def tokens(self) -> np.ndarray:
        if "tokens" not in self._memo:
            self._memo["tokens"] = np.ascontiguousarray(self.feats[:, -2])
        return self._memo["tokens"]

    def additive(self, d: int) -> np.ndarray:
        """(S,) each sequence's seconds summed over the stages at degree d, less what a
        micro-batch pays once (packing adds these; dcp_opt/pipeline/bound.py)."""
        if ("add", d) not in self._memo:
            rec = np.zeros((len(self.feats) + 1, self.layout.num_stages), dtype=int)
            both = np.vstack([self.feats, np.zeros((1, self.feats.shape[1]))])
            f, b, _ = column_times(self.layout, both, d, 0, "ulysses", rec)
            t = (f + b).sum(axis=0)
            self._memo[("add", d)] = (np.maximum(t[:-1] - t[-1], 0.0), float(t[-1]))
        return self._memo[("add", d)][0]

    def per_micro_batch(self, d: int) -> float:
        self.additive(d)
        return self._memo[("add", d)][1]

    def recompute_all(self, d: int) -> np.ndarray:
        """(S, p) the seconds each sequence's every layer recomputed adds on each stage at
        degree d, less what it adds to an empty micro-batch: bound.recompute_gpu_seconds's
        one layer (GPU-seconds) x the stage's layers / d (a recomputed layer costs the same
        forward and collectives each time, stages.column_times)."""
        if ("rec", d) not in self._memo:
            one = recompute_gpu_seconds(self.layout, self.batch, [d])[0]  # (p, S)
            layers = np.array(self.layout.pipeline.stage_layers, dtype=float)[:, None]
            self._memo[("rec", d)] = (one * layers / d).T
        return self._memo[("rec", d)]


@dataclass
class Column:
    """A draft column: micro-batches (lists of sequence indices) in order, their recompute."""

    degree: int
    start: int
    mbs: list
    rec: np.ndarray  # (m, p)

    def features(self, inst: Instance) -> np.ndarray:
        return np.array([inst.feats[mb].sum(axis=0) for mb in self.mbs]).reshape(
            -1, inst.feats.shape[1]
        )

    def times(self, inst: Instance, feats=None):
        feats = self.features(inst) if feats is None else feats
        return column_times(inst.layout, feats, self.degree, self.start, "ulysses", self.rec)

    def makespan(self, inst: Instance, order=None, times=None) -> float:
        """Exact makespan (makespan.column_makespan) of the micro-batches in `order`."""
        f, b, x = self.times(inst) if times is None else times
        if order is not None:
            f, b, x = f[:, order], b[:, order], x[:, order]
        pipe = inst.layout.pipeline
        return column_makespan(f, b, x, schedule=pipe.schedule, num_stages=pipe.num_stages,
                               virtual=pipe.virtual_stages).makespan_s  # fmt: skip

    def memory(self, inst: Instance):
        """(stored, work) (V, m) bytes and per-stage capacity left after states (p,)."""
        tokens = np.array([inst.tokens[mb].sum() for mb in self.mbs])
        stored, work = column_memory(inst.layout, tokens, self.degree, self.rec)
        lay = inst.layout
        room = np.array(
            [stage_capacity(lay, s, self.start, self.degree) for s in range(lay.num_stages)]
        ) - stage_fixed_bytes(lay)
        return stored, work, room


def columns_of_plan(plan, batch: Batch, cost: CostModel) -> tuple[Instance, list[Column]]:
    """A pipeline plan's first phase as draft columns (every pipeline planner here plans
    one phase), on its instance."""
    from dcp_opt.pipeline.stages import stage_layout

    inst = Instance(stage_layout(cost, plan.pipeline, plan.tensor_parallel), batch)
    pos = {i: k for k, i in enumerate(inst.ids)}
    cols = [
        Column(g.degree, g.start_rank, [[pos[i] for i in mb.sequence_ids] for mb in g.micro_batches],
               np.array([mb.stage_recompute for mb in g.micro_batches], dtype=int))
        for g in plan.phases[0].groups if g.micro_batches
    ]  # fmt: skip
    return inst, cols
