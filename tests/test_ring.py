"""Ring attention (`ring` groups) in the runtime (runtime/ring.py): the attention against
single-device attention (GQA, windows, softcap, sinks, padding), gradient equivalence (float64,
gloo, worlds 2 and 4) of plans mixing Ulysses, cp and ring groups for TinyLM and a
transformers Llama (GQA too) and the window / softcap / sinks families, the K/V bytes each
step sends against the cost model's charge, and what autograd keeps."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime.cp import head_tail_layout
from dcp_opt.runtime.testing import DistWorkers, flat_grads, max_relative_error

from dcp_opt import Batch, make_plan, validate
from dcp_opt.cost.ring import sent_bytes_per_layer
from dcp_opt.plan import Group, MicroBatch, Plan
from tests import test_runtime_equiv as lm
from tests import test_runtime_hf as hf

KINDS = ("ulysses", "cp", "ring")


def _g(start, degree, kind, *mbs) -> Group:
    return Group(start, degree, tuple(MicroBatch(tuple(ids), r) for ids, r in mbs), kind)


def ring_plans(world: int, batch: Batch, cost) -> list[Plan]:
    """ring alone, and ring beside Ulysses and cp in one phase and across phases; packed
    micro-batches, recompute, a sequence shorter than 2d."""
    ids = [s.id for s in batch.sequences]
    a, b, c, d, e = ids[0], ids[1], ids[2], ids[3], ids[4:]
    if world == 2:
        layouts = [
            [[_g(0, 2, "ring", (ids, 1))]],
            [[_g(0, 2, "ring", ((a, b), 1), ((c,), 0))], [_g(0, 2, "cp", ((d, *e), 2))]],
            [[_g(0, 2, "ulysses", ((a,), 0), ((b, c), 1))], [_g(0, 2, "ring", ((d, *e), 0))]],
        ]
    else:
        layouts = [
            [[_g(0, 4, "ring", (ids, 1))]],
            [
                [_g(0, 2, "ring", ((a, c), 2)), _g(2, 2, "cp", ((b,), 1))],
                [_g(0, 4, "ring", ((d, *e), 0))],
            ],
            [[_g(0, 2, "ulysses", ((a, b), 0)), _g(2, 2, "ring", ((c,), 1), ((d, *e), 0))]],
        ]
    plans = []
    for k, phases in enumerate(layouts):
        norm = "samples" if k % 2 else "tokens"
        plan = make_plan(phases, batch, cost, planner=f"ring{k}", normalizer_kind=norm)
        assert validate(plan, batch, cost) == []
        plans.append(plan)
    return plans


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def workers(request):
    w = DistWorkers(request.param, timeout_s=60.0)
    yield w
    w.close()


def _ring_against_whole_stream(ctx, window, softcap, with_sinks):
    """(largest |ring_attention - single-device attention| over this member's rows, output
    and the gradients of q, k, v; this member's sinks gradient or None)."""
    from dcp_opt.runtime.attention import segment_attention
    from dcp_opt.runtime.ring import ring_attention
    from dcp_opt.runtime.sp import SPGroup

    d, lengths = ctx.world_size, [21, 13, 6]
    layout = head_tail_layout(lengths, d)
    total = layout.numel()
    segments = torch.tensor(sum(([i] * n for i, n in enumerate(lengths)), []))
    segments = torch.cat([segments, torch.full((total - segments.numel(),), -1)])
    torch.manual_seed(0)
    whole = [torch.randn(total, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_sinks else None
    g = torch.randn(total, 4, 8, dtype=torch.float64)
    opts = {"window": window, "softcap": softcap}
    want = segment_attention(*whole, segments=segments, sinks=sinks, **opts)
    grads = torch.autograd.grad(want, whole, g, retain_graph=with_sinks)
    mine = layout[ctx.rank]
    local = [x.detach()[mine].requires_grad_() for x in whole]
    mine_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
    sp = SPGroup(None, d, ctx.rank)
    got = ring_attention(*local, sp, layout=layout, segments=segments, sinks=mine_sinks, **opts)
    got_grads = torch.autograd.grad(got, local + ([mine_sinks] if with_sinks else []), g[mine])
    pairs = [(got, want[mine])] + [(a, b[mine]) for a, b in zip(got_grads, grads, strict=False)]
    err = max(float((a - b).detach().abs().max()) for a, b in pairs)
    if not with_sinks:
        return err, None, None
    (want_sinks,) = torch.autograd.grad(want, [sinks], g)
    return err, got_grads[3].detach(), want_sinks.detach()


@pytest.mark.dist
def test_ring_attention_equals_whole_stream_attention(workers):
    # GQA 4/2, padding (40 tokens at d = 4: 48 rows), windows that cut inside a block and none,
    # softcap, sinks (each member's sinks gradient is its queries' share: they sum to the whole)
    for window, softcap, sinks in ((None, None, False), (3, None, False), (9, 5.0, True)):
        res = workers.run(_ring_against_whole_stream, window, softcap, sinks)
        assert max(r[0] for r in res) <= 1e-12, (window, softcap, [r[0] for r in res])
        if sinks:
            total = sum(r[1] for r in res)
            assert float((total - res[0][2]).abs().max()) <= 1e-12


@pytest.mark.dist
def test_grad_equiv_tiny_lm_ring_mixed_with_ulysses_and_cp(workers):
    batch = Batch.from_lengths([13, 9, 20, 3, 6])
    cost = lm.cost_for("1d", workers.world_size).with_(sp_kinds=KINDS)
    for plan in ring_plans(workers.world_size, batch, cost):
        lm.check_equivalent(workers, "1d", plan, batch)


@pytest.mark.dist
@pytest.mark.parametrize("model_key", ["mha", "gqa8"])
def test_grad_equiv_hf_llama_ring_mixed_with_ulysses_and_cp(workers, model_key):
    # gqa8: 8 query heads over 2 kv heads; the ring passes only the 2 kv heads
    batch = Batch.from_lengths(hf.LENGTHS)
    cost = hf.cost_for(workers.world_size, batch).with_(sp_kinds=KINDS)
    plans = ring_plans(workers.world_size, batch, cost)
    if model_key != "mha":
        plans = plans[1:2]  # one mixed plan is enough for the head mapping
    texts = [p.to_json() for p in plans]
    for rank_result in workers.run(hf.job_plans, model_key, batch.to_dict(), texts, 1, wait_s=240):
        for plan, (loss_err, grad_err) in zip(plans, rank_result, strict=True):
            assert loss_err <= hf.TOL and grad_err <= hf.TOL, (plan.planner, loss_err, grad_err)


RING_FAMILIES = ["mistral/window", "gemma2/window+softcap", "gpt_oss/window+sinks"]


@pytest.mark.dist
@pytest.mark.parametrize("workers", [2], indirect=True, ids=["world2"])
def test_grad_equiv_hf_families_with_window_softcap_sinks_under_ring(workers):
    from tests import test_hf_families as fam

    batch = Batch.from_lengths(fam.LENGTHS)
    spec = fam.ModelSpec("tiny-hf", "1d", 2, 32, 4, 48, vocab_size=fam.VOCAB, gated_mlp=True)
    cluster = fam.Cluster("cpu", 1, workers.world_size, 1e15, 1e12, 1e10, 1e10)
    cost = fam.CostModel(spec, cluster, sp_kinds=KINDS)
    ids = tuple(range(len(fam.LENGTHS)))
    plans = [make_plan([[_g(0, 2, "ring", (ids[:3], 1))], [_g(0, 2, "cp", (ids[3:], 0))]],
                       batch, cost, planner="ring-families")]  # fmt: skip
    assert validate(plans[0], batch, cost) == []
    texts = [p.to_json() for p in plans]
    results = workers.run(fam.job_matrix, RING_FAMILIES, batch.to_dict(), texts, wait_s=600)
    for entry in RING_FAMILIES:
        low = fam.MATRIX[entry][3]
        for rank_result in results:
            status, rows = rank_result[entry]
            assert status == "ran", (entry, rows)
            for loss_err, exact_err, rough_err in rows:
                assert loss_err <= (fam.LOW_TOL if low == "eager" else fam.TOL), entry
                assert exact_err <= fam.TOL and rough_err <= fam.LOW_TOL, (entry, exact_err)


# ---- what the ring sends and keeps, against the cost model -------------------------------------
def _step_with_sends(ctx, plan_json, batch_dict):
    """One TinyLM executor step; (loss, gradients, every ring send on this rank)."""
    from dcp_opt.runtime import SPState, execute_step, parallelize
    from dcp_opt.runtime.ring import record_sends

    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    model = lm.make_model("1d", 3)
    state = SPState()
    parallelize(model, state)
    data = lm.make_data("1d", batch, 3)
    with record_sends() as sent:
        report = execute_step(plan, lm.TASKS["1d"], model, data, pool=ctx.pool, state=state,
                              step=5)  # fmt: skip
    return report.loss, flat_grads(model), list(sent)


@pytest.mark.dist
def test_ring_kv_bytes_per_step_are_the_cost_models_charge(workers):
    # one ring micro-batch of 3 uneven sequences (2001 tokens) over the whole world, one of the
    # 3 layers recomputed: per layer the forward ring sends d-1 blocks, the backward 2 (d-1)
    # (K/V and dK/dV), the recomputed layer's forward again. A block is the member's rows: the
    # head-tail chunks pad a member to at most one token per sequence over T/d, so the bytes
    # sent are within 1 % of the charge (T/d tokens per block)
    d = workers.world_size
    batch = Batch.from_lengths([997, 613, 391])
    cost = lm.cost_for("1d", d).with_(sp_kinds=KINDS)
    plan = make_plan([[_g(0, d, "ring", ((0, 1, 2), 1))]], batch, cost, planner="ring-bytes")
    results = workers.run(_step_with_sends, plan.to_json(), batch.to_dict())
    want_loss, want_grads = lm.reference("1d", plan.normalizer_kind, batch, 3, 5)
    fwd, bwd = (float(x) for x in sent_bytes_per_layer(cost.model, batch.num_tokens, d))
    L, r = cost.model.num_layers, 1
    charge = L * (fwd + bwd) + r * fwd
    for loss, grads, sent in results:
        assert abs(loss - want_loss) <= lm.TOL * abs(want_loss)
        assert max_relative_error(grads, want_grads) <= lm.TOL
        total = sum(b for *_, b in sent)
        assert abs(total / charge - 1) <= 0.01, (total, charge)
        # per step: forward d-1 sends of one block per ring (L + r rings), backward d sends
        # per layer, one block at the ends, two in between
        f = [b for p, _, b in sent if p == "fwd"]
        bw = [(s, b) for p, s, b in sent if p == "bwd"]
        assert len(f) == (L + r) * (d - 1) and len(set(f)) == 1
        assert len(bw) == L * d
        assert all(b == (f[0] if s in (0, d - 1) else 2 * f[0]) for s, b in bw)
        assert abs(f[0] / (fwd / (d - 1)) - 1) <= 0.01


def _saved_by_ring_attention(ctx, kv_heads: int):
    """(M, [(times saved, shape, bytes)]) of what autograd keeps from one ring_attention call
    on this member, the inputs q, k, v excluded."""
    from dcp_opt.runtime.ring import ring_attention
    from dcp_opt.runtime.sp import SPGroup

    torch.manual_seed(ctx.rank)
    d, lengths = ctx.world_size, [200, 136]
    layout = head_tail_layout(lengths, d)
    m = layout.shape[1]
    segments = torch.tensor([0] * 200 + [1] * 136 + [-1] * (layout.numel() - 336))
    q = torch.randn(m, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(m, kv_heads, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    saved: dict[int, list] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            entry = saved.setdefault(ptr, [0, tuple(t.shape), 0])
            entry[0] += 1
            entry[2] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ring_attention(q, k, v, SPGroup(None, d, ctx.rank), layout=layout, segments=segments)
    return m, list(saved.values())


@pytest.mark.dist
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_ring_keeps_one_block_not_the_gathered_kv(workers, kv_heads):
    # kept: the last block held ([M, 2 kv_heads, 8], member r+1's, where the backward ring
    # starts), the output [4, M, 8] and logsumexp [4, M]: per local token, as Ulysses (cp
    # keeps d M tokens of K/V); q itself is an input
    for m, saved in workers.run(_saved_by_ring_attention, kv_heads):
        shapes = sorted(shape for _, shape, _ in saved)
        assert shapes == sorted([(m, 2 * kv_heads, 8), (4, m, 8), (4, m)]), shapes
        assert max(b for *_, b in saved) <= m * max(2 * kv_heads, 4) * 8 * 8
