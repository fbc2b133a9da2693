"""Profile files: measured cost coefficients as versioned JSON, and the CostModel built from them.

A profile records what was measured (device, date, torch version, thread count), for which
model (a fingerprint of everything that decides one layer's cost: depth is extrapolated, so
`num_layers` is not part of it), the fitted `CostCoefficients`, the fit report, and optionally
the all-to-all bandwidth measured per group size and (schema 2) cp's all-gather and
reduce-scatter per group size (`cp`) and the ring's P2P step per group size (`ring`); a
profile without either is written as schema 1, as before. Loading checks every field and names the one at fault, so a stale or hand-edited file
fails loudly instead of planning with nonsense.

    profile = load_profile("tiny-lm.profile.json", model=spec)   # -> Profile
    cost = cost_model_from_profile("tiny-lm.profile.json", spec, cluster)

This module is torch-free (core).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .cluster import Cluster
from .cost import BlockCoeffs, CostCoefficients, CostModel, TermCoeffs
from .cost.cp import CPMeasurement
from .cost.ring import RingMeasurement
from .errors import DcpOptError, is_real, loads_json, read_text, short_repr
from .model import ModelSpec

PROFILE_SCHEMA_VERSION = 2  # 2: the optional `cp` and `ring` measurements
READS_SCHEMA_VERSIONS = (1, 2)  # a version-1 profile is a version 2 without `cp` and `ring`
PROFILE_KIND = "dcp_opt.profile"
# What decides one layer's cost; name, depth and parameter count do not.
_LAYER_FIELDS = (
    "kind",
    "hidden",
    "num_heads",
    "ffn_hidden",
    "vocab_size",
    "text_tokens",
    "gated_mlp",
    "causal",
    "dtype_bytes",
)
_TERM_FIELDS = tuple(f.name for f in fields(TermCoeffs))


# Every number of a profile (seconds, bytes, bytes/s, counts) is at most this: 1e15 seconds or
# bytes per unit is no measurement, and a coefficient of 1e308 overflowed the step times to
# inf/NaN (greedy then failed or ran for ever; fuzz, issue 29).
MAX_NUMBER = 1e15


class ProfileError(DcpOptError):
    """A profile file that cannot be used: unreadable, malformed, or for another model."""


def layer_fingerprint(model: ModelSpec) -> str:
    """Hash of the fields that decide one layer's time and memory (not depth, not name)."""
    payload = {k: getattr(model, k) for k in _LAYER_FIELDS}
    if model.num_kv_heads is not None:  # absent for multi-head models: their hashes stay
        payload["num_kv_heads"] = model.num_kv_heads
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class A2AMeasurement:
    """All-to-all of one group size: time = latency_s + bytes_sent_per_rank / bandwidth."""

    group_size: int
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class RuntimeCalibration:
    """What a short real run of the runtime measured on top of the isolated block profile.

    Synthetic micro-batches (not a workload's) run through the runtime's executor with all
    `world` ranks busy, as in training. Fitted in the cost model's own form:

    - degree 1: measured = compute_factor * predicted + microbatch_overhead_s, where
      `predicted` is the isolated profile's micro-batch time (blocks x depth + head +
      constant). `compute_factor` holds what one block alone on an idle device does not see:
      the other ranks' load on shared caches / memory bandwidth / host, and a deep stack's
      activations leaving the cache; `microbatch_overhead_s` the framework's per-micro-batch
      work outside blocks and head (packing, sharding, loss weighting, hooks).
    - degree d > 1: the rest, measured - (calibrated compute), is the all-to-all as the runtime
      pays it (transfer, waiting for the slowest member, padding, copies), fitted as the cost
      model charges it: per layer, bytes / bandwidth + calls * latency * (d - 1).
    - per step: `grad_sync_s`, the executor's gradient sum (buckets, copies, all-reduce) plus
      the step's time outside micro-batches, at this world size.

    The cost model's measured-profile knobs (CostModel; optional, absent from the JSON when
    not measured, so an older calibration loads and re-saves unchanged):

    - `sp_compute_overhead` ((degree, x), ...): at degree d > 1 a layer's time is (1 + x) times
      its FLOP share; fitted jointly with the all-to-all from the degree > 1 samples
      (runtime/profile/fit.py: the all-to-all bytes are the cost model's, so the rest of the
      time separates by its shape over the micro-batches).
    - `replicated_seq_s_per_layer`: per-sample seconds of one layer's forward + backward that
      every member of a group repeats (CostModel.replicated_seq_s / num_layers: stored per
      layer so a profile serves any depth). It is part of the per-sample work the isolated
      profile measured at degree 1, so `apply` moves it out of the blocks' `seq` terms.
    - `step_overhead_s`: the part of `grad_sync_s` outside the executor's gradient sum
      (optimizer, bookkeeping): CostModel.step_overhead_s, paid at any world size.
    """

    world: int
    compute_factor: float
    microbatch_overhead_s: float
    a2a_bandwidth_bytes_per_s: float | None
    a2a_latency_s: float | None
    grad_sync_s: float
    fit: dict[str, Any] = field(default_factory=dict)
    samples: tuple[dict, ...] = ()
    date: str = ""
    sp_compute_overhead: tuple[tuple[int, float], ...] = ()
    replicated_seq_s_per_layer: float = 0.0
    step_overhead_s: float = 0.0

    def to_dict(self) -> dict:
        d = {**asdict(self), "samples": list(self.samples)}
        d["sp_compute_overhead"] = [list(p) for p in self.sp_compute_overhead]
        for k in _KNOB_FIELDS:  # only when measured: an older calibration re-saves unchanged
            if not d[k]:
                del d[k]
        return d

    def apply(self, coeffs: CostCoefficients) -> CostCoefficients:
        """`coeffs` (the isolated profile's) with the in-situ factor and overhead applied."""
        k = self.compute_factor
        # the replicated per-sample work leaves the seq terms (the knob charges it), each
        # pass its share as CostModel charges it (1/3 forward, 2/3 backward), spread over the
        # blocks in proportion to their seq terms
        keep = {
            part: _seq_keep(coeffs, part, k, self.replicated_seq_s_per_layer * share)
            for part, share in (("fwd", 1 / 3), ("bwd", 2 / 3))
        }

        def scale(t: TermCoeffs, part: str) -> TermCoeffs:
            return TermCoeffs(
                *(k * getattr(t, f) * (keep[part] if f == "seq" else 1.0) for f in _TERM_FIELDS)
            )

        return replace(
            coeffs,
            blocks={
                n: BlockCoeffs(scale(b.fwd, "fwd"), scale(b.bwd, "bwd"))
                for n, b in coeffs.blocks.items()
            },
            head_fwd_per_token_s=k * coeffs.head_fwd_per_token_s,
            head_bwd_per_token_s=k * coeffs.head_bwd_per_token_s,
            microbatch_overhead_s=k * coeffs.microbatch_overhead_s + self.microbatch_overhead_s,
            source=f"{coeffs.source}+runtime[{self.world}]",
        )

    def grad_reduce_bytes_per_param(self, model: ModelSpec, cluster: Cluster) -> float:
        """Bytes per parameter that make CostModel.grad_sync_time() (a ring all-reduce,
        2 (N-1)/N * bytes / bandwidth) equal the measured in-situ gradient sum."""
        n = cluster.num_gpus
        bw = cluster.inter_node_bw if cluster.num_nodes > 1 else cluster.intra_node_bw
        if n < 2:
            return 0.0
        sync = max(self.grad_sync_s - self.step_overhead_s, 0.0)  # the knob charges the rest
        return sync * bw / (2 * (n - 1) / n * model.total_params)

    def cost_knobs(self, model: ModelSpec, cluster: Cluster) -> dict:
        """CostModel knobs of this calibration for `model` (any depth) on `cluster`: the SP
        overhead of the cluster's degrees that were measured (others pay none)."""
        allowed = set(cluster.allowed_degrees)
        return {
            "sp_compute_overhead": tuple(
                (d, x) for d, x in self.sp_compute_overhead if d in allowed and x > 0
            ),
            "replicated_seq_s": self.replicated_seq_s_per_layer * model.num_layers,
            "step_overhead_s": self.step_overhead_s,
        }


_KNOB_FIELDS = ("sp_compute_overhead", "replicated_seq_s_per_layer", "step_overhead_s")


def _seq_keep(coeffs: CostCoefficients, part: str, k: float, seconds: float) -> float:
    """Share of the blocks' `part` seq terms (times k) left after taking `seconds` out."""
    total = k * sum(getattr(b, part).seq for b in coeffs.blocks.values())
    if seconds <= 0:
        return 1.0
    if seconds > total * (1 + 1e-9):
        raise ProfileError(
            f"profile.runtime.replicated_seq_s_per_layer: {part} share {seconds:.3g} s exceeds "
            f"the profile's per-sample {part} time {total:.3g} s per layer"
        )
    return max(1.0 - seconds / total, 0.0)


@dataclass(frozen=True)
class Profile:
    coefficients: CostCoefficients
    model: ModelSpec
    device: dict[str, Any]
    date: str
    fit: dict[str, Any] = field(default_factory=dict)
    a2a: tuple[A2AMeasurement, ...] = ()
    method: dict[str, Any] = field(default_factory=dict)
    runtime: RuntimeCalibration | None = None
    schema_version: int = PROFILE_SCHEMA_VERSION
    cp: tuple[CPMeasurement, ...] = ()
    ring: tuple[RingMeasurement, ...] = ()

    @property
    def model_fingerprint(self) -> str:
        return layer_fingerprint(self.model)

    def to_dict(self) -> dict:
        return {
            # the lowest version that holds it: a profile without cp and ring stays version 1
            "schema_version": PROFILE_SCHEMA_VERSION if self.cp or self.ring else 1,
            "kind": PROFILE_KIND,
            "device": self.device,
            "date": self.date,
            "model": self.model.to_dict(),
            "model_fingerprint": self.model_fingerprint,
            "coefficients": self.coefficients.to_dict(),
            "fit": self.fit,
            "a2a": [asdict(a) for a in self.a2a],
            **({"cp": [asdict(m) for m in self.cp]} if self.cp else {}),
            **({"ring": [asdict(m) for m in self.ring]} if self.ring else {}),
            "method": self.method,
            **({} if self.runtime is None else {"runtime": self.runtime.to_dict()}),
        }


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def save_profile(profile: Profile, path: str | Path, *, force: bool = False) -> Path:
    """Write `profile` as JSON; refuse to replace an existing file unless `force`."""
    p = Path(path)
    if p.exists() and not force:
        raise ProfileError(f"profile {str(p)!r}: exists; pass force=True (--force) to overwrite")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1, sort_keys=True) + "\n")
    tmp.replace(p)  # atomic: a crash never leaves half a profile
    return p


def load_profile(path: str | Path, *, model: ModelSpec | None = None) -> Profile:
    """Read and check a profile; with `model`, also check it was measured for that model."""
    p = Path(path)
    text = read_text(p, f"profile {str(p)!r}", ProfileError)
    prof = profile_from_dict(loads_json(text, f"profile {p.name}", ProfileError))
    if model is not None:
        check_profile_matches(prof, model)
    return prof


def profile_from_dict(d: Any) -> Profile:
    if not isinstance(d, dict):
        raise ProfileError(f"profile: expected a JSON object, got {type(d).__name__}")
    version = _get(d, "schema_version", int, "profile")
    if version not in READS_SCHEMA_VERSIONS:
        raise ProfileError(
            f"profile.schema_version: {version} not supported; "
            f"this dcp_opt reads {list(READS_SCHEMA_VERSIONS)}"
        )
    kind = _get(d, "kind", str, "profile")
    if kind != PROFILE_KIND:
        raise ProfileError(f"profile.kind: expected {PROFILE_KIND!r}, got {kind!r}")
    try:
        model = ModelSpec.from_dict(_get(d, "model", dict, "profile"))
    except DcpOptError as e:
        raise ProfileError(f"profile.model: {e}") from None
    stored = _get(d, "model_fingerprint", str, "profile")
    if stored != layer_fingerprint(model):
        raise ProfileError(
            f"profile.model_fingerprint: {stored!r} does not match the file's own model "
            f"({layer_fingerprint(model)!r}); the file was edited by hand or is corrupt"
        )
    coeffs = _parse_coefficients(_get(d, "coefficients", dict, "profile"), model)
    runtime = _parse_runtime(d["runtime"]) if "runtime" in d else None
    if runtime is not None:
        runtime.apply(coeffs)  # its replicated work must fit in the profile's per-sample time
    return Profile(
        coefficients=coeffs,
        model=model,
        device=_get(d, "device", dict, "profile"),
        date=_get(d, "date", str, "profile"),
        fit=d.get("fit", {}) if isinstance(d.get("fit", {}), dict) else {},
        a2a=_parse_a2a(d.get("a2a", [])),
        cp=_parse_cp(d.get("cp", [])),
        ring=_parse_ring(d.get("ring", [])),
        method=d.get("method", {}) if isinstance(d.get("method", {}), dict) else {},
        runtime=runtime,
    )


def check_profile_matches(profile: Profile, model: ModelSpec) -> None:
    """Raise ProfileError unless the profile's layer shape is `model`'s."""
    if profile.model_fingerprint == layer_fingerprint(model):
        return
    diffs = [
        f"{k}: profile {getattr(profile.model, k)!r} vs model {getattr(model, k)!r}"
        for k in _LAYER_FIELDS
        if getattr(profile.model, k) != getattr(model, k)
    ]
    raise ProfileError(
        f"profile.model_fingerprint: measured for model {profile.model.name!r}, whose layers "
        f"differ from {model.name!r} ({'; '.join(diffs)}); profile this model instead"
    )


def cost_model_from_profile(
    path: str | Path,
    model: ModelSpec,
    cluster: Cluster,
    *,
    use_measured_a2a: bool = False,
    use_runtime_calibration: bool = True,
    **cost_kw,
) -> CostModel:
    """`CostModel.from_profile`: a CostModel whose coefficients come from a profile file.

    With `use_measured_a2a`, the cluster's intra-node bandwidth and per-peer latency are
    replaced by the profile's all-to-all measurement of its largest group size, or, when the
    profile has a runtime calibration with an in-situ all-to-all fit, by that fit; and cp
    groups inside a node pay the profile's measured all-gather and reduce-scatter
    (`CostModel.cp_comm`, dcp_opt/cost/cp.py) when it has them (else the rates above), ring
    groups inside a node its measured P2P step (`CostModel.ring_comm`, dcp_opt/cost/ring.py).
    A runtime calibration (`Profile.runtime`) is applied unless `use_runtime_calibration`
    is False; when the cluster has the calibrated world size and `grad_reduce_bytes_per_param`
    is not given, the gradient sync is set to the measured one. The calibration's knobs
    (SP overhead per measured degree, replicated per-sample work at the model's depth, the
    per-step overhead) are set unless given in `cost_kw`.
    """
    prof = load_profile(path, model=model)
    cal = prof.runtime if use_runtime_calibration else None
    coeffs = prof.coefficients if cal is None else cal.apply(prof.coefficients)
    if use_measured_a2a and cal is not None and cal.a2a_bandwidth_bytes_per_s:
        cluster = cluster.with_(
            intra_node_bw=cal.a2a_bandwidth_bytes_per_s,
            intra_node_latency_s=cal.a2a_latency_s or 0.0,
        )
    elif use_measured_a2a and prof.a2a:
        a = max(prof.a2a, key=lambda m: m.group_size)
        # CostModel charges latency per peer, (d - 1) per call; the measurement is per call.
        cluster = cluster.with_(
            intra_node_bw=a.bandwidth_bytes_per_s,
            intra_node_latency_s=a.latency_s / (a.group_size - 1),
        )
    if use_measured_a2a and prof.cp:
        cost_kw.setdefault("cp_comm", prof.cp)
    if use_measured_a2a and prof.ring:
        cost_kw.setdefault("ring_comm", prof.ring)
    if cal is not None and cluster.num_gpus == cal.world:
        cost_kw.setdefault(
            "grad_reduce_bytes_per_param", cal.grad_reduce_bytes_per_param(model, cluster)
        )
    if cal is not None:  # the measured knobs (all 0 for a calibration without them)
        for k, v in cal.cost_knobs(model, cluster).items():
            cost_kw.setdefault(k, v)
    return CostModel(model, cluster, coeffs, **cost_kw)


# ---- the device a profile was measured on, against the cluster it plans for --------------------
# GPU families as device names and preset names spell them (NVIDIA H200 -> h200x32).
_GPU_FAMILY = re.compile(
    r"(?<![a-z0-9])(gb200|b200|b100|h200|h100|h800|a100|a800|l40s?|v100)", re.I
)


def device_mismatch(profile: Profile, cluster: Cluster) -> str | None:
    """Why a profile's timings may not be this cluster's, or None: measured on a CPU (or
    another non-CUDA device) for a cluster of GPUs, or on a GPU family other than the one
    the cluster's name gives (an H100 profile planned on `h200x32`). The profile's step
    times are its device's; the cluster only scales memory and communication."""
    dev = profile.device if isinstance(profile.device, dict) else {}
    kind, name = str(dev.get("type", "")).lower(), str(dev.get("name", ""))
    gpus = f"{cluster.name!r} ({cluster.num_gpus} GPUs of {cluster.peak_flops / 1e12:.0f} TFLOP/s)"
    if kind and kind != "cuda" and cluster.peak_flops >= 1e14:
        return (
            f"the profile was measured on {kind} ({name or 'unknown'}), not on a GPU, but plans "
            f"for {gpus}: its step times are the {kind}'s; profile on the cluster's GPU"
        )
    found, want = _GPU_FAMILY.search(name), _GPU_FAMILY.search(cluster.name)
    if kind == "cuda" and found and want and found.group(1).lower() != want.group(1).lower():
        return (
            f"the profile was measured on {name} but plans for {gpus}: its step times are "
            f"the {found.group(1).upper()}'s, not the {want.group(1).upper()}'s"
        )
    return None


# ---- parsing helpers ----------------------------------------------------------------------
def _get(d: dict, key: str, typ, where: str):
    if key not in d:
        raise ProfileError(f"{where}.{key}: missing")
    v = d[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
        raise ProfileError(f"{where}.{key}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _number(d: dict, key: str, where: str, *, integer: bool = False) -> float:
    if key not in d:
        raise ProfileError(f"{where}.{key}: missing")
    v = d[key]
    # is_real: no bool, no NaN, no integer past float range (a 400-digit number); an
    # integer field takes integers only (2.0 is not 2)
    ok = (isinstance(v, int) and not isinstance(v, bool) and v < 2**31) if integer else is_real(v)
    if not ok or not 0 <= v <= MAX_NUMBER:
        want = (
            "an integer >= 0 (below 2**31)"
            if integer
            else f"a finite number >= 0 (at most {MAX_NUMBER:g})"
        )
        raise ProfileError(f"{where}.{key}: must be {want}, got {short_repr(v)}")
    return int(v) if integer else float(v)


def _parse_terms(d: Any, where: str) -> TermCoeffs:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected an object, got {type(d).__name__}")
    extra = sorted(set(d) - set(_TERM_FIELDS))
    if extra:
        raise ProfileError(f"{where}: unknown fields {extra}; allowed: {list(_TERM_FIELDS)}")
    return TermCoeffs(**{k: _number(d, k, where) for k in _TERM_FIELDS})


def _parse_coefficients(d: dict, model: ModelSpec) -> CostCoefficients:
    where = "profile.coefficients"
    blocks = _get(d, "blocks", dict, where)
    missing = [b for b in model.block_types if b not in blocks]
    if missing:
        raise ProfileError(
            f"{where}.blocks: no entry for block types {missing} of a {model.kind} model; "
            f"found {sorted(blocks)}"
        )
    parsed = {}
    for name in model.block_types:
        b = blocks[name]
        bw = f"{where}.blocks.{name}"
        if not isinstance(b, dict):
            raise ProfileError(f"{bw}: expected an object, got {type(b).__name__}")
        parsed[name] = BlockCoeffs(
            _parse_terms(b.get("fwd"), f"{bw}.fwd"), _parse_terms(b.get("bwd"), f"{bw}.bwd")
        )
    scalars = {
        f.name: _number(d, f.name, where, integer=f.name == "a2a_calls_per_layer")
        for f in fields(CostCoefficients)
        if f.name not in ("blocks", "source")
    }
    if not any(
        getattr(t, f) for b in parsed.values() for t in (b.fwd, b.bwd) for f in _TERM_FIELDS
    ):
        raise ProfileError(
            f"{where}.blocks: every time coefficient is 0, so every step would take no time; "
            "the fit measured nothing (re-run `dcp-opt profile`)"
        )
    source = d.get("source", "profile")
    return CostCoefficients(blocks=parsed, source=str(source), **scalars)


def _objects(items: Any, key: str):
    """(where, object) for each entry of the profile's list `key`; anything else is an error
    naming the field."""
    if not isinstance(items, list):
        raise ProfileError(f"profile.{key}: expected a list, got {type(items).__name__}")
    for i, a in enumerate(items):
        where = f"profile.{key}[{i}]"
        if not isinstance(a, dict):
            raise ProfileError(f"{where}: expected an object, got {type(a).__name__}")
        yield where, a


def _parse_a2a(items: Any) -> tuple[A2AMeasurement, ...]:
    out = []
    for where, a in _objects(items, "a2a"):
        size = _number(a, "group_size", where, integer=True)
        bw = _number(a, "bandwidth_bytes_per_s", where)
        if size < 2 or bw <= 0:
            raise ProfileError(f"{where}: needs group_size >= 2 and bandwidth > 0, got {a}")
        out.append(A2AMeasurement(size, bw, _number(a, "latency_s", where)))
    return tuple(out)


def _parse_cp(items: Any) -> tuple[CPMeasurement, ...]:
    out = []
    for where, a in _objects(items, "cp"):
        vals = {f.name: _number(a, f.name, where, integer=f.name == "group_size")
                for f in fields(CPMeasurement)}  # fmt: skip
        bws = [v for k, v in vals.items() if k.endswith("bandwidth_bytes_per_s")]
        if vals["group_size"] < 2 or min(bws) <= 0:
            raise ProfileError(f"{where}: needs group_size >= 2 and bandwidths > 0, got {a}")
        out.append(CPMeasurement(**vals))
    if len({m.group_size for m in out}) != len(out):
        raise ProfileError(f"profile.cp: group sizes must be distinct, got {items}")
    return tuple(out)


def _parse_ring(items: Any) -> tuple[RingMeasurement, ...]:
    out = []
    for where, a in _objects(items, "ring"):
        vals = {f.name: _number(a, f.name, where, integer=f.name == "group_size")
                for f in fields(RingMeasurement)}  # fmt: skip
        if vals["group_size"] < 2 or vals["bandwidth_bytes_per_s"] <= 0:
            raise ProfileError(f"{where}: needs group_size >= 2 and bandwidth > 0, got {a}")
        out.append(RingMeasurement(**vals))
    if len({m.group_size for m in out}) != len(out):
        raise ProfileError(f"profile.ring: group sizes must be distinct, got {items}")
    return tuple(out)


def _parse_runtime(d: Any) -> RuntimeCalibration:
    where = "profile.runtime"
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected an object, got {type(d).__name__}")
    world = _number(d, "world", where, integer=True)
    factor = _number(d, "compute_factor", where)
    if world < 1 or factor <= 0:
        raise ProfileError(f"{where}: needs world >= 1 and compute_factor > 0, got {d}")
    a2a = {}
    for k in ("a2a_bandwidth_bytes_per_s", "a2a_latency_s"):
        a2a[k] = None if d.get(k) is None else _number(d, k, where)
    if a2a["a2a_bandwidth_bytes_per_s"] == 0:
        raise ProfileError(f"{where}.a2a_bandwidth_bytes_per_s: must be > 0 or null")
    samples = d.get("samples", [])
    fit = d.get("fit", {})
    return RuntimeCalibration(
        world=world,
        compute_factor=factor,
        microbatch_overhead_s=_number(d, "microbatch_overhead_s", where),
        grad_sync_s=_number(d, "grad_sync_s", where),
        fit=fit if isinstance(fit, dict) else {},
        samples=tuple(s for s in samples if isinstance(s, dict))
        if isinstance(samples, list)
        else (),
        date=str(d.get("date", "")),
        **a2a,
        **_parse_knobs(d, where),
    )


def _parse_knobs(d: dict, where: str) -> dict:
    """The optional measured knobs of a runtime calibration (absent: not measured)."""
    out = {
        k: _number(d, k, where) for k in ("replicated_seq_s_per_layer", "step_overhead_s") if k in d
    }
    pairs = d.get("sp_compute_overhead", [])
    ok = isinstance(pairs, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], int)
        and not isinstance(p[0], bool)
        and p[0] >= 2
        and isinstance(p[1], (int, float))
        and not isinstance(p[1], bool)
        and math.isfinite(p[1])
        and p[1] >= 0
        for p in pairs
    )
    if not ok or len({p[0] for p in pairs}) != len(pairs):
        raise ProfileError(
            f"{where}.sp_compute_overhead: must be a list of distinct [degree >= 2, x >= 0] "
            f"pairs, got {pairs!r}"
        )
    out["sp_compute_overhead"] = tuple(sorted((int(a), float(b)) for a, b in pairs))
    return out
