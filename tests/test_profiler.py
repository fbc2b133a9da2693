"""The torch profiler (dcp_opt.runtime.profile.measure): measurement, memory accounting, caching,
the CUDA path (with fake torch.cuda functions: no GPU here), and end to end to a CostModel."""

import contextlib
import json
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from dcp_opt.runtime.profile import measure as P
from dcp_opt.runtime.profile.blocks import ProfileTarget
from torch import nn

from dcp_opt import Batch, ModelSpec, cluster_preset
from dcp_opt.fit import block_features
from dcp_opt.profile_io import cost_model_from_profile, save_profile

H = 8  # hidden of the tiny blocks
# Known per-layer coefficients the fake-clock block "costs" (seconds):
FWD = dict(quad=1e-6, lin=2e-4, seq=3e-3, const=5e-3)
BWD = dict(quad=2e-6, lin=4e-4, seq=1e-3, const=2e-3)


class FakeClock:
    """Time advances only when the block says so: a noiseless device."""

    device = torch.device("cpu")

    def __init__(self):
        self.t = 0.0

    def mark(self):
        return self.t

    def seconds(self, a, b):
        return b - a

    def memory_run(self):
        return contextlib.nullcontext(None)


class _Charge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, fwd_s, bwd_s):
        clock.t += fwd_s
        ctx.clock, ctx.bwd_s = clock, bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.clock.t += ctx.bwd_s
        return g, None, None, None


class ScaleExp(nn.Module):
    """y = exp(x * w): autograd saves x (for dw) and exp's result -> 2 * T * H * 4 bytes of
    activations (w is a parameter and is not counted)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((H,), 0.1))

    def forward(self, x):
        return torch.exp(x * self.w)


class ChargedBlock:
    """A 1D block behind the profiler's protocol whose time on FakeClock is known exactly."""

    block_type = "layer"

    def __init__(self, clock):
        self.clock, self.module = clock, ScaleExp()

    def make_inputs(self, shapes, *, dtype, device):
        t = sum(s[0] for s in shapes)
        return [(torch.randn(t, H, dtype=dtype).requires_grad_(True), tuple(shapes))]

    def forward(self, inputs):
        out = []
        for x, shapes in inputs:
            q, t, s = block_features("layer", shapes)
            f = FWD["quad"] * q + FWD["lin"] * t + FWD["seq"] * s + FWD["const"]
            b = BWD["quad"] * q + BWD["lin"] * t + BWD["seq"] * s + BWD["const"]
            out.append(self.module(_Charge.apply(x, self.clock, f, b)))  # charged first,
            # so that the checkpoint's recompute (which stops early after the last saved
            # tensor) runs it again
        return out


SPEC = ModelSpec("fake", "1d", 12, H, 2, 16, vocab_size=0, dtype_bytes=4)
SMALL = P.ProfileConfig(
    grid=P.Grid(lengths=(16, 32, 64, 128), pack=(1, 2, 4), max_tokens=256),
    warmup=0,
    repeats=1,
    passes=1,
    min_time_s=0.0,
    num_threads=None,
)


def test_fake_clock_profile_recovers_coefficients_end_to_end(tmp_path):
    clock = FakeClock()
    target = ProfileTarget(SPEC, {"layer": ChargedBlock(clock)}, signature="fake")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a noiseless device must not give a poor-fit warning
        prof = P.profile_model(target, SMALL, clock=clock, progress=False)
    got = prof.coefficients.blocks["layer"]
    for k, v in FWD.items():
        assert getattr(got.fwd, k) == pytest.approx(v, rel=1e-6), k
    for k, v in BWD.items():
        assert getattr(got.bwd, k) == pytest.approx(v, rel=1e-6), k
    rep = prof.fit["layer"]
    assert rep["fwd"]["median_rel_err_test"] < 1e-9 and rep["fwd"]["n_test"] == 3  # 11 points
    # Recompute runs the forward once more in backward: measured ratio exactly 1.
    assert rep["recompute_extra_forward_ratio"] == pytest.approx(1.0)
    # Memory: exp(x*w) saves x and y -> 2 * 8 * 4 = 64 B per token; checkpoint keeps x: 32.
    assert prof.coefficients.act_bytes_per_token_layer == pytest.approx(64)
    assert prof.coefficients.ckpt_bytes_per_token_layer == pytest.approx(32)
    # The saved profile drives a CostModel; one 100-token sequence, degree 1, no recompute:
    # 12 layers x (fwd + bwd) = 12 * (0.01 + 0.02 + 0.003 + 0.005 + 0.02 + 0.04 + 0.001
    # + 0.002) = 12 * 0.101 = 1.212 s (head and overhead are 0: no head measured).
    path = save_profile(prof, tmp_path / "fake.json")
    cost = cost_model_from_profile(path, SPEC, cluster_preset("h200x8"))
    t = cost.microbatch_time(list(Batch.from_lengths([100]).sequences), 1)
    assert t.total_s == pytest.approx(1.212, rel=1e-6)


class WindowedBlock(ChargedBlock):
    """ChargedBlock of a layer with a sliding window of 48 keys: its attention work is
    Q = s^2 - (s - 48)^2 for s > 48 (written out here, not through the code under test)."""

    window = 48

    def forward(self, inputs):
        out = []
        for x, shapes in inputs:
            q = sum(s * s - max(s - self.window, 0) ** 2 for (s,) in shapes)
            t, n = sum(s for (s,) in shapes), len(shapes)
            f = FWD["quad"] * q + FWD["lin"] * t + FWD["seq"] * n + FWD["const"]
            b = BWD["quad"] * q + BWD["lin"] * t + BWD["seq"] * n + BWD["const"]
            out.append(self.module(_Charge.apply(x, self.clock, f, b)))
        return out


def test_fit_follows_the_measured_layers_window():
    # A layer whose time follows the windowed Q: the fit recovers every coefficient and
    # reports the window. Fitted on plain s^2 it could not (quad would absorb a wrong shape).
    clock = FakeClock()
    target = ProfileTarget(SPEC, {"layer": WindowedBlock(clock)}, signature="fake-w")
    prof = P.profile_model(target, SMALL, clock=clock, progress=False)
    got = prof.coefficients.blocks["layer"]
    for part, want in (("fwd", FWD), ("bwd", BWD)):
        for k, v in want.items():
            assert getattr(getattr(got, part), k) == pytest.approx(v, rel=1e-6), (part, k)
    assert prof.fit["layer"]["window"] == 48
    assert prof.fit["layer"]["fwd"]["median_rel_err_test"] < 1e-9
    # the same points on plain s^2 fit worse: the report's check can tell the two apart
    assert prof.fit["layer"]["plain_s2_median_rel_err_test"]["fwd"] > 1e-3


def test_cache_skips_measured_points(tmp_path):
    clock = FakeClock()
    block = ChargedBlock(clock)
    calls = []
    orig = block.forward
    block.forward = lambda inputs: calls.append(1) or orig(inputs)
    target = ProfileTarget(SPEC, {"layer": block}, signature="fake")
    cache = tmp_path / "points.json"
    first = P.measure_all(target, SMALL, clock=clock, cache_path=cache, progress=False)
    n = len(calls)
    assert n > 0 and cache.exists()
    again = P.measure_all(target, SMALL, clock=clock, cache_path=cache, progress=False)
    assert len(calls) == n  # nothing measured the second time
    assert [p.fwd_s for p in again] == [p.fwd_s for p in first]
    other = ProfileTarget(SPEC, {"layer": block}, signature="changed block")
    P.measure_all(other, SMALL, clock=clock, cache_path=cache, progress=False)
    assert len(calls) > n  # a new signature is a cache miss


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    lin = nn.Linear(4, 4, bias=False)
    x = torch.randn(10, 4, requires_grad=True)
    with P.SavedBytes(list(lin.parameters())) as sb:
        y = lin(x)
        z = y * y  # saves y twice (both operands): counted once
    # linear saves x (10*4*4 = 160 B) and its weight (excluded); y*y saves y (160 B)
    assert sb.total == 160 + 160
    z.sum().backward()


def test_adaptive_repeats_reach_min_time():
    clock = FakeClock()
    target_block = ChargedBlock(clock)
    p = P.measure_block(
        target_block,
        ((16,),),
        recompute=False,
        clock=clock,
        warmup=0,
        repeats=2,
        dtype=torch.float32,
        min_time_s=0.2,
    )
    # one run = fwd 0.256+3.2+3+5 ms... : fwd(16) = 16^2e-6 + 16*2e-4 + 3e-3 + 5e-3 = 0.011456,
    # bwd = 0.000512 + 0.0064 + 0.001 + 0.002 = 0.009912; sum 0.021368 -> 10 runs reach 0.2 s
    assert len(p.fwd_samples) == 10


class _FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = len(_FakeEvent.log) * 2.5  # milliseconds
        _FakeEvent.log.append(self)

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def test_cuda_clock_path_with_fake_cuda(monkeypatch):
    """The CUDA code path on a CPU machine: torch.cuda functions replaced by fakes."""
    mem = {"alloc": 1000, "peak": 0}
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: mem.update(peak=0))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: mem["alloc"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: mem["peak"])
    clock = P.CudaClock("cpu")  # events are fake; tensors stay on the CPU
    a, b = clock.mark(), clock.mark()
    assert clock.seconds(a, b) == pytest.approx(2.5e-3)  # 2.5 ms between two records
    with clock.memory_run() as box:
        mem["peak"] = 5000
    assert box["peak"] == 4000  # peak 5000 minus the 1000 allocated before
    block = ChargedBlock(FakeClock())
    p = P.measure_block(
        block, ((16,),), recompute=False, clock=clock, warmup=1, repeats=3, dtype=torch.float32
    )
    assert p.fwd_samples == pytest.approx((2.5e-3,) * 3)  # marks a,b,c,d: 2.5 ms apart
    assert p.peak_bytes == 0 - 1000  # the fake allocator's peak was reset to 0
    assert p.saved_bytes == 16 * H * 4 * 2


def test_runtime_model_adapters_measure():
    from dcp_opt.runtime.models import DiTConfig, LMConfig
    from dcp_opt.runtime.profile.blocks import dit_target, lm_target

    lm = lm_target(LMConfig())
    p = P.measure_block(
        lm.blocks["layer"],
        ((5,), (7,)),
        recompute=True,
        clock=P.CpuClock(),
        warmup=0,
        repeats=1,
        dtype=torch.float32,
    )
    assert p.fwd_s > 0 and p.tokens == 12
    # the checkpoint keeps the block's inputs only: h, 12 tokens x hidden 16 x 4 B = 768 B,
    # plus positions and segment ids, 12 x int64 each = 192 B
    assert p.saved_bytes == 12 * 16 * 4 + 2 * 12 * 8
    head = P.measure_head(lm.head, 12, clock=P.CpuClock(), warmup=0, repeats=1, dtype=torch.float32)
    assert head.bwd_s > 0 and head.saved_bytes > 0
    dit = dit_target(DiTConfig())
    assert dit.model.block_types == ("spatial", "temporal")
    inputs = dit.blocks["temporal"].make_inputs(
        [(3, 2, 2), (1, 2, 2)], dtype=torch.float32, device="cpu"
    )
    assert [x.shape for x, _ in inputs] == [(4, 3, 16), (4, 1, 16)]  # rows = spatial, cols = F


def test_profile_target_needs_every_block_type():
    spec2d = ModelSpec("v", "2d", 2, H, 2, 16, causal=False)
    with pytest.raises(ValueError, match=r"missing block types \['temporal'\]"):
        ProfileTarget(spec2d, {"spatial": ChargedBlock(FakeClock())})


def test_cpu_clock_modes():
    assert P.CpuClock().mode == "thread"
    with pytest.raises(ValueError, match="clock mode"):
        P.CpuClock("gpu")


def test_profile_json_records_method_and_device(tmp_path):
    clock = FakeClock()
    target = ProfileTarget(SPEC, {"layer": ChargedBlock(clock)}, signature="fake")
    prof = P.profile_model(target, SMALL, clock=clock, progress=False)
    d = json.loads(save_profile(prof, tmp_path / "p.json").read_text())
    assert d["device"]["type"] == "cpu" and d["device"]["torch"] == torch.__version__
    assert "saved_tensors_hooks" in d["method"]["memory"]
    assert d["method"]["extrapolation"].endswith("x12 layers")


# ---- dcp-opt profile ---------------------------------------------------------------------
def test_cli_refuses_to_overwrite_before_measuring(tmp_path, capsys):
    from dcp_opt.cli import main

    out = tmp_path / "p.json"
    out.write_text("{}")
    assert main(["profile", "-o", str(out), "--quick"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_text() == "{}"  # untouched
    assert main(["profile", "-o", str(tmp_path / "q.json"), "--heads", "3"]) == 2
    assert "--heads: must divide --hidden=256" in capsys.readouterr().err


def test_cli_profiles_writes_and_loads(tmp_path, capsys):
    from dcp_opt.runtime.models import LMConfig
    from dcp_opt.runtime.profile.blocks import lm_spec

    from dcp_opt.cli import main
    from dcp_opt.profile_io import load_profile

    out = tmp_path / "p.json"
    argv = ["profile", "-o", str(out), "--quick", "--no-progress", "--json"]
    argv += ["--hidden", "16", "--ffn", "32", "--heads", "2", "--layers", "3"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fit"]["layer"]["fwd"]["n_train"] >= 4
    spec = lm_spec(LMConfig(vocab_size=512, hidden=16, num_heads=2, num_layers=3, ffn_hidden=32))
    prof = load_profile(out, model=spec)  # the file is for exactly this model
    assert prof.coefficients.source == "profile" and prof.model.num_layers == 3
    assert (tmp_path / "p.json.points.json").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--calibrate-world", "1"], "--calibrate-world: 1 not allowed; allowed: 0 (off) or >= 2"),
        (
            ["--calibrate-world", "2", "--target", "tiny-dit"],
            "tiny-lm or an HF --model on --device cpu",
        ),
        (["--calibrate-world", "2", "--model", "hf:llama-7b"], "6.74B parameters; the calibration"),
    ],
)
def test_cli_calibration_refused_before_measuring(tmp_path, capsys, extra, message):
    from dcp_opt.cli import main

    out = tmp_path / "p.json"
    assert main(["profile", "-o", str(out), "--quick", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "p.json.points.json").exists()


@pytest.mark.dist
def test_cli_calibrate_world_stores_the_runtime_calibration(tmp_path, capsys):
    from dcp_opt.cli import main
    from dcp_opt.profile_io import load_profile

    out = tmp_path / "p.json"
    argv = ["profile", "-o", str(out), "--quick", "--no-progress", "--json", "--no-cache"]
    argv += ["--hidden", "16", "--ffn", "32", "--heads", "2", "--layers", "2"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a quick grid's fit may be flagged as poor
        assert main([*argv, "--calibrate-world", "2"]) == 0
    cal = load_profile(out).runtime
    assert cal is not None and cal.world == 2 and {s["degree"] for s in cal.samples} == {1, 2}
    # the report shows what the calibration measured, knobs included
    shown = json.loads(capsys.readouterr().out)["runtime"]
    assert shown["sp_compute_overhead"] == {str(d): x for d, x in cal.sp_compute_overhead}
    assert shown["step_overhead_s"] == cal.step_overhead_s <= shown["grad_sync_s"]


@pytest.mark.dist
def test_cli_calibrate_world_works_for_an_hf_model(tmp_path):
    # issue 28: --calibrate-world took only the built-in tiny-lm, so an HF model's profile
    # had no runtime overheads (it predicted 0.014 s for steps measured at 0.2-0.4 s)
    from dcp_opt.cli import main
    from dcp_opt.profile_io import load_profile

    out = tmp_path / "hf.json"
    argv = ["profile", "--model", "hf:tiny-llama", "-o", str(out), "--quick", "--no-progress"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a quick grid's fit may be flagged as poor
        assert main([*argv, "--no-cache", "--calibrate-world", "2"]) == 0
    cal = load_profile(out).runtime
    assert cal is not None and cal.world == 2 and {s["degree"] for s in cal.samples} == {1, 2}
    assert cal.compute_factor > 0 and cal.step_overhead_s >= 0


# ---- fidelity benchmark helpers --------------------------------------------------------
def _bench():
    from tests.scripts import load_script

    return load_script("benchmarks/bench_fidelity.py")


def test_fidelity_cost_calibrates_grad_sync_and_link(tmp_path):
    from dcp_opt.profile_io import A2AMeasurement

    bench = _bench()
    clock = FakeClock()
    target = ProfileTarget(SPEC, {"layer": ChargedBlock(clock)}, signature="fake")
    prof = P.profile_model(target, SMALL, clock=clock, progress=False)
    a2a = A2AMeasurement(2, 5e8, 2e-4)
    cost = bench.make_cost(prof, 2, a2a, grad_sync_s=0.03)
    assert cost.grad_sync_time() == pytest.approx(0.03)  # calibrated to the measurement
    assert cost.cluster.intra_node_bw == 5e8
    assert cost.cluster.intra_node_latency_s == pytest.approx(2e-4)  # 1 peer at degree 2
    b = bench.make_batch(3, 1000)
    assert b.num_tokens >= 1000 and all(32 <= s.shape[0] <= 2048 for s in b.sequences)


def test_fidelity_microbatch_samples_use_group_leaders():
    bench = _bench()
    from tests.toy import toy_cost

    cost = toy_cost()
    batch = Batch.from_lengths([10, 20])
    # one step; rank 0 leads a degree-2 group (seq 0), rank 1 is its member (ignored)
    # row: (phase, start, degree, index, ids, recompute, wall s, cpu s)
    runs = [
        {"micro_batches": [[(0, 0, 2, 0, [0], 0, 40.0, 30.0)]]},
        {"micro_batches": [[(0, 0, 2, 0, [0], 0, 99.0, 99.0)]]},
    ]
    # toy: 6T/d + 0.5 = 6*10/2 + 0.5 = 30.5 predicted
    assert bench.microbatch_samples(cost, batch, runs, "wall") == [(2, 30.5, 40.0)]
    assert bench.microbatch_samples(cost, batch, runs, "cpu") == [(2, 30.5, 30.0)]


# ---- runtime calibration ---------------------------------------------------------------------
def _truth_samples(world, k, c, bw, lat):
    """Calibration micro-batches 'measured' on a device that is exactly the calibrated model."""
    from dcp_opt import CostModel, flops_coefficients
    from dcp_opt.cluster import Cluster
    from dcp_opt.profile_io import RuntimeCalibration

    cluster = Cluster("t", 1, world, 1e15, 1e12, bw, bw, intra_node_latency_s=lat)
    raw = flops_coefficients(SPEC, cluster)
    true = RuntimeCalibration(world, k, c, bw, lat, 0.0).apply(raw)
    cost = CostModel(SPEC, cluster, true)
    samples, steps = [], []
    for plan, batch in P.calibration_plans(SPEC, world):
        for _, g, _, mb in plan.micro_batches():
            if g.start_rank:
                continue
            seqs = [batch.by_id[i] for i in mb.sequence_ids]
            t = cost.microbatch_time(seqs, g.degree, spans_nodes=False).total_s
            shapes = [list(s.shape) for s in seqs]
            samples.append({"degree": g.degree, "shapes": shapes, "recompute": 0, "measured_s": t})
        steps.append({"step_s": 1.03, "mb_s": 1.0, "grad_sync_s": 0.025})
    return raw, samples, steps


def test_runtime_calibration_fit_recovers_known_terms():
    raw, samples, steps = _truth_samples(4, k=1.3, c=4e-3, bw=2e8, lat=5e-4)
    cal = P.fit_runtime_calibration(SPEC, raw, 4, samples, steps)
    assert cal.world == 4 and {s["degree"] for s in samples} == {1, 2, 4}
    assert cal.compute_factor == pytest.approx(1.3, rel=1e-6)
    assert cal.microbatch_overhead_s == pytest.approx(4e-3, rel=1e-4)
    assert cal.a2a_bandwidth_bytes_per_s == pytest.approx(2e8, rel=1e-4)
    assert cal.a2a_latency_s == pytest.approx(5e-4, rel=1e-4)
    assert cal.grad_sync_s == pytest.approx(0.03)  # step beyond its micro-batches
    assert cal.fit["executor_grad_sync_s"] == pytest.approx(0.025)
    for s in cal.samples:  # calibrated predictions reproduce the measurements
        assert s["predicted_s"] == pytest.approx(s["measured_s"], rel=1e-6)
        assert s["isolated_s"] < s["measured_s"]


# A profile with per-sample work (seq terms), so replicated work has somewhere to come from:
# per layer, forward 1 ms + 20 us/token + 1e-8 s/s^2 + 0.2 ms; backward twice that.
SEQ_TERMS = dict(quad=1e-8, lin=2e-5, seq=1e-3, const=2e-4)


def _knob_truth(world, *, over, rep, noise=0.0, seed=0):
    """Calibration micro-batches 'measured' on a device that is exactly a calibrated model
    with the measured-profile knobs: SP overhead `over` per degree, replicated per-sample
    seconds `rep` per layer (part of the profile's seq term), compute x1.2 + 3 ms, a2a
    2e8 B/s and 0.5 ms per peer, 40 ms per step beyond 25 ms of gradient sum; times times
    (1 + noise * N(0, 1))."""
    from dcp_opt import CostModel, flops_coefficients
    from dcp_opt.cluster import Cluster
    from dcp_opt.cost import BlockCoeffs, TermCoeffs
    from dcp_opt.profile_io import RuntimeCalibration

    cluster = Cluster("t", 1, world, 1e15, 1e12, 2e8, 2e8, intra_node_latency_s=5e-4)
    fwd = TermCoeffs(**SEQ_TERMS)
    bwd = TermCoeffs(*(2 * v for v in SEQ_TERMS.values()))
    raw = replace(flops_coefficients(SPEC, cluster), blocks={"layer": BlockCoeffs(fwd, bwd)})
    true = RuntimeCalibration(
        world, 1.2, 3e-3, 2e8, 5e-4, 0.065,
        sp_compute_overhead=tuple(over.items()), replicated_seq_s_per_layer=rep,
        step_overhead_s=0.04,
    )  # fmt: skip
    cost = CostModel(SPEC, cluster, true.apply(raw), **true.cost_knobs(SPEC, cluster))
    rng = np.random.default_rng(seed)
    samples = []
    for plan, batch in P.calibration_plans(SPEC, world):
        for _, g, _, mb in plan.micro_batches():
            seqs = [batch.by_id[i] for i in mb.sequence_ids]
            t = cost.microbatch_time(seqs, g.degree, spans_nodes=False).total_s
            t *= 1 + noise * rng.standard_normal()
            shapes = [list(s.shape) for s in seqs]
            samples.append({"degree": g.degree, "shapes": shapes, "recompute": 0, "measured_s": t})
    steps = [{"step_s": 1.065, "mb_s": 1.0, "grad_sync_s": 0.025}] * 3
    return raw, samples, steps, cost


def test_runtime_calibration_recovers_sp_overhead_and_replicated_work():
    # World 4: degrees 1, 2, 4; every group's micro-batches (2 groups at degree 2).
    over, rep = {2: 0.3, 4: 0.5}, 4e-4
    raw, samples, steps, truth = _knob_truth(4, over=over, rep=rep)
    cal = P.fit_runtime_calibration(SPEC, raw, 4, samples, steps)
    assert cal.compute_factor == pytest.approx(1.2, rel=1e-6)
    assert dict(cal.sp_compute_overhead) == pytest.approx(over, rel=1e-4)
    assert cal.replicated_seq_s_per_layer == pytest.approx(rep, rel=1e-4)
    assert cal.a2a_bandwidth_bytes_per_s == pytest.approx(2e8, rel=1e-4)
    assert cal.a2a_latency_s == pytest.approx(5e-4, rel=1e-4)
    # per step: 65 ms beyond the micro-batches, 25 ms of it the executor's gradient sum
    assert cal.grad_sync_s == pytest.approx(0.065) and cal.step_overhead_s == pytest.approx(0.04)
    for s in cal.samples:
        assert s["predicted_s"] == pytest.approx(s["measured_s"], rel=1e-6)
    # Charged to the all-to-all alone (the fit before the knobs), a degree-2 micro-batch of
    # 1280 tokens would be mispredicted: the knobs are what makes the rows above match.
    assert cal.fit["sp_overhead"]["fitted"] and cal.fit["sp_overhead"]["per_degree"]["2"] > 0.2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runtime_calibration_sp_overhead_under_noise(seed):
    # 2% multiplicative noise on every micro-batch: each overhead within 0.1 of its value,
    # and no overhead invented where there is none
    over = {2: 0.25, 4: 0.0}
    raw, samples, steps, _ = _knob_truth(4, over=over, rep=0.0, noise=0.02, seed=seed)
    got = dict(P.fit_runtime_calibration(SPEC, raw, 4, samples, steps).sp_compute_overhead)
    assert got.get(2, 0.0) == pytest.approx(0.25, abs=0.1)
    assert got.get(4, 0.0) < 0.1


def test_runtime_calibration_without_multi_rank_groups_has_no_a2a():
    raw, samples, steps = _truth_samples(2, k=0.8, c=0.0, bw=1e9, lat=1e-4)
    ones = [s for s in samples if s["degree"] == 1]
    cal = P.fit_runtime_calibration(SPEC, raw, 2, ones, [])
    assert cal.compute_factor == pytest.approx(0.8, rel=1e-6)
    assert cal.a2a_bandwidth_bytes_per_s is None and cal.grad_sync_s == 0.0


def test_calibration_plans_keep_every_rank_busy_once_per_sequence():
    spec2d = ModelSpec("d", "2d", 2, H, 2, 16, text_tokens=4, causal=False)
    for model in (SPEC, spec2d):
        plans = P.calibration_plans(model, 4)
        assert [p.phases[0].groups[0].degree for p, _ in plans] == [1, 2, 4]
        for plan, batch in plans:
            assert sorted(plan.sequence_ids()) == [s.id for s in batch.sequences]
            covered = sorted(r for g in plan.phases[0].groups for r in g.ranks)
            assert covered == [0, 1, 2, 3]
            assert all(g.micro_batches for g in plan.phases[0].groups)
            assert plan.loss_normalizer > 0 and batch.kind == model.kind


def test_calibration_samples_take_leaders_and_the_slowest_rank():
    batch = Batch.from_lengths([10, 20, 30])
    # row: (phase, start, degree, index, ids, recompute, wall s, cpu s); 2 steps, 2 ranks
    runs = [
        {
            "step_s": [1.0, 2.0],
            "grad_sync_s": [0.1, 0.1],
            "micro_batches": [[(0, 0, 1, 0, [0], 0, 0.5, 0.4)], [(0, 0, 1, 0, [0], 0, 0.7, 0.6)]],
        },
        {
            "step_s": [1.0, 2.0],
            "grad_sync_s": [0.2, 0.3],
            "micro_batches": [
                [(0, 1, 1, 0, [1, 2], 1, 0.9, 0.8)],
                [(0, 1, 1, 0, [1, 2], 1, 1.1, 1.0)],
            ],
        },
    ]
    samples, steps = P.calibration_samples(batch, runs)
    assert samples == [
        {"degree": 1, "shapes": [[10]], "recompute": 0, "measured_s": 0.6, "cpu_s": 0.5},
        {"degree": 1, "shapes": [[20], [30]], "recompute": 1, "measured_s": 1.0, "cpu_s": 0.9},
    ]
    assert steps == [
        {"step_s": 1.0, "mb_s": 0.9, "grad_sync_s": 0.2},
        {"step_s": 2.0, "mb_s": 1.1, "grad_sync_s": 0.3},
    ]


def test_calibrate_tiny_lm_end_to_end_with_two_ranks():
    """A real executor run (2 gloo processes): the calibration is measured and usable."""
    from dcp_opt.runtime.models import LMConfig
    from dcp_opt.runtime.profile.blocks import lm_target
    from dcp_opt.runtime.profile.fidelity import calibrate_tiny_lm

    cfg = dict(vocab_size=32, hidden=16, num_heads=2, num_layers=2, ffn_hidden=32)
    target = lm_target(LMConfig(**cfg))
    grid = P.Grid(lengths=(64, 128, 256, 512), pack=(1, 2), max_tokens=512)
    quick = P.ProfileConfig(grid=grid, warmup=0, repeats=1, passes=1, min_time_s=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-repeat fit may be poor; not the point here
        prof = P.profile_model(target, quick, progress=False)
        cal = calibrate_tiny_lm(prof, cfg, 2).runtime
    assert cal.world == 2 and cal.compute_factor > 0 and cal.grad_sync_s >= 0
    assert {s["degree"] for s in cal.samples} == {1, 2}
    assert len(cal.samples) == 3 * len(P.CALIBRATION_1D)  # 2 groups at d=1, 1 group at d=2
    assert cal.a2a_bandwidth_bytes_per_s > 0


def test_fidelity_cost_uses_the_runtime_calibration():
    from dataclasses import replace

    from dcp_opt.profile_io import A2AMeasurement, RuntimeCalibration

    bench = _bench()
    clock = FakeClock()
    target = ProfileTarget(SPEC, {"layer": ChargedBlock(clock)}, signature="fake")
    prof = P.profile_model(target, SMALL, clock=clock, progress=False)
    cal = RuntimeCalibration(2, 1.5, 0.01, 1e8, 3e-3, 0.07)
    a2a = A2AMeasurement(2, 5e8, 2e-4)
    cost = bench.make_cost(replace(prof, runtime=cal), 2, a2a, grad_sync_s=0.03)
    assert cost.coeffs == cal.apply(prof.coefficients)
    assert cost.grad_sync_time() == pytest.approx(0.07)  # the in-situ per-step time
    assert cost.cluster.intra_node_bw == 1e8 and cost.cluster.intra_node_latency_s == 3e-3
    iso = bench.make_cost(replace(prof, runtime=cal), 2, a2a, 0.03, calibrated=False)
    assert iso.coeffs == prof.coefficients and iso.grad_sync_time() == pytest.approx(0.03)
