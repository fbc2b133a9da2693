"""A pipeline's stages priced from the per-layer cost model (docs/cost-model.md, "Pipeline").

Stage s of p holds `stage_layers[s]` layers; under the interleaved schedule they split into
v chunks (chunk j is virtual stage c = j p + s; the first `stage_layers[s] % v` chunks hold
one layer more). A micro-batch of features F (its sequences' sum), T tokens, on a group of
degree d, SP kind k, speed sp, recomputing r_c of chunk c's first L_c layers:

    f_c = (L_c fwd(F, d) + [c last] T/d head_fwd + ovh / 3) / sp + L_c a(T, d)
    b_c = (L_c bwd(F, d) + r_c fwd(F, d) + [c last] T/d head_bwd + 2 ovh / 3) / sp
          + (L_c + r_c) a(T, d)

fwd, bwd: one layer's seconds (CostModel.layer_times); a: one layer's SP communication
(CostModel.comm_time_per_layer, Ulysses or cp); ovh: the per-micro-batch constant, paid by
every stage (its own launches, copies, hooks), split 1/3 : 2/3 as the passes (backward = 2
forwards, Narayanan et al. 2021). With p = 1 the two sum to CostModel.time(); a recomputed
layer pays one more forward (Chen et al. 2016). The embedding lookup is not timed (as without
a pipeline); its parameters sit on stage 0, the head's on the last.

Tensor parallelism is the cost model's (cost/units.py): with `CostModel.tensor_parallel` t the
planner's ranks are units of t GPUs, `cost.cluster` is the cluster of units (t GPUs' memory,
FLOPs and links each) and the coefficients a unit's, so every figure below is per unit: one
layer's TP collectives (units.tp_comm_per_layer) are added to each layer's pass and each
recomputed forward, and a GPU holds 1/t of a unit's bytes. Unit u of stage s is unit
s n + u of the cluster of units, GPUs (s n + u) t .. + t - 1 (docs/plan-format.md).

P2P between virtual stages c and c + 1 (the activations forward, their gradients backward):
each member unit sends its T/d tokens x hidden x dtype bytes (each of its GPUs 1/t, with
sequence parallelism, Korthikanti et al. 2022 sec. 4.2.2, over its own link: a unit's link is
t GPUs') to the same unit of the next stage, at the NIC rate when any member's pair of units
is in two nodes, else NVLink, plus one latency (Megatron-LM p2p_communication; Narayanan et
al. 2021 sec. 4). Chunks of one stage (p = 1) send nothing.

Memory of stage s per unit (as CostModel.memory, Korthikanti et al. 2022 sec. 4): its model
states (its layers' parameters, the embedding on stage 0 and the head on the last, 2 + 4 B
each and 12 B of master weights and moments, sharded over the stage's units unless `none`)
+ the reserve + every in-flight micro-batch's stored activations, T/d ((L_c - r_c) act +
r_c ckpt) per chunk, + the running one's working set, T/d (act + [c last] head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cluster import Cluster
from ..cost import CostModel
from ..cost.units import tp_comm_per_layer
from ..errors import DcpOptError
from ..plan import Pipeline

PIPELINE_KINDS = ("ulysses", "cp")  # ring's overlap is priced per whole micro-batch only


@dataclass(frozen=True)
class StageLayout:
    """Where a pipeline's stages live and what each holds (no batch): build with
    `stage_layout`, which checks it."""

    cost: CostModel
    pipeline: Pipeline
    tensor_parallel: int  # the cost model's: GPUs per unit (figures here are per unit)
    num_units: int  # units (of tensor_parallel GPUs) per stage: the plan's num_ranks
    chunk_layers: tuple[int, ...]  # per virtual stage c = j p + s

    @property
    def num_stages(self) -> int:
        return self.pipeline.num_stages

    @property
    def num_virtual(self) -> int:
        return len(self.chunk_layers)

    def gpu(self, stage: int, unit: int) -> int:
        """(stage, unit)'s index in the cost model's cluster of units, s n + u: its GPUs are
        (s n + u) t .. + t - 1 (docs/plan-format.md, the rank map)."""
        return stage * self.num_units + unit

    def stage_of(self, c: int) -> int:
        return c % self.num_stages


def stage_layout(cost: CostModel, pipeline: Pipeline, tensor_parallel: int | None = None):
    """The checked layout: layers sum to the model's, stages divide the cluster of units.
    Tensor parallelism is the cost model's (`pipeline_cost` makes one); `tensor_parallel`,
    when given, must be it (a plan's, checked against the cost model it is priced on)."""
    cl, p, t = cost.cluster, pipeline.num_stages, cost.tensor_parallel
    if tensor_parallel not in (None, t):
        raise DcpOptError(
            f"tensor_parallel: {tensor_parallel} on a cost model of tensor_parallel {t}; "
            f"allowed: {t} (price the plan with CostModel(tensor_parallel={tensor_parallel}))"
        )
    L = cost.model.num_layers
    if sum(pipeline.stage_layers) != L:
        raise DcpOptError(
            f"pipeline.stage_layers: must sum to the model's {L} layers, got "
            f"{list(pipeline.stage_layers)}"
        )
    if cl.topology is not None:
        raise DcpOptError(
            f"cluster.topology: a pipeline is priced on two-level clusters (h100x64, h200xN); "
            f"got the fabric of {cl.name!r}"
        )
    if cost.shard_domain:
        raise DcpOptError(
            f"shard_domain: {cost.shard_domain} (zero3 per layer) is not priced under a "
            "pipeline; allowed: 0 (a stage holds 1/p of the states: --tp divides them further)"
        )
    if cl.num_gpus % p:
        raise DcpOptError(
            f"pipeline.stage_layers: {p} stages must divide the cluster's {cl.num_gpus} "
            f"units of tensor_parallel {t} GPUs"
        )
    v = pipeline.virtual_stages
    if any(n < v for n in pipeline.stage_layers):
        raise DcpOptError(
            f"pipeline.virtual_stages: {v} chunks need >= {v} layers per stage, got "
            f"{list(pipeline.stage_layers)}"
        )
    chunks = [0] * (p * v)
    for s, n in enumerate(pipeline.stage_layers):
        for j in range(v):
            chunks[j * p + s] = n // v + (j < n % v)
    return StageLayout(cost, pipeline, t, cl.num_gpus // p, tuple(chunks))


def pipeline_cost(cost: CostModel, tensor_parallel: int | None) -> CostModel:
    """The cost model a pipeline planner prices on: `cost` itself, or its copy at
    `tensor_parallel` when a planner is asked for one the cost model does not have yet."""
    if tensor_parallel in (None, cost.tensor_parallel):
        return cost
    if cost.tensor_parallel != 1:
        raise DcpOptError(
            f"tensor_parallel: {tensor_parallel} on a cost model of tensor_parallel "
            f"{cost.tensor_parallel}; allowed: {cost.tensor_parallel}"
        )
    return cost.with_(tensor_parallel=tensor_parallel)


def stage_gpu_cluster(layout: StageLayout) -> Cluster:
    """One stage's GPUs as a cluster (its n units x t GPUs, nodes as the job's)."""
    gcl = layout.cost.gpu_cluster
    gpus = layout.num_units * layout.tensor_parallel
    per_node = min(gcl.gpus_per_node, gpus)
    return gcl.with_(name=f"{gcl.name}/stage", num_nodes=gpus // per_node,
                     gpus_per_node=per_node, degrees=None, speed_factors=None,
                     memory_per_rank=None)  # fmt: skip


def stage_cluster(layout: StageLayout) -> Cluster:
    """One stage's units as a cluster (degrees and placements of its layout)."""
    return layout_cost(layout).cluster


def chunk_recompute(layout: StageLayout, stage_recompute) -> np.ndarray:
    """(V, m) recomputed layers per chunk from (m, p) per stage: a stage's first layers are
    its chunks' in order (chunk j before j + 1)."""
    rec = np.asarray(stage_recompute, dtype=int).reshape(-1, layout.num_stages)
    p = layout.num_stages
    out = np.zeros((layout.num_virtual, len(rec)), dtype=int)
    left = rec.T.copy()  # (p, m)
    for c, n in enumerate(layout.chunk_layers):
        s = c % p
        take = np.minimum(left[s], n)
        out[c], left[s] = take, left[s] - take
    return out


def _column_rates(layout: StageLayout, start_unit: int, degree: int) -> tuple:
    """(speed, spans_nodes, p2p seconds per byte per virtual edge, p2p latency per edge)."""
    cl = layout.cost.cluster  # of units
    p = layout.num_stages
    speed = min(cl.group_speed(layout.gpu(s, start_unit), degree) for s in range(p))
    spans = cl.spans_nodes(layout.gpu(0, start_unit), degree)
    per_byte, lat = [], []
    for c in range(layout.num_virtual - 1):
        a, b = c % p, (c + 1) % p
        if a == b:  # one stage: no transfer
            per_byte.append(0.0)
            lat.append(0.0)
            continue
        cross = any(
            cl.node_of(layout.gpu(a, u)) != cl.node_of(layout.gpu(b, u))
            for u in range(start_unit, start_unit + degree)
        )
        bw = cl.inter_node_bw if cross else cl.intra_node_bw
        per_byte.append(1.0 / bw)
        lat.append(cl.inter_node_latency_s if cross else cl.intra_node_latency_s)
    return speed, spans, np.array(per_byte), np.array(lat)


def column_times(layout: StageLayout, feats, degree: int, start_unit: int, kind: str, rec):
    """(f, b, x): (V, m) forward and backward seconds per virtual stage and micro-batch, and
    (V - 1, m) P2P seconds of each edge (the module docstring). `feats` (m, F) are the
    micro-batches' summed features, `rec` (m, p) their per-stage recompute."""
    if kind not in PIPELINE_KINDS:
        raise DcpOptError(
            f"kind: {kind!r} not allowed in a pipeline; allowed: {list(PIPELINE_KINDS)}"
        )
    cost, co = layout.cost, layout.cost.coeffs
    feats = np.asarray(feats, dtype=float).reshape(-1, cost.num_features)
    tokens = feats[:, -2]
    kw = {} if kind == "ulysses" else {"kind": kind}
    fwd, bwd = cost.layer_times(feats, degree, **kw)
    speed, spans, per_byte, lat = _column_rates(layout, start_unit, degree)
    comm = cost.comm_time_per_layer(tokens, degree, spans, kind) * np.ones_like(tokens)
    comm = comm + tp_comm_per_layer(cost, tokens, degree)  # 0.0 at tensor_parallel 1
    Lc = np.array(layout.chunk_layers, dtype=float)[:, None]
    r = chunk_recompute(layout, rec).astype(float)
    last = np.zeros_like(Lc)
    last[-1] = 1.0
    ovh = co.microbatch_overhead_s
    head_f = last * tokens / degree * co.head_fwd_per_token_s
    head_b = last * tokens / degree * co.head_bwd_per_token_s
    f = (Lc * fwd + head_f + ovh / 3) / speed + Lc * comm
    b = (Lc * bwd + r * fwd + head_b + 2 * ovh / 3) / speed + (Lc + r) * comm
    if kind == "cp":  # measured reduce-scatter rates (cp_cost.backward_extra; 0 without)
        from ..cost.cp import backward_extra

        extra = [backward_extra(cost, tokens, degree, spans, n, comm) for n in Lc[:, 0]]
        b = b + np.stack([np.broadcast_to(e, tokens.shape) for e in extra])  # 0.0 unmeasured
    sent = tokens / degree * cost.model.hidden * cost.model.dtype_bytes  # per unit
    x = per_byte[:, None] * sent + lat[:, None]
    return f, b, x


def stage_params(layout: StageLayout) -> np.ndarray:
    """Parameters of each stage: its layers' share of the model's count less the embedding
    and head (vocab x hidden each), + the embedding on stage 0, the head on the last."""
    m = layout.cost.model
    emb = float(m.vocab_size * m.hidden)
    per_layer = max(m.total_params - 2 * emb, 0.0) / m.num_layers
    out = np.array(layout.pipeline.stage_layers, dtype=float) * per_layer
    out[0] += emb
    out[-1] += emb
    return out


def stage_fixed_bytes(layout: StageLayout) -> np.ndarray:
    """Model states + reserve per unit of each stage (the module docstring; a GPU holds 1/t)."""
    cost = layout.cost
    opt = 12.0 if cost.optimizer_sharding == "none" else 12.0 / layout.num_units
    states = stage_params(layout) * (2.0 + 4.0 + opt)
    return states + cost.coeffs.reserved_bytes


def column_memory(layout: StageLayout, tokens, degree: int, rec) -> tuple:
    """(stored, work): (V, m) bytes per unit of each micro-batch's kept activations on each
    chunk and of its working set while a chunk runs."""
    co = layout.cost.coeffs
    local = np.asarray(tokens, dtype=float) / degree
    Lc = np.array(layout.chunk_layers, dtype=float)[:, None]
    r = chunk_recompute(layout, rec).astype(float)
    stored = local * ((Lc - r) * co.act_bytes_per_token_layer + r * co.ckpt_bytes_per_token_layer)
    last = np.zeros_like(Lc)
    last[-1] = co.head_bytes_per_token
    work = local * (co.act_bytes_per_token_layer + last)
    return stored, work


def stage_capacity(layout: StageLayout, stage: int, start_unit: int, degree: int) -> float:
    return layout.cost.capacity(layout.gpu(stage, start_unit), degree)


def layout_cost(layout: StageLayout) -> CostModel:
    """The cost model on one stage's units: what checks a plan's groups (degrees,
    placements, kinds) under a pipeline. Memoised on the job's cost model."""
    cost = layout.cost
    key = ("pipeline_layout_cost", layout.num_units, layout.tensor_parallel)
    return cost.memoised(key, lambda: cost.with_(cluster=stage_gpu_cluster(layout)))
