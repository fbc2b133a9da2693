"""CostModel: the frozen data a plan is priced on (model, cluster, coefficients, mode,
knobs), its checks, memo and fingerprint. What it charges is in the mixins beside it:
features.py, compute.py, comm.py, memory.py (formulas in the package docstring); phase.py
asks them for one phase at once."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, fields, replace
from typing import TypeVar

from ..batch import Batch
from ..cluster import Cluster
from ..errors import DcpOptError, is_real
from ..model import ModelSpec
from . import cp as cp_cost
from . import ring as ring_cost
from . import zero3
from .coeffs import CostCoefficients, check_coefficients, flops_coefficients
from .comm import Comm, runtime_reduce_bytes
from .compute import Compute
from .features import Features
from .finite import check_cost_scale
from .memo import MemoCache
from .memory import SHARDING_MODES, Memory
from .phase import PhaseCosts, phase_costs
from .units import check_tensor_parallel, unit_cluster, unit_coefficients

T = TypeVar("T")
_MISS = object()  # memoised(): None may be a value


@dataclass(frozen=True)
class CostModel(Features, Compute, Comm, Memory):
    """Time and memory of micro-batches on a cluster, for one model.

    `optimizer_sharding`: model states per GPU follow mixed-precision Adam (Rajbhandari et al.
    2020, ZeRO, sec. 3): bf16 weights 2 B, fp32 gradient accumulator 4 B, fp32 master weights
    and two moments 12 B per parameter; zero1 shards the 12 B over the whole world (as VideoSys'
    ZeRO-1 does). zero2 and zero3 hold the same peak under the runtime's schedule, which
    reduces the world once per step (model_state_bytes). That schedule gathers the parameters
    once per step, so no mode, zero3 included, needs aligned micro-step counts: a plan from
    any planner runs as made. The step time charges the mode's world collectives and, in the
    sharded modes, the closing one-token micro-step (grad_sync_time, closing_step_time).
    `shard_domain` > 0 (zero3 only) is ZeRO-3 per layer over aligned blocks of units, which
    does need aligned counts inside a domain (zero3.py; simulate pads); `tensor_parallel` t
    makes units of t GPUs the planner's ranks (units.py).
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
    # or "ring" the per-degree tables (table.py) and bounds take the least over the kinds,
    # and greedy and cpsat choose each group's kind. Every figure of a given kind is the same
    # either way.
    sp_kinds: tuple[str, ...] = ("ulysses",)
    # cp's collectives as a profile measured them (cp_cost.CPMeasurement per group size;
    # empty: the cluster's rates). Used by cp groups inside a node (cp_cost, Measured rates).
    cp_comm: tuple = ()
    # the ring's P2P step as a profile measured it (ring_cost.RingMeasurement per group size;
    # empty: the cluster's rates). Used by ring groups inside a node (dcp_opt/cost/ring.py).
    ring_comm: tuple = ()
    # Tensor parallelism (cost/units.py): units of this many GPUs of one node are the
    # planner's ranks; `cluster` and `coeffs` then read as the units' (the GPUs' are kept in
    # gpu_cluster, gpu_coeffs). 1: a unit is a GPU, every figure as before.
    tensor_parallel: int = 1
    # ZeRO-3 per layer over aligned blocks of this many units (cost/zero3.py); 0: the mode's
    # step-level schedule. Needs optimizer_sharding "zero3".
    shard_domain: int = 0
    gpu_cluster: Cluster = field(default=None, init=False, compare=False, repr=False)
    gpu_coeffs: CostCoefficients = field(default=None, init=False, compare=False, repr=False)
    _cache: dict = field(default_factory=MemoCache, compare=False, hash=False, repr=False)
    # Whether grad_reduce_bytes_per_param was left to the mode (set in __post_init__)
    _reduce_follows_mode: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.coeffs is None:
            object.__setattr__(self, "coeffs", flops_coefficients(self.model, self.cluster))
            try:  # derived: what is wrong is the cluster's peak (or the model's size)
                check_coefficients(self.coeffs)
            except DcpOptError as e:
                raise DcpOptError(
                    f"cluster.peak_flops: {self.cluster.peak_flops!r} FLOP/s gives FLOP-derived "
                    f"coefficients no float64 holds ({e})"
                ) from None
        check_coefficients(self.coeffs)
        self._make_units()
        if self.optimizer_sharding not in SHARDING_MODES:
            raise DcpOptError(
                f"optimizer_sharding: {self.optimizer_sharding!r} not allowed; "
                f"allowed: {list(SHARDING_MODES)}"
            )
        if not (is_real(self.usable_memory_fraction) and 0 < self.usable_memory_fraction <= 1):
            raise DcpOptError(
                f"usable_memory_fraction: must be in (0, 1], got {self.usable_memory_fraction}"
            )
        zero3.check_shard_domain(self.shard_domain, self.optimizer_sharding, self.cluster)
        self._resolve_reduce_bytes()
        self._check_knobs()
        self._check_sp_kinds()
        object.__setattr__(self, "cp_comm", cp_cost.check_measurements(self.cp_comm))
        object.__setattr__(self, "ring_comm", ring_cost.check_measurements(self.ring_comm))
        missing = set(self.model.block_types) - set(self.coeffs.blocks)
        if missing:
            raise DcpOptError(
                f"cost coefficients: no entry for block types {sorted(missing)} "
                f"of model {self.model.name!r}"
            )
        check_cost_scale(self)  # every product of finite inputs finite (cost/finite.py)

    def _make_units(self) -> None:
        """Keep the GPUs' cluster and coefficients; under tensor_parallel t > 1 read the
        cluster and coefficients as the units' (cost/units.py)."""
        t = self.tensor_parallel
        check_tensor_parallel(t, self.model, self.cluster)
        object.__setattr__(self, "gpu_cluster", self.cluster)
        object.__setattr__(self, "gpu_coeffs", self.coeffs)
        if t > 1:
            object.__setattr__(self, "cluster", unit_cluster(self.cluster, t, self.model))
            object.__setattr__(self, "coeffs", unit_coefficients(self.coeffs, t))

    def _resolve_reduce_bytes(self) -> None:
        """grad_reduce_bytes_per_param: None follows the mode; a number is checked."""
        v = self.grad_reduce_bytes_per_param
        follows = v is None
        if follows:
            v = runtime_reduce_bytes(self.optimizer_sharding)
        elif not is_real(v) or v < 0:
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
            if not (is_real(v) and v >= 0):  # no bool, no nan
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
        for k in kinds:
            cp_cost.check_kind(self.model, k)  # cp and ring: 1D models only
        object.__setattr__(self, "sp_kinds", tuple(k for k in cp_cost.SP_KINDS if k in kinds))

    def with_(self, **changes) -> CostModel:
        """A copy with `changes`. A sync volume left to the mode keeps following it (a copy
        with another optimizer_sharding charges that mode's collectives)."""
        if self._reduce_follows_mode:
            changes.setdefault("grad_reduce_bytes_per_param", None)
        changes.setdefault("cluster", self.gpu_cluster)  # the GPUs', not the units'
        changes.setdefault("coeffs", self.gpu_coeffs)
        return replace(self, _cache=MemoCache(), **changes)

    def memoised(self, key, make: Callable[[], T]) -> T:
        """make()'s value for `key`, memoised on this cost model (MemoCache: pure functions of
        the cost model and a batch; bounded). The value is kept in a local: another thread
        (AsyncPlanner) may evict the entry between its write and a second read."""
        found = self._cache.get(key, _MISS)
        if found is _MISS:
            found = self._cache[key] = make()
        return found

    def recall(self, key):
        """What `remember` last put under `key` on this cost model, or None (evicted, or never
        kept). For answers that depend on more than (cost model, batch): the caller keeps what
        it was computed from in the value and checks it."""
        return self._cache.get(key)

    def remember(self, key, value) -> None:
        self._cache[key] = value

    def init_fields(self) -> dict:
        """Every field this cost model was built from, the memo excluded, with a sync volume
        left to the mode as None (so a copy built from them keeps following the mode)."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(CostModel)
            if f.init and f.name != "_cache"
        }
        if self._reduce_follows_mode:
            out["grad_reduce_bytes_per_param"] = None
        out["cluster"], out["coeffs"] = self.gpu_cluster, self.gpu_coeffs
        return out

    def phase_costs(self, groups, batch: Batch) -> PhaseCosts:
        """Every micro-batch's time parts and memory for one phase's groups (phase.py)."""
        return phase_costs(self, groups, batch)

    def fingerprint(self) -> str:
        payload = {
            "model": self.model.to_dict(),
            # to_dict(), a topology as its digest; the GPUs' (tensor_parallel is below)
            "cluster": self.gpu_cluster.fingerprint_dict(),
            "coeffs": self.gpu_coeffs.to_dict(),
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
        if self.ring_comm:
            payload["ring_comm"] = [list(astuple(m)) for m in self.ring_comm]
        if self.tensor_parallel != 1:
            payload["tensor_parallel"] = self.tensor_parallel
        if self.shard_domain:
            payload["shard_domain"] = self.shard_domain
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def plan_fingerprint(batch: Batch, cost: CostModel) -> str:
    """What a plan was made for: the batch and the cost model (which holds cluster and model)."""
    return combine_fingerprints(batch.fingerprint(), cost.fingerprint())


def combine_fingerprints(batch_fingerprint: str, cost_fingerprint: str) -> str:
    return hashlib.sha256((batch_fingerprint + cost_fingerprint).encode()).hexdigest()[:16]


def loss_normalizer(batch: Batch, kind: str) -> float:
    return float(batch.num_tokens if kind == "tokens" else len(batch))


def default_normalizer_kind(model: ModelSpec) -> str:
    """Language models average the loss over tokens, diffusion models over samples."""
    return "tokens" if model.kind == "1d" else "samples"
