"""Issue 30: the pipeline planner against the pipeline baselines, one batch per setting.

    .venv/bin/python benchmarks/bench_pipeline.py [--json benchmarks/results/pipeline.json]

Settings: llama3-70b (examples/models/llama3-70b.json) at p = 8 and p = 4, and a 34B
model of the same family (48 layers, hidden 8192, GQA 8, FFN 22016) at p = 4, on h200x64 and
h200x256, zero1, 16K tokens per GPU, micro-batches of at most 128K tokens (the context);
workloads 1d-wlbllm, 1d-prolong and the standard 1D ones, seed 0. A 70B model at p = 4 holds
6.75 B x 17.6e9 parameters = 119 GB of states per GPU: with no tensor parallelism priced yet
it fits no stage, and its rows say so.

Per setting and method: step time (simulate(), or the lockstep evaluator for Megatron),
pp_greedy's speedup over it, the certified gap of pp_greedy (bound.batch_lower_bound + the
step's collectives) and its order gap (the 1F1B window bound of its own micro-batches),
planning milliseconds. Then pp_greedy's planning time over 20 seeds at 256 GPUs with
about 1,000 documents (p50, p99). Figures are the cost model's (FLOP presets), one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from dcp_opt.solvers import PIPELINE_BASELINES, run_planner
from dcp_opt.solvers.baselines.pipeline_megatron import megatron_pipeline_step

from dcp_opt import CostModel, cluster_preset
from dcp_opt.errors import DcpOptError
from dcp_opt.model import ModelSpec
from dcp_opt.workloads import standard_batch

ROOT = Path(__file__).resolve().parent.parent
L70 = ModelSpec(**json.loads((ROOT / "examples/models/llama3-70b.json").read_text()))
L34 = ModelSpec("llama-34b", "1d", 48, 8192, 64, 22016, vocab_size=32000, gated_mlp=True,
                num_params=33.7e9, num_kv_heads=8)  # fmt: skip
WORKLOADS = ("1d-wlbllm", "1d-prolong", "1d-short", "1d-balanced", "1d-long")
SETTINGS = [(L70, 8), (L70, 4), (L34, 4)]
CLUSTERS = ("h200x64", "h200x256")
TOKENS_PER_GPU = 16384


def one(batch, cost, pp: int) -> dict:
    out = {}
    try:
        g = run_planner("pp_greedy", batch, cost, pp=pp)
    except DcpOptError as e:
        return {"infeasible": str(e)[:200]}
    out["pp_greedy"] = {"step_s": g.predicted_step_time_s, "ms": g.wall_time_s * 1e3,
                        "bound_s": g.lower_bound_s, "gap": g.gap,
                        "order_gap": g.stats["order_gap"]}  # fmt: skip
    try:
        il = run_planner("pp_greedy", batch, cost, pp=pp, schedule="interleaved",
                         virtual_stages=2)  # fmt: skip
        out["pp_greedy_interleaved2"] = {"step_s": il.predicted_step_time_s,
                                         "ms": il.wall_time_s * 1e3, "gap": il.gap}  # fmt: skip
    except DcpOptError as e:
        out["pp_greedy_interleaved2"] = {"error": str(e)[:200]}
    try:
        mg = megatron_pipeline_step(batch, cost, pp=pp)
        out["megatron_heaviest_first"] = {"step_s": mg["step_time_s"],
                                          "ms": mg["wall_time_s"] * 1e3}  # fmt: skip
    except DcpOptError as e:
        out["megatron_heaviest_first"] = {"error": str(e)[:200]}
    for name in PIPELINE_BASELINES:
        try:
            r = run_planner(name, batch, cost, pp=pp)
            out[name] = {"step_s": r.predicted_step_time_s, "ms": r.wall_time_s * 1e3}
        except DcpOptError as e:
            out[name] = {"error": str(e)[:200]}
    base = out["pp_greedy"]["step_s"]
    for v in out.values():
        if "step_s" in v:
            v["greedy_speedup"] = v["step_s"] / base
    return out


def latency(seeds: int = 20) -> dict:
    cost = CostModel(L70, cluster_preset("h200x256"))
    ws, docs = [], []
    for s in range(seeds + 1):
        b = standard_batch("1d-wlbllm", s, num_gpus=256, tokens_per_gpu=14848)
        t = time.perf_counter()
        run_planner("pp_greedy", b, cost, pp=8)
        if s:  # the first call warms imports and caches
            ws.append((time.perf_counter() - t) * 1e3)
            docs.append(len(b))
    return {"p50_ms": float(np.percentile(ws, 50)), "p99_ms": float(np.percentile(ws, 99)),
            "max_ms": max(ws), "documents": [min(docs), max(docs)], "seeds": seeds}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/pipeline.json"))
    args = ap.parse_args()
    rows = []
    for model, pp in SETTINGS:
        for cl in CLUSTERS:
            cost = CostModel(model, cluster_preset(cl))
            for wl in WORKLOADS:
                b = standard_batch(wl, 0, num_gpus=cost.cluster.num_gpus,
                                   tokens_per_gpu=TOKENS_PER_GPU)  # fmt: skip
                r = {"model": model.name, "pp": pp, "cluster": cl, "workload": wl,
                     "sequences": len(b), "methods": one(b, cost, pp)}  # fmt: skip
                rows.append(r)
                print_row(r)
    lat = latency()
    print(f"pp_greedy planning at 256 GPUs x {lat['documents']} documents: p50 "
          f"{lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms")  # fmt: skip
    Path(args.json).write_text(json.dumps({"rows": rows, "latency": lat}, indent=1) + "\n")


def print_row(r: dict) -> None:
    head = f"{r['model']:>10} p={r['pp']} {r['cluster']:>8} {r['workload']:>11}"
    m = r["methods"]
    if "infeasible" in m:
        print(f"{head}  infeasible: {m['infeasible'][:90]}")
        return
    g = m["pp_greedy"]
    cells = [f"greedy {g['step_s']:.2f}s gap {g['gap']:.0%} order-gap {g['order_gap']:.0%} "
             f"{g['ms']:.0f}ms"]  # fmt: skip
    for k, v in m.items():
        if k != "pp_greedy":
            cells.append(f"{k} {v['greedy_speedup']:.2f}x" if "step_s" in v else f"{k} -")
    print(head + "  " + " | ".join(cells))


if __name__ == "__main__":
    main()
