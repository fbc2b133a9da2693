"""Megatron-style tensor parallelism with sequence parallelism for TinyLM and Hugging Face
Llama / Qwen2 decoders, on torch's engine (torch.distributed.tensor.parallel).

What each GPU of a unit of t holds and moves (Shoeybi et al. 2019, Megatron-LM, sec. 3;
Korthikanti et al. 2022, "Reducing Activation Recomputation", sec. 4.2.2): the query, key,
value and MLP-in projections are split by output columns (`ColwiseParallel`: each GPU holds
H / t heads and F / t of the MLP width), the attention-out and MLP-out projections by input
rows (`RowwiseParallel`); the norms and residual stream between them are split along the
tokens (`SequenceParallel`), so a sequence-parallel region is entered by an all-gather of the
tokens and left by a reduce-scatter: per layer, forward, 2 all-gathers and 2 reduce-scatters
of the unit's s x h activations, and the same again in backward. The embedding is split by
vocabulary rows and hands the first layer its token shard; the head is split by vocabulary
columns and returns the whole logits to every GPU of the unit (no loss parallelism), as
torchtitan's `apply_tp` does for its Llama with loss parallelism off
(torchtitan/models/llama3/infra/parallelize.py at 018740b, `apply_tp` from line 159: the
embedding / norm / head plan at 171-186, the per-block plan at 215-248).

Tokens are the packed stream of a micro-batch: [T] for TinyLM (sequence dim 0), [1, T] for
transformers models (dim 1). The task pads the unit's part of the stream to a multiple of t
(SPState.tp_degree; padding has loss weight 0), so the split is even and exact.

TinyLM keeps q, k and v in one fused projection (`qkv`, rows [q; k; v]). A plain column split
would give GPU 0 all of q and part of k; `FusedColwiseParallel` shards its rows as torch's
`_StridedShard(0, split_factor=3)` (the placement FSDP2 + TP uses for such layouts) so GPU j
holds rows q_j, k_j, v_j, the full tensor (`full_tensor()`, checkpoints) stays the model's own
layout, and the model's `chunk(3)` splits its own heads.

Refusals (`TensorParallelError`, a ValueError) come before anything changes: a model whose
layers are not the known layout (a parameter no style covers, tied embeddings, biases after a
row split), heads, kv heads, MLP width or vocabulary that t does not divide (naming the field).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

# torch's placement for a dimension sharded in interleaved blocks (torch private; the public
# Shard cannot say "rows q_j, k_j, v_j"): the placement FSDP2 itself builds for TP + FSDP.
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from dcp_opt.errors import DcpOptError

from .models import LMBlock, TinyLM

# transformers families whose decoder layers are verified under TP (tests/test_tensor_parallel
# _hf.py): Llama-layout projections, no per-head norms or sinks that would need their own split.
TP_FAMILIES = ("llama", "qwen2")


class TensorParallelError(DcpOptError, ValueError):
    """apply_tensor_parallel refused a model before changing anything."""


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a projection whose output is `parts` blocks side by side (TinyLM's
    qkv: [q; k; v] rows): GPU j holds the j-th slice of every block, and its local output is
    the model's own [q_j, k_j, v_j] (no redistribution back to a plain column split)."""

    def __init__(self, parts: int, **kwargs):
        super().__init__(**kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        placement = [_StridedShard(0, split_factor=self.parts)]
        for pname, param in list(module.named_parameters()):
            sharded = distribute_tensor(param, device_mesh, placement)
            module.register_parameter(pname, nn.Parameter(sharded, param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs


def _refuse(field: str, value, allowed: str) -> None:
    raise TensorParallelError(f"{field}: {value!r} not supported; allowed: {allowed}")


def _divides(degree: int, **fields) -> None:
    for field, value in fields.items():
        if value % degree:
            _refuse(field, value, f"a multiple of the tensor-parallel degree {degree}")


def lm_plan(model: TinyLM, degree: int) -> dict:
    """The parallelize_module plan of a TinyLM (module name -> style), checked for `degree`."""
    cfg = model.cfg
    _divides(degree, **{
        "cfg.num_heads": cfg.num_heads, "cfg.ffn_hidden": cfg.ffn_hidden,
        "cfg.vocab_size": cfg.vocab_size,
    })  # fmt: skip
    seq = Shard(0)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": SequenceParallel(sequence_dim=0, use_local_output=True),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    for i, block in enumerate(model.layers):
        if not isinstance(block, LMBlock):
            _refuse(f"model.layers[{i}]", type(block).__name__, "LMBlock")
        plan |= {
            f"layers.{i}.norm1": SequenceParallel(sequence_dim=0),
            f"layers.{i}.attn.qkv": FusedColwiseParallel(3, input_layouts=seq),
            f"layers.{i}.attn.out": RowwiseParallel(output_layouts=seq),
            f"layers.{i}.norm2": SequenceParallel(sequence_dim=0),
            f"layers.{i}.mlp.0": ColwiseParallel(input_layouts=seq),
            f"layers.{i}.mlp.2": RowwiseParallel(output_layouts=seq),
        }
    return plan


def hf_plan(model: nn.Module, degree: int) -> dict:
    """The plan of a transformers Llama / Qwen2 causal LM (`model.model.layers`, `lm_head`)."""
    cfg = model.config
    family = getattr(cfg, "model_type", None)
    if family not in TP_FAMILIES:
        _refuse("config.model_type", family, f"{list(TP_FAMILIES)} under tensor parallelism")
    if getattr(cfg, "tie_word_embeddings", False):
        _refuse("config.tie_word_embeddings", True, "False (the embedding is split by rows, "
                "the head by columns: one tied weight cannot be both)")  # fmt: skip
    _divides(degree, **{
        "config.num_attention_heads": cfg.num_attention_heads,
        "config.num_key_value_heads": getattr(cfg, "num_key_value_heads", None)
        or cfg.num_attention_heads,
        "config.intermediate_size": cfg.intermediate_size,
        "config.vocab_size": cfg.vocab_size,
    })  # fmt: skip
    seq = Shard(1)
    hidden = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": seq},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
    )
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "model.norm": SequenceParallel(sequence_dim=1, use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        plan |= {
            pre + "input_layernorm": SequenceParallel(sequence_dim=1),
            pre + "self_attn": hidden,
            pre + "self_attn.q_proj": ColwiseParallel(),
            pre + "self_attn.k_proj": ColwiseParallel(),
            pre + "self_attn.v_proj": ColwiseParallel(),
            pre + "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            pre + "post_attention_layernorm": SequenceParallel(sequence_dim=1),
            pre + "mlp": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            ),
            pre + "mlp.gate_proj": ColwiseParallel(),
            pre + "mlp.up_proj": ColwiseParallel(),
            pre + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        }
    return plan


def tp_plan(model: nn.Module, degree: int) -> dict:
    """The checked plan for `model` at TP degree `degree` (nothing changes)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        _refuse("tensor_parallel", degree, "an integer >= 1")
    if isinstance(model, TinyLM):
        plan = lm_plan(model, degree)
    elif hasattr(getattr(model, "model", None), "layers") and hasattr(model, "config"):
        plan = hf_plan(model, degree)
    else:
        _refuse("model", type(model).__name__, f"TinyLM or a transformers {list(TP_FAMILIES)}")
    _check_plan_covers(model, plan)
    return plan


def _check_plan_covers(model: nn.Module, plan: dict) -> None:
    """Every module the plan names exists with the right type, and every parameter lies in a
    module the plan splits or replicates: a parameter outside would be summed wrongly."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        sub = modules.get(name)
        if sub is None:
            _refuse(f"model.{name}", None, "the module this model family has there")
        linear = isinstance(style, (ColwiseParallel, RowwiseParallel))
        if linear and not isinstance(sub, (nn.Linear, nn.Embedding)):
            _refuse(f"model.{name}", type(sub).__name__, "nn.Linear (or nn.Embedding)")
    covered = {n for n, s in plan.items() if not isinstance(s, PrepareModuleInput)}
    for pname, _ in model.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        if owner not in covered:
            _refuse(f"model.{pname}", "a parameter", "parameters of the split layers only")


def apply_tensor_parallel(model: nn.Module, tp) -> nn.Module:
    """Split `model` in place over the units of `tp` (runtime/groups.py TPGroups) and return
    it: collective over each unit (every rank calls it alike). Parameters become DTensors on
    the "tp" mesh dimension; their gradients are summed over units by the executor (or FSDP2
    over "dp"). Refused models (TensorParallelError) are left exactly as they were."""
    plan = tp_plan(model, tp.degree)
    if tp.degree == 1:
        return model
    parallelize_module(model, tp.mesh["tp"], plan)
    for name, style in plan.items():
        if isinstance(style, RowwiseParallel) and isinstance(
            model.get_submodule(name), nn.Embedding
        ):
            model.get_submodule(name).register_forward_pre_hook(_grad_keeps_placement)
    return model


def _grad_keeps_placement(module: nn.Module, _args) -> None:
    """Forward pre-hook of a vocabulary-split embedding. DTensor's embedding backward hands
    the weight's gradient back Replicate: the whole vocabulary on every GPU, and FSDP2 would
    accumulate it so ([V, h] in fp32 per GPU, measured: benchmarks/bench_memory.py
    --layouts). A gradient hook on the weight running now (FSDP2 registers its gathered
    parameter for the forward; once per parameter object) gives it the parameter's
    placement first: a local slice of the own rows, no traffic."""
    weight = module.weight
    if getattr(weight, "_dcp_grad_placement", False):
        return
    placements = weight.placements

    def to_placement(grad):
        if getattr(grad, "placements", placements) == placements:
            return grad
        return grad.redistribute(grad.device_mesh, placements)

    weight.register_hook(to_placement)
    weight._dcp_grad_placement = True


def attention_heads(model: nn.Module) -> int:
    """The model's query heads (TinyLM cfg, transformers config)."""
    cfg = getattr(model, "cfg", None) or model.config
    return int(getattr(cfg, "num_heads", None) or cfg.num_attention_heads)


def check_plan_heads(plan, model: nn.Module) -> None:
    """Refuse (every rank alike, before any collective) a plan whose Ulysses groups cannot
    split the heads: H must divide by t x d, and cp / ring groups are not built under TP."""
    t = plan.tensor_parallel
    heads = attention_heads(model)
    for p, phase in enumerate(plan.phases):
        for g in phase.groups:
            if g.degree > 1 and g.kind != "ulysses":
                raise TensorParallelError(
                    f"plan.phases[{p}]: a group of kind {g.kind!r} with tensor_parallel {t}; "
                    "allowed: 'ulysses' groups (cp and ring under TP are not built)"
                )
            if heads % (t * g.degree):
                raise TensorParallelError(
                    f"plan.phases[{p}]: heads {heads} do not divide by tensor_parallel {t} x "
                    f"degree {g.degree}; allowed: degrees d with {heads} % ({t} d) == 0"
                )


def is_strided(t) -> bool:
    """Whether `t` is a DTensor split in interleaved blocks (FusedColwiseParallel's
    _StridedShard), which torch.distributed.checkpoint cannot write as a chunk (its offsets
    overlap): runtime/checkpoint.py writes such a tensor whole."""
    return any(isinstance(p, _StridedShard) for p in getattr(t, "placements", ()))


def fsdp_placement(param):
    """FSDP2's `shard_placement_fn` over the units (runtime/sharding.py with tp): a fused
    projection's rows are already split as interleaved blocks over TP, and FSDP2's own split
    of those rows would nest two strided splits (measured: its full tensor and its update come
    out wrong), so it shards the input columns instead; None (FSDP2's dim 0) otherwise."""
    if any(isinstance(p, _StridedShard) for p in getattr(param, "placements", ())):
        return Shard(param.dim() - 1)
    return None


class CollectiveBytes(TorchDispatchMode):
    """Count what the TP collectives send (a context manager, this rank): every functional
    collective DTensor issues (`torch.ops._c10d_functional`: all_gather_into_tensor,
    reduce_scatter_tensor, all_reduce), forward and backward, as (op, bytes sent per GPU) in
    `records`. A ring over g GPUs sends (g - 1) x the input of an all-gather, (g - 1) / g of the
    input of a reduce-scatter, 2 (g - 1) / g of an all-reduce's (Thakur et al. 2005); `degree`
    is g for all-reduce, which carries no group size."""

    def __init__(self, degree: int):
        super().__init__()
        self.degree, self.records = degree, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("_c10d_functional::"):
            op, x = name.split("::")[1].split(".")[0], args[0]
            g = self.degree
            sent = {
                "all_gather_into_tensor": (g - 1) * x.nbytes,
                "reduce_scatter_tensor": (g - 1) * x.nbytes // g,
                "all_reduce": 2 * (g - 1) * x.nbytes // g,
            }.get(op)
            if sent is not None:
                self.records.append((op, sent))
        return func(*args, **(kwargs or {}))

    def total(self, op: str | None = None) -> int:
        return sum(b for o, b in self.records if op is None or o == op)


def reduce_partial_grads(model: nn.Module) -> None:
    """Give every gradient its parameter's placement. A norm weight is replicated under
    SequenceParallel and each GPU sees its own tokens, so DTensor leaves its gradient
    Partial(sum) over TP: one all-reduce of h values per norm. The embedding's would come back
    Replicate (the whole vocabulary on every GPU); `_grad_keeps_placement` already slices it
    to its own rows as it is produced (no traffic either way).
    Left as they are, every optimizer op would redistribute again and the sum over units
    would move (and, for a partial one, add) the wrong tensors."""
    for p in model.parameters():
        g = p.grad
        if g is not None and getattr(g, "placements", p.placements) != p.placements:
            p.grad = g.redistribute(g.device_mesh, p.placements)
