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
    dcp-opt profile --target tiny-lm --layers 4 --hidden 64 --heads 4 --ffn 128 \
        --dtype bfloat16 --quick --device cpu -o tiny_lm_bf16.profile.json
    python benchmarks/bench_memory.py --profile tiny_lm_bf16.profile.json   # measured act

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
    """The saved part of the cost model's activation term: T/d ((L - r) act + r ckpt + head),
    without the one-layer working set (`+ act`), which autograd does not save."""
    co, L = cost.coeffs, cost.model.num_layers
    per = (L - r) * co.act_bytes_per_token_layer + r * co.ckpt_bytes_per_token_layer
    return tokens / d * (per + co.head_bytes_per_token)


class SavedBytes:
    """LMTask whose run records the bytes of the storages autograd saves (weights excluded),
    each storage once, and by the module that saved it first (`layers.*.attn`: any layer;
    `-`: outside every module, the loss). A view keeps its whole storage alive, so a storage
    is the memory a saved tensor holds."""

    def __init__(self):
        self.task, self.per_mb, self.stack = LMTask(), [], ["-"]

    def run(self, model, samples, state, **kw):
        seen: dict[int, tuple[str, int]] = {}
        # weights: the gathered compute copy, counted in model states
        exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in exclude and st.data_ptr() not in seen:
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
    if args.json:
        with open(args.json, "w") as f:
            out = {"schema": "dcp-opt-bench-memory/1", "rows": rows, "per_layer": layered}
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
