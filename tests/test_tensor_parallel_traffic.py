"""Bytes the TP collectives send, counted on gloo (runtime/tensor_parallel.CollectiveBytes over
DTensor's functional collectives), against the charge of docs/architecture.md (issue 26): per
layer, forward and backward, 2 all-gathers and 2 reduce-scatters of s h b bytes, (t - 1) / t
of it per GPU (s: the unit's tokens, padded to a multiple of t; h: hidden; b: bytes per value).

Outside the layers torch sends, per micro-batch, one s h b exchange each way at the embedding
(reduce-scatter forward, all-gather backward) and at the head (all-gather forward,
reduce-scatter backward), and the logits' all-gather (s V b, (t - 1) / t per GPU: no loss
parallelism); per step, one all-reduce of h values per norm weight (reduce_partial_grads)."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import LMTask, SPState, parallelize
from dcp_opt.runtime.hf import HFCausalLMTask, parallelize_hf, tiny_llama
from dcp_opt.runtime.tensor_parallel import (
    CollectiveBytes,
    apply_tensor_parallel,
    reduce_partial_grads,
)
from dcp_opt.runtime.testing import DistWorkers

from tests.test_tensor_parallel import CFG, make_model, tp_groups

LENGTHS = [5, 11, 3, 22]  # 41 tokens: the unit's stream pads to 42
T = 2


def build(which: str, state: SPState):
    if which == "tinylm":
        model = make_model(0)
        parallelize(model, state)
        return model, LMTask(), CFG.hidden, CFG.vocab_size, CFG.num_layers
    model = tiny_llama(hidden=32, num_kv_heads=2, vocab_size=64, intermediate=64, num_layers=3)
    parallelize_hf(model, state)
    cfg = model.config
    return model, HFCausalLMTask(), cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers


def job_traffic(ctx, which: str) -> dict:
    """One micro-batch's forward and backward, then the step's norm-gradient sums."""
    tp, state = tp_groups(T), SPState(tp_degree=T)
    model, task, h, vocab, layers = build(which, state)
    apply_tensor_parallel(model, tp)
    g = torch.Generator().manual_seed(0)
    samples = [(i, torch.randint(vocab, (n + 1,), generator=g)) for i, n in enumerate(LENGTHS)]
    with CollectiveBytes(T) as micro:
        task.run(model, samples, state, step=0, kind="tokens", scale=1.0)
    with CollectiveBytes(T) as step:
        reduce_partial_grads(model)
    return {"micro": micro.total(), "ops": len(micro.records), "step": step.total(),
            "h": h, "vocab": vocab, "layers": layers}  # fmt: skip


@pytest.fixture(scope="module")
def workers():
    w = DistWorkers(4, timeout_s=60.0)
    yield w
    w.close()


@pytest.mark.parametrize("which", ["tinylm", "hf_llama"])
def test_tp_collective_bytes_match_the_charge(workers, which):
    for got in workers.run(job_traffic, which):
        s, b, h, layers = -(-sum(LENGTHS) // T) * T, 8, got["h"], got["layers"]
        frac = (T - 1) / T
        charge = layers * 8 * frac * s * h * b  # the cost model's per-layer TP traffic
        outside = 4 * frac * s * h * b + frac * s * got["vocab"] * b
        in_layers = got["micro"] - outside
        ratio = in_layers / charge
        print(f"{which}: layers {in_layers:.0f} B vs charge {charge:.0f} B, ratio {ratio:.4f}")
        assert abs(ratio - 1) <= 0.01, ratio
        assert got["ops"] == 8 * layers + 4 + 1  # 8 per layer, 4 at the ends, the logits
        norms = 2 * layers + 1
        assert got["step"] == norms * 2 * frac * h * b  # one all-reduce per norm weight
