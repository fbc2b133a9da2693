"""Tensor parallelism as the planner's unit (issue 26; docs/architecture.md, "Tensor
parallelism as a job-level axis"; docs/cost-model.md, "Tensor parallelism").

A TP degree t splits every node's GPUs into units of t GPUs that run Megatron-style tensor
parallelism with sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) on every
micro-batch. The planners plan over units: the cost model's `cluster` is the cluster of
units (`unit_cluster`), and its coefficients are a unit's (`unit_coefficients`):

- compute / t: each GPU runs 1/t of every matmul and 1/t of the heads (Shoeybi et al. 2019,
  sec. 3); the per-layer launch constant and the micro-batch constant are not split;
- memory x t per unit: a unit holds t GPUs' memory, and every per-token activation is split
  over them (sequence parallelism, Korthikanti et al. 2022, sec. 4.2.2; the attention and MLP
  inner activations by head and column), so the per-unit bytes are today's per-GPU bytes
  and a GPU holds 1/t; the reserve is per GPU, so a unit's is t times it;
- bandwidth x t per unit: a Ulysses all-to-all between units runs between the GPUs of equal
  TP rank, each moving 1/t of the unit's bytes over its own link (NVLink port or NIC);
- per layer, forward and backward, two all-gathers and two reduce-scatters of the layer's
  local s x h activations (b bytes each) inside the unit: `tp_comm_per_layer`;
- outside the layers, per micro-batch: one s x h exchange each way at the embedding and at
  the head, and the logits' all-gather (s x V): `tp_comm_outside_layers`; per step, one
  all-reduce of h values per norm weight: `tp_step_time`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cluster import Cluster
from ..errors import DcpOptError
from ..model import ModelSpec, ulysses_kv_heads
from .coeffs import BlockCoeffs, CostCoefficients, TermCoeffs

TP_COLLECTIVES_PER_LAYER = 4  # 2 all-gathers + 2 reduce-scatters per pass (Korthikanti sec. 4.2.2)
TP_COLLECTIVES_AT_ENDS = 4  # embedding: reduce-scatter fwd, all-gather bwd; the head: the reverse
NORM_GRAD_BYTES = 4.0  # the norms' fp32 gradients, summed over the unit once per step


def check_tensor_parallel(t, model: ModelSpec, cluster: Cluster) -> None:
    """`tensor_parallel` must divide the node, the heads and the key/value heads; no wired
    topology (its links are per GPU)."""
    ok = isinstance(t, int) and not isinstance(t, bool) and t >= 1
    if not ok:
        raise DcpOptError(f"tensor_parallel: must be an integer >= 1, got {t!r}")
    if t == 1:
        return
    if cluster.topology is not None:
        raise DcpOptError(
            f"tensor_parallel: {t} not allowed with a wired topology (cluster "
            f"{cluster.name!r}); allowed: [1]"
        )
    allowed = allowed_tensor_parallel(model, cluster)
    if t not in allowed:
        raise DcpOptError(
            f"tensor_parallel: {t} not allowed for {model.num_heads} heads, {model.kv_heads} "
            f"key/value heads and {cluster.gpus_per_node} GPUs per node; allowed: {allowed} "
            "(t must divide the node, the heads and the key/value heads)"
        )


def allowed_tensor_parallel(model: ModelSpec, cluster: Cluster) -> list[int]:
    """TP degrees that divide the node, the heads and the key/value heads, ascending (1
    only on a wired topology)."""
    if cluster.topology is not None:
        return [1]
    g = cluster.gpus_per_node
    return [
        x
        for x in range(1, g + 1)
        if g % x == 0 and model.num_heads % x == 0 and model.kv_heads % x == 0
    ]


def unit_degrees(model: ModelSpec, units: Cluster, t: int) -> tuple[int, ...]:
    """The SP degrees offered over units: a Ulysses group of d units splits each TP rank's
    H / t heads by d, so H must divide by t d; a degree that does not is not offered (any SP
    kind: the cluster's degree list is one for all kinds)."""
    per_rank = model.num_heads // t
    return tuple(d for d in units.allowed_degrees if per_rank % d == 0)


def unit_cluster(cluster: Cluster, t: int, model: ModelSpec) -> Cluster:
    """The cluster of units: num_gpus / t ranks, gpus_per_node / t per node; each unit has t
    GPUs' memory, FLOPs and link bandwidth, and runs at its slowest GPU's pace."""
    if t == 1:
        return cluster
    g = cluster.gpus_per_node

    def per_unit(values, combine):
        if values is None:
            return None
        return tuple(combine(values[u * t : (u + 1) * t]) for u in range(len(values) // t))

    plain = cluster.with_(
        name=f"{cluster.name}/tp{t}",
        gpus_per_node=g // t,
        memory_bytes=cluster.memory_bytes * t,
        peak_flops=cluster.peak_flops * t,
        intra_node_bw=cluster.intra_node_bw * t,
        inter_node_bw=cluster.inter_node_bw * t,
        speed_factors=per_unit(cluster.speed_factors, min),
        memory_per_rank=per_unit(cluster.memory_per_rank, lambda m: t * min(m)),
        degrees=None,
    )
    degrees = unit_degrees(model, plain, t)
    if cluster.degrees is not None:  # the user's list, in units
        degrees = tuple(d for d in degrees if d * t in cluster.degrees or d == 1)
    return plain.with_(degrees=degrees)


def unit_coefficients(co: CostCoefficients, t: int) -> CostCoefficients:
    """A unit's coefficients from one GPU's: every per-token and per-pair time / t (the
    matmuls and attention split by t), the launch and micro-batch constants unchanged, the
    reserve x t (per GPU); bytes per token unchanged (a unit's, split over its GPUs)."""
    if t == 1:
        return co

    def term(tc: TermCoeffs) -> TermCoeffs:
        return TermCoeffs(tc.quad / t, tc.lin / t, tc.seq / t, tc.const)

    blocks = {k: BlockCoeffs(term(b.fwd), term(b.bwd)) for k, b in co.blocks.items()}
    return replace(
        co,
        blocks=blocks,
        head_fwd_per_token_s=co.head_fwd_per_token_s / t,
        head_bwd_per_token_s=co.head_bwd_per_token_s / t,
        reserved_bytes=co.reserved_bytes * t,
    )


def tp_comm_per_layer(cost, tokens, d) -> np.ndarray | float:
    """Seconds of one layer's tensor-parallel collectives in one pass (forward; backward pays
    the same): two all-gathers and two reduce-scatters of the unit's s = tokens / d local
    tokens x hidden x dtype bytes per block (Korthikanti et al. 2022, sec. 4.2.2), each a ring
    moving (t - 1) / t of the buffer per GPU (Thakur et al. 2005) over NVLink at one GPU's
    rate, plus one latency per ring step. Exposed: the runtime runs them inline."""
    if cost.tensor_parallel == 1:
        return 0.0
    m = cost.model
    buf = np.asarray(tokens, dtype=float) / d * m.hidden * m.dtype_bytes
    return TP_COLLECTIVES_PER_LAYER * len(m.block_types) * _ring_call(cost, buf)


def _ring_call(cost, buf):
    """Seconds of one ring all-gather or reduce-scatter of `buf` bytes (the whole buffer)
    inside a unit: (t - 1) / t of it per GPU over NVLink at one GPU's rate, + (t - 1)
    latencies (Thakur et al. 2005)."""
    t, gpu = cost.tensor_parallel, cost.gpu_cluster
    return (t - 1) / t * buf / gpu.intra_node_bw + (t - 1) * gpu.intra_node_latency_s


def tp_comm_outside_layers(cost, tokens, d) -> np.ndarray | float:
    """Seconds of a micro-batch's TP collectives outside the layers (counted on gloo,
    tests/test_tensor_parallel_traffic.py; docs/integration.md, "Tensor parallelism"): at
    the embedding (vocabulary-row split) a reduce-scatter of s h b into the sequence-parallel
    region in forward and an all-gather in backward, at the head the reverse, and the
    logits' all-gather s V b in forward (the head is column-parallel and returns whole
    logits: no loss parallelism); s = tokens / d the unit's local tokens, V the vocabulary
    (0: no logits). Each a ring, (t - 1) / t per GPU. Not recomputed; exposed."""
    t = cost.tensor_parallel
    if t == 1:
        return 0.0
    m = cost.model
    s = np.asarray(tokens, dtype=float) / d
    out = TP_COLLECTIVES_AT_ENDS * _ring_call(cost, s * m.hidden * m.dtype_bytes)
    if m.vocab_size:
        out = out + _ring_call(cost, s * m.vocab_size * m.dtype_bytes)
    return out


def num_norms(model: ModelSpec) -> int:
    """Norm weights of the model: two per block (before attention and before the MLP) and
    the final norm (2 L + 1 for a 1D model: tests/test_tensor_parallel_traffic.py)."""
    return 2 * model.num_layers * len(model.block_types) + 1


def tp_step_time(cost) -> float:
    """Seconds per step of summing the norms' partial gradients over the unit (runtime's
    reduce_partial_grads: sequence parallelism leaves each GPU a partial sum of every norm
    weight's gradient; Korthikanti et al. 2022 sec. 4.2.2): one ring all-reduce of h fp32
    values per norm weight, 2 (t - 1) / t of it per GPU + 2 (t - 1) latencies. 0 at t = 1."""
    t = cost.tensor_parallel
    if t == 1:
        return 0.0
    m = cost.model
    return num_norms(m) * 2 * _ring_call(cost, m.hidden * NORM_GRAD_BYTES)


def tp_volume_share(model: ModelSpec, t: int, degree: int) -> float:
    """ModelSpec.a2a_volume_share for a TP rank's heads (H / t query, kv / t key/value): the
    Ulysses all-to-alls between equal TP ranks carry those."""
    if model.kind != "1d" or model.num_kv_heads is None:
        return 1.0
    h, kv = model.num_heads // t, model.kv_heads // t
    return (2 + 2 * ulysses_kv_heads(h, kv, degree) / h) / 4
