"""Issue 30: the pipeline planner against the pipeline baselines, one batch per setting.

    .venv/bin/python benchmarks/bench_pipeline.py [--json benchmarks/results/pipeline.json]
        [--rows acceptance|latency]

Settings: llama3-70b (examples/models/llama3-70b.json) at p = 8 and p = 4, and a 34B
model of the same family (48 layers, hidden 8192, GQA 8, FFN 22016) at p = 4, on h200x64 and
h200x256, zero1, 16K tokens per GPU, micro-batches of at most 128K tokens (the context);
workloads 1d-wlbllm, 1d-prolong and the standard 1D ones, seed 0. Where no plan fits a
setting without tensor parallelism (70B at p = 4 on 64 GPUs: 119 GB of states a GPU), the
least TP degree that fits (the cost model's units, dcp_opt/pipeline/stages.py) is used by
every method of that row; the row records it.

Megatron runs at the max_seqlen_per_dp_cp_rank a user tunes on their data (every fitting
power of two tried, the fastest kept: `megatron_heaviest_first`) and at the largest that
fits (`megatron_max_m`; the setting earlier runs of this benchmark used).

Per setting and method: step time (simulate(), or the lockstep evaluator for Megatron),
pp_greedy's speedup over it, planning milliseconds (wall and process time). Every baseline
runs on both layer splits (parameter-balanced and Megatron-LM's even default) and keeps its
better one, recorded as `split`. pp_greedy runs at its default budget (0.1 s), at 1 s
(`pp_greedy_1s`) and held to columns (`pp_greedy_columns`: no micro-step plans, schema 3);
`form` says which it answered. Its gap is to the batch bound over every plan (`gap`);
`bound_max_speedup` is Megatron's step over that bound: no plan of any form beats Megatron
by more. pp_greedy_columns also has its gap over every single-phase plan
(`single_phase_gap`, with the window bounds) and to the order bound of its own
micro-batches (`order_gap`). Then pp_greedy's planning
time over 20 seeds at 256 GPUs with about 1,000 documents (p = 8 and p = 4; p50, p99; wall
and process time). Figures are the cost model's (FLOP presets), one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from dcp_opt.solvers import PIPELINE_BASELINES, run_planner
from dcp_opt.solvers.baselines.pipeline_megatron import megatron_pipeline_step
from dcp_opt.solvers.pipeline.plan import stage_splits

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


def timed(fn, *args, **kw):
    """(result, wall ms, process ms)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kw)
    return out, (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def both_splits(fn, cost, pp: int, step, keep=()) -> dict:
    """The better of a baseline on the two splits pp_greedy tries (stage_splits); `keep`:
    fields of its result to record."""
    best = None
    for layers in stage_splits(cost, pp):
        try:
            r, ms, cpu = timed(fn, stage_layers=layers)
        except DcpOptError as e:
            best = best or {"error": str(e)[:200]}
            continue
        if "step_s" not in (best or {}) or step(r) < best["step_s"]:
            best = {"step_s": step(r), "ms": ms, "cpu_ms": cpu, "split": list(layers),
                    **{k: int(r[k]) for k in keep}}  # fmt: skip
    return best


def one(batch, cost, pp: int) -> dict:
    out = {}
    try:
        g, ms, cpu = timed(run_planner, "pp_greedy", batch, cost, pp=pp)
    except DcpOptError as e:
        return {"infeasible": str(e)[:200]}
    out["pp_greedy"] = {"step_s": g.predicted_step_time_s, "ms": ms, "cpu_ms": cpu,
                        "bound_s": g.lower_bound_s, "gap": g.gap, **form_of(g)}  # fmt: skip
    c, ms, cpu = timed(run_planner, "pp_greedy", batch, cost, pp=pp, micro_steps=False)
    out["pp_greedy_columns"] = {"step_s": c.predicted_step_time_s, "ms": ms, "cpu_ms": cpu,
                                "gap": c.gap, **form_of(c),
                                "single_phase_bound_s": c.stats["single_phase_bound_s"],
                                "single_phase_gap": c.stats["single_phase_gap"],
                                "order_gap": c.stats["order_gap"]}  # fmt: skip
    g1, ms, cpu = timed(run_planner, "pp_greedy", batch, cost, pp=pp, time_limit_s=1.0)
    out["pp_greedy_1s"] = {"step_s": g1.predicted_step_time_s, "ms": ms, "cpu_ms": cpu,
                           "gap": g1.gap, **form_of(g1)}  # fmt: skip
    try:
        il, ms, cpu = timed(run_planner, "pp_greedy", batch, cost, pp=pp,
                            schedule="interleaved", virtual_stages=2)  # fmt: skip
        out["pp_greedy_interleaved2"] = {"step_s": il.predicted_step_time_s, "ms": ms,
                                         "cpu_ms": cpu, "gap": il.gap}  # fmt: skip
    except DcpOptError as e:
        out["pp_greedy_interleaved2"] = {"error": str(e)[:200]}
    for name, m in (("megatron_heaviest_first", "tuned"), ("megatron_max_m", "max")):
        out[name] = both_splits(
            lambda m=m, **kw: megatron_pipeline_step(batch, cost, pp=pp, max_seqlen_per_rank=m,
                                                     **kw), cost, pp,
            lambda r: r["step_time_s"], keep=("max_seqlen_per_rank", "num_micro_steps"))  # fmt: skip
    for name in PIPELINE_BASELINES:
        out[name] = both_splits(lambda n=name, **kw: run_planner(n, batch, cost, pp=pp, **kw),
                                cost, pp, lambda r: r.predicted_step_time_s)  # fmt: skip
    base = out["pp_greedy"]["step_s"]
    for v in out.values():
        if "step_s" in v:
            v["greedy_speedup"] = v["step_s"] / base
    mg = out["megatron_heaviest_first"]
    if "step_s" in mg:  # no plan of any form beats Megatron by more (the batch bound)
        out["pp_greedy"]["bound_max_speedup"] = mg["step_s"] / g.lower_bound_s
    return out


def form_of(r) -> dict:
    """A pipeline plan's form: micro-steps (schema 4) or columns, its degrees."""
    plan = r.plan
    degrees = sorted({x.degree for ph in plan.phases for x in ph.groups if x.micro_batches})
    form = "micro_steps" if plan.pipeline.micro_steps else "columns"
    return {"form": form, "split": list(plan.pipeline.stage_layers), "degrees": degrees}


def row_cost(model, cluster: str, pp: int, batch) -> tuple[CostModel, int]:
    """The cost model at the least TP degree where pp_greedy finds a plan (1 first)."""
    for t in (1, 2, 4, 8):
        cost = CostModel(model, cluster_preset(cluster), tensor_parallel=t)
        try:
            run_planner("pp_greedy", batch, cost, pp=pp)
            return cost, t
        except DcpOptError:
            continue
    return CostModel(model, cluster_preset(cluster)), 1


def latency(pp: int, seeds: int = 20) -> dict:
    cost = CostModel(L70, cluster_preset("h200x256"))
    ws, cs, docs = [], [], []
    for s in range(seeds + 1):
        b = standard_batch("1d-wlbllm", s, num_gpus=256, tokens_per_gpu=14848)
        _, ms, cpu = timed(run_planner, "pp_greedy", b, cost, pp=pp)
        if s:  # the first call warms imports and caches
            ws.append(ms)
            cs.append(cpu)
            docs.append(len(b))
    pct = lambda x, q: float(np.percentile(x, q))  # noqa: E731
    return {"pp": pp, "p50_ms": pct(ws, 50), "p99_ms": pct(ws, 99), "max_ms": max(ws),
            "cpu_p50_ms": pct(cs, 50), "cpu_p99_ms": pct(cs, 99), "cpu_max_ms": max(cs),
            "documents": [min(docs), max(docs)], "seeds": seeds}  # fmt: skip


ACCEPTANCE = [(L70, 4, "h200x256", "1d-wlbllm"), (L70, 4, "h200x64", "1d-wlbllm"),
              (L70, 8, "h200x256", "1d-wlbllm"), (L70, 8, "h200x64", "1d-prolong")]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/pipeline.json"))
    ap.add_argument("--rows", choices=["all", "acceptance", "latency"], default="all",
                    help="latency: re-measure only the planning latency, keeping the rows of "
                         "the --json file")  # fmt: skip
    args = ap.parse_args()
    grid = [(m, pp, cl, wl) for m, pp in SETTINGS for cl in CLUSTERS for wl in WORKLOADS]
    if args.rows == "acceptance":
        grid = ACCEPTANCE
    if args.rows == "latency":
        grid = []
    rows = json.loads(Path(args.json).read_text())["rows"] if args.rows == "latency" else []
    for model, pp, cl, wl in grid:
        n = cluster_preset(cl).num_gpus
        b = standard_batch(wl, 0, num_gpus=n, tokens_per_gpu=TOKENS_PER_GPU)
        cost, tp = row_cost(model, cl, pp, b)
        r = {"model": model.name, "pp": pp, "cluster": cl, "workload": wl, "tp": tp,
             "sequences": len(b), "methods": one(b, cost, pp)}  # fmt: skip
        rows.append(r)
        print_row(r)
    lat = [latency(8), latency(4)]
    for x in lat:
        print(f"pp_greedy planning at 256 GPUs x {x['documents']} documents, p = {x['pp']}: "
              f"wall p50 {x['p50_ms']:.0f} ms, p99 {x['p99_ms']:.0f} ms; process p50 "
              f"{x['cpu_p50_ms']:.0f} ms, p99 {x['cpu_p99_ms']:.0f} ms")  # fmt: skip
    Path(args.json).write_text(json.dumps({"rows": rows, "latency": lat}, indent=1) + "\n")


def print_row(r: dict) -> None:
    head = f"{r['model']:>10} p={r['pp']} tp={r['tp']} {r['cluster']:>8} {r['workload']:>11}"
    m = r["methods"]
    if "infeasible" in m:
        print(f"{head}  infeasible: {m['infeasible'][:90]}")
        return
    g = m["pp_greedy"]
    cells = [f"greedy {g['step_s']:.2f}s ({g['form']}) gap {g['gap']:.0%} {g['ms']:.0f}ms"]
    for k, v in m.items():
        if k != "pp_greedy":
            cells.append(f"{k} {v['greedy_speedup']:.2f}x" if "step_s" in v else f"{k} -")
    print(head + "  " + " | ".join(cells))


if __name__ == "__main__":
    main()
