"""Sequence-parallel building blocks: the group pool, the autograd all-to-all, Ulysses
attention and DSP switching, on a world of 3 ranks (not a power of two: degrees {1, 3}, 4 heads
padded to 6, lengths padded to multiples of 3); plus single-process checks of the models."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import LMConfig, SPState, TinyLM, parallelize
from dcp_opt.runtime.attention import segment_attention
from dcp_opt.runtime.sp import (
    SPGroup,
    all_to_all,
    frames_to_tokens,
    shard_bounds,
    tokens_to_frames,
    ulysses_attention,
)
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch
from dcp_opt.plan import Group, MicroBatch
from tests.test_runtime_equiv import check_equivalent, cost_for, make_plan


@pytest.fixture(scope="module")
def world3():
    w = DistWorkers(3, timeout_s=120.0)
    yield w
    w.close()


def _sp(ctx) -> SPGroup:
    return SPGroup(ctx.pool.get(0, 3), 3, ctx.rank)


# ---- jobs run on every rank -----------------------------------------------------------------
def job_pool_keys(ctx):
    return sorted(ctx.pool.groups), ctx.pool.degrees


def job_all_to_all(ctx):
    # Rank r holds x_r[i, c] = 100 r + 10 i + c, shape [6, 2]; scatter dim 0 (chunks of 2 rows),
    # gather dim 1: y_r = [x_0[2r:2r+2] | x_1[2r:2r+2] | x_2[2r:2r+2]], shape [2, 6].
    r = ctx.rank
    i, c = torch.meshgrid(torch.arange(6.0), torch.arange(2.0), indexing="ij")
    x = (100 * r + 10 * i + c).double().requires_grad_()
    y = all_to_all(x, _sp(ctx), scatter_dim=0, gather_dim=1)
    # Loss sum_r <y_r, w_r> with w_r = r + 1 everywhere: x_j's chunk r lands on rank r, so
    # d loss / d x_j[2r:2r+2] = r + 1.
    (y * (r + 1)).sum().backward()
    return y.detach(), x.grad


def job_ulysses(ctx, length: int, heads: int, causal: bool):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(length, heads, 4, generator=g, dtype=torch.float64) for _ in range(3))
    w = torch.randn(length, heads, 4, generator=g, dtype=torch.float64)
    segments = torch.tensor([0] * (length // 2) + [1] * (length - length // 2))
    padded, lo, hi = shard_bounds(length, 3, ctx.rank)
    seg_pad = torch.cat([segments, torch.full((padded - length,), -1)])

    def pad(x):
        return torch.cat([x, x.new_zeros(padded - length, *x.shape[1:])])

    ql, kl, vl = (pad(x)[lo:hi].clone().requires_grad_() for x in (q, k, v))
    out = ulysses_attention(
        ql, kl, vl, _sp(ctx), segment_attention, segments=seg_pad, causal=causal
    )
    (out * pad(w)[lo:hi]).sum().backward()
    return out.detach(), ql.grad, kl.grad, vl.grad, (q, k, v, w, segments)


def job_dsp_roundtrip(ctx, frames: int, spatial: int):
    sp = _sp(ctx)
    f_pad, lo, hi = shard_bounds(frames, 3, ctx.rank)
    video = torch.arange(frames * spatial * 2.0).reshape(frames, spatial, 2).double()
    full = torch.cat([video, video.new_zeros(f_pad - frames, spatial, 2)])
    mine = full[lo:hi].clone().requires_grad_()
    temporal = frames_to_tokens(mine, sp)
    back = tokens_to_frames(temporal * 2, sp, spatial)
    back.sum().backward()
    return temporal.detach(), back.detach(), mine.detach(), mine.grad, full


# ---- tests ----------------------------------------------------------------------------------
def test_group_pool_world3_has_every_aligned_group(world3):
    # 1 node x 3 GPUs: degrees {1 (powers of two dividing 3), 3 (the node)}; placements
    # 0, 1, 2 for degree 1 and 0 for degree 3 -> 4 groups, same keys on every rank.
    for keys, degrees in world3.run(job_pool_keys):
        assert keys == [(0, 1), (0, 3), (1, 1), (2, 1)]
        assert degrees == (1, 3)


def test_all_to_all_values_and_backward_world3(world3):
    results = world3.run(job_all_to_all)
    for r, (y, grad) in enumerate(results):
        for j in range(3):
            rows = torch.arange(2 * r, 2 * r + 2, dtype=torch.float64)
            want = 100 * j + 10 * rows[:, None] + torch.arange(2.0)[None, :]
            assert torch.equal(y[:, 2 * j : 2 * j + 2], want)
        want_grad = torch.repeat_interleave(torch.arange(1.0, 4.0), 2)[:, None].expand(6, 2)
        assert torch.equal(grad, want_grad.double())


@pytest.mark.parametrize("length,causal", [(8, True), (7, False), (2, True)])
def test_ulysses_equals_local_attention_world3(world3, length, causal):
    results = world3.run(job_ulysses, length, 4, causal)
    q, k, v, w, segments = results[0][4]
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    want = segment_attention(q, k, v, segments=segments, causal=causal)
    (want * w).sum().backward()
    got = torch.cat([r[0] for r in results])[:length]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for i, ref in enumerate((q.grad, k.grad, v.grad), start=1):
        grad = torch.cat([r[i] for r in results])[:length]
        assert torch.allclose(grad, ref, rtol=1e-12, atol=1e-12)


def test_dsp_switch_layouts_world3(world3):
    # F = 4 frames -> padded to 6, 2 per rank; S = 5 spatial tokens -> padded to 6, 2 per rank.
    results = world3.run(job_dsp_roundtrip, 4, 5)
    full = results[0][4]
    for r, (temporal, back, mine, grad, _) in enumerate(results):
        assert temporal.shape == (6, 2, 2)
        want = torch.cat([full, full.new_zeros(6, 1, 2)], dim=1)[:, 2 * r : 2 * r + 2]
        assert torch.equal(temporal, want)
        assert torch.equal(back, 2 * mine)
        assert torch.equal(grad, torch.full_like(grad, 2.0))  # d(2x)/dx through both switches


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_grad_equiv_world3_mixed_phases(world3, kind):
    # Phase 0: one degree-3 group, two micro-batches (one packed, recompute 1 and L);
    # phase 1: three degree-1 groups with 2, 0 and 1 micro-batches (rank 1 idle).
    if kind == "1d":
        batch = Batch.from_lengths([7, 2, 10, 1, 5, 4])
    else:
        batch = Batch.from_shapes(
            [(4, 2, 3), (1, 1, 2), (5, 1, 1), (2, 3, 2), (1, 2, 2), (3, 1, 2)]
        )
    cost = cost_for(kind, 3)
    last = cost.model.num_layers
    phases = [
        [Group(0, 3, (MicroBatch((0, 1), 1), MicroBatch((2,), last)))],
        [
            Group(0, 1, (MicroBatch((3,), 0), MicroBatch((4,), last))),
            Group(1, 1, ()),
            Group(2, 1, (MicroBatch((5,), 1),)),
        ],
    ]
    plan = make_plan(phases, batch, cost, planner="hand")
    check_equivalent(world3, kind, plan, batch)


# ---- single process -------------------------------------------------------------------------
def test_shard_bounds_arithmetic():
    # 7 items over 3 ranks: ceil(7/3) = 3 each, padded to 9; rank 2 holds [6, 9).
    assert shard_bounds(7, 3, 2) == (9, 6, 9)
    assert shard_bounds(6, 3, 1) == (6, 2, 4)


def test_packed_stream_equals_separate_sequences():
    torch.manual_seed(0)
    model = TinyLM(LMConfig(vocab_size=16, hidden=8, num_heads=2, num_layers=2)).double()
    a, b = torch.randint(16, (5,)), torch.randint(16, (3,))
    packed = model(
        torch.cat([a, b]),
        torch.cat([torch.arange(5), torch.arange(3)]),
        torch.tensor([0] * 5 + [1] * 3),
    )
    alone_a = model(a, torch.arange(5), torch.zeros(5, dtype=torch.long))
    alone_b = model(b, torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert torch.allclose(packed, torch.cat([alone_a, alone_b]), rtol=1e-12, atol=1e-12)


def test_parallelize_keeps_names_and_recomputes_first_layers():
    torch.manual_seed(0)
    model = TinyLM(LMConfig(vocab_size=16, hidden=8, num_heads=2, num_layers=3)).double()
    names = [n for n, _ in model.named_parameters()]
    state = SPState(recompute_layers=2)
    parallelize(model, state)
    assert [n for n, _ in model.named_parameters()] == names
    calls = [0, 0, 0]
    for i, layer in enumerate(model.layers):
        # A pre-hook on the first op: non-reentrant checkpointing stops recomputing once the
        # last saved tensor is rebuilt, so hooks late in the layer may not fire again.
        layer.norm1.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    tokens = torch.randint(16, (6,))
    model(tokens, torch.arange(6), torch.zeros(6, dtype=torch.long)).sum().backward()
    # Layers 0 and 1 run forward again during backward; layer 2 keeps its activations.
    assert calls == [2, 2, 1]


def test_core_stays_torch_free():
    # (The runtime -> solvers layering rule lives in tests/test_core.py.)
    import subprocess
    import sys

    code = "import sys, dcp_opt; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pool_rejects_plans_it_cannot_run():
    from dcp_opt.runtime import GroupPool

    from dcp_opt.errors import DcpOptError
    from dcp_opt.plan import Phase, Plan

    # A world of 2: groups (0,1), (1,1), (0,2). A degree-2 group at start 1 is misaligned.
    pool = GroupPool({(0, 1): None, (1, 1): None, (0, 2): None}, 0, 2, (1, 2))
    ok = Plan((Phase((Group(0, 2, (MicroBatch((0,)),)),)),), 2, 1.0)
    pool.check_plan(ok)
    bad = Plan((Phase((Group(0, 1), Group(1, 2, (MicroBatch((0,)),)))),), 2, 1.0)
    with pytest.raises(DcpOptError, match="start 1 with degree 2"):
        pool.check_plan(bad)
    with pytest.raises(DcpOptError, match="num_ranks"):
        pool.check_plan(Plan(ok.phases, 4, 1.0))
