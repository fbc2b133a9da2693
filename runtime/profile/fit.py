"""Turn measured points into cost coefficients (dcp_opt.fit), and measure all-to-all.

Per block type: forward and backward time fits (quad, lin, seq, const) on the points with
recompute off; activation bytes per token from the saved-tensor bytes with recompute off,
checkpoint bytes per token from those with recompute on. A 2D layer holds both blocks'
activations (their sum), but a checkpointed layer keeps only its input, which is the first
block's input. The head's per-token time and constant give `head_*_per_token_s` and
`microbatch_overhead_s`. The all-to-all volume per token per layer is analytic (cost.py,
DeepSpeed-Ulysses eq. 1 / DSP sec. 3); its bandwidth is measured where a process group exists,
and so are cp's all-gather and reduce-scatter (measure_cp_collectives; dcp_opt/cost/cp.py,
Measured rates) and the ring's P2P step (measure_ring_steps; dcp_opt/cost/ring.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from functools import partial

import numpy as np
import torch
from scipy.optimize import nnls

from dcp_opt.cluster import Cluster
from dcp_opt.cost import BlockCoeffs, CostCoefficients, flops_coefficients
from dcp_opt.cost.cp import CPMeasurement
from dcp_opt.cost.ring import RingMeasurement
from dcp_opt.fit import fit_block_time, fit_nonneg, fit_per_token
from dcp_opt.profile_io import A2AMeasurement, RuntimeCalibration, utc_now

from .blocks import ProfileTarget

# flops_coefficients() needs a cluster only for rates; the profile keeps just its analytic
# all-to-all volume (bytes per token per layer), which does not depend on the cluster.
_ANY_CLUSTER = Cluster("any", 1, 1, 1e12, 1e12, 1e9, 1e9)


def fit_points(target: ProfileTarget, points: list, config) -> tuple:
    """(CostCoefficients, fit report dict) from measured points."""
    model = target.model
    kw = dict(holdout_fraction=config.holdout_fraction, seed=config.seed)
    blocks, report = {}, {}
    act = ckpt = 0.0
    for i, name in enumerate(model.block_types):
        block = target.blocks[name]
        # a 3d adapter runs several layers per call (a joint model's double and single blocks
        # in proportion): one layer's time and kept bytes are the call's / layers_per_call;
        # a checkpointed call keeps one input, as a checkpointed layer does (not divided)
        per = int(getattr(block, "layers_per_call", 1) or 1)
        plain = [_per_layer(p, per) for p in points if p.block == name and not p.recompute]
        rec = [p for p in points if p.block == name and p.recompute]
        shapes = [p.shapes for p in plain]
        # the measured layer's own sliding window (an HF adapter's; 0: none): the fit's Q is
        # then the cost model's windowed term (dcp_opt.cost.windowed_quad); a 3d layer's joint
        # text tokens per sample join its Q (dcp_opt.cost.dit3d.quad)
        win = dict(kw, window=int(getattr(block, "window", 0) or 0))
        win["joint_text"] = int(getattr(block, "joint_text", 0) or 0)
        f = fit_block_time(name, shapes, [p.fwd_s for p in plain], label=f"{name}.fwd", **win)
        b = fit_block_time(name, shapes, [p.bwd_s for p in plain], label=f"{name}.bwd", **win)
        blocks[name] = (f.as_terms(), b.as_terms())
        toks = [p.tokens for p in plain]
        m_act = fit_per_token(
            toks, [p.saved_bytes for p in plain], label=f"{name}.act_bytes", with_const=False, **kw
        )
        m_ck = fit_per_token(
            [p.tokens for p in rec],
            [p.saved_bytes for p in rec],
            label=f"{name}.ckpt_bytes",
            with_const=False,
            **kw,
        )
        act += m_act.coef[0]  # a 2D layer holds both blocks' activations
        if i == 0:  # a checkpointed layer keeps only its input: the first block's input
            ckpt = m_ck.coef[0]
        report[name] = {
            "fwd": f.report.to_dict(),
            "bwd": b.report.to_dict(),
            "act_bytes": m_act.report.to_dict(),
            "ckpt_bytes": m_ck.report.to_dict(),
            "recompute_extra_forward_ratio": _recompute_ratio(
                plain, [_per_layer(p, per) for p in rec]
            ),
            **(_window_check(name, plain, win, kw) if win["window"] else {}),
            "num_points": len(plain) + len(rec),
        }
    head = _fit_head(points, report, kw)
    base = flops_coefficients(model, _ANY_CLUSTER)
    coeffs = CostCoefficients(
        blocks={k: BlockCoeffs(f, b) for k, (f, b) in blocks.items()},
        head_fwd_per_token_s=head["fwd"][0],
        head_bwd_per_token_s=head["bwd"][0],
        microbatch_overhead_s=head["fwd"][1] + head["bwd"][1],
        a2a_bytes_per_token_layer=base.a2a_bytes_per_token_layer,
        a2a_calls_per_layer=base.a2a_calls_per_layer,
        act_bytes_per_token_layer=act,
        ckpt_bytes_per_token_layer=ckpt,
        head_bytes_per_token=head["bytes"],
        reserved_bytes=0.0 if config.reserved_bytes is None else config.reserved_bytes,
        source="profile",
    )
    return coeffs, report


def _per_layer(p, layers: int):
    """Point `p` of a call that ran `layers` layers, as one layer's average."""
    if layers == 1:
        return p
    return replace(
        p,
        fwd_samples=tuple(x / layers for x in p.fwd_samples),
        bwd_samples=tuple(x / layers for x in p.bwd_samples),
        saved_bytes=p.saved_bytes / layers,
    )


def _window_check(name: str, plain: list, win: dict, kw: dict) -> dict:
    """The window the fit used and, beside it, the held-out median error of the same points
    fitted on plain s^2: a kernel that computes the whole s x s block and masks it (not
    FlashAttention's `window_size`) fits s^2 better, which says the measured kernel does not
    exploit the window the cost model charges (docs/profiler.md, limitations)."""
    shapes = [p.shapes for p in plain]
    plain_err = {
        part: fit_block_time(
            name, shapes, [getattr(p, f"{part}_s") for p in plain], warn=False, **kw
        ).report.median_rel_err_test
        for part in ("fwd", "bwd")
    }
    return {"window": win["window"], "plain_s2_median_rel_err_test": plain_err}


def _recompute_ratio(plain: list, rec: list) -> float | None:
    """Median of (bwd with recompute - bwd without) / fwd; the cost model assumes 1."""
    by = {p.shapes: p for p in plain}
    r = [(q.bwd_s - by[q.shapes].bwd_s) / by[q.shapes].fwd_s for q in rec if q.shapes in by]
    return statistics.median(r) if r else None


def _fit_head(points: list, report: dict, kw: dict) -> dict:
    hp = [p for p in points if p.block == "head"]
    if len(hp) < 3:
        return {"fwd": (0.0, 0.0), "bwd": (0.0, 0.0), "bytes": 0.0}
    toks = [p.tokens for p in hp]
    f = fit_per_token(toks, [p.fwd_s for p in hp], label="head.fwd", with_const=True, **kw)
    b = fit_per_token(toks, [p.bwd_s for p in hp], label="head.bwd", with_const=True, **kw)
    m = fit_per_token(
        toks, [max(p.saved_bytes, 1.0) for p in hp], label="head.bytes", with_const=False, **kw
    )
    report["head"] = {"fwd": f.report.to_dict(), "bwd": b.report.to_dict()}
    return {"fwd": f.coef, "bwd": b.coef, "bytes": m.coef[0]}


def _device():
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _timed(call, group, repeats: int) -> float:
    """Median seconds of `call()` over `repeats` (after one warm-up), the group's slowest.
    Under NCCL the collective is asynchronous on the stream: the device is synchronised before
    the clock stops."""
    import torch.distributed as dist

    cuda = dist.get_backend(group) == "nccl"
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(statistics.median(times))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the group waits for the slowest
    return float(t)


def _fit_rates(xs, ys, label: str, group) -> tuple[float, float]:
    """(bandwidth, latency per call) of time = latency + bytes_sent / bandwidth."""
    import torch.distributed as dist

    fit = fit_nonneg(
        xs, ys, ("latency", "inv_bw"), label=label, holdout_fraction=0.0,
        warn=dist.get_rank(group) == 0,
    )  # fmt: skip
    return 1.0 / max(fit.coef[1], 1e-15), fit.coef[0]


def measure_all_to_all(
    group=None, *, sizes_bytes=(1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24), repeats: int = 7
):
    """A2AMeasurement of `group` (default: the world): time = latency + bytes_sent/bw.

    Every rank of the group must call it. Bytes sent per rank = (d-1)/d of its buffer."""
    import torch.distributed as dist

    d, dev = dist.get_world_size(group), _device()
    xs, ys = [], []
    for nbytes in sizes_bytes:
        n = max(d, nbytes // 4 // d * d)
        send, recv = torch.ones(n, device=dev), torch.empty(n, device=dev)
        ys.append(_timed(partial(dist.all_to_all_single, recv, send, group=group), group, repeats))
        xs.append([1.0, n * 4 * (d - 1) / d])
    bw, lat = _fit_rates(xs, ys, f"a2a[{d}]", group)
    return A2AMeasurement(d, bw, lat)


def measure_cp_collectives(
    group=None, *, sizes_bytes=(1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24), repeats: int = 7
) -> CPMeasurement:
    """CPMeasurement of `group` (default: the world): the runtime's own cp collectives
    (runtime/cp.py all_gather_raw of K/V, reduce_scatter_raw of dK/dV), each fitted as
    time = latency + bytes_sent / bw with bytes sent per rank = (d-1)/d of the gathered
    buffer (dcp_opt/cost/cp.py). `sizes_bytes`: gathered buffer sizes. Every rank calls it."""
    import torch.distributed as dist

    from ..cp import all_gather_raw, reduce_scatter_raw
    from ..sp import SPGroup

    d, dev = dist.get_world_size(group), _device()
    sp = SPGroup(group, d, dist.get_rank(group))
    xs, ag, rs = [], [], []
    for nbytes in sizes_bytes:
        n = max(d, nbytes // 4 // d * d)  # float32 elements of the gathered buffer
        part, whole = torch.ones(n // d, device=dev), torch.ones(n, device=dev)
        ag.append(_timed(partial(all_gather_raw, part, sp), group, repeats))
        rs.append(_timed(partial(reduce_scatter_raw, whole, sp), group, repeats))
        xs.append([1.0, n * 4 * (d - 1) / d])
    return CPMeasurement(
        d, *_fit_rates(xs, ag, f"cp.all_gather[{d}]", group),
        *_fit_rates(xs, rs, f"cp.reduce_scatter[{d}]", group),
    )  # fmt: skip


def measure_ring_steps(
    group=None, *, sizes_bytes=(1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24), repeats: int = 7
) -> RingMeasurement:
    """RingMeasurement of `group` (default: the world): the runtime's own ring step
    (runtime/ring.py `exchange`: one block to the next member, one from the previous, one
    batch_isend_irecv, waited), fitted as time = latency + block bytes / bw
    (dcp_opt/cost/ring.py). `sizes_bytes`: block sizes. Every rank calls it."""
    import torch.distributed as dist

    from ..ring import exchange_step
    from ..sp import SPGroup

    d, dev = dist.get_world_size(group), _device()
    sp = SPGroup(group, d, dist.get_rank(group))
    xs, ys = [], []
    for nbytes in sizes_bytes:
        n = max(1, nbytes // 4)  # float32 elements of one block
        send, recv = torch.ones(n, device=dev), torch.empty(n, device=dev)
        ys.append(_timed(partial(exchange_step, send, recv, sp), group, repeats))
        xs.append([1.0, n * 4.0])
    return RingMeasurement(d, *_fit_rates(xs, ys, f"ring.step[{d}]", group))


def _a2a_worker(rank: int, world: int, port: int, sizes, queue, with_cp: bool, nbytes) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        a2a, cp, ring = [], [], []
        for d in sizes:
            group = dist.new_group(list(range(d)))  # every rank creates every group
            if rank < d:
                kw = {} if nbytes is None else {"sizes_bytes": nbytes}
                a2a.append(measure_all_to_all(group, **kw))
                if with_cp:
                    cp.append(measure_cp_collectives(group, **kw))
                    ring.append(measure_ring_steps(group, **kw))
        if rank == 0:
            queue.put((a2a, cp, ring))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_comm_local(
    world: int, *, timeout_s: float = 120.0, cp: bool = True, sizes_bytes=None
) -> tuple[tuple[A2AMeasurement, ...], tuple[CPMeasurement, ...], tuple[RingMeasurement, ...]]:
    """Spawn `world` gloo processes on this host; all-to-all and (with `cp`) cp's all-gather
    and reduce-scatter and the ring's P2P step of every group size 2, 4, ... and `world`
    (the degrees the runtime runs on this host). Returns (a2a, cp, ring) measurements, all
    empty below world 2.
    `sizes_bytes`: the buffer sizes to time (default: the measure_* functions')."""
    import socket

    import torch.multiprocessing as mp

    if world < 2:
        return (), (), ()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    sizes = [d for d in (2, 4, 8, 16, 32, 64) if d < world] + [world]
    procs = [
        ctx.Process(target=_a2a_worker, args=(r, world, port, sizes, queue, cp, sizes_bytes))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        a2a, cps, rings = _result(queue, procs, timeout_s)
        return tuple(a2a), tuple(cps), tuple(rings)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def _result(queue, procs, timeout_s: float):
    """rank 0's result; a worker that dies first (an import error, a crash) fails at once
    instead of after the whole timeout."""
    import queue as queue_mod

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"measure_comm_local: a worker exited with {dead[0]}") from None
    raise TimeoutError(f"measure_comm_local: no result within {timeout_s} s")


def measure_a2a_local(world: int, *, timeout_s: float = 120.0) -> tuple[A2AMeasurement, ...]:
    """Spawn `world` gloo processes on this host; all-to-all of every group size 2..world."""
    return measure_comm_local(world, timeout_s=timeout_s, cp=False)[0]


# ---- runtime calibration: the isolated profile against a real run of the executor ----------
def _any_cluster(world: int) -> Cluster:
    return Cluster("calibration", 1, world, 1e15, 1e12, 1e9, 1e9)


def fit_runtime_calibration(
    model, coeffs: CostCoefficients, world: int, samples: list[dict], steps: list[dict]
) -> RuntimeCalibration:
    """Fit a RuntimeCalibration (its docstring gives the model) to in-situ measurements.

    samples: per micro-batch {"degree", "shapes", "recompute", "measured_s", "cpu_s"}
    (wall seconds as the executor reports them); steps: per step {"step_s", "mb_s",
    "grad_sync_s"} of the slowest rank (largest micro-batch sum)."""
    from dcp_opt.batch import Sequence
    from dcp_opt.cost import CostModel

    cluster = _any_cluster(world)
    raw = CostModel(model, cluster, coeffs)

    def seqs(s):
        return [Sequence(i, tuple(sh)) for i, sh in enumerate(s["shapes"])]

    def pred(cost, s):
        return cost.microbatch_time(seqs(s), s["degree"], s["recompute"], spans_nodes=False)

    one = [s for s in samples if s["degree"] == 1]
    x = [[pred(raw, s).total_s, 1.0] for s in one]
    f1 = fit_nonneg(
        x, [s["measured_s"] for s in one], ("compute_factor", "overhead"), label="runtime[d=1]"
    )
    k, c = max(f1.coef[0], 1e-3), f1.coef[1]
    cal = RuntimeCalibration(world, k, c, None, None, 0.0)
    cost = CostModel(model, cluster, cal.apply(coeffs))
    report = {"degree_1": f1.report.to_dict()}
    multi = [s for s in samples if s["degree"] > 1]
    terms = _fit_degree_terms(cost, multi, seqs) if len(multi) >= 2 else None
    if terms is not None:
        report.update(terms.pop("report"))
    sync = statistics.median(max(s["step_s"] - s["mb_s"], 0.0) for s in steps) if steps else 0.0
    report["executor_grad_sync_s"] = (
        statistics.median(s["grad_sync_s"] for s in steps) if steps else 0.0
    )
    # what the step pays beyond micro-batches and the executor's gradient sum: optimizer,
    # bookkeeping (CostModel.step_overhead_s); the sum itself stays the gradient sync
    step = (
        statistics.median(max(s["step_s"] - s["mb_s"] - s["grad_sync_s"], 0.0) for s in steps)
        if steps
        else 0.0
    )
    cal = RuntimeCalibration(
        world,
        k,
        c,
        None if terms is None else terms["bw"],
        None if terms is None else terms["lat"],
        sync,
        report,
        (),
        utc_now(),
        sp_compute_overhead=() if terms is None else terms["over"],
        replicated_seq_s_per_layer=0.0 if terms is None else terms["rep"],
        step_overhead_s=min(step, sync),
    )
    full = CostModel(model, cluster, cal.apply(coeffs), **cal.cost_knobs(model, cluster))
    if terms is not None:
        full = full.with_(
            cluster=cluster.with_(intra_node_bw=terms["bw"], intra_node_latency_s=terms["lat"])
        )
    # what each calibration micro-batch is predicted to take: raw profile, then calibrated
    rows = tuple(
        {**s, "isolated_s": pred(raw, s).total_s, "predicted_s": pred(full, s).total_s}
        for s in samples
    )
    return replace(cal, samples=rows)


def _degree_rows(cost, multi: list[dict], seqs) -> dict[str, np.ndarray]:
    """Per degree > 1 sample, the columns of CostModel's time at degree d beyond the
    calibrated compute (y): `layer`, the layers' time that (1 + x_d) multiplies (forward,
    backward and recomputed forwards); `rep`, what one second of replicated per-sample work
    per layer adds at d (it is in the profile's seq term, split d ways: S (L + r/3)(1 - 1/d),
    the 1/3 of a recomputed forward as CostModel charges it); `bytes` and `lat`, the
    all-to-all per layer as CostModel.comm_time_per_layer charges it (DeepSpeed-Ulysses
    eq. 1: each rank sends (d-1)/d of its T/d tokens), over 2L + r passes."""
    co, L = cost.coeffs, cost.model.num_layers
    cols: dict[str, list] = {k: [] for k in ("d", "layer", "rep", "bytes", "lat", "y")}
    for s in multi:
        d, r, ss = s["degree"], s["recompute"], seqs(s)
        feats = sum(cost.features(q) for q in ss)
        fwd, bwd = cost.layer_times(feats, d)
        p = cost.microbatch_time(ss, d, r, spans_nodes=False)
        calls, t = 2 * L + r, float(feats[-2])
        cols["d"].append(d)
        cols["layer"].append(L * (fwd + bwd) + r * fwd)
        cols["rep"].append(len(ss) * (L + r / 3) * (1 - 1 / d))
        cols["bytes"].append(calls * float(cost.a2a_bytes_per_token(d)) * t / d * (d - 1) / d)
        cols["lat"].append(calls * co.a2a_calls_per_layer * (d - 1))
        cols["y"].append(s["measured_s"] - p.compute_s - p.recompute_s)
    return {k: np.asarray(v, dtype=float) for k, v in cols.items()}


def _nnls(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Absolute NNLS, columns scaled to unit norm: a residual may be ~0 or negative (noise),
    which the relative fit of dcp_opt.fit cannot take; the coefficients stay >= 0."""
    norms = np.linalg.norm(xs, axis=0)
    norms[norms == 0] = 1.0
    return nnls(xs / norms, ys)[0] / norms


def _fit_degree_terms(cost, multi: list[dict], seqs, rounds: int = 4) -> dict | None:
    """Jointly, from the degree > 1 samples: the SP compute overhead x_d per degree, the
    replicated per-sample seconds per layer R, and the in-situ all-to-all (bandwidth,
    per-peer latency). The all-to-all bytes are the cost model's, so the time beyond the
    calibrated compute, y = x_d * layer + R (1 + x_d) rep + bytes / bw + lat * calls,
    separates by its shape over micro-batches of different lengths and packings (attention
    grows with s^2, the all-to-all with tokens, the latency per call). (1 + x_d) multiplies
    R: a few rounds, each refitting with the previous x_d (exact on noiseless data).
    R is bounded by the profile's own per-sample time (it is part of it): at the bound it is
    fixed and the rest refitted. Too few samples for every term: the all-to-all alone."""
    c = _degree_rows(cost, multi, seqs)
    degrees = sorted(set(c["d"].astype(int).tolist()))
    seq = {p: sum(getattr(b, p).seq for b in cost.coeffs.blocks.values()) for p in ("fwd", "bwd")}
    r_max = min(3 * seq["fwd"], 1.5 * seq["bwd"])  # R/3 forward, 2R/3 backward (CostModel)
    full = len(multi) >= len(degrees) + 3 + 2
    over = dict.fromkeys(degrees, 0.0)
    rep = 0.0
    for _ in range(rounds if full else 1):
        grow = 1 + np.array([over[int(d)] for d in c["d"]])
        sp = [np.where(c["d"] == d, c["layer"], 0.0) for d in degrees] if full else []
        base = np.column_stack([*sp, c["bytes"], c["lat"]])
        y = c["y"]
        if full and r_max > 0:
            coef = _nnls(np.column_stack([base, c["rep"] * grow]), y)
            rep = min(coef[-1], r_max)
            if coef[-1] > r_max:  # at the bound: fixed, the rest refitted
                coef = _nnls(base, y - rep * c["rep"] * grow)
        else:
            coef = _nnls(base, y)
        if full:
            over = {d: float(coef[i]) for i, d in enumerate(degrees)}
    n = len(degrees) if full else 0
    inv_bw, lat = coef[n], coef[n + 1]
    grow = 1 + np.array([over[int(d)] for d in c["d"]])
    fitted = sum(over[d] * np.where(c["d"] == d, c["layer"], 0.0) for d in degrees)
    fitted = fitted + rep * grow * c["rep"] + inv_bw * c["bytes"] + lat * c["lat"]
    report = {
        "a2a": {"residual_s": c["y"].tolist(), "fitted_s": np.asarray(fitted).tolist()},
        "sp_overhead": {
            "fitted": full,
            "per_degree": {str(d): x for d, x in over.items()},
            "replicated_seq_s_per_layer": rep,
            "replicated_bound_s": r_max,
        },
    }
    return {
        "bw": 1.0 / max(inv_bw, 1e-15),
        "lat": float(lat),
        "over": tuple((d, x) for d, x in over.items() if x > 0),
        "rep": float(rep),
        "report": report,
    }
