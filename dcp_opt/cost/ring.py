"""Cost of the third sequence-parallel kind, `ring`: ring attention as TransformerEngine runs
it for Megatron-Core (docs/cost-model.md, "Ring attention", with the cited lines).

TE below is TransformerEngine `transformer_engine/pytorch/attention/dot_product_attention/
context_parallel.py` at d0067d0 (`AttnFuncWithCPAndKVP2P`); Liu et al. 2023, "Ring attention
with blockwise transformers for near-infinite context".

Layout and balance: cp's head-tail chunks (dcp_opt/cost/cp.py): member i holds chunks i and
2d-1-i of every sequence. At ring step s it attends to the K/V block of member i-s; each of
TE's three tile shapes (TE:1781-1796) has ~2c^2 causal pairs, so each of the d steps does 1/d
of the member's attention, quad * Q / d (cp's term): a_f = quad_fwd * Q / d^2 a step
(forward), a_b likewise backward, at the group's speed.

Communication, per layer. One block is the member's T/d tokens' K and V:
B = T/d * kv_bytes (kv_bytes = 2 * kv_heads * head_dim * dtype_bytes: only kv heads travel,
TE:1690). One transfer of n blocks is one P2P call, X_n = n B / bw + latency (TE:96-136).
- forward: d steps, the send/recv of step s+1's block issued before step s's attention
  (TE:1698-1720): exposed (d-1) max(0, X_1 - a_f);
- backward, the ring reversed (TE:2229): step 0 sends K/V, steps 1..d-2 K/V and the dK/dV
  accumulated so far (one [2, block] buffer, TE:2396-2401, 2460-2495), step d-1 dK/dV only,
  each while that step's attention backward runs (dK/dV added on arrival, TE:2717-2727):
  exposed 2 max(0, X_1 - a_b) + (d-2) max(0, X_2 - a_b); 2 (d-1) B bytes;
- a recomputed layer runs the forward ring again.
bw and latency are cp's (a node-crossing edge paces every step at the NIC rate; a topology:
the ring's most loaded link, cp_cost.ring_rates). Measured rates (optional; CostModel.
ring_comm, from a profile: runtime/profile/fit.py measure_ring_steps): a RingMeasurement per
group size holds what the runtime's own P2P step (one block to the next member, one from the
previous) took on the profiled host, fitted as time = latency + block bytes / bandwidth; a
ring group inside a node (two-level cluster) pays the measurement of its degree, else of the
largest measured group. Groups across nodes and topology clusters keep the rates above (one
host measures no NIC), as cp's measured collectives.

Memory: autograd keeps per layer what Ulysses keeps (own q, K/V, output, logsumexp: TE:2087,
2142); the one working layer holds the ring's buffers, 4 blocks at the backward's peak (send
and receive, each K/V + dK/dV: TE:2396-2401; the forward holds 2): 4 kv_bytes per local token.

The exposure is not additive over packed sequences (a long sequence's attention hides a short
one's transfers), so tables and bounds price a ring group without it (`additive`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import cp as cp_cost

BUFFER_BLOCKS = 4  # the backward's send and receive buffers, each K/V + dK/dV (TE:2396-2401)


@dataclass(frozen=True)
class RingMeasurement:
    """The ring's P2P step at one group size (module doc, Measured rates): time = latency_s
    (per step) + bytes of the block each member sends / bandwidth."""

    group_size: int
    bandwidth_bytes_per_s: float
    latency_s: float


def check_measurements(items) -> tuple[RingMeasurement, ...]:
    """CostModel.ring_comm checked: RingMeasurements of distinct group sizes >= 2, bandwidth
    finite > 0, latency finite >= 0; sorted by group size."""
    return cp_cost.check_group_rates(
        items,
        RingMeasurement,
        lambda m: ((m.bandwidth_bytes_per_s, m.latency_s),),
        field="ring_comm",
    )


def block_bytes(model, tokens, d):
    """Bytes of one ring block: the member's T/d tokens' K and V at one layer."""
    return cp_cost.kv_bytes_per_token(model) * np.asarray(tokens, dtype=float) / np.asarray(d)


def sent_bytes_per_layer(model, tokens, d) -> tuple:
    """(forward, backward) bytes one member sends at one layer: (d-1) blocks, then (d-1) K/V
    blocks and (d-1) dK/dV blocks (module doc)."""
    b = block_bytes(model, tokens, d) * (np.asarray(d) - 1)
    return b, 2 * b


def buffer_bytes(model, d):
    """Bytes per local token the working layer holds beyond Ulysses' (module doc, Memory)."""
    dd = np.asarray(d)
    return np.where(dd > 1, BUFFER_BLOCKS * cp_cost.kv_bytes_per_token(model), 0.0)


def step_rates(cost, d, spans_nodes):
    """(seconds per byte, latency per P2P call) of a ring step, elementwise like
    cp_cost.comm_time_per_layer (two-level: `spans_nodes` a bool; topology: a comm class)."""
    c = cost.cluster
    d = np.asarray(d)
    if c.topology is not None:
        return cp_cost.ring_rates(c, d, spans_nodes)
    spans = np.asarray(spans_nodes) & (d > 1)
    bw = np.where(spans, c.inter_node_bw, c.intra_node_bw)
    lat = np.where(spans, c.inter_node_latency_s, c.intra_node_latency_s)
    measured = getattr(cost, "ring_comm", ())
    if measured:  # the profile's rates inside a node (module doc, Measured rates)
        by = {m.group_size: m for m in measured}
        pick = np.vectorize(lambda x: int(x) if int(x) in by else measured[-1].group_size)
        sizes = pick(d)
        m_bw = np.vectorize(lambda g: by[int(g)].bandwidth_bytes_per_s, otypes=[float])(sizes)
        m_lat = np.vectorize(lambda g: by[int(g)].latency_s, otypes=[float])(sizes)
        bw, lat = np.where(spans, bw, m_bw), np.where(spans, lat, m_lat)
    return 1.0 / bw, lat


def exposed_per_layer(cost, tokens, d, spans_nodes, attn_fwd, attn_bwd, speed=1.0):
    """(forward, backward) exposed seconds of one layer's ring (module doc). `attn_fwd`,
    `attn_bwd`: the layer's attention seconds at degree d at speed 1 (Compute.attention_times),
    all of the member's d steps; elementwise."""
    d = np.asarray(d)
    per_byte, lat = step_rates(cost, d, spans_nodes)
    sent = block_bytes(cost.model, tokens, d) * per_byte
    x1, x2 = sent + lat, 2 * sent + lat
    a_f = np.asarray(attn_fwd) / (d * speed)
    a_b = np.asarray(attn_bwd) / (d * speed)
    ring = d > 1
    fwd = np.where(ring, (d - 1) * np.maximum(0.0, x1 - a_f), 0.0)
    bwd = 2 * np.maximum(0.0, x1 - a_b) + np.maximum(d - 2, 0) * np.maximum(0.0, x2 - a_b)
    return fwd, np.where(ring, bwd, 0.0)
