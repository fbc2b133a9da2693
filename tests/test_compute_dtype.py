"""A bf16 run is planned as bf16 (issue 28 item 3): `model_spec(..., dtype=)` sizes the
activations in the compute dtype, not in the bytes of the fp32 master parameters that
`shard(dtype="bf16")` requires. The cost model's model states (2 + 4 + 12 B per parameter)
do not depend on it; its activation coefficients scale with `ModelSpec.dtype_bytes`."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import LMConfig, TinyDiT, TinyLM
from dcp_opt.runtime.models import DiTConfig, model_spec

from dcp_opt import Cluster, CostModel

from .scripts import load_script

CFG = LMConfig(vocab_size=32, hidden=16, num_heads=4, num_layers=2, ffn_hidden=24)
CLUSTER = Cluster("cpu", 1, 2, 1e12, 1e12, 1e10, 1e10)


def act(spec) -> float:
    return CostModel(spec, CLUSTER).coeffs.act_bytes_per_token_layer


def test_tiny_model_spec_follows_the_compute_dtype():
    model = TinyLM(CFG)  # float32: the master weights of a bf16 run
    fp32, bf16 = model_spec(model), model_spec(model, dtype="bf16")
    assert (fp32.dtype_bytes, bf16.dtype_bytes) == (4, 2)
    assert model_spec(model, dtype=torch.bfloat16) == bf16
    assert act(bf16) == 0.5 * act(fp32)  # activations at half the bytes
    # a model gives its exact parameter count (norms included); a config keeps its default
    assert bf16.num_params == sum(p.numel() for p in model.parameters())
    assert model_spec(CFG, dtype="bf16") == model_spec(CFG, dtype_bytes=2)
    assert model_spec(CFG).dtype_bytes == 4 and model_spec(model.double()).dtype_bytes == 8
    assert model_spec(TinyDiT(DiTConfig()), dtype="bf16").dtype_bytes == 2


def test_unknown_compute_dtype_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"dtype: 'bfloat16' not allowed; allowed: \['fp64'"):
        model_spec(CFG, dtype="bfloat16")
    with pytest.raises(ValueError, match="at most one"):
        model_spec(CFG, dtype="bf16", dtype_bytes=2)


def test_hf_model_spec_follows_the_compute_dtype():
    pytest.importorskip("transformers")
    from dcp_opt.runtime.hf import llama_spec, tiny_llama
    from dcp_opt.runtime.hf import model_spec as hf_model_spec

    model = tiny_llama(num_layers=2, hidden=16, num_heads=4, vocab_size=32, dtype=torch.float32)
    fp32, bf16 = hf_model_spec(model), hf_model_spec(model, dtype="bf16")
    assert (fp32.dtype_bytes, bf16.dtype_bytes) == (4, 2)  # before: 4 whatever the run computed
    assert act(bf16) == 0.5 * act(fp32)
    assert llama_spec(model, dtype=torch.bfloat16).dtype_bytes == 2
    assert hf_model_spec(model.to(torch.bfloat16)).dtype_bytes == 2  # pure bf16: its params


def test_memory_benchmark_sizes_bf16_through_model_spec():
    bench = load_script("benchmarks/bench_memory.py")
    assert bench.spec("bf16") == model_spec(TinyLM(bench.CFG), dtype="bf16")
    assert bench.spec("bf16").dtype_bytes == 2 and bench.spec(None).dtype_bytes == 4
