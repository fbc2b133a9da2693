"""Memory per sharding mode: what each rank holds, measured from tensor storage, next to the
cost model's prediction for the same plan (issue 14).

For every mode and world (gloo ranks on the CPU), a small Llama-shaped TinyLM trains two
steps of a greedy plan in the chosen dtype under runtime/sharding.py. At the step's peak of
model states (after the last micro-batch of step 2, before the world reduces; the optimizer
state exists from step 1) every rank reads `held_bytes`: fp32 master shards, the gathered
compute copy, the gradient accumulators, the optimizer state. Saved activations are the
storages autograd saves in each micro-batch (saved-tensor hooks; weights excluded); the
largest micro-batch is compared with the cost model's activation term for it.

    python benchmarks/bench_memory.py --worlds 2 4 --json out/bench_memory.json
    python benchmarks/bench_memory.py --worlds 4 --modes zero3 --shard-domains 2 4   # per layer
    python benchmarks/bench_memory.py --worlds 2 4 --layouts \
        --profile benchmarks/results/tiny_lm_bf16.profile.json   # + per-layer zero3 and TP
    dcp-opt profile --target tiny-lm --layers 4 --hidden 64 --heads 4 --ffn 128 \
        --dtype bfloat16 --quick --device cpu -o tiny_lm_bf16.profile.json
    python benchmarks/bench_memory.py --profile tiny_lm_bf16.profile.json   # measured act

`--layouts` (world 4): per-layer zero3 over 2 and 4 ranks, TP 2 with zero1 and with
per-layer zero3 over 1 and 2 units; each GPU's model-state peak (sampled at every FSDP2
collective and reduce-scatter buffer) against the cost model (per unit / t) and against the
formula of what FSDP2 holds (`per_layer_peak`, `step_level_peak`), and the saved activations
against the charge / t and, under TP, `tp_saved_term` (tests/test_memory_layouts.py).

The activation comparison uses a profile of this model (results/bench_memory.json was made
with results/tiny_lm_bf16.profile.json: the profiler's saved-tensor bytes of one layer and
of the head, runtime/profile/measure.py); each row also gives the FLOP preset's figure.
`breakdown` prints what autograd saves, by module, per local token (bf16, world 2, degree 1):
per layer 2544 B: each RMSNorm 516 (eager rms_norm upcasts: fp32 input 256, fp32 normalised
256, rsqrt 4), the attention call 616 (rope's cos/sin 64, positions 8, q/k/v copied per
sequence length 384, SDPA's output 128 and fp32 logsumexp 16, two int64 gather indices 16),
the out projection's input 128, the qkv input 128, the MLP 640; outside the layers 1686 (the
loss's bf16 log-softmax 1024, the final norm 516, the head's input 128, ids). The profile
measures 2648 per layer: its grid packs sequences of one length, where the reference path
attends over views (v keeps the whole qkv output alive, 384 instead of 128, and the output is
not copied), 104 B more than the mixed lengths of these plans; at degree d the gather
indices cover the gathered sequence (+16 (d - 1) B per local token per layer). So the
profiled term is 2-4 % high. The FLOP preset (act 1536, head 3072) assumes fused kernels
(norms that save their bf16 input only, fused rope) and is about 30 % low on this model.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch
from dcp_opt.runtime import LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.models import model_spec
from dcp_opt.runtime.sharding import held_bytes, shard
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, Cluster, CostModel, ModelSpec
from dcp_opt.cost import SHARDING_MODES
from dcp_opt.plan import Plan

# The shape `dcp-opt profile --target tiny-lm --layers 4 --hidden 64 --heads 4 --ffn 128` measures.
CFG = LMConfig(vocab_size=512, hidden=64, num_heads=4, num_layers=4, ffn_hidden=128)
LENGTHS = [37, 120, 64, 200, 15, 90, 150, 33, 48, 76, 180, 22]


def spec(dtype: str | None) -> ModelSpec:
    """The model as the run computes: activations in the compute dtype ("bf16": 2 bytes, not
    the 4 of the fp32 master parameters), the exact parameter count (biases and norms
    included), so the bytes are what runs."""
    return model_spec(TinyLM(CFG), dtype=dtype)


def cost_for(world: int, mode: str, dtype: str | None, profile: str | None = None) -> CostModel:
    cluster = Cluster("cpu", 1, world, 1e12, 1e12, 1e10, 1e10)
    if profile:  # measured activation coefficients (saved-tensor bytes, runtime/profile/measure.py)
        from dcp_opt.profile_io import cost_model_from_profile

        return cost_model_from_profile(profile, spec(dtype), cluster, optimizer_sharding=mode)
    return CostModel(spec(dtype), cluster, None, mode)


def saved_term(cost: CostModel, tokens: int, d: int, r: int) -> float:
    """The saved part of the cost model's activation term per unit (CostModel.
    saved_activation_bytes: T/d ((L - r) act + r ckpt + head), without the one-layer working
    set, which autograd does not save)."""
    return float(cost.saved_activation_bytes(tokens, d, r))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (tensor parallelism; no autograd op), the tensor a pending
    functional collective's result wraps (AsyncCollectiveTensor.elem), a plain tensor as is."""
    t = getattr(t, "_local_tensor", t)
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else t


class SavedBytes:
    """LMTask whose run records the bytes of the storages autograd saves (weights excluded),
    each storage once, and by the module that saved it first (`layers.*.attn`: any layer;
    `-`: outside every module, the loss). A view keeps its whole storage alive, so a storage
    is the memory a saved tensor holds."""

    def __init__(self):
        self.task, self.per_mb, self.stack = LMTask(), [], ["-"]

    def run(self, model, samples, state, **kw):
        seen: dict[int, tuple[str, int]] = {}

        def pack(t):
            st = _local(t).untyped_storage()
            # weights: the gathered compute copy, counted in model states. Read when saved:
            # per layer, FSDP2 registers a block's gathered parameters only while it runs.
            weights = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
            if st.data_ptr() not in weights and st.data_ptr() not in seen:
                seen[st.data_ptr()] = (self.stack[-1], st.nbytes())
            return t

        hooks = self._track_modules(model)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.task.run(model, samples, state, **kw)
        finally:
            for h in hooks:
                h.remove()
        by_module: dict[str, int] = {}
        for name, nbytes in seen.values():
            key = re.sub(r"^layers\.\d+", "layers.*", name)
            by_module[key] = by_module.get(key, 0) + nbytes
        tokens = sum(s.shape[0] - 1 for _, s in samples)
        d, r = state.sp.degree, state.recompute_layers
        self.per_mb.append((tokens, d, r, sum(by_module.values()), by_module))
        return out

    def _track_modules(self, model) -> list:
        """Forward hooks that keep the name of the innermost module running."""
        hooks = []
        for name, m in model.named_modules():
            hooks.append(m.register_forward_pre_hook(lambda _m, _a, n=name: self.stack.append(n)))
            hooks.append(m.register_forward_hook(lambda _m, _a, _o: self._pop()))
        return hooks

    def _pop(self) -> None:
        self.stack.pop()  # returns None: the module's output stays as it is


def job_measure(ctx, mode: str, dtype: str | None, plan_json: str, batch_dict: dict):
    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    torch.manual_seed(0)
    state = SPState()
    model = parallelize(TinyLM(CFG), state)
    task = SavedBytes()
    sh = shard(model, torch.optim.AdamW, mode=mode, pool=ctx.pool, task=task.task, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    data = {
        s.id: torch.randint(CFG.vocab_size, (s.shape[0] + 1,), generator=g) for s in batch.sequences
    }
    seen = {}

    def probe(s):
        seen.update(held_bytes(s))

    for step in range(2):
        sh.probe = probe if step == 1 else None
        task.per_mb.clear()
        execute_step(plan, task, model, data, pool=ctx.pool, state=state, step=step, sharding=sh)
    return {"held": seen, "micro_batches": task.per_mb}


def predicted(cost: CostModel) -> dict:
    p, n = cost.model.total_params, cost.cluster.num_gpus
    o = 12.0 if cost.optimizer_sharding == "none" else 12.0 / n
    return {"compute": 2 * p, "grads": 4 * p, "master+optimizer": o * p}


def measure(
    workers: DistWorkers, mode: str, dtype: str | None, profile=None, job=None
) -> list[dict]:
    """Rows of one mode on `workers`' world. `job`: job_measure, or a module-level function
    that calls it (a test imports this file by path, so its workers cannot unpickle ours)."""
    world = workers.world_size
    cost = cost_for(world, mode, dtype, profile)
    batch = Batch.from_lengths(LENGTHS)
    plan = run_planner("greedy", batch, cost).plan
    preset = cost_for(world, mode, dtype)  # the FLOP-derived coefficients, beside
    rows = []
    outs = workers.run(job or job_measure, mode, dtype, plan.to_json(), batch.to_dict())
    for rank, out in enumerate(outs):
        held = out["held"]
        got = held["params"] + held["compute"] + held["grads"] + held["optimizer"]
        want = cost.model_state_bytes()
        rows.append(
            {
                "world": world, "mode": mode, "dtype": dtype or "fp32", "rank": rank,
                "params": held["params"], "compute": held["compute"], "grads": held["grads"],
                "optimizer": held["optimizer"], "model_states": got,
                "predicted_model_states": want, "model_states_error": got / want - 1,
                "predicted_parts": predicted(cost), "coefficients": cost.coeffs.source,
                **activations(cost, preset, out["micro_batches"]),
            }
        )  # fmt: skip
    return rows


def activations(cost: CostModel, preset: CostModel, mbs: list) -> dict:
    """The largest micro-batch's saved bytes against the cost model's saved term for it,
    and against the FLOP preset's; the saved bytes by module per local token (per layer
    for `layers.*`: what differs from the coefficients)."""
    if not mbs:
        return {"peak_saved_activations": 0, "predicted_activations": 0.0,
                "activation_term": 0.0, "activations_error": None,
                "preset_activations": 0.0, "preset_activations_error": None}  # fmt: skip
    tokens, d, r, act, by_module = max(mbs, key=lambda m: m[3])
    want, flops = saved_term(cost, tokens, d, r), saved_term(preset, tokens, d, r)
    local, L = tokens / d, cost.model.num_layers
    return {
        "tokens": tokens, "degree": d, "recompute_layers": r,
        "peak_saved_activations": act, "predicted_activations": want,
        "activation_term": float(cost.memory(tokens, d, r)) - cost.fixed_bytes(),
        "activations_error": act / want - 1,
        "preset_activations": flops, "preset_activations_error": act / flops - 1,
        "saved_bytes_per_local_token": {
            k: v / local / (L if k.startswith("layers.") else 1) for k, v in by_module.items()
        },
    }  # fmt: skip


def job_per_layer(ctx, plan_json: str, batch_dict: dict):
    """ZeRO-3 per layer (the plan's shard_domain), bf16, two steps; in the second: bytes per
    collective kind and group size, held_bytes after the plan's last micro-batch, and the
    in-flight peak: held_bytes (+ the reduce-scatter's fp32 input) sampled at every
    collective."""
    import torch.distributed as dist

    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    torch.manual_seed(0)
    state, task = SPState(), LMTask()
    model = parallelize(TinyLM(CFG), state)
    sh = shard(model, torch.optim.AdamW, mode="zero3", pool=ctx.pool, task=task, dtype="bf16",
               shard_domain=plan.shard_domain)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = {q.id: torch.randint(CFG.vocab_size, (q.shape[0] + 1,), generator=g)
            for q in batch.sequences}  # fmt: skip
    counts, held, peak = {}, {}, {"total": 0}
    which = {"all_gather_single": 0, "reduce_scatter_single": 1, "all_reduce": 0}
    inner = {n: getattr(dist, n) for n in which}

    def wrap(name):
        def counted(*args, **kw):
            t = args[which[name]] if len(args) > which[name] else list(kw.values())[which[name]]
            nbytes = t.numel() * t.element_size()
            key = f"{name}/{dist.get_world_size(kw.get('group'))}"
            counts[key] = counts.get(key, 0) + nbytes
            now = held_bytes(sh)
            now["rs_input"] = nbytes if name == "reduce_scatter_single" else 0
            if sum(now.values()) > peak["total"]:
                peak.update(now, total=sum(now.values()))
            return inner[name](*args, **kw)

        return counted

    try:
        for name in which:
            setattr(dist, name, wrap(name))
        for step in range(2):
            counts.clear()
            peak.update(total=0)
            sh.probe = (lambda s: held.update(held_bytes(s))) if step else None
            report = execute_step(plan, task, model, data, pool=ctx.pool, state=state,
                                  step=step, sharding=sh)  # fmt: skip
    finally:
        for name in which:
            setattr(dist, name, inner[name])
    steps = len(report.micro_batches) + sum(report.padding) + 1
    return {"counts": counts, "between": held, "peak": peak, "micro_steps": steps}


def per_layer_rows(workers: DistWorkers, domains: list[int]) -> list[dict]:
    """Per shard domain s and rank: traffic against 2 x 2 B (gathers) + 4 B (reduce-scatter)
    per parameter and micro-step (+ 4 B / s once across domains), states between micro-steps
    against 16 B / s, and the in-flight peak above them."""
    import dataclasses

    world, batch = workers.world_size, Batch.from_lengths(LENGTHS)
    p = sum(q.numel() for q in TinyLM(CFG).parameters())
    plan = run_planner("greedy", batch, cost_for(world, "zero3", "bf16")).plan
    rows = []
    for s in domains:
        run = dataclasses.replace(plan, shard_domain=s).to_json()
        for rank, out in enumerate(workers.run(job_per_layer, run, batch.to_dict())):
            m, c = out["micro_steps"], out["counts"]
            sent = c.get(f"all_gather_single/{s}", 0) + c.get(f"reduce_scatter_single/{s}", 0)
            between = sum(out["between"].values())
            rows.append({
                "world": world, "shard_domain": s, "rank": rank, "micro_steps": m,
                "domain_bytes": sent, "domain_formula": 8 * p * m,
                "cross_domain_bytes": c.get(f"all_reduce/{world // s}", 0) if s < world else 0,
                "cross_domain_formula": 4 * p // s if s < world else 0,
                "between_micro_steps": between, "between_formula": 16 * p / s,
                "peak": out["peak"],
            })  # fmt: skip
    return rows


_TP: dict = {}


def _tp_groups(t: int):
    from dcp_opt.runtime.groups import TPGroups

    if t not in _TP:  # collective: once per degree in each worker, in the same order
        _TP[t] = TPGroups.create(t)
    return _TP[t]


def local_counts(model) -> dict[str, int]:
    """This GPU's parameters (its TP shard; before FSDP2 shards them) by FSDP2 unit: all, one
    block, the root unit (embedding, final norm, head) and, of it, the head with the norm."""

    def n(ps):
        return sum(_local(p).numel() for p in ps)

    outside = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    return {
        "total": n(model.parameters()), "block": n(model.layers[0].parameters()),
        "root": n(outside), "head": n([*model.head.parameters(), *model.norm.parameters()]),
    }  # fmt: skip


def per_layer_peak(counts: dict, s: int, c: int = 2) -> float:
    """The in-flight model-state peak of per-layer zero3 on one GPU, as FSDP2 holds it
    (docs/architecture.md, "Past the memory wall"; sampled at every collective, reduce-scatter
    buffer and copy-in by job_layout): 16 B / s per parameter (fp32 master, gradient shard,
    Adam moments) + the root unit's gathered parameters and the head's (and final norm's)
    compute-dtype gradients, c (P_root + P_head), + at block i's reduce-scatter, with block
    i - 1 prefetched (c): at the copy-in block i's compute-dtype gradients (c, freed only
    after it: torch's foreach_reduce) and its fp32 input (4), then the input with the output
    (4 / s): max(2 c + 4, c + 4 + 4 / s) P_block; or between two collectives block i's
    parameters and gradients with block i - 1, 3 c P_block; or, where larger, the root's own
    reduce-scatter: max(c + 4, 4 + 4 / s) P_root. `counts`: local_counts (a TP shard's under
    TP)."""
    block = max(2 * c + 4, c + 4 + 4 / s, 3 * c) * counts["block"]
    layer = c * (counts["root"] + counts["head"]) + block
    root = max(c + 4, 4 + 4 / s) * counts["root"]
    return 16 * counts["total"] / s + max(layer, root)


def step_level_peak(counts: dict, units: int, c: int = 2) -> float:
    """The step-level modes' peak on one GPU (zero1 / zero2 / zero3, shard_domain 0):
    compute copy c + fp32 accumulator 4 + (master + moments) 12 / units per local parameter
    (under TP the embedding's accumulator too holds only its own rows: before the runtime
    gave its gradient the parameter's placement it held the whole vocabulary, 4 V h (t - 1)
    / t more; runtime/tensor_parallel.py `_grad_keeps_placement`)."""
    return counts["total"] * (c + 4 + 12 / units)


def tp_saved_term(cost: CostModel, tokens: int, d: int, r: int, t: int) -> float:
    """Saved activation bytes on one GPU of a unit under TP t as torch's DTensor TP saves them
    (measured by module, runtime/tensor_parallel.py): the saved term / t, except that the
    column-parallel projections save their all-gathered input whole (qkv and the MLP's
    first: 2 h c (t - 1) / t more per token and kept layer), and the head keeps whole logits
    (no loss parallelism: the loss's log-softmax and the head's gathered input are not
    split), so the head's term is not divided by t."""
    co, L, h = cost.coeffs, cost.model.num_layers, cost.model.hidden
    c = cost.model.dtype_bytes
    per = (L - r) * (co.act_bytes_per_token_layer / t + 2 * h * c * (t - 1) / t)
    per += r * co.ckpt_bytes_per_token_layer / t
    return tokens / d * (per + co.head_bytes_per_token)


def job_layout(ctx, layout: dict, plan_json: str, batch_dict: dict):
    """One layout (`tp` t, `mode`, `shard_domain` s in units), bf16, two steps of the plan;
    in the second: held_bytes after the plan's last micro-batch and (per layer) its peak
    sampled at every FSDP2 collective and reduce-scatter buffer (torch 2.13 FSDP2's
    `foreach_reduce`, `DefaultReduceScatter.allocate`) with those buffers, the bytes of
    the FSDP2 collectives by kind and group size, the local parameter counts, and the saved
    bytes of every micro-batch."""
    import torch.distributed as dist
    from dcp_opt.runtime.tensor_parallel import apply_tensor_parallel
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fsdp_coll
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group

    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    torch.manual_seed(0)
    state, task, tp = SPState(), SavedBytes(), None
    model = parallelize(TinyLM(CFG), state)
    if layout["tp"] > 1:
        tp = _tp_groups(layout["tp"])
        apply_tensor_parallel(model, tp)
    counts = local_counts(model)
    sh = shard(model, torch.optim.AdamW, mode=layout["mode"], pool=ctx.pool, task=task.task,
               dtype="bf16", tp=tp, shard_domain=layout["shard_domain"])  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = {q.id: torch.randint(CFG.vocab_size, (q.shape[0] + 1,), generator=g)
            for q in batch.sequences}  # fmt: skip
    sent, held, peak = {}, {}, {"total": 0}
    which = {"all_gather_single": 0, "reduce_scatter_single": 1, "all_reduce": 0}
    inner = {n: getattr(dist, n) for n in which}

    buffers: list[int] = []  # the reduce-scatter's fp32 input (and output) while it runs

    def sample() -> None:
        now = held_bytes(sh)
        now["reduce_buffers"] = sum(buffers)
        if sum(now.values()) > peak["total"]:
            peak.update(now, total=sum(now.values()))

    def wrap(name):
        def counted(*args, **kw):
            t = args[which[name]] if len(args) > which[name] else list(kw.values())[which[name]]
            nbytes = t.numel() * t.element_size()
            key = f"{name}/{dist.get_world_size(kw.get('group'))}"
            sent[key] = sent.get(key, 0) + nbytes
            sample()
            return inner[name](*args, **kw)

        return counted

    def allocate(self, size, *, dtype, device):
        """FSDP2's reduce-scatter buffers, sampled as they appear: a one-unit domain calls
        no collective inside it, and there the output is as large as the input."""
        out = torch.empty(*size, dtype=dtype, device=device)
        buffers.append(out.numel() * out.element_size())
        sample()
        return out

    def copy_in(grads, into, world_size):
        """The copy-in: the block's compute-dtype gradients are alive (FSDP2 frees them only
        after it) beside the fp32 input just allocated; held_bytes does not see them."""
        buffers.append(sum(x.numel() * x.element_size() for x in grads))
        sample()
        buffers.pop()
        return inner_copy(grads, into, world_size)

    def reduce(*args, **kw):
        buffers.clear()
        try:
            return inner_reduce(*args, **kw)
        finally:
            buffers.clear()

    def probe(s):
        held.update(held_bytes(s))
        sample()

    inner_reduce, inner_alloc = fsdp_group.foreach_reduce, fsdp_coll.DefaultReduceScatter.allocate
    inner_copy = fsdp_coll.foreach_reduce_scatter_copy_in
    try:
        for name in which if layout["shard_domain"] else ():
            setattr(dist, name, wrap(name))
        if layout["shard_domain"]:
            fsdp_group.foreach_reduce = reduce
            fsdp_coll.DefaultReduceScatter.allocate = allocate
            fsdp_coll.foreach_reduce_scatter_copy_in = copy_in
        for step in range(2):
            sent.clear()
            task.per_mb.clear()
            peak.update(total=0)
            sh.probe = probe if step else None
            report = execute_step(plan, task, model, data, pool=ctx.pool, state=state,
                                  step=step, sharding=sh, tp=tp)  # fmt: skip
    finally:
        for name in which:
            setattr(dist, name, inner[name])
        fsdp_group.foreach_reduce = inner_reduce
        fsdp_coll.DefaultReduceScatter.allocate = inner_alloc
        fsdp_coll.foreach_reduce_scatter_copy_in = inner_copy
    steps = len(report.micro_batches) + sum(report.padding) + 1
    if not layout["shard_domain"]:  # step-level: the probe is the step's peak (issue 14)
        peak = {**held, "total": sum(held.values())}
    return {"held": held, "peak": peak, "sent": sent, "micro_steps": steps, "counts": counts,
            "micro_batches": task.per_mb, "padding": report.padding}  # fmt: skip


def layout_cost(world: int, layout: dict, profile: str | None = None) -> CostModel:
    """The cost model of a layout (bf16) on `world` CPU ranks; `profile`: measured
    activation coefficients."""
    kw = {"tensor_parallel": layout["tp"], "shard_domain": layout["shard_domain"]}
    cost = cost_for(world, layout["mode"], "bf16", profile)
    return cost.with_(**kw)


LAYOUTS = (
    {"tp": 1, "mode": "zero3", "shard_domain": 2},
    {"tp": 1, "mode": "zero3", "shard_domain": 4},
    {"tp": 2, "mode": "zero1", "shard_domain": 0},
    {"tp": 2, "mode": "zero3", "shard_domain": 1},
    {"tp": 2, "mode": "zero3", "shard_domain": 2},
)


def layout_rows(workers: DistWorkers, layouts, profile: str | None = None, job=None) -> list[dict]:
    """Per layout and GPU: the model-state peak against the cost model (per unit / t) and
    against the formula of what FSDP2 holds (per layer: per_layer_peak; step-level: 2 + 4 B
    + 12 B / units per local parameter); the largest micro-batch's saved activations
    against the saved part of the activation term (per unit / t); per layer, the bytes of
    the gathers and reduce-scatters inside the domain against 2 x 2 + 4 B per local
    parameter and micro-step. `job`: job_layout or a caller's module-level wrapper."""
    world, batch = workers.world_size, Batch.from_lengths(LENGTHS)
    rows = []
    for layout in layouts:
        t, s = layout["tp"], layout["shard_domain"]
        cost = layout_cost(world, layout, profile)
        plan = run_planner("greedy", batch, cost).plan
        outs = workers.run(job or job_layout, layout, plan.to_json(), batch.to_dict())
        for rank, out in enumerate(outs):
            c, m = out["counts"], out["micro_steps"]
            formula = per_layer_peak(c, s) if s else step_level_peak(c, world // t)
            got, want = out["peak"]["total"], cost.model_state_bytes() / t
            row = {
                "world": world, **layout, "rank": rank, "model_states": got,
                "predicted_model_states": want, "model_states_error": got / want - 1,
                "formula_model_states": formula, "formula_error": got / formula - 1,
                "peak": out["peak"], "counts": c, "padding": out["padding"],
            }  # fmt: skip
            if s > 1:
                sent = out["sent"]
                inside = sent.get(f"all_gather_single/{s}", 0)
                inside += sent.get(f"reduce_scatter_single/{s}", 0)
                row |= {"domain_bytes": inside, "domain_formula": 8 * c["total"] * m}
            row |= layout_activations(cost, t, out["micro_batches"])
            rows.append(row)
    return rows


def layout_activations(cost: CostModel, t: int, mbs: list) -> dict:
    """The largest micro-batch's saved bytes on one GPU against the cost model's saved term
    for it (per unit / t) and, under TP, against tp_saved_term (what DTensor TP saves)."""
    if not mbs:
        return {"peak_saved_activations": 0, "predicted_activations": 0.0,
                "activations_error": None, "tp_activations": 0.0, "tp_activations_error": None}  # fmt: skip
    tokens, d, r, act, by_module = max(mbs, key=lambda m: m[3])
    want, tp_want = saved_term(cost, tokens, d, r) / t, tp_saved_term(cost, tokens, d, r, t)
    local, L = tokens / d, cost.model.num_layers
    return {
        "tokens": tokens, "degree": d, "recompute_layers": r,
        "peak_saved_activations": act, "predicted_activations": want,
        "activations_error": act / want - 1,
        "tp_activations": tp_want, "tp_activations_error": act / tp_want - 1,
        "saved_bytes_per_local_token": {
            k: v / local / (L if k.startswith("layers.") else 1) for k, v in by_module.items()
        },
    }  # fmt: skip


def layout_table(rows: list[dict]) -> str:
    head = (
        f"{'tp':>2} {'mode':>5} {'s':>2} {'rank':>4} {'states':>9} {'predicted':>9} {'err':>7} "
        f"{'formula':>9} {'err':>7} {'act':>9} {'act pred':>9} {'err':>7} {'tp act':>9} {'err':>7}"
    )
    lines = [head]
    for r in rows:
        ae, te = (
            "-" if r[k] is None else f"{100 * r[k]:+.1f}%"
            for k in ("activations_error", "tp_activations_error")
        )
        lines.append(
            f"{r['tp']:>2} {r['mode']:>5} {r['shard_domain']:>2} {r['rank']:>4} "
            f"{r['model_states']:>9} {r['predicted_model_states']:>9.0f} "
            f"{100 * r['model_states_error']:>+6.2f}% {r['formula_model_states']:>9.0f} "
            f"{100 * r['formula_error']:>+6.2f}% {r['peak_saved_activations']:>9} "
            f"{r['predicted_activations']:>9.0f} {ae:>7} {r['tp_activations']:>9.0f} {te:>7}"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = (
        f"{'world':>5} {'mode':>5} {'rank':>4} {'params':>9} {'compute':>9} {'grads':>9} "
        f"{'optim':>9} {'states':>9} {'predicted':>9} {'err':>7} {'d':>2} {'act':>9} "
        f"{'act pred':>9} {'err':>7} {'preset':>9} {'err':>7}"
    )
    lines = [head]
    for r in rows:
        ae, pe = (
            "-" if r[k] is None else f"{100 * r[k]:+.1f}%"
            for k in ("activations_error", "preset_activations_error")
        )
        lines.append(
            f"{r['world']:>5} {r['mode']:>5} {r['rank']:>4} {r['params']:>9} {r['compute']:>9} "
            f"{r['grads']:>9} {r['optimizer']:>9} {r['model_states']:>9} "
            f"{r['predicted_model_states']:>9.0f} {100 * r['model_states_error']:>+6.2f}% "
            f"{r.get('degree', '-'):>2} {r['peak_saved_activations']:>9} "
            f"{r['predicted_activations']:>9.0f} {ae:>7} {r['preset_activations']:>9.0f} {pe:>7}"
        )
    return "\n".join(lines)


def breakdown(rows: list[dict], profile: str | None) -> str:
    """Saved bytes per local token by module (rank 0 of each world's first mode), beside the
    coefficients they are compared with."""
    out = []
    for world in sorted({r["world"] for r in rows}):
        r = next(x for x in rows if x["world"] == world and "saved_bytes_per_local_token" in x)
        parts = r["saved_bytes_per_local_token"]
        layer = sum(v for k, v in parts.items() if k.startswith("layers."))
        rest = sum(v for k, v in parts.items() if not k.startswith("layers."))
        out.append(
            f"world {world}, degree {r['degree']}: per layer {layer:.1f} B/local token "
            f"({', '.join(f'{k} {v:.1f}' for k, v in sorted(parts.items()) if k.startswith('layers.'))}); "
            f"outside the layers {rest:.1f}"
        )
    for name, src in (("profile", profile), ("FLOP preset", None)):
        if name == "profile" and not src:
            continue
        co = cost_for(2, "zero1", "bf16", src).coeffs
        out.append(
            f"{name}: act {co.act_bytes_per_token_layer:.1f} B/token/layer, "
            f"head {co.head_bytes_per_token:.1f} B/token"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=list(SHARDING_MODES), choices=SHARDING_MODES)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", metavar="OUT", help="write every row here")
    ap.add_argument("--profile", metavar="FILE", help="a dcp-opt profile of this model (bf16)")
    ap.add_argument(
        "--shard-domains", type=int, nargs="*", default=[],
        help="also ZeRO-3 per layer (bf16) over these shard domains, on the largest world",
    )  # fmt: skip
    ap.add_argument(
        "--layouts", action="store_true",
        help="also per-layer zero3 and tensor parallelism (LAYOUTS, bf16) at world 4",
    )  # fmt: skip
    args = ap.parse_args(argv)
    dtype = None if args.dtype == "fp32" else "bf16"
    rows, layered = [], []
    for world in args.worlds:
        workers = DistWorkers(world, timeout_s=120.0)
        try:
            for mode in args.modes:
                rows += measure(workers, mode, dtype, args.profile)
            if world == max(args.worlds) and args.shard_domains:
                layered = per_layer_rows(workers, args.shard_domains)
        finally:
            workers.close()
    src = args.profile or "FLOP-derived preset"
    print(f"model states and saved activations per rank, bytes ({args.dtype}, TinyLM {CFG})")
    print(f"activation coefficients: {src}; 'act pred' = the saved part of the activation term")
    print(table(rows))
    print(breakdown(rows, args.profile))
    for r in layered:
        print(json.dumps(r))
    layouts = []
    if args.layouts:
        workers = DistWorkers(4, timeout_s=120.0)
        try:
            layouts = layout_rows(workers, LAYOUTS, args.profile)
        finally:
            workers.close()
        print("per-layer zero3 and TP at world 4 (bf16): model-state peak per GPU vs the cost")
        print("model (per unit / t) and vs what FSDP2 holds; saved activations vs the charge / t")
        print(layout_table(layouts))
    if args.json:
        with open(args.json, "w") as f:
            out = {"schema": "dcp-opt-bench-memory/1", "rows": rows, "per_layer": layered}
            out["layouts"] = layouts
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
