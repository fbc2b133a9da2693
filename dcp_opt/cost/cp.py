"""Cost of the second sequence-parallel kind, `cp`: all-gather-KV context parallelism.

Why all-gather-KV and not ring attention. The Llama 3 report ("The Llama 3 Herd of Models",
2024, sec. 3.3.2) gathers the whole sequence's K and V on every rank of the CP group before
attention, and gives two reasons: any attention mask is easy (document masks of packed
sequences) and under GQA the K/V tensors are small next to the O(S^2) attention. For dcp_opt it
is also the kind that is simplest to make *exact*: every rank sees every key, so a rank's
queries can be any subset of the packed stream (the causal head-tail chunks below): each local
chunk attends to its own sequence's gathered keys up to its end, causal aligned bottom-right,
with no stream-wide mask, and the backward of an all-gather is a reduce-scatter
(runtime/cp.py). Ring attention (Liu et al. 2023) overlaps its K/V steps with blockwise
attention at the price of per-block causal bookkeeping: the third kind, dcp_opt/cost/ring.py.

Layout and balance (causal). A packed micro-batch of T tokens on a degree-d group: each
sequence is cut into 2d chunks and rank i holds chunks i and 2d-1-i (head-tail / zigzag,
Megatron-Core context parallelism; Llama 3 sec. 3.3.2). With chunks of c tokens, rank i's
causal pairs are (i + 2d-1-i) c^2 + 2 c(c+1)/2 = 2d c^2 + c, the same on every rank, and d times
that is the whole sequence's 2dc(2dc+1)/2: each rank does exactly 1/d of the attention work.
So the attention term is quad * Q / d (Ulysses': quad * Q * ceil(H/d)/H; cp has no head limit).
Under a sliding window the split is near, not exactly, 1/d (charged as 1/d).

Communication, per layer (GQA-aware: only the kv heads travel). K and V of one token are
kv_bytes = 2 * kv_heads * head_dim * dtype_bytes. Forward: one all-gather of the group's K and
V (one call, K and V in one buffer); a ring all-gather moves (d-1)/d of the whole T-token
buffer through every rank (Thakur et al. 2005, "Optimization of collective communication
operations in MPICH", sec. 4: time (p-1) alpha + (p-1)/p n beta). Backward: a reduce-scatter of
dK, dV of the same volume and cost (ibid.). A recomputed layer gathers again. So a layer's
comm counts 2 + (recomputed) times, exactly as Ulysses' all-to-alls in CostModel.time_parts.
Across nodes (two-level model): the ring's node-crossing edge runs at the NIC rate and sets
the pace of every step; inside a node NVLink's. With a topology: the ring's most loaded link
(topology.comm.group_ring) and the farthest pair's latency (as the all-to-all's).

Measured rates (optional; CostModel.cp_comm, from a profile: runtime/profile/fit.py
measure_cp_collectives). A CPMeasurement per group size holds what the runtime's own two
collectives took on the profiled host, fitted as time = latency (per call) + bytes sent per rank
/ bandwidth: the forward's all-gather and the backward's reduce-scatter (runtime/cp.py writes
the latter as an all-to-all and a sum; it moves a ring reduce-scatter's bytes). When present,
a group inside a node (two-level cluster) pays the measurement of its degree, or of the largest
measured group when its degree was not measured (as profile_io's use_measured_a2a does), with
the latency per ring step lat / (g - 1) of the measured size g; backward pays the
reduce-scatter's fit (CostModel.time_parts_from: L layers at the backward rate, L + r at the
forward's). Groups across nodes and topology clusters keep the rates above: one host measures
no NIC.

Overlap: none. The Llama 3 report states the all-gather "is exposed in the critical path"
(sec. 3.3.2) and argues it is small under GQA; the runtime likewise gathers before attention.

Memory: autograd keeps each non-recomputed layer's gathered K and V for backward: per local
token (d-1) * kv_bytes more than Ulysses' local K and V (which act_bytes_per_token_layer
already holds), also in the one working layer (Korthikanti et al. 2022's accounting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import DcpOptError

SP_KINDS = ("ulysses", "cp", "ring")


@dataclass(frozen=True)
class CPMeasurement:
    """cp's two collectives at one group size (module doc, Measured rates): each time =
    latency_s (per call) + bytes sent per rank ((d-1)/d of the gathered buffer) / bandwidth."""

    group_size: int
    all_gather_bandwidth_bytes_per_s: float
    all_gather_latency_s: float
    reduce_scatter_bandwidth_bytes_per_s: float
    reduce_scatter_latency_s: float

    def rates(self, collective: str) -> tuple[float, float]:
        """(bandwidth, latency per call) of "all_gather" or "reduce_scatter"."""
        return (
            getattr(self, f"{collective}_bandwidth_bytes_per_s"),
            getattr(self, f"{collective}_latency_s"),
        )


def check_measurements(items) -> tuple[CPMeasurement, ...]:
    """CostModel.cp_comm checked: CPMeasurements of distinct group sizes >= 2, bandwidths
    finite > 0, latencies finite >= 0; sorted by group size."""
    return check_group_rates(
        items,
        CPMeasurement,
        lambda m: (m.rates("all_gather"), m.rates("reduce_scatter")),
        field="cp_comm",
    )


def check_group_rates(items, kind: type, rates, *, field: str) -> tuple:
    """Measurements of collectives per group size (cp_comm, ring_comm) checked: instances of
    `kind` with distinct integer `group_size` >= 2 whose `rates(m)` pairs (bandwidth,
    latency) are finite, bandwidth > 0, latency >= 0; sorted by group size."""
    given = items
    try:
        items = tuple(items)
        ok = all(
            isinstance(m, kind)
            and isinstance(m.group_size, int)
            and m.group_size >= 2
            and all(math.isfinite(b) and b > 0 and math.isfinite(lat) and lat >= 0
                    for b, lat in rates(m))
            for m in items
        )  # fmt: skip
    except TypeError:  # not iterable, or a rate that is not a number
        items, ok = (), False
    if not ok or len({m.group_size for m in items}) != len(items):
        raise DcpOptError(
            f"{field}: must be {kind.__name__}s of distinct group sizes >= 2 with finite "
            f"bandwidths > 0 and latencies >= 0, got {given!r}"
        )
    return tuple(sorted(items, key=lambda m: m.group_size))


def check_kind(model, kind: str) -> None:
    """A one-line error for a kind that is not one of SP_KINDS, or cp / ring on a 2D model."""
    if kind not in SP_KINDS:
        raise DcpOptError(f"sp kind: {kind!r} not allowed; allowed: {list(SP_KINDS)}")
    if kind != "ulysses" and model.kind != "1d":
        raise DcpOptError(
            f"sp kind: {kind!r} not allowed for the {model.kind} model {model.name!r}; "
            f"allowed: 'ulysses' ({kind} is for 1D causal models)"
        )


def kv_bytes_per_token(model) -> float:
    """Bytes of one token's K and V at one layer: 2 * kv_heads * head_dim * dtype_bytes."""
    return 2.0 * model.kv_heads * (model.hidden // model.num_heads) * model.dtype_bytes


def extra_act_bytes(model, d):
    """Saved bytes per local token per layer beyond Ulysses' under cp: the gathered K/V of
    the d-1 other members' tokens, (d-1) * kv_bytes (module doc, Memory)."""
    return (np.asarray(d, dtype=float) - 1) * kv_bytes_per_token(model)


def comm_time_per_layer(cost, tokens, d, spans_nodes, collective: str = "all_gather"):
    """All-gather seconds of one layer's forward under cp (backward's reduce-scatter pays the
    same unless measured: `collective="reduce_scatter"`), elementwise like
    CostModel.comm_time_per_layer: `spans_nodes` is a bool (two-level) or a comm class
    (topology; None = the cheapest class of the degree)."""
    c = cost.cluster
    d = np.asarray(d)
    tokens = np.asarray(tokens, dtype=float)
    # Thakur et al. 2005: a ring all-gather moves (d-1)/d of the gathered buffer per rank
    sent = kv_bytes_per_token(cost.model) * tokens * (d - 1) / np.maximum(d, 1)
    if c.topology is not None:
        per_byte, lat = ring_rates(c, d, spans_nodes)
        return sent * per_byte + lat * (d - 1)
    spans = np.asarray(spans_nodes) & (d > 1)
    bw = np.where(spans, c.inter_node_bw, c.intra_node_bw)
    lat = np.where(spans, c.inter_node_latency_s, c.intra_node_latency_s)
    measured = getattr(cost, "cp_comm", ())
    if measured:  # the profile's rates inside a node (module doc, Measured rates)
        m_bw, m_lat = _measured_rates(measured, d, collective)
        bw, lat = np.where(spans, bw, m_bw), np.where(spans, lat, m_lat)
    return sent / bw + lat * (d - 1)  # one call: d-1 ring steps, each one latency


def _measured_rates(measured, d, collective: str):
    """(bandwidth, latency per ring step) of each degree in `d` from the measurements: its
    own group size's, else the largest measured."""
    by = {m.group_size: m.rates(collective) for m in measured}
    largest = measured[-1].group_size

    def one(x):
        g = int(x) if int(x) in by else largest
        bw, lat = by[g]
        return bw, lat / (g - 1)

    bw, lat = np.vectorize(one, otypes=[float, float])(np.asarray(d))
    return bw, lat


def backward_extra(cost, tokens, d, spans_nodes, L, forward):
    """What the L backward reduce-scatters cost beyond L forward-rate calls (0 unless
    measured rates are set: the unmeasured model charges both at one rate)."""
    if not getattr(cost, "cp_comm", ()):
        return 0.0
    return L * (comm_time_per_layer(cost, tokens, d, spans_nodes, "reduce_scatter") - forward)


def ring_rates(cluster, d, placement):
    """(seconds per byte of the ring's bottleneck link, latency per step) on the cluster's
    topology, elementwise (cp's all-gather and ring.py's P2P steps)."""
    from ..topology.comm import group_comm, group_ring

    topo = cluster.topology
    dd = np.asarray(d)
    pp = np.full(dd.shape, -1) if placement is None else np.asarray(placement)
    dd, pp = np.broadcast_arrays(dd, pp)
    per_byte, lat = np.empty(dd.shape), np.empty(dd.shape)
    seen: dict[tuple[int, int], tuple[float, float]] = {}
    for idx in np.ndindex(dd.shape):
        key = (int(dd[idx]), int(pp[idx]))
        if key not in seen:
            deg, cls = key
            starts = cluster.comm_classes(deg) if cls < 0 else (cls,)
            rates = [group_ring(topo, s, deg) for s in starts]
            seen[key] = (  # a lower bound over the placements, as default_comm's
                min(load / bw for load, bw in rates),
                min(group_comm(topo, s, deg).latency_s for s in starts),
            )
        per_byte[idx], lat[idx] = seen[key]
    return per_byte, lat
