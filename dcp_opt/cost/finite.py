"""Figures that overflow float64: refused, naming the inputs that feed them.

Every input is finite (the cluster, the coefficients and the knobs are checked where they are
made), but products of finite inputs need not be: a bandwidth of 1e-300 B/s prices one
all-to-all byte at 1e300 s, a latency of 1e308 s times 4 calls is inf. The tables use inf for
"does not fit" (dcp_opt/table.py), so an overflowed time would read as a degree no sequence
fits, and inf - inf as nan everywhere downstream. Instead the figure is refused here with the
fields behind it: once per cost model for what no batch changes (`check_cost_scale`: the
per-micro-batch constants, the gradient sync, the fixed memory), once per table for the
sequences' own times (`check_table_finite`).
"""

from __future__ import annotations

import numpy as np

from ..errors import DcpOptError


def check_cost_scale(cost) -> None:
    """The figures of `cost` no batch changes are finite: model states and reserve, the
    empty micro-batch at every allowed degree with no and with every layer recomputed,
    the gradient sync's collectives and overhead. Priced by the base class (a subclass that
    reprices micro-batches is not asked at construction; its figures meet the table checks)."""
    if not np.isfinite(cost.fixed_bytes()):
        raise _error(cost, "the model states and reserve per GPU (bytes)", "memory")
    degrees = np.asarray(cost.cluster.allowed_degrees)
    empty = np.zeros((1, cost.num_features))
    from .compute import Compute  # the base pricing: a subclass's state is not set up yet

    for r in (0, cost.model.num_layers):
        levels = np.full((len(degrees), 1), r)
        with np.errstate(over="ignore", invalid="ignore"):
            c, rc, m = Compute.time_parts(cost, empty, degrees[:, None], levels)
        for part, values in (("compute", c + rc), ("latency", m)):
            bad = np.flatnonzero(~np.isfinite(values[:, 0]))
            if len(bad):
                what = f"an empty micro-batch's {part} time at degree {int(degrees[bad[0]])}"
                raise _error(cost, what, part)
    with np.errstate(over="ignore", invalid="ignore"):
        sync = cost.ring_all_reduce_time() + cost.step_overhead_s
    check_sync_finite(cost, sync)


def check_sync_finite(cost, sync_s: float) -> None:
    """The gradient sync of a step (grad_sync_time, closing micro-step included) is finite."""
    if not np.isfinite(sync_s):
        raise _error(cost, "the gradient sync of a step", "sync")


def check_table_finite(cost, batch, degrees, r_min: np.ndarray, time: np.ndarray) -> None:
    """Every sequence's time is finite where it fits ((D, n) arrays, one row per degree):
    refused otherwise, naming the sequence, the degree and the inputs behind the part that
    overflowed."""
    bad = (r_min >= 0) & ~np.isfinite(time)
    if not bad.any():
        return
    i, k = (int(x[0]) for x in np.nonzero(bad))
    d, seq = int(degrees[i]), batch.sequences[k]
    feats = cost.batch_features(batch)[k : k + 1]
    with np.errstate(over="ignore", invalid="ignore"):
        c, rc, m = cost.time_parts(feats, d, int(r_min[i, k]))
    part = "compute" if not np.isfinite(c + rc).all() else "comm"
    what = f"sequence {seq.id} ({seq.num_tokens} tokens) at degree {d}: its {part} time"
    raise _error(cost, what, part)


def _error(cost, what: str, part: str) -> DcpOptError:
    c, co = cost.cluster, cost.coeffs
    if part == "comm":
        fields = [
            f"cluster.intra_node_bw={c.intra_node_bw!r}",
            f"cluster.inter_node_bw={c.inter_node_bw!r}",
            f"cost coefficients.a2a_bytes_per_token_layer={co.a2a_bytes_per_token_layer!r}",
        ]
        if c.topology is not None:
            fields = ["the topology's link bandwidths", fields[-1]]
    elif part == "latency":
        fields = [
            f"cluster.intra_node_latency_s={c.intra_node_latency_s!r}",
            f"cluster.inter_node_latency_s={c.inter_node_latency_s!r}",
            f"cost coefficients.a2a_calls_per_layer={co.a2a_calls_per_layer!r}",
        ]
        if c.topology is not None:
            fields = ["the topology's link latencies", fields[-1]]
    elif part == "sync":
        fields = [
            f"cluster.inter_node_bw={c.inter_node_bw!r}",
            f"cluster.intra_node_bw={c.intra_node_bw!r}",
            f"grad_reduce_bytes_per_param={cost.grad_reduce_bytes_per_param!r}",
            f"step_overhead_s={cost.step_overhead_s!r}",
            f"model.num_params={cost.model.total_params!r}",
        ]
    elif part == "memory":
        fields = [
            f"model.num_params={cost.model.total_params!r}",
            f"cost coefficients.reserved_bytes={co.reserved_bytes!r}",
        ]
    else:  # compute
        fields = ["the cost coefficients' seconds per unit (blocks, head, overhead)"]
        if co.source == "flops":
            fields.append(f"cluster.peak_flops={c.peak_flops!r}")
        if c.speed_factors is not None:
            fields.append("cluster.speed_factors")
    return DcpOptError(
        f"cost model: {what} overflows float64 (inf) from {', '.join(fields)}; "
        "give figures a real cluster and model have"
    )


def check_step_finite(cost, planner: str, step_s: float, bound_s: float) -> None:
    """A plan's step time and bound are finite: each micro-batch's time is (the checks
    above), their sum on a rank need not be. Refused naming the largest time figures."""
    if np.isfinite(step_s) and np.isfinite(bound_s):
        return
    co, c = cost.coeffs, cost.cluster
    figures = {
        "cost coefficients.microbatch_overhead_s": co.microbatch_overhead_s,
        "cost coefficients.head_fwd_per_token_s": co.head_fwd_per_token_s,
        "cost coefficients.head_bwd_per_token_s": co.head_bwd_per_token_s,
        "cluster.intra_node_latency_s": c.intra_node_latency_s,
        "cluster.inter_node_latency_s": c.inter_node_latency_s,
        "step_overhead_s": cost.step_overhead_s,
    }
    for name, block in co.blocks.items():
        for part in ("fwd", "bwd"):
            for term in ("quad", "lin", "seq", "const"):
                figures[f"cost coefficients.blocks.{name}.{part}.{term}"] = getattr(
                    getattr(block, part), term
                )
    top = sorted(figures.items(), key=lambda kv: -kv[1])[:2]
    named = ", ".join(f"{k}={v!r}" for k, v in top)
    raise DcpOptError(
        f"{planner}: the step time overflows float64 (plan {step_s}, bound {bound_s} s) "
        f"adding up micro-batches; the largest time figures: {named}; give figures a real "
        "cluster and model have"
    )
