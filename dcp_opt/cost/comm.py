"""Communication: the Ulysses all-to-alls of a layer (cp's gather is cp.py), and the step's
world collectives under the optimizer-sharding mode with the sharded modes' closing
micro-step (runtime/sharding.py runs exactly these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..errors import DcpOptError
from . import cp as cp_cost
from . import ring as ring_cost
from . import zero3
from .memory import SHARDING_MODES
from .units import tp_step_time, tp_volume_share


@dataclass(frozen=True)
class StepCosts:
    """Seconds and bytes of one step beyond its micro-batches (CostModel.step_costs)."""

    grad_sync_s: float  # every rank after the last phase: collectives + closing + overhead
    # bytes one rank sends in the world collectives (CostModel.step_collectives)
    collectives: dict = field(default_factory=dict)
    collectives_s: float = 0.0  # their time at the gradient sync's rate
    closing_step_s: float = 0.0  # the sharded modes' one-token micro-step
    fixed_bytes: float = 0.0  # every rank's memory before any micro-batch (states, reserve)


class Comm:
    """CostModel's communication (a mixin: reads the fields of dcp_opt.cost.model)."""

    def a2a_bytes_per_token(self, d):
        """Bytes one layer's forward all-to-alls move per token at degree d (array-wise):
        the coefficients' multi-head volume times the model's share at d (GQA sends fewer
        k/v heads, ModelSpec.a2a_volume_share)."""
        base = self.coeffs.a2a_bytes_per_token_layer
        if self.model.num_kv_heads is None:
            return base
        d = np.asarray(d)
        t = self.tensor_parallel  # a TP rank's heads, between equal TP ranks (units.py)
        vol = self.model.a2a_volume_share if t == 1 else partial(tp_volume_share, self.model, t)
        share = np.vectorize(vol, otypes=[float])(d)
        return base * share

    def comm_time_per_layer(self, tokens, d, spans_nodes, kind: str = "ulysses"):
        """All-to-all time of one layer's forward (backward pays the same again).
        Elementwise: `d` and `spans_nodes` may be arrays that broadcast with `tokens`.
        `kind="cp"`: the K/V all-gather of context parallelism (cp_cost); `kind="ring"`: the
        forward ring's d-1 transfers before any overlap (time_parts charges what the
        attention does not hide: ring_cost)."""
        if kind == "ring":
            per_byte, lat = ring_cost.step_rates(self, d, spans_nodes)
            steps = np.asarray(d) - 1
            return steps * (ring_cost.block_bytes(self.model, tokens, d) * per_byte + lat)
        if kind != "ulysses":
            return cp_cost.comm_time_per_layer(self, tokens, d, spans_nodes)
        c = self.cluster
        d = np.asarray(d)
        tokens = np.asarray(tokens, dtype=float)
        # DeepSpeed-Ulysses eq. 1: each rank sends (d-1)/d of its T/d-token shard; under GQA
        # k and v go with fewer heads (model.ulysses_kv_heads)
        sent = self.a2a_bytes_per_token(d) * tokens / d * (d - 1) / d
        if c.topology is not None:  # from the graph; spans_nodes holds comm classes
            from ..topology.comm import a2a_time  # (dcp_opt/topology/comm.py: model, sources)

            return a2a_time(c, sent, d, spans_nodes, self.coeffs.a2a_calls_per_layer)
        spans = np.asarray(spans_nodes) & (d > 1)  # one GPU sends nothing
        if spans.any():  # the share of peers on other nodes goes at the NIC rate
            off = np.where(spans, (d - c.gpus_per_node) / np.maximum(d - 1, 1), 0.0)
            # where off = 0 this is exactly sent / intra_node_bw, as below
            bw_time = sent * (1 - off) / c.intra_node_bw + sent * off / c.inter_node_bw
        else:
            bw_time = sent / c.intra_node_bw
        # a degree-1 group makes no call: its latency is 0 before any product, so a latency
        # too large to multiply (calls x 1e308 = inf) cannot turn 0 calls into inf x 0 = nan
        lat = np.where(spans, c.inter_node_latency_s, c.intra_node_latency_s) * (d > 1)
        return bw_time + self.coeffs.a2a_calls_per_layer * lat * (d - 1)

    def step_collectives(self) -> dict[str, float]:
        """Bytes one rank sends in the world-wide collectives of a step under
        runtime/sharding.py: `none` all-reduces the fp32 gradients (ring, 2 (N-1)/N x 4 B per
        parameter; Thakur et al. 2005); the sharded modes all-gather the bf16 weights once
        ((N-1)/N x 2 B) and reduce-scatter the fp32 gradients ((N-1)/N x 4 B). The step time
        charges them in `grad_sync_time` as an all-reduce of `grad_reduce_bytes_per_param`,
        which by default is `runtime_reduce_bytes(mode)`: exactly these bytes."""
        p, n = self.model.total_params, self.cluster.num_gpus
        share = (n - 1) / n
        if self.shard_domain:  # per-layer zero3: inside domains per micro-step (zero3.py)
            return {"grad_all_reduce_across_domains": zero3.cross_domain_bytes(self)}
        if self.optimizer_sharding == "none":
            return {"grad_all_reduce": 2 * share * 4.0 * p}
        return {"param_all_gather": share * 2.0 * p, "grad_reduce_scatter": share * 4.0 * p}

    def closing_step_time(self) -> float:
        """Seconds of the closing micro-step of the sharded modes: Sharding.finish_step
        (runtime/sharding.py) runs one token with loss x 0 on every rank, sync on, so that
        FSDP2 reduce-scatters every unit in the same order everywhere; `none` runs none. It
        is charged as the cost model's own one-token micro-batch at degree 1 (no
        all-to-all): L x (each block's per-layer constant `const` + one token's terms) + the
        head of one token + `microbatch_overhead_s`, as time_parts' compute, at the pace of
        the slowest rank (every rank runs it before the world reduces). `closing_step_s`,
        when set, replaces this figure."""
        if self.optimizer_sharding == "none":
            return 0.0
        if self.closing_step_s is not None:
            return float(self.closing_step_s)

        def make() -> float:
            one = np.ones((1, self.num_features))  # Q = T = S = 1: one token
            speed = self.cluster.group_speed(0, self.cluster.num_gpus)
            # time_parts, so a subclass that reprices micro-batches (recalibrate) reprices it
            c, r, m = self.time_parts(one, 1, 0, speed=speed)  # degree 1: m = 0
            return float(c[0] + r[0] + m[0])

        return self.memoised("closing", make)  # simulate asks once per plan

    def grad_sync_time(self) -> float:
        """Seconds every step pays after the plan's last phase: the world collectives as a
        ring all-reduce of `grad_reduce_bytes_per_param` (2 (N-1)/N * bytes / bandwidth,
        Thakur et al. 2005; by default the bytes runtime/sharding.py sends under the mode,
        step_collectives), at the NIC rate across nodes, + the closing micro-step of the
        sharded modes (closing_step_time) + `step_overhead_s`, + under tensor parallelism
        the norms' gradient sums inside each unit (units.tp_step_time)."""
        if self.cluster.num_gpus == 1:
            out = self.step_overhead_s + self.closing_step_time()
        else:
            out = self.ring_all_reduce_time() + self.step_overhead_s + self.closing_step_time()
        return out + tp_step_time(self) if self.tensor_parallel > 1 else out

    def ring_all_reduce_time(self) -> float:
        """The world collectives of grad_sync_time alone: a ring all-reduce of
        `grad_reduce_bytes_per_param` per parameter (0 on one GPU)."""
        c = self.cluster
        n = c.num_gpus
        if n == 1:
            return 0.0
        bw = c.inter_node_bw if c.num_nodes > 1 else c.intra_node_bw
        if self.shard_domain:  # the fp32 shards across domains (zero3.cross_domain_bytes)
            return zero3.cross_domain_bytes(self) / bw
        volume = self.model.total_params * self.grad_reduce_bytes_per_param
        if c.topology is not None:  # the ring's most loaded link (dcp_opt/topology/comm.py)
            from ..topology.comm import ring_bottleneck

            load, bw = ring_bottleneck(c.topology)
            volume = volume * load
        return 2 * (n - 1) / n * volume / bw

    def collectives_time(self, collectives: dict[str, float]) -> float:
        """Seconds of `collectives` (bytes one rank sends, step_collectives) at the rate
        grad_sync_time uses (the NIC across nodes)."""
        c = self.cluster
        if c.num_gpus == 1:
            return 0.0
        bw = c.inter_node_bw if c.num_nodes > 1 else c.intra_node_bw
        return sum(collectives.values()) / bw

    def step_costs(self) -> StepCosts:
        """What every step pays after the plan's phases, in one answer (simulate asks once)."""
        coll = self.step_collectives()
        return StepCosts(
            self.grad_sync_time(),
            coll,
            self.collectives_time(coll),
            self.closing_step_time(),
            self.fixed_bytes(),
        )


def runtime_reduce_bytes(mode: str) -> float:
    """`grad_reduce_bytes_per_param` that makes `grad_sync_time` (a ring all-reduce, 2 (N-1)/N
    x bytes) equal the step's collectives under runtime/sharding.py: an fp32 all-reduce for
    `none` (4 B), all-gather 2 B + reduce-scatter 4 B for the sharded modes (3 B)."""
    if mode not in SHARDING_MODES:
        raise DcpOptError(
            f"optimizer_sharding: {mode!r} not allowed; allowed: {list(SHARDING_MODES)}"
        )
    return 4.0 if mode == "none" else 3.0
