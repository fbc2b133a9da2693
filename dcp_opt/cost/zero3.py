"""ZeRO-3 per layer over shard domains (issue 26; docs/architecture.md, "ZeRO-3 per layer:
shard domains with aligned micro-steps"; docs/cost-model.md, "ZeRO-3 per layer").

`CostModel(optimizer_sharding="zero3", shard_domain=s)`: parameters, gradients and optimizer
states are sharded over aligned blocks of s units (FSDP2 `fully_shard` per block over a 2-D
mesh, replicate across domains: HSDP; Zhao et al. 2023, "PyTorch FSDP", sec. 3 and 4). Per
micro-step each block is all-gathered for its forward and again for its backward
(reshard_after_forward) and its fp32 gradient reduce-scattered inside the domain; the
all-reduce across domains runs once per step, in the closing micro-step. Every unit of a
domain runs the phase's largest micro-step count of its domain (`domain_padding`).

All figures here are per unit (a unit is tensor_parallel GPUs; the cost model's cluster is
the cluster of units, whose bandwidth is t GPUs' links): a GPU holds and sends 1/t.
"""

from __future__ import annotations

import numpy as np

from ..errors import DcpOptError

# Bytes per parameter (mixed-precision Adam, Rajbhandari et al. 2020, sec. 3; FSDP2's
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)):
SHARDED_BYTES = 4.0 + 4.0 + 8.0  # fp32 master, fp32 gradient shard, Adam moments (2 x fp32)
GATHER_BYTES = 2.0  # bf16 parameters all-gathered per block
REDUCE_BYTES = 4.0  # fp32 gradients reduce-scattered per block


def check_shard_domain(s, mode: str, units) -> None:
    """`shard_domain`: 0 (the mode's step-level schedule) or, under zero3, an aligned block
    size of the units that divides their count."""
    if not (isinstance(s, int) and not isinstance(s, bool) and s >= 0):
        raise DcpOptError(f"shard_domain: must be an integer >= 0, got {s!r}")
    if s == 0:
        return
    if mode != "zero3":
        raise DcpOptError(
            f"shard_domain: {s} needs optimizer_sharding 'zero3', got {mode!r}; allowed "
            "shard_domain under this mode: [0]"
        )
    allowed = allowed_domains(units)
    if s not in allowed:
        raise DcpOptError(
            f"shard_domain: {s} not allowed on {units.num_gpus} units of {units.name!r}; "
            f"allowed: {allowed} (an aligned block size dividing the units)"
        )


def allowed_domains(units) -> list[int]:
    """Aligned block sizes (the cluster's natural group sizes) dividing the unit count."""
    n = units.num_gpus
    g = units.gpus_per_node
    sizes = {d for d in range(1, g + 1) if g % d == 0 and (d & (d - 1) == 0 or d == g)}
    sizes |= {g * k for k in range(1, units.num_nodes + 1) if units.num_nodes % k == 0}
    return sorted(x for x in sizes if n % x == 0)


def root_params(model) -> float:
    """Parameters outside the repeated blocks: the token embedding and the output head
    (2 x vocab x hidden; 0 for a model without a vocabulary). The runtime's root FSDP unit
    (runtime/sharding.py `shard_units`: the model itself) holds them."""
    return min(2.0 * model.vocab_size * model.hidden, model.total_params)


def head_params(model) -> float:
    """The output head's parameters (vocab x hidden): half the root's."""
    return root_params(model) / 2


def layer_params(model) -> float:
    """Parameters of one layer (all its blocks: the runtime's FSDP unit, one entry of the
    model's `layers`), the rest of total_params spread evenly."""
    return (model.total_params - root_params(model)) / model.num_layers


def state_parts(model, s: int) -> dict[str, float]:
    """Model-state bytes per unit under per-layer zero3 over s units at the peak of a
    micro-step, by part; c = the compute dtype's bytes (model.dtype_bytes, 2 for bf16):
    - sharded: 16 B / s per parameter: fp32 master 4, fp32 gradient shard 4, Adam 8;
    - in flight in backward: the root unit's gathered parameters c P_root (held from the
      head's backward to the end of the micro-step) and the head's compute-dtype gradients
      c P_head (waiting for the root's reduce-scatter); at layer i's reduce-scatter, with
      layer i - 1 gathered by FSDP2's default backward prefetch (the runtime sets none of its
      own, c P_layer): at the copy-in layer i's compute-dtype gradients c P_layer and their
      fp32 input 4 P_layer (torch 2.13 `foreach_reduce` frees the gradients only after the
      copy-in), then the input with the reduce-scatter's output 4 / s P_layer; or, if
      larger, between two collectives layer i's parameters and gradients and the
      prefetched layer, 3 c P_layer;
    - or, if larger, the root's own reduce-scatter, max(c + 4, 4 + 4 / s) P_root.
    Forward holds less: the current and the prefetched layer, 2 c P_layer. Measured on
    gloo, bf16, world 4 (held bytes sampled at every FSDP2 collective, reduce-scatter buffer
    and copy-in: benchmarks/bench_memory.py per_layer_peak, tests/test_memory_layouts.py)."""
    p, lp, rp = model.total_params, layer_params(model), root_params(model)
    c = float(model.dtype_bytes)
    copy_in, scatter, between = 2 * c + REDUCE_BYTES, c + REDUCE_BYTES * (1 + 1 / s), 3 * c
    per_layer = max(copy_in, scatter, between)
    layer_peak = c * (rp + head_params(model)) + per_layer * lp
    root_peak = max(c + REDUCE_BYTES, REDUCE_BYTES * (1 + 1 / s)) * rp
    if layer_peak >= root_peak:  # gathered: the root, one layer (two if 3 c is the larger)
        w = c * (rp + (2 if between > max(copy_in, scatter) else 1) * lp)
        g = layer_peak - w
    else:
        w, g = 0.0, root_peak
    return {
        "parameters": w + 4.0 * p / s,  # gathered, + the fp32 master shard
        "gradients": g + 4.0 * p / s,
        "optimizer states": 8.0 * p / s,
    }


def layer_gather_times(cost) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's collectives inside the domain per
    micro-step: all-gather of 2 B per parameter in forward; all-gather 2 B again and
    reduce-scatter 4 B in backward; each a ring moving (s - 1) / s of the buffer per unit
    (Thakur et al. 2005), at NVLink rate inside a node, else the NIC's."""
    s, c = cost.shard_domain, cost.cluster
    if s <= 1:
        return 0.0, 0.0
    inside = s <= c.gpus_per_node
    bw = c.intra_node_bw if inside else c.inter_node_bw
    lat = (c.intra_node_latency_s if inside else c.inter_node_latency_s) * (s - 1)
    share = (s - 1) / s * layer_params(cost.model)
    return share * GATHER_BYTES / bw + lat, share * (GATHER_BYTES + REDUCE_BYTES) / bw + 2 * lat


def exposed_gather_time(cost, fwd, bwd, speed=1.0):
    """Seconds of a micro-step that the per-layer collectives add: FSDP2 prefetches the next
    layer's gather on its own CUDA stream, so a layer takes max(compute, comm); the first
    gather is exposed. `fwd`, `bwd`: one layer's compute seconds (elementwise)."""
    g_f, g_b = layer_gather_times(cost)
    if not (g_f or g_b):
        return 0.0
    L = cost.model.num_layers
    f, b = np.asarray(fwd) / speed, np.asarray(bwd) / speed
    return L * (np.maximum(g_f - f, 0.0) + np.maximum(g_b - b, 0.0)) + g_f


def empty_micro_step_time(cost) -> float:
    """Seconds of one padding micro-step (one zero token, loss x 0) that alignment adds: every
    layer's launch constants or its gathers, whichever is longer, + the micro-batch constant
    (as time_parts prices an empty micro-batch)."""
    one = np.zeros((1, cost.num_features))
    c, r, m = cost.time_parts(one, 1, 0, speed=1.0)
    return float(c[0] + r[0] + m[0])


def cross_domain_bytes(cost) -> float:
    """Bytes one unit sends in the all-reduce of its fp32 gradient shard (4 P / s) across the
    N / s domains, once per step: a ring, 2 (m - 1) / m of the buffer (Thakur et al. 2005)."""
    m = cost.cluster.num_gpus // cost.shard_domain
    return 2 * (m - 1) / m * REDUCE_BYTES * cost.model.total_params / cost.shard_domain


def domain_padding(plan_phase_groups, num_units: int, s: int) -> list[int]:
    """Padding micro-steps per unit in one phase: each unit runs its domain's largest
    micro-step count (idle units count 0)."""
    counts = [0] * num_units
    for g in plan_phase_groups:
        for r in range(g.start_rank, g.start_rank + g.degree):
            counts[r] = len(g.micro_batches)
    out = []
    for b in range(0, num_units, s):
        top = max(counts[b : b + s])
        out += [top - c for c in counts[b : b + s]]
    return out
