"""Issue 26's big-model figures: Llama 3 70B and a 14B video model planned past the memory
wall, with tensor parallelism and per-layer ZeRO-3 (dcp_opt/cost/units.py, zero3.py).

    .venv/bin/python benchmarks/bench_bigmodel.py [--json benchmarks/results/bigmodel.json]
                                                  [--epoch-tokens 16e6] [--quick]

Models: `llama3-70b` (the preset) on its real document lengths (`1d-wlbllm`), and a 14B
video DiT with Wan 2.1 14B's shapes (hidden 5120, 40 heads, FFN 13824, umT5 captions of 512
tokens) as the existing `2d` kind: 20 layers of (spatial, temporal) blocks = Wan's 40 blocks,
14.05e9 parameters, on `2d-balanced`. Wan 2.1 attends over all three axes at once; the `2d`
kind factorises it (a full-attention 3-D kind is h7's, with a `wan2.1-14b` preset: switch
when it is merged). Clusters: h100x64 and h200x32.

1. Layouts (dcp_opt.analysis.whatif_layout): every TP degree x {zero1, zero3 step-level,
   zero3 per layer over each shard domain} on one batch of 64K tokens per GPU: which fit,
   the states per GPU, and greedy, bucket and static_tuned's predicted step at that setting.
2. Stream: an epoch of `--epoch-tokens` tokens of the workload (seed 1) cut in data order into steps of 2M and 8M
   tokens (dcp_opt.analysis.stream), each step planned by the three planners at the fastest
   layout and at zero3 without TP (the least shard domain that fits): tokens/s over the
   epoch, greedy over bucket and over static_tuned.
JSON: {"config", "layouts": [rows], "stream": [rows]}. Every figure is the cost model's
prediction (FLOP-derived coefficients), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import time

from dcp_opt.solvers import run_planner

from dcp_opt import CostModel, cluster_preset, model_preset
from dcp_opt.analysis.stream import data_order_steps
from dcp_opt.analysis.whatif_layout import layout_sweep
from dcp_opt.batch import Batch
from dcp_opt.cost.settings import least_shard_domain
from dcp_opt.model import ModelSpec
from dcp_opt.workloads import Workload, standard_batch

PLANNERS = ("greedy", "bucket", "static_tuned")
# Wan 2.1 14B (Wan-Video/Wan2.1, config of the 14B T2V model: dim 5120, ffn_dim 13824,
# num_heads 40, num_layers 40, text_len 512) as 20 layers of the 2d kind's two blocks
WAN14B_2D = ModelSpec("wan2.1-14b-as-2d", "2d", 20, 5120, 40, 13824, text_tokens=512, causal=False)
CASES = (("llama3-70b", "1d-wlbllm"), ("wan2.1-14b-as-2d", "2d-balanced"))
CLUSTERS = ("h100x64", "h200x32")
SIZES = (2_000_000, 8_000_000)


def model_of(name: str) -> ModelSpec:
    return WAN14B_2D if name == WAN14B_2D.name else model_preset(name)


def layouts(model: str, workload: str, cluster: str, quick: bool) -> dict:
    cost = CostModel(model_of(model), cluster_preset(cluster))
    batch = standard_batch(workload, 0, num_gpus=cost.cluster.num_gpus)
    planners = PLANNERS[:1] if quick else PLANNERS
    doc = layout_sweep([batch], cost, planners=planners)
    for r in doc["rows"]:
        r.update(model=model, workload=workload, cluster=cluster)
    return doc


def stream_setting(cost: CostModel, epoch: Batch, size: int, planners) -> dict:
    """Tokens/s of each planner over the epoch cut into data-order steps of `size` tokens."""
    steps = data_order_steps(epoch, size)
    total = {p: 0.0 for p in planners}
    errors: dict[str, str] = {}
    for ids in steps:
        step = Batch(tuple(epoch.sequences[i] for i in ids))
        for p in planners:
            if p in errors:
                continue
            try:
                total[p] += run_planner(p, step, cost).predicted_step_time_s
            except Exception as e:  # a planner's refusal is a figure too
                errors[p] = f"{type(e).__name__}: {str(e)[:160]}"
    tokens = epoch.num_tokens
    tps = {p: (None if p in errors else tokens / total[p]) for p in planners}
    g = tps.get("greedy")
    ratio = {
        f"greedy_vs_{p}": (g / tps[p] if g and tps[p] else None) for p in planners if p != "greedy"
    }
    return {"num_steps": len(steps), "tokens_per_s": tps, **ratio, "errors": errors}


def stream_rows(case, cluster, fastest, epoch_tokens: float, quick: bool) -> list[dict]:
    model, workload = case
    base = CostModel(model_of(model), cluster_preset(cluster))
    epoch = Workload.parse(workload).batch(1, int(epoch_tokens))  # seed 1: not the one batch
    settings = []
    if fastest:
        settings.append((fastest["tensor_parallel"], fastest["optimizer_sharding"],
                         fastest["shard_domain"]))  # fmt: skip
    longest = max(q.num_tokens for q in epoch.sequences)
    s = least_shard_domain(base.with_(optimizer_sharding="zero3"), longest)
    if s is not None and (1, "zero3", s) not in settings:
        settings.append((1, "zero3", s))
    planners = PLANNERS[:2] if quick else PLANNERS
    rows = []
    for t, mode, dom in settings:
        cost = base.with_(tensor_parallel=t, optimizer_sharding=mode, shard_domain=dom)
        for size in SIZES:
            row = stream_setting(cost, epoch, size, planners)
            rows.append({
                "model": model, "workload": workload, "cluster": cluster,
                "tensor_parallel": t, "optimizer_sharding": mode, "shard_domain": dom,
                "step_tokens": size, "epoch_tokens": epoch.num_tokens, **row,
            })  # fmt: skip
            print(_stream_line(rows[-1]), flush=True)
    return rows


def _stream_line(r: dict) -> str:
    tps = "  ".join(f"{p} {v / 1e3:8.1f}K" if v else f"{p} -" for p, v in r["tokens_per_s"].items())
    ratios = "  ".join(
        f"{k[10:]} x{v:.2f}" for k, v in r.items() if k.startswith("greedy_vs_") and v
    )
    return (
        f"{r['model']:<18} {r['cluster']:<8} tp{r['tensor_parallel']} {r['optimizer_sharding']}"
        f"/{r['shard_domain']:<3} {r['step_tokens'] / 1e6:.0f}M x{r['num_steps']:<3} tokens/s: "
        f"{tps}  greedy vs {ratios}"
    )


def _layout_line(r: dict) -> str:
    head = f"{r['model']:<18} {r['cluster']:<8} {r['flags']:<50}"
    if not r["fits"]:
        return f"{head} does not fit ({r['why'][:70]})"
    steps = "  ".join(f"{p} {v:8.2f} s" for p, v in r["step_time_s"].items())
    return f"{head} states {r['states_gb_per_gpu']:5.1f} GB/GPU  {steps}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="benchmarks/results/bigmodel.json")
    ap.add_argument("--epoch-tokens", type=float, default=16e6)
    ap.add_argument("--quick", action="store_true", help="greedy (and bucket) only")
    args = ap.parse_args()
    started = time.perf_counter()
    all_layouts, all_stream = [], []
    for case in CASES:
        for cluster in CLUSTERS:
            doc = layouts(*case, cluster, args.quick)
            for r in doc["rows"]:
                print(_layout_line(r), flush=True)
            all_layouts += doc["rows"]
            best = doc["fastest"]
            print(f"fastest: {best['flags'] if best else 'none fits'}", flush=True)
            all_stream += stream_rows(case, cluster, best, args.epoch_tokens, args.quick)
    out = {
        "config": {
            "cases": [list(c) for c in CASES], "clusters": list(CLUSTERS),
            "planners": list(PLANNERS[:1] if args.quick else PLANNERS),
            "step_tokens": list(SIZES), "epoch_tokens": args.epoch_tokens,
            "one_batch_tokens_per_gpu": 65536, "seed": 0,
            "wall_time_s": time.perf_counter() - started,
        },
        "layouts": all_layouts,
        "stream": all_stream,
    }  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json} ({out['config']['wall_time_s']:.0f} s)")


if __name__ == "__main__":
    main()
