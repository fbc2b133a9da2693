"""runtime/cp.py at world 2 (gloo) against the cost model: what its attention keeps for
backward (saved_tensors_hooks) against cp's memory term (dcp_opt/cp_cost.py extra_act_bytes),
and its collectives as the profiler measures them (runtime/profile/fit.py)."""

from __future__ import annotations

import pytest
import torch

from dcp_opt.cost import CostModel
from dcp_opt.cp_cost import extra_act_bytes, kv_bytes_per_token
from dcp_opt.model import ModelSpec
from tests.test_cp_cost import CLUSTER, COEFFS, MODEL

HEADS, KV_HEADS, DH, LENGTHS = 4, 2, 8, [40, 24]


def _saved_by_cp_attention(ctx, kv_heads: int):
    from dcp_opt.runtime.cp import cp_attention, head_tail_layout
    from dcp_opt.runtime.sp import SPGroup

    torch.manual_seed(ctx.rank)
    d = ctx.world_size
    sp = SPGroup(None, d, ctx.rank)
    layout = head_tail_layout(LENGTHS, d)
    m = layout.shape[1]
    starts = torch.tensor([0, LENGTHS[0]])
    whole = layout.reshape(-1)
    segments = torch.bucketize(whole.sort().values, starts, right=True) - 1
    segments[sum(LENGTHS) :] = -1
    positions = torch.arange(whole.numel()) - starts[segments.clamp(min=0)]
    q = torch.randn(m, HEADS, DH, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(m, kv_heads, DH, dtype=torch.float64, requires_grad=True) for _ in "kv")
    saved, seen = [], set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in {x.untyped_storage().data_ptr() for x in (q, k, v)}:
            seen.add(ptr)
            saved.append((tuple(t.shape), str(t.dtype), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cp_attention(q, k, v, sp, layout=layout, segments=segments, positions=positions)
    return m, saved


@pytest.fixture(scope="module")
def workers():
    from dcp_opt.runtime.testing import DistWorkers

    w = DistWorkers(2, timeout_s=60.0)
    yield w
    w.close()


def _measure(ctx):
    from dcp_opt.runtime.profile.fit import measure_cp_collectives

    return measure_cp_collectives(None, sizes_bytes=(1 << 16, 1 << 20, 1 << 22), repeats=3)


@pytest.mark.dist
def test_measured_on_gloo_at_world_2(workers):
    # the runtime's own collectives (runtime/cp.py) on two gloo ranks, up to 4 MB; every
    # rank fits the same group-wide (slowest member's) times
    got = workers.run(_measure)
    assert got[0] == got[1] and got[0].group_size == 2
    for bw, lat in (got[0].rates("all_gather"), got[0].rates("reduce_scatter")):
        # finite rates of a CPU's copies (the fit caps an unmeasurable 1/bw at 1e15 B/s)
        assert 1e5 < bw <= 1e15 and 0 <= lat < 1.0
    CostModel(MODEL, CLUSTER, COEFFS, cp_comm=(got[0],))  # usable as measured


@pytest.mark.dist
@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS])
def test_cp_keeps_the_gathered_kv_the_cost_model_charges(workers, kv_heads):
    # float64, 4 query heads of 8 dims; M = 32 local tokens of two sequences (40 + 24) at d=2
    d = 2
    spec = ModelSpec("t", "1d", 1, HEADS * DH, HEADS, 64, vocab_size=10, num_kv_heads=kv_heads,
                     dtype_bytes=8)  # fmt: skip
    for m, saved in workers.run(_saved_by_cp_attention, kv_heads):
        # the gathered K and V ([1, kv_heads, d M, DH] each, one buffer under MHA): d M tokens
        # x kv_bytes = the own tokens' (in act_bytes, as Ulysses') + extra_act_bytes' (d-1) M
        kv = sum(b for shape, _, b in saved if len(shape) == 4 and shape[2] == d * m)
        want = m * (kv_bytes_per_token(spec) + float(extra_act_bytes(spec, d)))
        assert kv == want == d * m * 2 * kv_heads * DH * 8
        # the rest: the output and logsumexp of the local queries (per local token, as under
        # Ulysses), and the mask [M, d M] as a float, quadratic, which the cost model does not
        # charge (docs/cost-model.md, cp: what the runtime keeps)
        rest = {shape: b for shape, _, b in saved if not (len(shape) == 4 and shape[2] == d * m)}
        assert rest == {(m, d * m): m * d * m * 8, (1, HEADS, m, DH): m * HEADS * DH * 8,
                        (1, HEADS, m): m * HEADS * 8}  # fmt: skip
