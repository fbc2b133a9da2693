"""Cost model: time and memory of one micro-batch at SP degree d with r recomputed layers.

Every quantity is per layer and per block type (1D: "layer"; 2D: "spatial", "temporal") and
is a function of additive features of the micro-batch, so packing sequences adds features:

    Q_b  attention work of block b: 1D sum s^2 (causal); 2D spatial sum F*S^2, temporal sum S*F^2;
         1D layers with a sliding window w: s^2 - (s-w)^2 for s > w, i.e. ~2sw (CostModel._quad_1d)
    T    tokens;   S  sequences

Time of one block's forward on one GPU of speed 1 (fitted by the profiler, or from FLOPs):
    t_b = quad_b * Q_b * heads_share(d) + (lin_b * T + seq_b * S) / d + const_b
where heads_share(d) = ceil(H/d)/H: Ulysses splits attention by heads (Jacobs et al. 2023,
DeepSpeed-Ulysses, sec. 3), so a degree that does not divide H leaves some ranks more heads.
Backward has its own coefficients; a recomputed layer pays one more forward (Chen et al. 2016,
"Training deep nets with sublinear memory cost"). Communication: Ulysses moves q, k, v and
the attention output through all-to-alls (4 per layer forward; DeepSpeed-Ulysses eq. 1; under
grouped-query attention k and v with fewer heads, ModelSpec.a2a_volume_share);
2D dimension switching moves the activations twice per layer (Zhao et al. 2024, DSP, sec. 3).
Each rank sends (d-1)/d of its T/d-token shard; the part leaving the node goes at the NIC rate.

Memory per member (Korthikanti et al. 2022, "Reducing activation recomputation", sec. 4):
model states + reserve + T/d * ((L - r) * act + r * ckpt + act + head), where the extra `act`
is the working set of the one layer being recomputed or back-propagated.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import asdict, astuple, dataclass, field, replace

import numpy as np

from . import cp_cost
from .batch import Batch, Sequence
from .cluster import GB, Cluster
from .errors import DcpOptError, InfeasibleError
from .model import ModelSpec

SHARDING_MODES = ("none", "zero1", "zero2", "zero3")
_PASS_SHARE = {"fwd": 1 / 3, "bwd": 2 / 3}  # CostModel.replicated_seq_s per pass


@dataclass(frozen=True)
class TermCoeffs:
    """Seconds on one GPU of speed 1, for one block of one layer."""

    quad: float = 0.0
    lin: float = 0.0
    seq: float = 0.0
    const: float = 0.0


@dataclass(frozen=True)
class BlockCoeffs:
    fwd: TermCoeffs
    bwd: TermCoeffs


@dataclass(frozen=True)
class CostCoefficients:
    blocks: dict[str, BlockCoeffs]
    head_fwd_per_token_s: float
    head_bwd_per_token_s: float
    microbatch_overhead_s: float
    a2a_bytes_per_token_layer: float
    a2a_calls_per_layer: int
    act_bytes_per_token_layer: float
    ckpt_bytes_per_token_layer: float
    head_bytes_per_token: float
    reserved_bytes: float
    source: str = "preset"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostCoefficients:
        d = dict(d)
        try:
            d["blocks"] = {
                k: BlockCoeffs(TermCoeffs(**v["fwd"]), TermCoeffs(**v["bwd"]))
                for k, v in d["blocks"].items()
            }
            return cls(**d)
        except (KeyError, TypeError, AttributeError) as e:
            raise DcpOptError(f"cost coefficients: malformed ({e})") from None


@dataclass(frozen=True)
class Efficiency:
    """Assumptions behind the FLOP-derived presets (docs/cost-model.md)."""

    mfu_linear: float = 0.55  # matmul share of peak reached in training (Megatron reports ~0.5)
    mfu_attention: float = 0.45  # FlashAttention-2/3 fwd+bwd share of peak on Hopper
    bwd_linear_ratio: float = 2.0  # backward = 2x forward FLOPs (Narayanan et al. 2021, eq. 3)
    bwd_attention_ratio: float = 2.5  # FlashAttention-2 backward ~2.5x forward (Dao 2023, sec. 3)
    block_launch_s: float = 30e-6  # kernel launches of one block's forward
    microbatch_overhead_s: float = 4e-3  # embedding, loss, data copy, hooks
    reserved_bytes: float = 4 * GB  # CUDA context, NCCL buffers of many groups, fragmentation


def flops_coefficients(
    model: ModelSpec, cluster: Cluster, eff: Efficiency = Efficiency()
) -> CostCoefficients:
    """Coefficients from FLOP counts and the cluster's peak (no profile needed)."""
    h, f, b = model.hidden, model.ffn_hidden, model.dtype_bytes
    lin_rate = cluster.peak_flops * eff.mfu_linear
    att_rate = cluster.peak_flops * eff.mfu_attention
    # Forward FLOPs of the matmuls: 2 per parameter per token (Kaplan et al. 2020, sec. 2.1).
    lin_flops = 2 * model.params_per_block
    if model.kind == "1d":
        quad_flops = 2 * h  # QK^T and PV: 4 s^2 h, halved by the causal mask
        seq_flops = 0.0
    else:
        quad_flops = 4 * h  # full (non-causal) attention over the block's axis
        lin_flops += 4 * h * model.text_tokens  # cross-attention scores and PV
        seq_flops = 4 * h * h * model.text_tokens  # cross-attention k, v of the caption
    fwd = TermCoeffs(
        quad_flops / att_rate, lin_flops / lin_rate, seq_flops / lin_rate, eff.block_launch_s
    )
    bwd = TermCoeffs(
        fwd.quad * eff.bwd_attention_ratio,
        fwd.lin * eff.bwd_linear_ratio,
        fwd.seq * eff.bwd_linear_ratio,
        fwd.const * 2,
    )
    blocks = {name: BlockCoeffs(fwd, bwd) for name in model.block_types}
    nb = len(model.block_types)
    if model.kind == "1d":
        head_flops = 2 * h * model.vocab_size
        # Saved per token per layer (2-byte units), FlashAttention so no s^2 term: norm inputs
        # 2h, qkv input h, q k v 3h (k, v narrower under GQA), attention output h, MLP input
        # h, gate/up/act/product 4f (SwiGLU; 2f for a plain MLP) -- Korthikanti et al. 2022
        # eq. 1 re-derived for Llama.
        act = b * ((6 + 2 * model.kv_fraction) * h + (4 if model.gated_mlp else 2) * f)
        head_bytes = 6 * model.vocab_size  # bf16 logits + fp32 softmax of the loss
        a2a = 4 * h * b
        calls = 4
    else:
        head_flops = 2 * h * 64  # final projection to patch channels
        act = nb * b * (13 * h + 2 * f)  # per block: attention 8h, cross 4h, MLP h + 2f
        head_bytes = 4 * h * b
        a2a = 2 * h * b
        calls = 2
    return CostCoefficients(
        blocks=blocks,
        head_fwd_per_token_s=head_flops / lin_rate,
        head_bwd_per_token_s=2 * head_flops / lin_rate,
        microbatch_overhead_s=eff.microbatch_overhead_s,
        a2a_bytes_per_token_layer=a2a,
        a2a_calls_per_layer=calls,
        act_bytes_per_token_layer=act,
        ckpt_bytes_per_token_layer=nb * b * h,
        head_bytes_per_token=head_bytes,
        reserved_bytes=eff.reserved_bytes,
        source="flops",
    )


def windowed_quad(t, window: int = 0, share: float = 1.0):
    """Attention feature Q of a causal 1D sequence of t tokens (a float or an array) when a
    `share` of the layers has a sliding window of `window` keys (0: none): s^2, less
    share * (s - w)^2 for s > w (CostModel._quad_1d gives the arithmetic). The one definition:
    the cost model's features and the profiler's fit (dcp_opt/fit.py) both call it. Without
    a window it is t * t bit for bit."""
    if not window:
        return t * t
    excess = np.maximum(t - window, 0.0)
    return t * t - share * (excess * excess)


@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float
    recompute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.recompute_s + self.comm_s


class MemoCache(dict):
    """The cost model's memo of pure functions of (cost model, batch): cost tables, bounds,
    fingerprints. Bounded, oldest entry evicted first: a training run plans a new batch every
    step with one CostModel, and an unbounded memo would keep every batch's tables for the
    whole run. Entries are recomputed when missing, so eviction never changes a result."""

    MAX_ENTRIES = 256  # ~6-10 entries per batch: the last few dozen batches stay memoised

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > self.MAX_ENTRIES:
            # another thread (AsyncPlanner) may evict the same entry first
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del self[next(iter(self))]


@dataclass(frozen=True)
class CostModel:
    """Time and memory of micro-batches on a cluster, for one model.

    `optimizer_sharding`: model states per GPU follow mixed-precision Adam (Rajbhandari et al.
    2020, ZeRO, sec. 3): bf16 weights 2 B, fp32 gradient accumulator 4 B, fp32 master weights
    and two moments 12 B per parameter; zero1 shards the 12 B over the whole world (as VideoSys'
    ZeRO-1 does). zero2 and zero3 hold the same peak under the runtime's schedule, which
    reduces the world once per step (model_state_bytes). That schedule gathers the parameters
    once per step, so no mode, zero3 included, needs aligned micro-step counts: a plan from
    any planner runs as made. The step time charges the mode's world collectives and, in the
    sharded modes, the closing one-token micro-step (grad_sync_time, closing_step_time).
    """

    model: ModelSpec
    cluster: Cluster
    coeffs: CostCoefficients = None  # type: ignore[assignment]
    optimizer_sharding: str = "zero1"
    usable_memory_fraction: float = 0.9
    # Bytes per parameter of a ring all-reduce that the step's world collectives cost
    # (grad_sync_time). None (the default): what runtime/sharding.py sends under
    # `optimizer_sharding` (runtime_reduce_bytes: 4 for `none`, 3 for the sharded modes),
    # and it follows the mode through `with_`; a number overrides it for a runtime that
    # reduces otherwise (e.g. 2 for bf16 gradient reduction; a profile's measured sync).
    grad_reduce_bytes_per_param: float | None = None
    # Seconds of the sharded modes' closing micro-step (closing_step_time). None (the
    # default): the cost model's own one-token micro-batch; a number: a runtime's own
    # figure (0 for one without that step).
    closing_step_s: float | None = None
    # Knobs a measured profile may need beyond the FLOP preset (all off by default, where
    # every figure and the fingerprint are the preset's; dcp_opt/perturb.py gives the ranges
    # a measurement could give and why):
    # - sp_compute_overhead ((degree, x), ...): one layer's time at that degree is (1 + x)
    #   times its FLOP share (SP runs smaller kernels, waits on its slowest member, copies
    #   shards); degrees not listed pay x = 0;
    # - replicated_seq_s: seconds per sample of one forward + backward pass over all layers
    #   that every rank of a group repeats instead of splitting (VideoSys keeps the caption's
    #   cross-attention k/v whole on every rank), charged per layer (1/3 forward, 2/3
    #   backward, as the 2x backward of Narayanan et al. 2021), so recompute repeats it;
    # - step_overhead_s: fixed seconds per optimizer step (optimizer, host sync), paid with the
    #   gradient sync.
    sp_compute_overhead: tuple[tuple[int, float], ...] = ()
    replicated_seq_s: float = 0.0
    step_overhead_s: float = 0.0
    # The SP kinds a planner may give a group (cp_cost.SP_KINDS; Ulysses always): with "cp"
    # the per-degree tables (table.py) and bounds take the least over the kinds, and greedy
    # and cpsat choose each group's kind. Every figure of a given kind is the same either way.
    sp_kinds: tuple[str, ...] = ("ulysses",)
    # cp's collectives as a profile measured them (cp_cost.CPMeasurement per group size;
    # empty: the cluster's rates). Used by cp groups inside a node (cp_cost, Measured rates).
    cp_comm: tuple = ()
    _cache: dict = field(default_factory=MemoCache, compare=False, hash=False, repr=False)
    # Whether grad_reduce_bytes_per_param was left to the mode (set in __post_init__)
    _reduce_follows_mode: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.coeffs is None:
            object.__setattr__(self, "coeffs", flops_coefficients(self.model, self.cluster))
        if self.optimizer_sharding not in SHARDING_MODES:
            raise DcpOptError(
                f"optimizer_sharding: {self.optimizer_sharding!r} not allowed; "
                f"allowed: {list(SHARDING_MODES)}"
            )
        if not 0 < self.usable_memory_fraction <= 1:
            raise DcpOptError(
                f"usable_memory_fraction: must be in (0, 1], got {self.usable_memory_fraction}"
            )
        self._resolve_reduce_bytes()
        self._check_knobs()
        self._check_sp_kinds()
        object.__setattr__(self, "cp_comm", cp_cost.check_measurements(self.cp_comm))
        missing = set(self.model.block_types) - set(self.coeffs.blocks)
        if missing:
            raise DcpOptError(
                f"cost coefficients: no entry for block types {sorted(missing)} "
                f"of model {self.model.name!r}"
            )

    def _resolve_reduce_bytes(self) -> None:
        """grad_reduce_bytes_per_param: None follows the mode; a number is checked."""
        v = self.grad_reduce_bytes_per_param
        follows = v is None
        if follows:
            v = runtime_reduce_bytes(self.optimizer_sharding)
        elif isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v)) or v < 0:
            raise DcpOptError(
                f"grad_reduce_bytes_per_param: must be a finite number >= 0 or None (the "
                f"runtime's collectives of optimizer_sharding), got {v!r}"
            )
        object.__setattr__(self, "grad_reduce_bytes_per_param", float(v))
        object.__setattr__(self, "_reduce_follows_mode", follows)

    def _check_knobs(self) -> None:
        """The measured-profile knobs: finite, >= 0; overheads as (degree, x) pairs."""
        for name in ("replicated_seq_s", "step_overhead_s", "closing_step_s"):
            v = getattr(self, name)
            if name == "closing_step_s" and v is None:
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise DcpOptError(f"{name}: must be a finite number >= 0, got {v!r}")
        try:
            pairs = tuple((int(d), float(x)) for d, x in self.sp_compute_overhead)
        except (TypeError, ValueError):
            pairs = None
        allowed = self.cluster.allowed_degrees
        if (
            pairs is None
            or any(d not in allowed or not math.isfinite(x) or x < 0 for d, x in pairs)
            or len({d for d, _ in pairs}) != len(pairs)
        ):
            raise DcpOptError(
                f"sp_compute_overhead: must be distinct (degree, x) pairs with degree in "
                f"{list(allowed)} and finite x >= 0, got {self.sp_compute_overhead!r}"
            )
        object.__setattr__(self, "sp_compute_overhead", tuple(sorted(pairs)))

    def _check_sp_kinds(self) -> None:
        kinds = self.sp_kinds
        ok = (
            isinstance(kinds, (tuple, list))
            and "ulysses" in kinds
            and len(set(kinds)) == len(kinds)
            and all(k in cp_cost.SP_KINDS for k in kinds)
        )
        if not ok:
            raise DcpOptError(
                f"sp_kinds: {kinds!r} not allowed; allowed: distinct entries of "
                f"{list(cp_cost.SP_KINDS)}, 'ulysses' included"
            )
        if "cp" in kinds:
            cp_cost.check_kind(self.model, "cp")
        object.__setattr__(self, "sp_kinds", tuple(k for k in cp_cost.SP_KINDS if k in kinds))

    def sp_factor(self, d: int) -> float:
        """Multiplier of one layer's time at degree d (1 + sp_compute_overhead's x)."""
        return 1.0 + dict(self.sp_compute_overhead).get(int(d), 0.0)

    def with_(self, **changes) -> CostModel:
        """A copy with `changes`. A sync volume left to the mode keeps following it (a copy
        with another optimizer_sharding charges that mode's collectives)."""
        if self._reduce_follows_mode:
            changes.setdefault("grad_reduce_bytes_per_param", None)
        return replace(self, _cache=MemoCache(), **changes)

    # ---- features ----------------------------------------------------------------------
    @property
    def num_features(self) -> int:
        return len(self.model.block_types) + 2

    def features(self, seq: Sequence) -> np.ndarray:
        """Additive features of one sequence: [Q_b for each block type..., T, S]."""
        if (seq.kind == "1d") != (self.model.kind == "1d"):
            raise DcpOptError(
                f"sequence {seq.id}: a {seq.kind} shape {seq.shape} does not fit the "
                f"{self.model.kind} model {self.model.name!r}"
            )
        t = float(seq.num_tokens)
        if self.model.kind == "1d":
            return np.array([self._quad_1d(t), t, 1.0])
        fr, sp = float(seq.frames), float(seq.spatial_tokens)
        return np.array([fr * sp * sp, sp * fr * fr, t, 1.0])

    def _quad_1d(self, t):
        """Q of a 1D sequence of t tokens (a float or an array), averaged over the layers.
        Causal attention over s tokens scores s(s+1)/2 ~ s^2/2 pairs: Q = s^2 (quad_flops
        counts 2h per unit). Under a window w (ModelSpec.window) a query sees min(i+1, w)
        keys, w(w+1)/2 + (s-w)w ~ s*w - w^2/2 pairs for s > w: Q_w = s^2 - (s-w)^2 = 2sw - w^2
        (equal to s^2 at s = w). Without a window the feature is s^2 bit for bit as before."""
        m = self.model
        return windowed_quad(t, m.window if m.windowed_layers else 0, m.windowed_share)

    def batch_features(self, batch: Batch) -> np.ndarray:
        key = ("bf", batch.fingerprint())
        if key not in self._cache:
            self.features(batch.sequences[0])  # a batch has one kind: check it once
            x = np.array([s.shape for s in batch.sequences], dtype=float)
            if self.model.kind == "1d":
                t = x[:, 0]
                f = np.stack([self._quad_1d(t), t, np.ones_like(t)], axis=1)
            else:  # the same columns as features(), for every row at once
                fr, sp = x[:, 0], x[:, 1] * x[:, 2]
                f = np.stack([fr * sp * sp, sp * fr * fr, fr * sp, np.ones_like(fr)], axis=1)
            self._cache[key] = f
        return self._cache[key]

    # ---- time --------------------------------------------------------------------------
    def _heads_share(self, d: int) -> float:
        h = self.model.num_heads
        return math.ceil(h / d) / h

    def _layer_vectors(
        self, d: int, kind: str = "ulysses"
    ) -> tuple[np.ndarray, float, np.ndarray, float]:
        """(w_fwd, c_fwd, w_bwd, c_bwd): one layer's time = features @ w + c at degree d.
        Under `cp` the attention splits 1/d by causal head-tail chunks (cp_cost)."""
        key = ("lv", d) if kind == "ulysses" else ("lv", d, kind)
        if key in self._cache:
            return self._cache[key]
        hs = self._heads_share(d) if kind == "ulysses" else 1.0 / d
        nb = len(self.model.block_types)
        out = []
        for part in ("fwd", "bwd"):
            w = np.zeros(nb + 2)
            c = 0.0
            for i, name in enumerate(self.model.block_types):
                tc: TermCoeffs = getattr(self.coeffs.blocks[name], part)
                w[i] = tc.quad * hs
                w[nb] += tc.lin / d
                w[nb + 1] += tc.seq / d
                c += tc.const
            if self.replicated_seq_s:  # not split by d: every member repeats it
                w[nb + 1] += self.replicated_seq_s * _PASS_SHARE[part] / self.model.num_layers
            if self.sp_compute_overhead:
                f = self.sp_factor(d)
                w, c = w * f, c * f
            out += [w, c]
        self._cache[key] = tuple(out)
        return self._cache[key]

    def _layer_stack(
        self, degrees: tuple[int, ...], kind: str = "ulysses"
    ) -> tuple[np.ndarray, ...]:
        """_layer_vectors of every degree, stacked: (W_fwd (D, F), c_fwd (D,), W_bwd, c_bwd)."""
        key = ("ls", degrees) if kind == "ulysses" else ("ls", degrees, kind)
        if key not in self._cache:
            vs = [self._layer_vectors(d, kind) for d in degrees]
            self._cache[key] = tuple(np.array([v[k] for v in vs]) for k in range(4))
        return self._cache[key]

    def layer_times(self, feats, d, kind: str = "ulysses") -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds of one layer for rows of `feats` (n, F) at degree d. A column
        of degrees (D, 1) gives (D, n): a stack of matrix-vector products, so each row is
        bit-for-bit the one-degree call (one matrix product would round differently)."""
        if np.ndim(d) == 0:
            wf, cf, wb, cb = self._layer_vectors(d, kind)
            return feats @ wf + cf, feats @ wb + cb
        wf, cf, wb, cb = self._layer_stack(tuple(int(x) for x in np.ravel(d)), kind)
        fwd = np.matmul(feats, wf[:, :, None])[..., 0] + cf[:, None]
        return fwd, np.matmul(feats, wb[:, :, None])[..., 0] + cb[:, None]

    def a2a_bytes_per_token(self, d):
        """Bytes one layer's forward all-to-alls move per token at degree d (array-wise):
        the coefficients' multi-head volume times the model's share at d (GQA sends fewer
        k/v heads, ModelSpec.a2a_volume_share)."""
        base = self.coeffs.a2a_bytes_per_token_layer
        if self.model.num_kv_heads is None:
            return base
        d = np.asarray(d)
        share = np.vectorize(self.model.a2a_volume_share, otypes=[float])(d)
        return base * share

    def comm_time_per_layer(self, tokens, d, spans_nodes, kind: str = "ulysses"):
        """All-to-all time of one layer's forward (backward pays the same again).
        Elementwise: `d` and `spans_nodes` may be arrays that broadcast with `tokens`.
        `kind="cp"`: the K/V all-gather of context parallelism (cp_cost)."""
        if kind != "ulysses":
            return cp_cost.comm_time_per_layer(self, tokens, d, spans_nodes)
        c = self.cluster
        d = np.asarray(d)
        tokens = np.asarray(tokens, dtype=float)
        # DeepSpeed-Ulysses eq. 1: each rank sends (d-1)/d of its T/d-token shard; under GQA
        # k and v go with fewer heads (model.ulysses_kv_heads)
        sent = self.a2a_bytes_per_token(d) * tokens / d * (d - 1) / d
        if c.topology is not None:  # from the graph; spans_nodes holds comm classes
            from .topology.comm import a2a_time  # (dcp_opt/topology/comm.py: model, sources)

            return a2a_time(c, sent, d, spans_nodes, self.coeffs.a2a_calls_per_layer)
        spans = np.asarray(spans_nodes) & (d > 1)  # one GPU sends nothing
        if spans.any():  # the share of peers on other nodes goes at the NIC rate
            off = np.where(spans, (d - c.gpus_per_node) / np.maximum(d - 1, 1), 0.0)
            # where off = 0 this is exactly sent / intra_node_bw, as below
            bw_time = sent * (1 - off) / c.intra_node_bw + sent * off / c.inter_node_bw
        else:
            bw_time = sent / c.intra_node_bw
        lat = np.where(spans, c.inter_node_latency_s, c.intra_node_latency_s)
        return bw_time + self.coeffs.a2a_calls_per_layer * lat * (d - 1)

    def time_parts(
        self,
        feats,
        d,
        recompute_layers,
        *,
        spans_nodes=None,
        speed=1.0,
        kind="ulysses",
    ):
        """Vectorised over rows of `feats` (n, F) -> (compute, recompute, comm), seconds.
        `d` may be a column of degrees (D, 1): each part is then (D, n), one row per degree,
        and `recompute_layers`, `spans_nodes` and `speed` broadcast against it. `kind`: the
        SP kind of the group, "ulysses" or "cp" (cp_cost)."""
        if kind != "ulysses":
            cp_cost.check_kind(self.model, kind)
        feats = np.asarray(feats, dtype=float)
        if spans_nodes is None and self.cluster.topology is None:  # None: per-degree default
            spans_nodes = np.asarray(d) > self.cluster.gpus_per_node
        fwd, bwd = self.layer_times(feats, d, kind)
        tokens = feats[..., -2]
        return self.time_parts_from(
            fwd, bwd, tokens, d, recompute_layers, spans_nodes=spans_nodes, speed=speed, kind=kind
        )

    def time_parts_from(
        self, fwd, bwd, tokens, d, recompute_layers, *, spans_nodes, speed, kind="ulysses"
    ):
        """time_parts from one layer's (fwd, bwd) seconds (layer_times). Elementwise: every
        argument may be an array, e.g. one degree, span and speed per micro-batch."""
        L = self.model.num_layers
        co = self.coeffs
        head = tokens / d * (co.head_fwd_per_token_s + co.head_bwd_per_token_s)
        compute = L * (fwd + bwd) + head + co.microbatch_overhead_s
        r = np.asarray(recompute_layers, dtype=float)
        layer_comm = self.comm_time_per_layer(tokens, d, spans_nodes, kind)
        recompute = r * fwd  # one more forward per recomputed layer (Chen et al. 2016)
        if np.ndim(speed) or speed != 1:  # x / 1.0 == x: skip two passes at full speed
            compute, recompute = compute / speed, recompute / speed
        comm = (2 * L + r) * layer_comm  # forward, backward, each recomputed forward
        if kind == "cp":  # a measured reduce-scatter: the backward at its own rate (cp_cost)
            comm = comm + cp_cost.backward_extra(self, tokens, d, spans_nodes, L, layer_comm)
        return compute, recompute, comm

    @property
    def takes_degree_vectors(self) -> bool:
        """Whether time_parts is this class's own, which takes a column of degrees. A subclass
        that reprices it per degree (recalibrate.RecalibratedCostModel) takes one degree."""
        return type(self).time_parts is CostModel.time_parts

    def time_by_degree(self, feats, degrees, recompute_layers, kind="ulysses") -> np.ndarray:
        """time() of every row of `feats` (n, F) at every degree (D,) -> (D, n), with
        `recompute_layers` (D, n): one vectorised call, or one per degree for a subclass."""
        kw = {} if kind == "ulysses" else {"kind": kind}
        if self.takes_degree_vectors:
            return self.time(feats, np.asarray(degrees)[:, None], recompute_layers, **kw)
        rows = zip(degrees, recompute_layers, strict=True)
        return np.stack([self.time(feats, d, r, **kw) for d, r in rows])

    def time(self, feats, d, recompute_layers=0, **kw):
        c, r, m = self.time_parts(feats, d, recompute_layers, **kw)
        return c + r + m

    def microbatch_time(
        self,
        seqs: list[Sequence],
        d: int,
        recompute_layers: int = 0,
        *,
        spans_nodes: bool | None = None,
        speed: float = 1.0,
        kind: str = "ulysses",
    ) -> TimeBreakdown:
        f = sum(self.features(s) for s in seqs)
        kw = {} if kind == "ulysses" else {"kind": kind}
        c, r, m = self.time_parts(
            f, d, recompute_layers, spans_nodes=spans_nodes, speed=speed, **kw
        )
        return TimeBreakdown(float(c), float(r), float(m))

    # ---- memory ------------------------------------------------------------------------
    def model_state_bytes(self) -> float:
        """Peak model-state bytes per GPU in a step as runtime/sharding.py runs the mode
        (docs/architecture.md, "Sharded, mixed-precision training"). The world reduces the
        gradients once per step, since groups run different numbers of micro-batches; until
        then every rank holds the gathered bf16 weights and a full fp32 accumulator. So zero2
        and zero3 hold the zero1 peak: only the fp32 master weights and moments are sharded."""
        p, n = self.model.total_params, self.cluster.num_gpus
        w, g, o = 2.0, 4.0, 12.0
        if self.optimizer_sharding != "none":
            o /= n
        return p * (w + g + o)

    def step_collectives(self) -> dict[str, float]:
        """Bytes one rank sends in the world-wide collectives of a step under
        runtime/sharding.py: `none` all-reduces the fp32 gradients (ring, 2 (N-1)/N x 4 B per
        parameter; Thakur et al. 2005); the sharded modes all-gather the bf16 weights once
        ((N-1)/N x 2 B) and reduce-scatter the fp32 gradients ((N-1)/N x 4 B). The step time
        charges them in `grad_sync_time` as an all-reduce of `grad_reduce_bytes_per_param`,
        which by default is `runtime_reduce_bytes(mode)`: exactly these bytes."""
        p, n = self.model.total_params, self.cluster.num_gpus
        share = (n - 1) / n
        if self.optimizer_sharding == "none":
            return {"grad_all_reduce": 2 * share * 4.0 * p}
        return {"param_all_gather": share * 2.0 * p, "grad_reduce_scatter": share * 4.0 * p}

    def fixed_bytes(self) -> float:
        return self.model_state_bytes() + self.coeffs.reserved_bytes

    def _act_bytes(self, d, kind: str):
        """Saved bytes per local token per layer: the coefficient, plus under cp the
        gathered K/V of the other members (cp_cost.extra_act_bytes)."""
        act = self.coeffs.act_bytes_per_token_layer
        if kind == "ulysses":
            return act
        cp_cost.check_kind(self.model, kind)
        return act + cp_cost.extra_act_bytes(self.model, d)

    def memory(self, tokens, d, recompute_layers=0, kind="ulysses"):
        """Peak bytes on each member of a degree-d group (elementwise over tokens, d, r)."""
        co, L = self.coeffs, self.model.num_layers
        r = np.asarray(recompute_layers, dtype=float)
        act = self._act_bytes(d, kind)
        per_token = (
            (L - r) * act + r * co.ckpt_bytes_per_token_layer + act + co.head_bytes_per_token
        )
        return self.fixed_bytes() + np.asarray(tokens, dtype=float) / d * per_token

    def capacity(self, start: int = 0, degree: int = 1) -> float:
        return self.cluster.group_memory(start, degree) * self.usable_memory_fraction

    def min_recompute(self, tokens, d, capacity=None, kind="ulysses"):
        """Fewest recomputed layers that fit; -1 where even r = L does not fit. Elementwise:
        tokens (n,) with a column of degrees and their capacities (D, 1) give (D, n)."""
        cap = self.capacity() if capacity is None else capacity
        co, L = self.coeffs, self.model.num_layers
        t = np.asarray(tokens, dtype=float) / d
        room = cap - self.fixed_bytes()
        act = self._act_bytes(d, kind)
        base = t * ((L + 1) * act + co.head_bytes_per_token)
        saved_per_layer = t * (act - co.ckpt_bytes_per_token_layer)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.ceil((base - room) / np.maximum(saved_per_layer, 1e-30) - 1e-9)
        r = np.maximum(need, 0)  # np.clip costs more per call
        return np.where((r <= L) & (room > 0), r, -1).astype(int)

    # ---- whole step --------------------------------------------------------------------
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
        if "closing" not in self._cache:  # simulate asks once per plan
            one = np.ones((1, self.num_features))  # Q = T = S = 1: one token
            speed = self.cluster.group_speed(0, self.cluster.num_gpus)
            # time_parts, so a subclass that reprices micro-batches (recalibrate) reprices it
            c, r, m = self.time_parts(one, 1, 0, speed=speed)  # degree 1: m = 0
            self._cache["closing"] = float(c[0] + r[0] + m[0])
        return self._cache["closing"]

    def grad_sync_time(self) -> float:
        """Seconds every step pays after the plan's last phase: the world collectives as a
        ring all-reduce of `grad_reduce_bytes_per_param` (2 (N-1)/N * bytes / bandwidth,
        Thakur et al. 2005; by default the bytes runtime/sharding.py sends under the mode,
        step_collectives), at the NIC rate across nodes, + the closing micro-step of the
        sharded modes (closing_step_time) + `step_overhead_s`."""
        c = self.cluster
        n = c.num_gpus
        if n == 1:
            return self.step_overhead_s + self.closing_step_time()
        bw = c.inter_node_bw if c.num_nodes > 1 else c.intra_node_bw
        volume = self.model.total_params * self.grad_reduce_bytes_per_param
        if c.topology is not None:  # the ring's most loaded link (dcp_opt/topology/comm.py)
            from .topology.comm import ring_bottleneck

            load, bw = ring_bottleneck(c.topology)
            volume = volume * load
        return 2 * (n - 1) / n * volume / bw + self.step_overhead_s + self.closing_step_time()

    def check_fits(self, batch: Batch) -> None:
        """Raise InfeasibleError naming the first sequence that fits nowhere."""
        dmax = max(self.cluster.allowed_degrees)
        cap = max(self.capacity(s, dmax) for s in self.cluster.placements(dmax))
        tokens = self.batch_features(batch)[:, -2]
        bad = np.flatnonzero(self.min_recompute(tokens, dmax, cap) < 0)
        if len(bad):
            s = batch.sequences[int(bad[0])]
            need = float(self.memory(s.num_tokens, dmax, self.model.num_layers))
            raise InfeasibleError(
                f"sequence {s.id} (shape {s.shape}, {s.num_tokens} tokens) cannot fit: needs "
                f"{need / GB:.1f} GB per GPU at the largest degree {dmax} with all "
                f"{self.model.num_layers} layers recomputed; capacity {cap / GB:.1f} GB",
                sequence_id=s.id,
                need_bytes=need,
                capacity_bytes=cap,
            )

    def fingerprint(self) -> str:
        payload = {
            "model": self.model.to_dict(),
            "cluster": self.cluster.fingerprint_dict(),  # to_dict(), a topology as its digest
            "coeffs": self.coeffs.to_dict(),
            "sharding": self.optimizer_sharding,
            "mem_frac": self.usable_memory_fraction,
            "grad": self.grad_reduce_bytes_per_param,
        }
        # the measured-profile knobs only when set: a preset model's fingerprint is unchanged
        if self.sp_compute_overhead:
            payload["sp_overhead"] = [list(p) for p in self.sp_compute_overhead]
        if self.replicated_seq_s:
            payload["replicated_seq_s"] = self.replicated_seq_s
        if self.step_overhead_s:
            payload["step_overhead_s"] = self.step_overhead_s
        if self.closing_step_s is not None:  # the default follows the coefficients
            payload["closing_step_s"] = self.closing_step_s
        if self.sp_kinds != ("ulysses",):  # plans for cp-capable planners differ
            payload["sp_kinds"] = list(self.sp_kinds)
        if self.cp_comm:
            payload["cp_comm"] = [list(astuple(m)) for m in self.cp_comm]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def plan_fingerprint(batch: Batch, cost: CostModel) -> str:
    """What a plan was made for: the batch and the cost model (which holds cluster and model)."""
    return combine_fingerprints(batch.fingerprint(), cost.fingerprint())


def combine_fingerprints(batch_fingerprint: str, cost_fingerprint: str) -> str:
    return hashlib.sha256((batch_fingerprint + cost_fingerprint).encode()).hexdigest()[:16]


def runtime_reduce_bytes(mode: str) -> float:
    """`grad_reduce_bytes_per_param` that makes `grad_sync_time` (a ring all-reduce, 2 (N-1)/N
    x bytes) equal the step's collectives under runtime/sharding.py: an fp32 all-reduce for
    `none` (4 B), all-gather 2 B + reduce-scatter 4 B for the sharded modes (3 B)."""
    if mode not in SHARDING_MODES:
        raise DcpOptError(
            f"optimizer_sharding: {mode!r} not allowed; allowed: {list(SHARDING_MODES)}"
        )
    return 4.0 if mode == "none" else 3.0


def loss_normalizer(batch: Batch, kind: str) -> float:
    return float(batch.num_tokens if kind == "tokens" else len(batch))


def default_normalizer_kind(model: ModelSpec) -> str:
    """Language models average the loss over tokens, diffusion models over samples."""
    return "tokens" if model.kind == "1d" else "samples"
