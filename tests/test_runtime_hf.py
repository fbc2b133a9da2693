"""An unmodified transformers `LlamaForCausalLM` under DCP plans (runtime/hf.py): gloo ranks in
float64 give the loss and summed gradient of single-process training of the same model on the
same batch (each sequence alone, transformers' own "sdpa" attention, per-token cross-entropy
computed here and tests/reference.objective) to rel. err <= 1e-9.

One pool of worker processes per world size runs every plan of that world in one job (the
reference is computed on each worker too, so only error figures travel back).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from dcp_opt.runtime import SPState, execute_step
from dcp_opt.runtime.hf import (
    ATTN_NAME,
    HFCausalLMTask,
    UnsupportedModelError,
    llama_spec,
    parallelize_hf,
    tiny_llama,
)
from dcp_opt.runtime.testing import DistWorkers, flat_grads, max_relative_error
from dcp_opt.solvers import available_planners, run_planner

from dcp_opt import Batch, Cluster, CostModel, make_plan, validate
from dcp_opt.plan import Group, MicroBatch, Plan
from tests.reference import objective

TOL = 1e-9
LENGTHS = [3, 20, 7, 12, 5, 9, 2, 16]
# 4 query heads; gqa: 2 kv heads; gqa8: 8 query heads, 2 kv heads (at degree 4 the kv heads
# travel repeated to 4, fewer than the 8 query heads: dcp_opt.model.ulysses_kv_heads)
MODELS = {"mha": {}, "gqa": {"num_kv_heads": 2}, "gqa8": {"num_heads": 8, "num_kv_heads": 2}}
PLANNERS = [p for p in ("greedy", "static_tuned", "bucket", "cpsat") if p in available_planners()]


@functools.cache
def base_model(model_key: str):
    # Built once per process (the first build pays transformers' lazy imports); every plan
    # trains a deep copy, so each starts from the same weights.
    return tiny_llama(**MODELS[model_key])


def fresh(model_key: str):
    return copy.deepcopy(base_model(model_key))


def make_data(batch: Batch, seed: int = 11) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {s.id: torch.randint(128, (s.shape[0] + 1,), generator=g) for s in batch.sequences}


def reference_loss(model, data: dict, kind: str) -> torch.Tensor:
    """Single-process objective: each sequence alone through the model's own attention,
    per-token cross-entropy, tests/reference.objective (not the runtime's weighting)."""
    losses = []
    for _, seq in sorted(data.items()):
        n = seq.shape[0] - 1
        out = model(input_ids=seq[None, :-1], position_ids=torch.arange(n)[None], use_cache=False)
        losses.append(F.cross_entropy(out.logits[0], seq[1:], reduction="none"))
    return objective(losses, kind)


def job_plans(ctx, model_key: str, batch_dict: dict, plan_jsons: list[str], step: int):
    """On every rank: the reference once, then one executor step per plan, each on a fresh
    copy of the same model; returns [(loss error, gradient error)] per plan."""
    batch = Batch.from_dict(batch_dict)
    data = make_data(batch)
    task = HFCausalLMTask()
    out = []
    for text in plan_jsons:
        plan = Plan.from_json(text)
        ref = fresh(model_key)
        ref_loss = reference_loss(ref, data, plan.normalizer_kind)
        ref_loss.backward()
        want_loss = float(ref_loss.detach())
        model = fresh(model_key)
        state = SPState()
        parallelize_hf(model, state)
        report = execute_step(plan, task, model, data, pool=ctx.pool, state=state, step=step)
        loss_err = abs(report.loss - want_loss) / abs(want_loss)
        out.append((loss_err, max_relative_error(flat_grads(model), flat_grads(ref))))
    return out


def cost_for(world: int, batch: Batch, *, memory_fraction: float | None = None) -> CostModel:
    """Cost model of the test Llama on 1 node x `world` CPUs. With `memory_fraction`, memory
    holds that share of the longest sequence's activations at degree 1 without recompute, so
    the planners must use SP groups or recompute."""
    spec = llama_spec(base_model("mha"))
    base = CostModel(spec, Cluster("cpu", 1, world, 1e15, 1e12, 1e10, 1e10))
    if memory_fraction is None:
        return base
    biggest = max(s.num_tokens for s in batch.sequences)
    per_token = float(base.memory(1, 1, 0)) - base.fixed_bytes()
    memory = (base.fixed_bytes() + memory_fraction * biggest * per_token) / (
        base.usable_memory_fraction
    )
    return CostModel(spec, base.cluster.with_(memory_bytes=memory))


def _g(start: int, degree: int, *mbs) -> Group:
    return Group(start, degree, tuple(MicroBatch(tuple(ids), r) for ids, r in mbs))


def hand_plans(world: int, batch: Batch) -> list[Plan]:
    """Mixed degrees, several phases, uneven micro-batch counts, idle ranks, recompute 0..2,
    both normalisers. Ids 0..7 have lengths 3, 20, 7, 12, 5, 9, 2, 16."""
    whole = [_g(0, world, ((0, 1, 2, 3, 4, 5, 6, 7), 2))]
    two_phase = [
        [_g(0, 2, ((1,), 1), ((3, 6), 0)), *([_g(2, 2, ((7,), 2))] if world == 4 else [])],
        # ranks 2, 3 idle in phase 1; with 2 ranks, rank 1 also takes sequence 7 here
        [
            _g(0, 1, ((0,), 0), ((2,), 1), ((4,), 2)),
            _g(1, 1, ((5,), 0), *([((7,), 2)] * (world == 2))),
        ],
    ]
    if world == 4:
        mixed = [[_g(0, 2, ((1, 2), 1)), _g(2, 1, ((3,), 0), ((4, 5), 2)), _g(3, 1)]]
        mixed.append([_g(0, 4, ((7,), 0), ((0, 6), 1))])
    else:
        mixed = [[_g(0, 1, ((1, 2), 1), ((3,), 0), ((4, 5), 2)), _g(1, 1)]]
        mixed.append([_g(0, 2, ((7,), 0), ((0, 6), 1))])
    cost = cost_for(world, batch)
    out = [
        make_plan([whole], batch, cost, planner="hand-whole"),
        make_plan(two_phase, batch, cost, planner="hand-2phase", normalizer_kind="samples"),
        make_plan(mixed, batch, cost, planner="hand-mixed"),
    ]
    for plan in out:
        assert validate(plan, batch, cost) == []
    return out


def planner_plans(world: int, batch: Batch) -> list[Plan]:
    cost = cost_for(world, batch, memory_fraction=0.6)
    out = []
    for name in PLANNERS:
        plan = run_planner(name, batch, cost).plan
        assert validate(plan, batch, cost) == []
        out.append(plan)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def workers(request):
    w = DistWorkers(request.param, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.dist
def test_grad_equiv_hf_llama_plans(workers):
    batch = Batch.from_lengths(LENGTHS)
    plans = hand_plans(workers.world_size, batch) + planner_plans(workers.world_size, batch)
    # The planners must really exercise SP or recompute under the tight memory (else the
    # planner plans would only repeat the degree-1 case).
    assert any(
        g.degree > 1 or mb.recompute_layers > 0
        for plan in plans[3:]
        for _, g, _, mb in plan.micro_batches()
    )
    texts = [p.to_json() for p in plans]
    for rank_result in workers.run(job_plans, "mha", batch.to_dict(), texts, 3, wait_s=240):
        for plan, (loss_err, grad_err) in zip(plans, rank_result, strict=True):
            assert loss_err <= TOL, (plan.planner, loss_err)
            assert grad_err <= TOL, (plan.planner, grad_err)


@pytest.mark.dist
@pytest.mark.parametrize("model_key", ["gqa", "gqa8"])
def test_grad_equiv_hf_llama_grouped_query_heads(workers, model_key):
    # Only the kv heads each member needs travel (world 2: the 2 kv heads; world 4: 4 for
    # gqa8); a degree-w group over the whole batch, and a planner's plan.
    batch = Batch.from_lengths(LENGTHS)
    plans = hand_plans(workers.world_size, batch)[:1] + planner_plans(workers.world_size, batch)[:1]
    texts = [p.to_json() for p in plans]
    for rank_result in workers.run(job_plans, model_key, batch.to_dict(), texts, 0, wait_s=240):
        for plan, (loss_err, grad_err) in zip(plans, rank_result, strict=True):
            assert loss_err <= TOL and grad_err <= TOL, (plan.planner, loss_err, grad_err)


def job_a2a_bytes(ctx, model_key: str, batch_dict: dict, plan_json: str) -> int:
    """Bytes this rank hands to all_to_all_single during one executor step of `plan_json`."""
    import torch.distributed as dist

    batch, plan = Batch.from_dict(batch_dict), Plan.from_json(plan_json)
    model, state, sent = fresh(model_key), SPState(), []
    parallelize_hf(model, state)
    real = dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        sent.append(inp.numel() * inp.element_size())
        return real(out, inp, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        data, task = make_data(batch), HFCausalLMTask()
        execute_step(plan, task, model, data, pool=ctx.pool, state=state, step=0)
    finally:
        dist.all_to_all_single = real
    return sum(sent)


@pytest.mark.dist
@pytest.mark.parametrize("model_key", ["mha", "gqa", "gqa8"])
def test_hf_all_to_all_volume_is_the_cost_models(workers, model_key):
    """The runtime moves exactly the bytes the cost model charges (fewer kv heads under
    GQA; forward, backward and recomputed forward), on a whole-batch group of degree w.
    The expectation is the cost model's own formula, not a count made here: its
    communication time of the micro-batch on a cluster of 1 B/s links and no latency is
    the bytes one rank sends to its peers, (w - 1)/w of what it hands to all_to_all."""
    world = workers.world_size
    batch = Batch.from_lengths([10, 22, 4])  # 36 tokens: no padding at degree 2 or 4
    whole = [[_g(0, world, ((0, 1, 2), 1))]]
    plan = make_plan(whole, batch, cost_for(world, batch), planner="hand-whole")
    spec = llama_spec(base_model(model_key))
    assert spec.kv_heads == MODELS[model_key].get("num_kv_heads", spec.num_heads)
    unit = Cluster("bytes", 1, world, 1e15, 1e12, 1.0, 1.0, 0.0, 0.0)
    cost = CostModel(spec, unit)
    comm_s = cost.microbatch_time(batch.sequences, world, 1).comm_s
    assert comm_s > cost.microbatch_time(batch.sequences, world, 0).comm_s  # recompute charged
    want = comm_s * world / (world - 1)
    got = workers.run(job_a2a_bytes, model_key, batch.to_dict(), plan.to_json())
    assert got == [pytest.approx(want, rel=1e-12)] * world


def test_parallelize_hf_keeps_model_unmodified():
    from transformers import LlamaForCausalLM

    plain, model = fresh("mha"), fresh("mha")
    state = SPState()
    parallelize_hf(model, state)
    assert type(model) is LlamaForCausalLM
    assert model.config._attn_implementation == ATTN_NAME
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names
    # Single process, degree 1: the registered attention over one packed row of two
    # sequences gives the loss of the plain model run on each sequence alone.
    data = make_data(Batch.from_lengths([4, 6]))
    task = HFCausalLMTask()
    with torch.no_grad():
        want = float(reference_loss(plain, data, "tokens"))
    got = float(task.run(model, sorted(data.items()), state, step=0, kind="tokens", scale=0.1))
    assert abs(got - want) <= TOL * abs(want)


def _snapshot(model, probe: torch.Tensor) -> dict:
    """What a refusal must leave alone: the config (with its attention implementation),
    every module's own attributes (forward methods included) and parameters, and the output
    of an ordinary forward."""
    with torch.no_grad():
        logits = model(input_ids=probe[None], use_cache=False).logits.clone()
    return {
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
        "modules": [(n, type(m), dict(vars(m))) for n, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "logits": logits,
    }


def _assert_same(before: dict, after: dict) -> None:
    assert after["config"] == before["config"]
    assert after["attn"] == before["attn"]
    for (n0, t0, d0), (n1, t1, d1) in zip(before["modules"], after["modules"], strict=True):
        assert (n0, t0) == (n1, t1)
        assert d0.keys() == d1.keys(), n0  # e.g. no instance `forward` left behind
        for key in d0:
            if key not in ("_parameters", "_buffers", "_modules"):
                assert d1[key] is d0[key] or d1[key] == d0[key], (n0, key)
    assert before["state"].keys() == after["state"].keys()
    assert all(torch.equal(before["state"][k], after["state"][k]) for k in before["state"])
    assert torch.equal(before["logits"], after["logits"])


def _moe_with_aux_loss():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM._from_config(cfg, experts_implementation="eager")
    return model.to(torch.float64)


def _with_dropout():
    model = fresh("mha")
    model.config.attention_dropout = 0.1
    model.model.layers[1].self_attn.attention_dropout = 0.1  # checked after layer 0
    return model


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").to(torch.float64)


def _bad_locator(model):
    return [(layer, layer.self_attn) for layer in model.model.layers] + [(model, "x")]


REFUSALS = {
    # model, locator, what the error names
    "attention_dropout": (_with_dropout, None, "config.attention_dropout: 0.1"),
    "router aux loss": (_moe_with_aux_loss, None, "config.output_router_logits: True"),
    "bad locator": (lambda: fresh("mha"), _bad_locator, "locator"),
    # the case: the config used to be switched before the layout was refused
    "other layout": (_gpt2, None, "no decoder layer list"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_model_is_unchanged(case):
    """parallelize_hf checks everything before it changes anything: after a refusal the
    config, every module and an ordinary forward are exactly as before."""
    build, locator, message = REFUSALS[case]
    model = build().eval()  # eval: no dropout in the probe forward (refused in either mode)
    probe = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    before = _snapshot(model, probe)
    with pytest.raises(UnsupportedModelError, match=message):
        parallelize_hf(model, SPState(), locator=locator)
    _assert_same(before, _snapshot(model, probe))


def test_locator_names_the_layers():
    """A user locator replaces find_layers; one that leaves an attention module out is
    refused (that module would switch to "dcp_ulysses" unprepared)."""
    model, state = fresh("mha"), SPState()
    pairs = [(layer, layer.self_attn) for layer in model.model.layers]
    parallelize_hf(model, state, locator=lambda m: pairs)
    data = make_data(Batch.from_lengths([5]))
    with torch.no_grad():
        want = float(reference_loss(fresh("mha"), data, "tokens"))
    task = HFCausalLMTask()
    got = float(task.run(model, sorted(data.items()), state, step=0, kind="tokens", scale=0.2))
    assert abs(got - want) <= TOL * abs(want)
    other = fresh("mha")
    first = (other.model.layers[0], other.model.layers[0].self_attn)
    with pytest.raises(UnsupportedModelError, match=r"model\.model\.layers\.1\.self_attn"):
        parallelize_hf(other, SPState(), locator=lambda m: [first])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dropout": 0.1}, "attention_dropout"),
        ({"is_causal": False}, "is_causal"),
        ({"position_bias": torch.zeros(1)}, "position_bias"),
        ({"some_future_kwarg": 3}, "some_future_kwarg"),
    ],
)
def test_dcp_attention_refuses_what_it_cannot_honour(kwargs, message):
    """The last line behind parallelize_hf's checks: a kwarg it cannot honour raises, none is
    dropped (position_ids, output_attentions and False flags carry nothing and pass)."""
    from dcp_opt.runtime.hf import dcp_attention

    model = fresh("mha")
    parallelize_hf(model, SPState())
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 6, 16, dtype=torch.float64)
    out, _ = dcp_attention(attn, q, q, q, None, position_ids=torch.arange(6), use_cache=False)
    assert out.shape == (1, 6, 4, 16)
    with pytest.raises(ValueError, match=message):
        dcp_attention(attn, q, q, q, None, **kwargs)
    with pytest.raises(ValueError, match="attention_mask"):
        dcp_attention(attn, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))
