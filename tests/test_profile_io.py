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
    # (plus zero1's closing micro-step, which the executor's measured sum does not hold)
    assert cost.grad_sync_time() == pytest.approx(0.05 + cost.closing_step_time())
    plain = cost_model_from_profile(p, LLAMA, CLUSTER, use_runtime_calibration=False)
    assert plain.coeffs == _profile().coefficients
    # another world size: the sync measured at 8 ranks says nothing about it
    other = cost_model_from_profile(p, LLAMA, cluster_preset("h200x16"))
    assert other.grad_reduce_bytes_per_param == 3.0  # zero1's all-gather + reduce-scatter


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


# ---- measured cost-model knobs in the runtime calibration (issue 19) ------------------------
def _with_knobs(model=LLAMA) -> Profile:
    prof = _calibrated(model)
    cal = replace(
        prof.runtime,
        sp_compute_overhead=((2, 0.2), (4, 0.35), (16, 0.5)),
        replicated_seq_s_per_layer=1e-9,
        step_overhead_s=0.03,
    )
    # the FLOP preset has no per-sample (seq) term for a 1D model: give the profile one, so
    # that replicated per-sample work has somewhere to come from
    from dcp_opt.cost import BlockCoeffs

    b = prof.coefficients.blocks["layer"]
    blocks = {"layer": BlockCoeffs(replace(b.fwd, seq=1e-8), replace(b.bwd, seq=2e-8))}
    return replace(prof, runtime=cal, coefficients=replace(prof.coefficients, blocks=blocks))


def test_knobs_round_trip_and_set_the_cost_model(tmp_path):
    from dcp_opt.profile_io import RuntimeCalibration

    p = save_profile(_with_knobs(), tmp_path / "p.json")
    assert load_profile(p, model=LLAMA) == _with_knobs()
    doc = json.loads(p.read_text())["runtime"]
    assert doc["sp_compute_overhead"] == [[2, 0.2], [4, 0.35], [16, 0.5]]
    cost = cost_model_from_profile(p, LLAMA, CLUSTER)  # 8 GPUs: degree 16 does not exist
    assert cost.sp_compute_overhead == ((2, 0.2), (4, 0.35))
    assert cost.replicated_seq_s == pytest.approx(1e-9 * LLAMA.num_layers)  # per layer x depth
    assert cost.step_overhead_s == 0.03
    # the replicated work left the seq terms (1/3 forward, 2/3 backward, x1.25 calibration):
    # forward 1.25e-8 - 1e-9 / 3, backward 2.5e-8 - 2e-9 / 3 per layer and sample
    layer = cost.coeffs.blocks["layer"]
    assert layer.fwd.seq == pytest.approx(1.25e-8 - 1e-9 / 3)
    assert layer.bwd.seq == pytest.approx(2.5e-8 - 2e-9 / 3)
    # against the calibration without knobs (same factor and overhead): equal at degree 1;
    # at degree 2 the layers cost 1.2x, and each of the 2 samples' replicated 1e-9 s per
    # layer is paid whole instead of halved: + 1.2 * 16 layers * 2 * 1e-9 / 2
    ref = CostModel(
        LLAMA, CLUSTER, RuntimeCalibration(8, 1.25, 0.002, None, None, 0.0).apply(
            _with_knobs().coefficients
        )
    )  # fmt: skip
    seqs = list(Batch.from_lengths([300, 700]).sequences)
    t1, r1 = cost.microbatch_time(seqs, 1), ref.microbatch_time(seqs, 1)
    assert t1.compute_s == pytest.approx(r1.compute_s, rel=1e-12)
    feats = sum(ref.features(s) for s in seqs)
    fwd, bwd = ref.layer_times(feats, 2)
    layers = 16 * (fwd + bwd)
    want = ref.microbatch_time(seqs, 2).compute_s - layers + 1.2 * (layers + 16 * 2 * 1e-9 / 2)
    assert cost.microbatch_time(seqs, 2).compute_s == pytest.approx(want, rel=1e-9)
    # per step: the measured 50 ms at this world (30 ms of it fixed); on 16 GPUs the preset
    # all-reduce plus the fixed 30 ms
    # (each plus zero1's closing micro-step, at its own coefficients)
    assert cost.grad_sync_time() == pytest.approx(0.05 + cost.closing_step_time())
    other = cost_model_from_profile(p, LLAMA, cluster_preset("h200x16"))
    preset = CostModel(LLAMA, other.cluster)
    ring = preset.grad_sync_time() - preset.closing_step_time()
    assert other.grad_sync_time() == pytest.approx(ring + other.closing_step_time() + 0.03)


def test_old_calibrated_profile_loads_unchanged(tmp_path):
    # A profile saved before the knobs existed (the fidelity benchmark's, world 2)
    from pathlib import Path

    from dcp_opt.cluster import Cluster
    from dcp_opt.cost import BlockCoeffs, TermCoeffs

    stored = Path(__file__).parents[1] / "benchmarks" / "results" / "fidelity.profile.json"
    doc = json.loads(stored.read_text())
    for k in ("sp_compute_overhead", "replicated_seq_s_per_layer", "step_overhead_s"):
        doc["runtime"].pop(k, None)  # none in the stored file; so it stays old if re-measured
    src = tmp_path / "old.json"
    src.write_text(json.dumps(doc))
    prof = load_profile(src)
    # re-saved, the same document: nothing written for knobs it does not have
    assert json.loads(save_profile(prof, tmp_path / "new.json").read_text()) == doc
    # its cost model is the one the former rule gives, built here by hand from the JSON:
    # every time term x compute_factor, + the overhead per micro-batch, the gradient sync
    # as the measured per-step time on a 2-GPU cluster; no knob set
    rt, co = doc["runtime"], doc["coefficients"]
    k = rt["compute_factor"]

    def terms(t):
        return TermCoeffs(**{n: k * v for n, v in t.items()})

    coeffs = replace(
        prof.coefficients,
        blocks={n: BlockCoeffs(terms(b["fwd"]), terms(b["bwd"])) for n, b in co["blocks"].items()},
        head_fwd_per_token_s=k * co["head_fwd_per_token_s"],
        head_bwd_per_token_s=k * co["head_bwd_per_token_s"],
        microbatch_overhead_s=k * co["microbatch_overhead_s"] + rt["microbatch_overhead_s"],
        source=f"{co['source']}+runtime[2]",
    )
    cluster = Cluster("cpu2", 1, 2, 1e12, 1e12, 1e9, 1e9)
    per_param = rt["grad_sync_s"] * 1e9 / (2 * 1 / 2 * prof.model.total_params)
    want = CostModel(prof.model, cluster, coeffs, grad_reduce_bytes_per_param=per_param)
    got = cost_model_from_profile(src, prof.model, cluster)
    assert got.fingerprint() == want.fingerprint()
    assert (got.sp_compute_overhead, got.replicated_seq_s, got.step_overhead_s) == ((), 0.0, 0.0)


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda r: r.update(sp_compute_overhead=[[1, 0.2]]), r"runtime\.sp_compute_overhead"),
        (lambda r: r.update(sp_compute_overhead=[[2, -0.1]]), r"runtime\.sp_compute_overhead"),
        (lambda r: r.update(sp_compute_overhead=[[2, 1], [2, 2]]), "distinct"),
        (lambda r: r.update(step_overhead_s=-1), r"runtime\.step_overhead_s: must be"),
        (lambda r: r.update(replicated_seq_s_per_layer="x"), r"replicated_seq_s_per_layer"),
        # more replicated work than the profile's per-sample time (forward 1e-8 x 1.25)
        (lambda r: r.update(replicated_seq_s_per_layer=1e-6), r"exceeds the profile's"),
    ],
)
def test_bad_knobs_name_the_field(tmp_path, mutate, pattern):
    d = json.loads(save_profile(_with_knobs(), tmp_path / "p.json").read_text())
    mutate(d["runtime"])
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=pattern):
        load_profile(tmp_path / "p.json")
