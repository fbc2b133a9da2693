"""Profile JSON (dcp_opt.profile_io): round trip, and clear errors for bad or mismatched files."""

import json
from dataclasses import replace

import pytest

from dcp_opt import MODEL_PRESETS, Batch, CostModel, cluster_preset, flops_coefficients
from dcp_opt.profile_io import (
    A2AMeasurement,
    Profile,
    ProfileError,
    cost_model_from_profile,
    layer_fingerprint,
    load_profile,
    save_profile,
)

LLAMA = MODEL_PRESETS["llama-1b"]
CLUSTER = cluster_preset("h200x8")


def _profile(model=LLAMA) -> Profile:
    return Profile(
        coefficients=replace(flops_coefficients(model, CLUSTER), source="profile"),
        model=model,
        device={"type": "cpu", "name": "test", "num_threads": 1},
        date="2026-11-29T10:00:00Z",
        fit={"layer": {"fwd": {"median_rel_err_test": 0.03}}},
        a2a=(A2AMeasurement(2, 1.5e9, 1e-4),),
    )


def test_round_trip(tmp_path):
    p = save_profile(_profile(), tmp_path / "p.json")
    back = load_profile(p, model=LLAMA)
    assert back == _profile()
    assert json.loads(p.read_text())["schema_version"] == 1


def test_refuses_overwrite_without_force(tmp_path):
    p = save_profile(_profile(), tmp_path / "p.json")
    with pytest.raises(ProfileError, match="exists.*force"):
        save_profile(_profile(), p)
    save_profile(_profile(), p, force=True)


def test_cost_model_from_profile_uses_the_coefficients(tmp_path):
    p = save_profile(_profile(), tmp_path / "p.json")
    cost = cost_model_from_profile(p, LLAMA, CLUSTER)
    assert cost.coeffs == _profile().coefficients
    assert cost.coeffs.source == "profile"
    # With the measured a2a (group of 2): intra-node link 1.5 GB/s, latency 0.1 ms per call
    # = 0.1 ms per peer (d - 1 = 1 peer).
    cost2 = cost_model_from_profile(p, LLAMA, CLUSTER, use_measured_a2a=True)
    assert cost2.cluster.intra_node_bw == 1.5e9 and cost2.cluster.intra_node_latency_s == 1e-4
    assert isinstance(cost2, CostModel)


def test_fingerprint_ignores_depth_and_name():
    deeper = replace(LLAMA, name="other", num_layers=99, num_params=None)
    assert layer_fingerprint(deeper) == layer_fingerprint(LLAMA)
    assert layer_fingerprint(replace(LLAMA, hidden=4096)) != layer_fingerprint(LLAMA)


def test_deeper_model_of_same_layer_loads(tmp_path):
    p = save_profile(_profile(replace(LLAMA, num_layers=2)), tmp_path / "p.json")
    cost = cost_model_from_profile(p, LLAMA, CLUSTER)  # extrapolated to 16 layers
    assert cost.model.num_layers == 16


def test_mismatched_model_names_the_field(tmp_path):
    p = save_profile(_profile(), tmp_path / "p.json")
    other = MODEL_PRESETS["llama-7b"]
    with pytest.raises(
        ProfileError, match=r"model_fingerprint.*hidden: profile 2048 vs model 4096"
    ):
        load_profile(p, model=other)
    video = MODEL_PRESETS["opensora-stdit3-xl"]
    with pytest.raises(ProfileError, match="kind: profile '1d' vs model '2d'"):
        cost_model_from_profile(p, video, CLUSTER)


def _write(tmp_path, mutate):
    d = _profile().to_dict()
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda d: d.update(schema_version=7), r"profile\.schema_version: 7 not supported"),
        (lambda d: d.pop("schema_version"), r"profile\.schema_version: missing"),
        (lambda d: d.update(kind="plan"), r"profile\.kind: expected"),
        (lambda d: d.pop("date"), r"profile\.date: missing"),
        (lambda d: d.update(device="cpu"), r"profile\.device: expected dict, got str"),
        (lambda d: d.update(model_fingerprint="0" * 16), r"profile\.model_fingerprint"),
        (lambda d: d["model"].update(hidden=-1), r"profile\.model: model\.hidden"),
        (
            lambda d: d["coefficients"]["blocks"]["layer"]["fwd"].update(quad=-1.0),
            r"profile\.coefficients\.blocks\.layer\.fwd\.quad: must be a finite number >= 0",
        ),
        (
            lambda d: d["coefficients"]["blocks"]["layer"]["bwd"].update(cubic=1.0),
            r"blocks\.layer\.bwd: unknown fields \['cubic'\]",
        ),
        (
            lambda d: d["coefficients"]["blocks"].pop("layer"),
            r"coefficients\.blocks: no entry for block types \['layer'\]",
        ),
        (
            lambda d: d["coefficients"].update(reserved_bytes="4GB"),
            r"coefficients\.reserved_bytes: must be a finite number",
        ),
        (
            lambda d: d["coefficients"].pop("act_bytes_per_token_layer"),
            r"coefficients\.act_bytes_per_token_layer: missing",
        ),
        (
            lambda d: d["coefficients"].update(a2a_calls_per_layer=2.5),
            r"a2a_calls_per_layer: must be an integer",
        ),
        (lambda d: d["a2a"][0].update(group_size=1), r"profile\.a2a\[0\]: needs group_size"),
    ],
)
def test_bad_files_name_the_field(tmp_path, mutate, pattern):
    with pytest.raises(ProfileError, match=pattern):
        load_profile(_write(tmp_path, mutate))


def test_unreadable_and_non_json(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(p)
    p.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="expected a JSON object, got list"):
        load_profile(p)


# ---- runtime calibration (Profile.runtime) -----------------------------------------------
def _calibrated(model=LLAMA) -> Profile:
    from dcp_opt.profile_io import RuntimeCalibration

    cal = RuntimeCalibration(
        world=8,
        compute_factor=1.25,
        microbatch_overhead_s=0.002,
        a2a_bandwidth_bytes_per_s=4e8,
        a2a_latency_s=3e-4,
        grad_sync_s=0.05,
        fit={"degree_1": {"median_rel_err_test": 0.02}},
        samples=({"degree": 1, "shapes": [[128]], "measured_s": 0.1},),
        date="2026-11-29T13:00:00Z",
    )
    return replace(_profile(model), runtime=cal)


def test_runtime_calibration_round_trips(tmp_path):
    p = save_profile(_calibrated(), tmp_path / "p.json")
    assert load_profile(p, model=LLAMA) == _calibrated()
    assert "runtime" not in json.loads(save_profile(_profile(), tmp_path / "q.json").read_text())


def test_runtime_calibration_scales_every_time_term():
    prof = _calibrated()
    raw, cal = prof.coefficients, prof.runtime.apply(prof.coefficients)
    for name, b in raw.blocks.items():
        for part in ("fwd", "bwd"):
            for term in ("quad", "lin", "seq", "const"):
                want = 1.25 * getattr(getattr(b, part), term)
                assert getattr(getattr(cal.blocks[name], part), term) == pytest.approx(want)
    assert cal.head_fwd_per_token_s == pytest.approx(1.25 * raw.head_fwd_per_token_s)
    assert cal.microbatch_overhead_s == pytest.approx(1.25 * raw.microbatch_overhead_s + 0.002)
    assert cal.act_bytes_per_token_layer == raw.act_bytes_per_token_layer  # memory untouched
    # so every micro-batch time is 1.25 x the isolated one + 2 ms (degree 1: no comm)
    seqs = list(Batch.from_lengths([300, 700]).sequences)
    t_raw = CostModel(LLAMA, CLUSTER, raw).microbatch_time(seqs, 1).total_s
    t_cal = CostModel(LLAMA, CLUSTER, cal).microbatch_time(seqs, 1).total_s
    assert t_cal == pytest.approx(1.25 * t_raw + 0.002)


def test_cost_model_from_profile_applies_the_runtime_calibration(tmp_path):
    p = save_profile(_calibrated(), tmp_path / "p.json")
    cost = cost_model_from_profile(p, LLAMA, CLUSTER, use_measured_a2a=True)
    assert cost.coeffs == _calibrated().runtime.apply(_profile().coefficients)
    # in-situ all-to-all, and (the cluster has the calibrated world of 8) the in-situ sync
    assert cost.cluster.intra_node_bw == 4e8 and cost.cluster.intra_node_latency_s == 3e-4
    assert cost.grad_sync_time() == pytest.approx(0.05)
    plain = cost_model_from_profile(p, LLAMA, CLUSTER, use_runtime_calibration=False)
    assert plain.coeffs == _profile().coefficients
    # another world size: the sync measured at 8 ranks says nothing about it
    other = cost_model_from_profile(p, LLAMA, cluster_preset("h200x16"))
    assert other.grad_reduce_bytes_per_param == 2.0


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda d: d["runtime"].update(compute_factor=-1), r"profile\.runtime\.compute_factor"),
        (lambda d: d["runtime"].pop("grad_sync_s"), r"profile\.runtime\.grad_sync_s: missing"),
        (lambda d: d["runtime"].update(world=0), r"profile\.runtime: needs world >= 1"),
        (lambda d: d["runtime"].update(a2a_bandwidth_bytes_per_s=0), "must be > 0 or null"),
        (lambda d: d.update(runtime=[1]), r"profile\.runtime: expected an object"),
    ],
)
def test_bad_runtime_calibration_names_the_field(tmp_path, mutate, pattern):
    d = json.loads(save_profile(_calibrated(), tmp_path / "p.json").read_text())
    mutate(d)
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=pattern):
        load_profile(tmp_path / "p.json")
