"""Tensor parallelism on unmodified transformers models (runtime/tensor_parallel.py hf_plan):
HF Llama with grouped-query attention and Qwen2 (q/k/v biases), random weights from tiny
configs, float64, gloo, world 4 = 2 units of TP 2. A step's gradient and one AdamW step equal
single-process training (the model's own "sdpa" attention, each sequence alone) to 1e-9,
under a Ulysses group of degree 2 across the units and under unequal micro-batch counts with
an idle unit. Refusals name the config field and leave the model unchanged."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from dcp_opt.runtime import SPState, execute_step
from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf, tiny_llama
from dcp_opt.runtime.tensor_parallel import apply_tensor_parallel
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt import Batch
from dcp_opt.plan import Plan
from tests.reference import objective
from tests.test_tensor_parallel import (
    BATCH,
    TOL,
    adamw,
    assert_refused,
    full,
    rel,
    tp_groups,
    ulysses_plan,
    uneven_plan,
)

VOCAB = 64


def tiny_qwen2(*, num_kv_heads: int = 2, tie: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
        attention_dropout=0.0, tie_word_embeddings=tie, use_sliding_window=False,
    )  # fmt: skip
    torch.manual_seed(1)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa").to(torch.float64)


BUILD = {
    "llama_gqa": lambda: tiny_llama(hidden=32, num_kv_heads=2, vocab_size=VOCAB, intermediate=64),
    "qwen2_gqa": tiny_qwen2,
}


@functools.cache
def base(key: str):
    return BUILD[key]()


def make_data(batch: Batch, seed: int = 11) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {s.id: torch.randint(VOCAB, (s.shape[0] + 1,), generator=g) for s in batch.sequences}


def reference(model, data: dict, kind: str):
    """Single-process: each sequence alone, tests/reference.objective; then one AdamW step."""
    losses = []
    for _, seq in sorted(data.items()):
        n = seq.shape[0] - 1
        out = model(input_ids=seq[None, :-1], position_ids=torch.arange(n)[None], use_cache=False)
        losses.append(F.cross_entropy(out.logits[0], seq[1:], reduction="none"))
    loss = objective(losses, kind)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    adamw(model.parameters()).step()
    return float(loss.detach()), grads, [p.detach().clone() for p in model.parameters()]


def job_errors(ctx, key: str, plan_json: str) -> tuple[float, float]:
    """On every rank: (loss error, worst gradient / update error) of one TP step vs single."""
    plan, data = Plan.from_json(plan_json), make_data(BATCH)
    before = [p.detach().clone() for p in base(key).parameters()]
    want_loss, want_grads, want = reference(copy.deepcopy(base(key)), data, plan.normalizer_kind)
    tp, state, model = tp_groups(plan.tensor_parallel), SPState(), copy.deepcopy(base(key))
    parallelize_hf(model, state)
    apply_tensor_parallel(model, tp)
    q = model.model.layers[0].self_attn.q_proj.weight  # H / t heads of 8 on each GPU
    assert q.to_local().shape[0] == q.shape[0] // tp.degree
    report = execute_step(
        plan, HFCausalLMTask(), model, data, pool=ctx.pool, state=state, step=0, tp=tp
    )
    worst = max(rel(full(p.grad), w) for p, w in zip(model.parameters(), want_grads, strict=True))
    adamw(model.parameters()).step()
    for p, w, b in zip(model.parameters(), want, before, strict=True):
        worst = max(worst, rel(full(p) - b, w - b))
    return abs(report.loss - want_loss) / abs(want_loss), worst


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(4, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.parametrize("key", sorted(BUILD))
@pytest.mark.parametrize("plan", [ulysses_plan, uneven_plan], ids=["ulysses2", "uneven"])
def test_hf_tp2_step_and_adamw_equal_single_process(workers, key, plan):
    for loss_err, worst in workers.run(job_errors, key, plan().to_json()):
        assert loss_err <= TOL and worst <= TOL, (loss_err, worst)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: tiny_qwen2(num_kv_heads=1), "config.num_key_value_heads: 1"),
        (lambda: tiny_qwen2(tie=True), "config.tie_word_embeddings"),
        (lambda: tiny_llama(hidden=36, num_heads=3, vocab_size=VOCAB), "num_attention_heads: 3"),
        (lambda: tiny_llama(vocab_size=65), "config.vocab_size: 65"),
    ],
)
def test_hf_models_tp_cannot_split_are_refused_unchanged(make, field):
    assert_refused(make(), field)


def test_an_unverified_family_is_refused_unchanged():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    assert_refused(GemmaForCausalLM._from_config(cfg), "config.model_type: 'gemma'")
