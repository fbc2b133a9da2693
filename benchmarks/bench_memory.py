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
    dcp-opt profile --target tiny-lm --layers 4 --hidden 64 --heads 4 --ffn 128 \
        --dtype bfloat16 --quick --device cpu -o tiny_lm_bf16.profile.json
    python benchmarks/bench_memory.py --profile tiny_lm_bf16.profile.json   # measured act

The FLOP-derived preset's activation coefficients assume fused GPU kernels (FlashAttention,
fused norms); on the CPU the runtime's per-segment SDPA and fp32 norm internals save more,
so the activation comparison uses a profile of this model (results/bench_memory.json was made
with results/tiny_lm_bf16.profile.json).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from dcp_opt.runtime import LMConfig, LMTask, SPState, TinyLM, execute_step, parallelize
from dcp_opt.runtime.sharding import held_bytes, shard
from dcp_opt.runtime.testing import DistWorkers
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, Cluster, CostModel, ModelSpec
from dcp_opt.cost import SHARDING_MODES
from dcp_opt.plan import Plan

# The shape `dcp-opt profile --target tiny-lm --layers 4 --hidden 64 --heads 4 --ffn 128` measures.
CFG = LMConfig(vocab_size=512, hidden=64, num_heads=4, num_layers=4, ffn_hidden=128)
LENGTHS = [37, 120, 64, 200, 15, 90, 150, 33, 48, 76, 180, 22]


def num_params() -> int:
    return sum(p.numel() for p in TinyLM(CFG).parameters())


def spec(dtype: str | None) -> ModelSpec:
    # The exact parameter count (biases and norms included): the bytes must be what runs.
    b = 2 if dtype == "bf16" else 4
    return ModelSpec(
        "tiny-llama", "1d", CFG.num_layers, CFG.hidden, CFG.num_heads, CFG.ffn_hidden,
        vocab_size=CFG.vocab_size, dtype_bytes=b, num_params=float(num_params()),
    )  # fmt: skip


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
    """LMTask whose run records the bytes of the storages autograd saves (weights excluded)."""

    def __init__(self):
        self.task, self.exclude, self.per_mb = LMTask(), set(), []

    def run(self, model, samples, state, **kw):
        seen: dict[int, int] = {}
        # weights: the gathered compute copy, counted in model states
        self.exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in self.exclude:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.task.run(model, samples, state, **kw)
        tokens = sum(s.shape[0] - 1 for _, s in samples)
        self.per_mb.append((tokens, state.sp.degree, state.recompute_layers, sum(seen.values())))
        return out


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


def measure(workers: DistWorkers, mode: str, dtype: str | None, profile=None) -> list[dict]:
    world = workers.world_size
    cost = cost_for(world, mode, dtype, profile)
    batch = Batch.from_lengths(LENGTHS)
    plan = run_planner("greedy", batch, cost).plan
    rows = []
    outs = workers.run(job_measure, mode, dtype, plan.to_json(), batch.to_dict())
    for rank, out in enumerate(outs):
        held = out["held"]
        got = held["params"] + held["compute"] + held["grads"] + held["optimizer"]
        want = cost.model_state_bytes()
        mbs = out["micro_batches"]
        act, act_want, term = 0, 0.0, 0.0
        if mbs:
            tokens, d, r, act = max(mbs, key=lambda m: m[3])
            act_want = saved_term(cost, tokens, d, r)
            term = float(cost.memory(tokens, d, r)) - cost.fixed_bytes()
        rows.append(
            {
                "world": world, "mode": mode, "dtype": dtype or "fp32", "rank": rank,
                "params": held["params"], "compute": held["compute"], "grads": held["grads"],
                "optimizer": held["optimizer"], "model_states": got,
                "predicted_model_states": want, "model_states_error": got / want - 1,
                "predicted_parts": predicted(cost), "peak_saved_activations": act,
                "predicted_activations": act_want, "activation_term": term,
                "coefficients": cost.coeffs.source,
                "activations_error": act / act_want - 1 if act_want else None,
            }
        )  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    head = (
        f"{'world':>5} {'mode':>5} {'rank':>4} {'params':>9} {'compute':>9} {'grads':>9} "
        f"{'optim':>9} {'states':>9} {'predicted':>9} {'err':>7} {'act':>9} {'act pred':>9} "
        f"{'err':>7}"
    )
    lines = [head]
    for r in rows:
        ae = "-" if r["activations_error"] is None else f"{100 * r['activations_error']:+.1f}%"
        lines.append(
            f"{r['world']:>5} {r['mode']:>5} {r['rank']:>4} {r['params']:>9} {r['compute']:>9} "
            f"{r['grads']:>9} {r['optimizer']:>9} {r['model_states']:>9} "
            f"{r['predicted_model_states']:>9.0f} {100 * r['model_states_error']:>+6.2f}% "
            f"{r['peak_saved_activations']:>9} {r['predicted_activations']:>9.0f} {ae:>7}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=list(SHARDING_MODES), choices=SHARDING_MODES)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", metavar="OUT", help="write every row here")
    ap.add_argument("--profile", metavar="FILE", help="a dcp-opt profile of this model (bf16)")
    args = ap.parse_args(argv)
    dtype = None if args.dtype == "fp32" else "bf16"
    rows = []
    for world in args.worlds:
        workers = DistWorkers(world, timeout_s=120.0)
        try:
            for mode in args.modes:
                rows += measure(workers, mode, dtype, args.profile)
        finally:
            workers.close()
    src = args.profile or "FLOP-derived preset"
    print(f"model states and saved activations per rank, bytes ({args.dtype}, TinyLM {CFG})")
    print(f"activation coefficients: {src}; 'act pred' = the saved part of the activation term")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "dcp-opt-bench-memory/1", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
