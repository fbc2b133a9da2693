"""Context parallelism (`cp` groups) in the runtime: head-tail layout, and gradient
equivalence (float64, gloo, worlds 2 and 4) of plans with cp groups and of plans mixing cp and
Ulysses groups in one step, for TinyLM and a transformers Llama (GQA too). The reference is
tests/reference.py's objective from each whole sequence's forward (test_runtime_equiv.py,
test_runtime_hf.py). At the end: what cp_attention keeps for backward against the cost
model's memory term, and its collectives as the profiler measures them."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime.cp import head_tail_layout
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch, make_plan, validate
from dcp_opt.cost import CostModel
from dcp_opt.cost.cp import extra_act_bytes, kv_bytes_per_token
from dcp_opt.model import ModelSpec
from dcp_opt.plan import Group, MicroBatch, Plan
from tests import test_runtime_equiv as lm
from tests import test_runtime_hf as hf
from tests.test_cp_cost import CLUSTER, COEFFS, MODEL


def test_head_tail_layout_balances_causal_pairs():
    # two sequences of 16 and 8 tokens at d=2: 4 chunks each; member 0 holds chunks 0 and 3
    layout = head_tail_layout([16, 8], 2)
    assert layout.tolist() == [
        [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 22, 23],
        [4, 5, 6, 7, 8, 9, 10, 11, 18, 19, 20, 21],
    ]
    # every member has the same causal pairs when 2d divides each length: for chunks of c
    # tokens, 2d c^2 + c per sequence (dcp_opt/cost/cp.py)
    lengths, d = [40, 24, 8], 4
    starts = torch.tensor([0, 40, 64])
    for row in head_tail_layout(lengths, d):
        seg = torch.bucketize(row, starts, right=True) - 1
        pos = row - starts[seg]
        pairs = int((pos + 1).sum())  # query at position p sees p + 1 keys
        assert pairs == sum(2 * d * (n // 8) ** 2 + n // 8 for n in lengths)
    # uneven lengths and sequences shorter than 2d: every token exactly once, padding after
    layout = head_tail_layout([3, 5, 1], 4)
    real = sorted(i for i in layout.reshape(-1).tolist() if i < 9)
    assert real == list(range(9)) and layout.shape == (4, 3)
    assert len(set(layout.reshape(-1).tolist())) == 12


def test_local_chunks_are_runs_inside_one_sequence():
    from dcp_opt.runtime.cp import local_chunks

    # [16, 8] at d=2 (layout above) padded to 24: member 0 holds 0-3, 12-15 | 16-17, 22-23;
    # member 1 holds 4-11 (chunks 1 and 2 adjoin: one run) | 18-21
    layout = head_tail_layout([16, 8], 2)
    segments = torch.tensor([0] * 16 + [1] * 8)
    assert local_chunks(layout, segments, 0) == [(0, 4, 0, 4), (4, 4, 0, 16), (8, 2, 16, 2),
                                                 (10, 2, 16, 8)]  # fmt: skip
    assert local_chunks(layout, segments, 1) == [(0, 8, 0, 12), (8, 4, 16, 6)]
    # padding (segment -1) after 9 real tokens is one more sequence
    layout = head_tail_layout([3, 5, 1], 4)
    segments = torch.tensor([0] * 3 + [1] * 5 + [2] + [-1] * 3)
    got = [ch for r in range(4) for ch in local_chunks(layout, segments, r)]
    covered = sorted(i for _, c, s, p in got for i in range(s + p - c, s + p))
    assert covered == list(range(12))  # every token once, as its chunk's stream indices
    assert {s for _, c, s, p in got if s + p - c >= 9} == {9}  # padding: one sequence at 9


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_prefix_causal_matches_bottom_right_masked_attention(kv_heads):
    # c queries at the end of n keys, the CPU kernel cp_attention uses, against SDPA with the
    # bottom-right causal mask; float64, forward and every gradient
    from dcp_opt.runtime.cp import _PrefixCausal

    torch.manual_seed(0)
    for c, n in [(5, 13), (6, 6), (1, 9)]:
        q = torch.randn(1, 4, c, 8, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, n, 8, dtype=torch.float64, requires_grad=True)
                for _ in "kv")  # fmt: skip
        g = torch.randn(1, 4, c, 8, dtype=torch.float64)
        got = _PrefixCausal.apply(q, k, v, 0.3)
        grads = torch.autograd.grad(got, (q, k, v), g)
        mask = torch.ones(c, n, dtype=torch.bool).tril(n - c)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4
        )
        wants = (want, *torch.autograd.grad(want, (q, k, v), g))
        for a, b in zip((got, *grads), wants, strict=True):
            assert torch.allclose(a, b, atol=1e-12, rtol=0), (c, n, (a - b).abs().max())


def _g(start, degree, kind, *mbs) -> Group:
    return Group(start, degree, tuple(MicroBatch(tuple(ids), r) for ids, r in mbs), kind)


def cp_plans(world: int, batch: Batch, cost) -> list[Plan]:
    """cp alone, and cp beside Ulysses in one phase and across phases; packed micro-batches,
    recompute, a sequence shorter than 2d."""
    ids = [s.id for s in batch.sequences]
    a, b, c, d, e = ids[0], ids[1], ids[2], ids[3], ids[4:]
    if world == 2:
        layouts = [
            [[_g(0, 2, "cp", (ids, 1))]],
            [[_g(0, 2, "cp", ((a, b), 1), ((c,), 0))], [_g(0, 2, "ulysses", ((d, *e), 2))]],
            [[_g(0, 2, "ulysses", ((a,), 0), ((b, c), 1))], [_g(0, 2, "cp", ((d, *e), 0))]],
        ]
    else:
        layouts = [
            [[_g(0, 4, "cp", (ids, 1))]],
            [
                [_g(0, 2, "cp", ((a, c), 2)), _g(2, 2, "ulysses", ((b,), 1))],
                [_g(0, 4, "cp", ((d, *e), 0))],
            ],
            [[_g(0, 2, "ulysses", ((a, b), 0)), _g(2, 2, "cp", ((c,), 1), ((d, *e), 0))]],
        ]
    plans = []
    for k, phases in enumerate(layouts):
        norm = "samples" if k % 2 else "tokens"
        plan = make_plan(phases, batch, cost, planner=f"cp{k}", normalizer_kind=norm)
        assert validate(plan, batch, cost) == []
        plans.append(plan)
    return plans


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def workers(request):
    w = DistWorkers(request.param, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.dist
def test_grad_equiv_tiny_lm_cp_and_mixed_plans(workers):
    batch = Batch.from_lengths([13, 9, 20, 3, 6])
    cost = lm.cost_for("1d", workers.world_size).with_(sp_kinds=("ulysses", "cp"))
    for plan in cp_plans(workers.world_size, batch, cost):
        lm.check_equivalent(workers, "1d", plan, batch)


@pytest.mark.dist
@pytest.mark.parametrize("model_key", ["mha", "gqa8"])
def test_grad_equiv_hf_llama_cp_and_mixed_plans(workers, model_key):
    # gqa8: 8 query heads over 2 kv heads; cp gathers only the 2 kv heads
    batch = Batch.from_lengths(hf.LENGTHS)
    cost = hf.cost_for(workers.world_size, batch).with_(sp_kinds=("ulysses", "cp"))
    plans = cp_plans(workers.world_size, batch, cost)
    if model_key != "mha":
        plans = plans[1:2]  # one mixed plan is enough for the head mapping
    texts = [p.to_json() for p in plans]
    for rank_result in workers.run(hf.job_plans, model_key, batch.to_dict(), texts, 1, wait_s=240):
        for plan, (loss_err, grad_err) in zip(plans, rank_result, strict=True):
            assert loss_err <= hf.TOL and grad_err <= hf.TOL, (plan.planner, loss_err, grad_err)


def test_cp_groups_are_refused_for_a_task_that_cannot_run_them():
    from dcp_opt.runtime import DiffusionTask, LMTask
    from dcp_opt.runtime.executor import check_kinds

    batch = Batch.from_lengths([4, 4])
    plan = make_plan([[_g(0, 2, "cp", ((0, 1), 0))]], batch, lm.cost_for("1d", 2), planner="hand")
    check_kinds(plan, LMTask())  # runs
    with pytest.raises(ValueError, match="kind 'cp' needs a 1D task.*DiffusionTask runs only"):
        check_kinds(plan, DiffusionTask())


# Families whose attention has a sliding window, a softcap or sinks (tests/test_hf_families.py
# builds them, random weights): cp must honour each exactly too.
CP_FAMILIES = ["mistral/window", "gemma2/window+softcap", "gpt_oss/window+sinks"]


@pytest.mark.dist
def test_grad_equiv_hf_families_with_window_softcap_sinks_under_cp(workers):
    from tests import test_hf_families as fam

    batch = Batch.from_lengths(fam.LENGTHS)
    spec = fam.ModelSpec("tiny-hf", "1d", 2, 32, 4, 48, vocab_size=fam.VOCAB, gated_mlp=True)
    cluster = fam.Cluster("cpu", 1, workers.world_size, 1e15, 1e12, 1e10, 1e10)
    cost = fam.CostModel(spec, cluster, sp_kinds=("ulysses", "cp"))
    ids = tuple(range(len(fam.LENGTHS)))
    half = workers.world_size // 2
    layouts = [
        [[_g(0, workers.world_size, "cp", (ids, 1))]],
        [[_g(0, half, "cp", (ids[:3], 0)), _g(half, half, "ulysses", (ids[3:], 1))]],
    ]
    plans = [make_plan(p, batch, cost, planner=f"cp{k}") for k, p in enumerate(layouts)]
    assert all(validate(p, batch, cost) == [] for p in plans)
    texts = [p.to_json() for p in plans]
    results = workers.run(fam.job_matrix, CP_FAMILIES, batch.to_dict(), texts, wait_s=600)
    for entry in CP_FAMILIES:
        low = fam.MATRIX[entry][3]
        for rank_result in results:
            status, rows = rank_result[entry]
            assert status == "ran", (entry, rows)
            for loss_err, exact_err, rough_err in rows:
                assert loss_err <= (fam.LOW_TOL if low == "eager" else fam.TOL), entry
                assert exact_err <= fam.TOL and rough_err <= fam.LOW_TOL, (entry, exact_err)


# ---- what the runtime's cp keeps and sends, against the cost model -----------------------------
# (saved_tensors_hooks on cp_attention; the profiler's measurement of its collectives).
# Lengths large enough that a mask over the stream, M x d M, would outsize the gathered K/V.
CP_HEADS, CP_KV_HEADS, DH, CP_LENGTHS = 4, 2, 8, [200, 136]


def _saved_by_cp_attention(ctx, kv_heads: int, cp_module: str = "dcp_opt.runtime.cp"):
    """(M, {storage: [times saved, shape, dtype, bytes]}) of what autograd keeps from one
    cp_attention call on this member, the inputs q, k, v excluded."""
    import importlib

    from dcp_opt.runtime.sp import SPGroup

    cp_attention = importlib.import_module(cp_module).cp_attention
    torch.manual_seed(ctx.rank)
    d = ctx.world_size
    sp = SPGroup(None, d, ctx.rank)
    layout = head_tail_layout(CP_LENGTHS, d)
    m = layout.shape[1]
    starts = torch.tensor([0, CP_LENGTHS[0]])
    whole = layout.reshape(-1)
    segments = torch.bucketize(whole.sort().values, starts, right=True) - 1
    segments[sum(CP_LENGTHS) :] = -1
    positions = torch.arange(whole.numel()) - starts[segments.clamp(min=0)]
    q = torch.randn(m, CP_HEADS, DH, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(m, kv_heads, DH, dtype=torch.float64, requires_grad=True) for _ in "kv")
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    saved: dict[int, list] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            entry = saved.setdefault(ptr, [0, tuple(t.shape), str(t.dtype), 0])
            entry[0] += 1
            entry[3] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cp_attention(q, k, v, sp, layout=layout, segments=segments, positions=positions)
    return m, list(saved.values())


def _fake_varlen(q, k, v, lengths, k_lengths, *, causal, scale, window):
    """What FlashAttention's varlen call computes (CPU stand-in): query sequence i (c rows)
    against key sequence i (n rows), causal aligned bottom-right, window (w - 1, 0): query r
    sees keys n - c + r - w < j <= n - c + r."""
    assert causal
    outs, qo, ko = [], 0, 0
    for c, n in zip(lengths, k_lengths, strict=True):
        r, j = torch.arange(c)[:, None] + n - c, torch.arange(n)[None, :]
        mask = (j <= r) & (j > r - (window or n + 1))
        q4, k4, v4 = (
            x.transpose(0, 1)[None] for x in (q[qo : qo + c], k[ko : ko + n], v[ko : ko + n])
        )
        att = torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(att[0].transpose(0, 1))
        qo, ko = qo + c, ko + n
    return torch.cat(outs)


def _cp_against_whole_stream(ctx, window, fake_varlen):
    """Largest |cp_attention - single-device attention| over this member's rows, output and
    the gradients of q, k, v (every rank builds the same whole stream: same seed)."""
    from dcp_opt.runtime import cp
    from dcp_opt.runtime.attention import segment_attention
    from dcp_opt.runtime.sp import SPGroup

    d, lengths = ctx.world_size, [21, 13, 6]
    layout = head_tail_layout(lengths, d)
    total = layout.numel()
    segments = torch.tensor(sum(([i] * n for i, n in enumerate(lengths)), []))
    segments = torch.cat([segments, torch.full((total - segments.numel(),), -1)])
    torch.manual_seed(0)
    whole = [torch.randn(total, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    g = torch.randn(total, 4, 8, dtype=torch.float64)
    want = segment_attention(*whole, segments=segments, window=window)
    grads = torch.autograd.grad(want, whole, g)
    mine = layout[ctx.rank]
    local = [x.detach()[mine].requires_grad_() for x in whole]
    saved = cp.chunk_kernel, cp.varlen_attention
    if fake_varlen:
        cp.chunk_kernel, cp.varlen_attention = (lambda *a, **k: "varlen"), _fake_varlen
    try:
        sp = SPGroup(None, d, ctx.rank)
        got = cp.cp_attention(*local, sp, layout=layout, segments=segments, window=window)
        got_grads = torch.autograd.grad(got, local, g[mine])
    finally:
        cp.chunk_kernel, cp.varlen_attention = saved
    pairs = [(got, want[mine])] + [(a, b[mine]) for a, b in zip(got_grads, grads, strict=True)]
    return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.dist
def test_cp_attention_equals_whole_stream_attention(workers):
    # direct check of cp_attention's rows and gradients (GQA 4/2, padding, windows that cut
    # inside a chunk's key range and none), on the CPU kernels and on the varlen call's
    # arguments (with a CPU stand-in for FlashAttention's bottom-right semantics)
    for window in (None, 3, 9):
        for fake in (False, True):
            errs = workers.run(_cp_against_whole_stream, window, fake)
            assert max(errs) <= 1e-12, (window, fake, errs)


def _measure(ctx):
    from dcp_opt.runtime.profile.fit import measure_cp_collectives

    return measure_cp_collectives(None, sizes_bytes=(1 << 16, 1 << 19, 1 << 21), repeats=3)


@pytest.mark.dist
@pytest.mark.parametrize("workers", [2], indirect=True, ids=["world2"])
def test_cp_collectives_measured_on_gloo(workers):
    # the runtime's own collectives (runtime/cp.py) on the gloo ranks, buffers up to 2 MB;
    # every rank fits the same group-wide (slowest member's) times. World 2 only: at 4 ranks
    # on 2 shared cores the barriers dominate (~20 s) and nothing new is checked
    got = workers.run(_measure)
    assert all(g == got[0] for g in got) and got[0].group_size == workers.world_size
    for bw, lat in (got[0].rates("all_gather"), got[0].rates("reduce_scatter")):
        # finite rates of a CPU's copies (the fit caps an unmeasurable 1/bw at 1e15 B/s)
        assert 1e5 < bw <= 1e15 and 0 <= lat < 1.0
    CostModel(MODEL, CLUSTER, COEFFS, cp_comm=(got[0],))  # usable as measured


@pytest.mark.dist
@pytest.mark.parametrize("kv_heads", [CP_KV_HEADS, CP_HEADS])
def test_cp_keeps_the_gathered_kv_the_cost_model_charges(workers, kv_heads):
    # float64, 4 query heads of 8 dims; two sequences (200 + 136 tokens) over d = the world
    d = workers.world_size
    spec = ModelSpec(
        "t", "1d", 1, CP_HEADS * DH, CP_HEADS, 64, vocab_size=10, num_kv_heads=kv_heads,
        dtype_bytes=8,
    )  # fmt: skip
    for m, saved in workers.run(_saved_by_cp_attention, kv_heads):
        # nothing of the size of a mask over the stream (M x d M entries) is kept
        assert max(b // 8 for *_, b in saved) < m * d * m
        # the gathered K and V in one buffer (every chunk keeps views of it: saved more than
        # once): d M tokens x kv_bytes = the own tokens' (in act_bytes, as Ulysses') +
        # extra_act_bytes' (d-1) M
        kv = [b for times, *_, b in saved if times > 1]
        want = m * (kv_bytes_per_token(spec) + float(extra_act_bytes(spec, d)))
        assert kv == [want] == [d * m * 2 * kv_heads * DH * 8]
        # the rest: per chunk (2 per sequence and the padding) its output [1, H, c, DH] and
        # logsumexp [1, H, c]: per local token, as under Ulysses, and nothing else
        rest = [(shape, b) for times, shape, _, b in saved if times == 1]
        outs = [s[2] for s, b in rest if len(s) == 4 and b == s[2] * CP_HEADS * DH * 8]
        lses = [s[2] for s, b in rest if len(s) == 3 and b == s[2] * CP_HEADS * 8]
        assert sum(outs) == sum(lses) == m and len(outs) + len(lses) == len(rest)
        assert len(outs) <= 2 * len(CP_LENGTHS) + 1
