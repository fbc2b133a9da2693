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

P2P between virtual stages c and c + 1 (the activations forward, their gradients backward):
each member sends its T/d tokens x hidden x dtype bytes (/ t under tensor parallelism with
sequence parallelism, Korthikanti et al. 2022 sec. 4.2.2) to the member of the same unit on
the next stage, at the NIC rate when any member's pair of GPUs is in two nodes, else NVLink,
plus one latency (Megatron-LM p2p_communication; Narayanan et al. 2021 sec. 4). Chunks of
one stage (p = 1) send nothing.

Memory of stage s (as CostModel.memory, Korthikanti et al. 2022 sec. 4): its model states
(its layers' parameters, the embedding on stage 0 and the head on the last, 2 + 4 B each and
12 B of master weights and moments, sharded over the stage's ranks unless `none`; all / t)
+ the reserve + every in-flight micro-batch's stored activations, T/d ((L_c - r_c) act +
r_c ckpt) per chunk, + the running one's working set, T/d (act + [c last] head).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cluster import Cluster
from ..cost import CostModel
from ..errors import DcpOptError
from ..plan import Pipeline

PIPELINE_KINDS = ("ulysses", "cp")  # ring's overlap is priced per whole micro-batch only


@dataclass(frozen=True)
class StageLayout:
    """Where a pipeline's stages live and what each holds (no batch): build with
    `stage_layout`, which checks it."""

    cost: CostModel
    pipeline: Pipeline
    tensor_parallel: int
    num_units: int  # units (of tensor_parallel GPUs) per stage: the plan's num_ranks
    chunk_layers: tuple[int, ...]  # per virtual stage c = j p + s

    @property
    def num_stages(self) -> int:
        return self.pipeline.num_stages

    @property
    def num_virtual(self) -> int:
        return len(self.chunk_layers)

    def gpu(self, stage: int, unit: int) -> int:
        """The first GPU of (stage, unit): (s n + u) t (docs/plan-format.md, the rank map)."""
        return (stage * self.num_units + unit) * self.tensor_parallel

    def stage_of(self, c: int) -> int:
        return c % self.num_stages


def stage_layout(cost: CostModel, pipeline: Pipeline, tensor_parallel: int = 1) -> StageLayout:
    """The checked layout: layers sum to the model's, stages divide the cluster."""
    cl, p, t = cost.cluster, pipeline.num_stages, tensor_parallel
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
    if t < 1 or cl.num_gpus % (p * t) or (t > 1 and cl.gpus_per_node % t):
        raise DcpOptError(
            f"pipeline.stage_layers: {p} stages x tensor_parallel {t} must divide the "
            f"cluster's {cl.num_gpus} GPUs (and t the node's {cl.gpus_per_node})"
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
    return StageLayout(cost, pipeline, t, cl.num_gpus // (p * t), tuple(chunks))


def stage_cluster(layout: StageLayout) -> Cluster:
    """One stage's units as a cluster (degrees and placements of its layout)."""
    cl, n = layout.cost.cluster, layout.num_units
    per_node = max(1, cl.gpus_per_node // layout.tensor_parallel)
    if n <= per_node:
        return cl.with_(name=f"{cl.name}/stage", num_nodes=1, gpus_per_node=n, degrees=None,
                        speed_factors=None, memory_per_rank=None)  # fmt: skip
    return cl.with_(name=f"{cl.name}/stage", num_nodes=n // per_node, gpus_per_node=per_node,
                    degrees=None, speed_factors=None, memory_per_rank=None)  # fmt: skip


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
    cl, t = layout.cost.cluster, layout.tensor_parallel
    p, n = layout.num_stages, layout.num_units
    speed = min(cl.group_speed(layout.gpu(s, start_unit), degree * t) for s in range(p))
    spans = cl.spans_nodes(layout.gpu(0, start_unit), degree * t)
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
    del n
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
    sent = tokens / degree * cost.model.hidden * cost.model.dtype_bytes / layout.tensor_parallel
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
    """Model states + reserve per GPU of each stage (the module docstring)."""
    cost = layout.cost
    ranks = layout.num_units * layout.tensor_parallel  # the stage's replicas x TP
    opt = 12.0 if cost.optimizer_sharding == "none" else 12.0 / ranks
    states = stage_params(layout) * (2.0 + 4.0 + opt) / layout.tensor_parallel
    return states + cost.coeffs.reserved_bytes


def column_memory(layout: StageLayout, tokens, degree: int, rec) -> tuple:
    """(stored, work): (V, m) bytes per GPU of each micro-batch's kept activations on each
    chunk and of its working set while a chunk runs."""
    co = layout.cost.coeffs
    local = np.asarray(tokens, dtype=float) / degree / layout.tensor_parallel
    Lc = np.array(layout.chunk_layers, dtype=float)[:, None]
    r = chunk_recompute(layout, rec).astype(float)
    stored = local * ((Lc - r) * co.act_bytes_per_token_layer + r * co.ckpt_bytes_per_token_layer)
    last = np.zeros_like(Lc)
    last[-1] = co.head_bytes_per_token
    work = local * (co.act_bytes_per_token_layer + last)
    return stored, work


def stage_capacity(layout: StageLayout, stage: int, start_unit: int, degree: int) -> float:
    t = layout.tensor_parallel
    return layout.cost.capacity(layout.gpu(stage, start_unit), degree * t)


def layout_cost(layout: StageLayout) -> CostModel:
    """The cost model on one stage's units: what checks a plan's groups (degrees,
    placements, kinds) under a pipeline. Memoised on the job's cost model."""
    cost = layout.cost
    key = ("pipeline_layout_cost", layout.num_units, layout.tensor_parallel)
    return cost.memoised(key, lambda: cost.with_(cluster=stage_cluster(layout)))
