"""What the CLI's `--model`, `--cluster` and `--profile` name, resolved to library objects.

`--model` and `--cluster` take a preset name or a JSON file (`ModelSpec.to_dict()` /
`Cluster.to_dict()`; `{"model": {...}}` / `{"cluster": {...}}` too, so a profile's model section
serves as a model file). An existing path is a file, anything else a preset name. `--profile`
takes a profile JSON (dcp_opt.profile_io): the cost model comes from its measured
coefficients and its ModelSpec, unless `--model` names a model with the same layers (another
depth: the profile extrapolates). Every error is a DcpOptError naming the file and the field.

    cluster = load_cluster("a100x48.json")
    cost = cost_model(kind="1d", cluster=cluster, model=None, profile="lm.profile.json")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cluster import MAX_GPUS, Cluster  # noqa: F401 (MAX_GPUS: re-exported)
from .cost import CostModel
from .errors import DcpOptError, loads_json, read_text
from .model import ModelSpec, model_preset
from .topology.presets import cluster_preset


def load_model(arg: str) -> ModelSpec:
    """A model preset, or a ModelSpec JSON file (`name` defaults to the file's stem)."""
    if not _is_file(arg):
        return _preset(model_preset, arg)
    d = _read_object(arg, "model")
    d.setdefault("name", Path(arg).stem)
    try:
        if not isinstance(d["name"], str):
            raise DcpOptError(f"model.name: must be a string, got {d['name']!r}")
        return ModelSpec.from_dict(d)
    except (DcpOptError, TypeError, ValueError) as e:
        raise DcpOptError(f"model file {Path(arg).name}: {e}") from None


def load_cluster(arg: str) -> Cluster:
    """A cluster preset, or a Cluster JSON file (`name` defaults to the file's stem)."""
    if not _is_file(arg):
        return _preset(cluster_preset, arg)
    d = _read_object(arg, "cluster")
    d.setdefault("name", Path(arg).stem)
    where = f"cluster file {Path(arg).name}"
    try:
        return Cluster.from_dict(d)  # it checks every field's type and range, GPUs capped
    except (DcpOptError, TypeError, ValueError) as e:
        raise DcpOptError(f"{where}: {e}") from None


def cost_model(
    *,
    kind: str,
    cluster: Cluster,
    model: str | None,
    profile: str | None,
    default_model: str,
    source: str = "the batch",
    **cost_kw: Any,
) -> CostModel:
    """The cost model for inputs of `kind` ("1d"/"2d") that `source` holds: from `profile`
    when given (with `model`'s depth if it names the same layers), else from the model's
    FLOP-based coefficients (`model`, or `default_model`)."""
    if profile is None:
        spec = load_model(model or default_model)
        _check_kind(spec, kind, source, "model")
        return CostModel(spec, cluster, **cost_kw)
    from .profile_io import check_profile_matches, cost_model_from_profile, load_profile

    prof = _named(profile, load_profile, profile)
    spec = prof.model if model is None else load_model(model)
    if model is not None:
        _named(profile, check_profile_matches, prof, spec)
    _check_kind(spec, kind, source, f"profile {Path(profile).name}")
    return _named(profile, cost_model_from_profile, profile, spec, cluster, **cost_kw)


def profile_kind(profile: str) -> str:
    """The kind ("1d"/"2d"/"3d") of the model a profile file was measured for."""
    from .profile_io import load_profile

    return _named(profile, load_profile, profile).model.kind


def _check_kind(spec: ModelSpec, kind: str, source: str, what: str) -> None:
    if spec.input_kind != kind:
        raise DcpOptError(
            f"{what}: {spec.name!r} is a {spec.kind} model but {source} holds {kind} sequences"
        )


def _named(path: str, fn, *args, **kw):
    """fn(...), its DcpOptError naming the profile file if it does not already."""
    try:
        return fn(*args, **kw)
    except DcpOptError as e:
        name = Path(path).name
        raise DcpOptError(str(e) if name in str(e) else f"profile {name}: {e}") from None


def _is_file(arg: str) -> bool:
    """Whether `arg` names an existing path ("" is the current folder, not a file; a name too
    long for the OS, e.g. a 400-digit preset, is no file either)."""
    try:
        return bool(arg) and Path(arg).exists()
    except (OSError, ValueError):
        return False


def _preset(lookup, name: str):
    try:
        return lookup(name)
    except DcpOptError as e:
        hint = " or a JSON file" if "unknown preset" in str(e) else ""
        raise DcpOptError(f"{e}{hint}") from None


def _read_object(path: str, key: str) -> dict:
    """The JSON object in `path`; `{key: {...}}` is unwrapped (a profile's model section)."""
    name = Path(path).name
    d = loads_json(read_text(path, f"{key} file {name}"), f"{key} file {name}")
    if isinstance(d, dict) and isinstance(d.get(key), dict):
        d = d[key]
    if not isinstance(d, dict):
        raise DcpOptError(f"{key} file {name}: expected a JSON object, got {type(d).__name__}")
    return dict(d)
