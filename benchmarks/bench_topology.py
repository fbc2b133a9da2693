"""Issue 17's acceptance figures: planning on fabrics as wired (dcp_opt/topology).

    .venv/bin/python benchmarks/bench_topology.py [--reps 10] [--seeds 3] [--json out.json]

1. gb200-nvl72 (one rack) and gb200-nvl72x4 (four racks over IB): greedy on every standard
   workload (64K tokens per GPU; on four racks also the long-context batches of 2.): the SP
   degrees it uses (above 8 inside the rack?), and its step time against a topology-blind
   plan (the same GPUs as compute trays of 4 over the NICs, the two-level model) priced on
   the graph: ratio = blind / aware (> 1: knowing the NVLink domain pays).
2. h100-fattree-2to1 (4 leaves of 4 DGX H100, 2:1 above the leaves): the same comparison
   (blind = the two-level model of the same nodes, no oversubscription), the share of
   GPU-seconds in groups that span leaves, on the standard workloads and on long-context
   1D batches (sequences 64K-1M tokens on Llama 7B and Llama 3 8B, 32K-256K on Llama 7B,
   log-uniform). Then fat-trees whose leaves are smaller than those groups: two DGX H100
   per leaf (16 GPUs, 128 GPUs in all) at 2:1 and 4:1, three per leaf (24 GPUs, 96 in all)
   at 2:1.
3. Oversubscription sweep 1, 2, 4, 8:1 on the long-context batches, leaves of 32 GPUs (the
   preset's) and of 16: the aware step time over the non-blocking fabric's ("what does r:1
   cost my plan?"), blind / aware, and the cross-leaf shares.
4. Greedy latency at 64 GPUs x 512 sequences with a topology (h100x64-fattree-2to1, 1d- and
   2d-balanced), h100x64 (no topology) interleaved as the reference: p50 / p99 wall and CPU
   ms over --reps batches, a fresh CostModel per call as in bench_planner.py (the cluster,
   and its topology's routing cache, is reused: it is the same cluster from step to step);
   the first (cold) call, which builds the routes, apart. `--latency-only`: this section.
JSON: {"config", "nvl72": [rows], "fattree": [rows], "sweep": [rows], "latency": [rows]}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import numpy as np
from dcp_opt.solvers import run_planner

from dcp_opt import Batch, CostModel, cluster_preset, model_preset, validate
from dcp_opt.batch import Sequence
from dcp_opt.topology.whatif import compare_blind, fat_tree_cluster, sweep_oversubscription
from dcp_opt.workloads import DEFAULT_TOKENS_PER_GPU, STANDARD_WORKLOADS, Workload

MODELS = {"1d": "llama-7b", "2d": "opensora-stdit3-xl"}


def degrees(plan) -> dict[int, int]:
    return dict(
        sorted(collections.Counter(g.degree for p in plan.phases for g in p.groups).items())
    )


def long_context(seed: int, gpus: int, lo: int = 65536, hi: int = 1 << 20) -> Batch:
    """1D sequences of lo-hi tokens (log-uniform; 64K-1M by default) up to 64K tokens per
    GPU."""
    rng = np.random.default_rng(seed)
    seqs: list[int] = []
    while sum(seqs) < gpus * DEFAULT_TOKENS_PER_GPU:
        seqs.append(int(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    return Batch(tuple(Sequence(i, (s,)) for i, s in enumerate(seqs)))


def long_cases(gpus: int) -> list:
    """The long-context 1D cases: 64K-1M tokens on Llama 7B and Llama 3 8B (GQA: a quarter
    of the K/V all-to-all), and 32K-256K on Llama 7B (where Ulysses traffic weighs most
    against attention, which grows with the square of the length)."""
    return [
        ("1d-longcontext", "llama-7b", lambda s, _n: long_context(s, gpus)),
        ("1d-longcontext", "llama3-8b", lambda s, _n: long_context(s, gpus)),
        ("1d-midcontext", "llama-7b", lambda s, _n: long_context(s, gpus, 32768, 1 << 18)),
    ]


def compare_rows(cluster_name: str, seeds: int, extra_long: bool, cluster=None) -> list[dict]:
    cluster = cluster or cluster_preset(cluster_name)
    cases = [(wl.name, MODELS[wl.kind], wl.batch) for wl in STANDARD_WORKLOADS]
    if extra_long:
        cases += long_cases(cluster.num_gpus)
    rows = []
    for name, model, make in cases:
        cost = CostModel(model_preset(model), cluster)
        got = []
        for seed in range(seeds):
            batch = make(seed, cluster.num_gpus * DEFAULT_TOKENS_PER_GPU)
            g = compare_blind(batch, cost)
            assert validate(g["aware_plan"], batch, cost) == [], (cluster_name, name, seed)
            got.append(g)
        rows.append(
            {
                "cluster": cluster_name,
                "workload": name,
                "model": model,
                "seeds": seeds,
                "aware_degrees": degrees(got[0]["aware_plan"]),
                "blind_degrees": degrees(got[0]["blind_plan"]),
                "max_aware_degree": max(max(degrees(g["aware_plan"])) for g in got),
                "ratio_median": statistics.median(g["ratio"] for g in got),
                "ratio_min": min(g["ratio"] for g in got),
                "ratio_max": max(g["ratio"] for g in got),
                "aware_cross_leaf": statistics.median(g["aware_cross_leaf"] for g in got),
                "blind_cross_leaf": statistics.median(g["blind_cross_leaf"] for g in got),
            }
        )
        r = rows[-1]
        print(
            f"{cluster_name:18s} {name:15s} {model:10s} blind/aware median {r['ratio_median']:.4f} "
            f"[{r['ratio_min']:.4f}, {r['ratio_max']:.4f}]  max degree {r['max_aware_degree']}  "
            f"cross-leaf {r['aware_cross_leaf']:.2f} (blind {r['blind_cross_leaf']:.2f})  "
            f"aware {r['aware_degrees']}  blind {r['blind_degrees']}",
            flush=True,
        )
    return rows


def latency_rows(reps: int) -> list[dict]:
    """Greedy at 64 x 512 on the 2:1 fat-tree, and on h100x64 (the same GPUs, no topology)
    interleaved with it as the reference: wall and CPU ms (on a shared machine the wall time
    also counts waiting for a core; the CPU time is the planner's own)."""
    clusters = {c: cluster_preset(c) for c in ("h100x64-fattree-2to1", "h100x64")}
    rows = []
    for wl_name in ("1d-balanced", "2d-balanced"):
        wl = Workload.parse(wl_name)
        model = model_preset(MODELS[wl.kind])

        def batch(seed, wl=wl):
            rng = np.random.default_rng(seed)
            return Batch(tuple(Sequence(i, wl.sample_shape(rng)) for i in range(512)))

        cold = {}
        for name, cluster in clusters.items():
            t0 = time.perf_counter()
            run_planner("greedy", batch(10_000), CostModel(model, cluster))
            cold[name] = (time.perf_counter() - t0) * 1e3
        walls = {c: [] for c in clusters}
        cpus = {c: [] for c in clusters}
        for rep in range(reps):
            b = batch(rep)
            for name, cluster in clusters.items():
                cost = CostModel(model, cluster)  # fresh: no table cached from an earlier call
                t0, c0 = time.perf_counter(), time.process_time()
                res = run_planner("greedy", b, cost)
                walls[name].append((time.perf_counter() - t0) * 1e3)
                cpus[name].append((time.process_time() - c0) * 1e3)
                assert validate(res.plan, b, cost) == []
        for name in clusters:
            w, c = np.array(walls[name]), np.array(cpus[name])
            rows.append(
                {
                    "cluster": name,
                    "workload": wl_name,
                    "gpus": 64,
                    "seqs": 512,
                    "reps": reps,
                    "p50_ms": float(np.percentile(w, 50)),
                    "p99_ms": float(np.percentile(w, 99)),
                    "cpu_p50_ms": float(np.percentile(c, 50)),
                    "cpu_p99_ms": float(np.percentile(c, 99)),
                    "cold_ms": cold[name],
                }
            )
            r = rows[-1]
            print(
                f"greedy {wl_name} 64 x 512 on {name:20s}: wall p50 {r['p50_ms']:.2f} ms "
                f"(p99 {r['p99_ms']:.2f}), CPU p50 {r['cpu_p50_ms']:.2f} ms "
                f"(p99 {r['cpu_p99_ms']:.2f}), first call {r['cold_ms']:.0f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--latency-only", action="store_true", help="section 4 only")
    args = ap.parse_args()
    out = {"config": {"reps": args.reps, "seeds": args.seeds}, "loadavg_start": os.getloadavg()}
    if args.latency_only:
        out["latency"] = latency_rows(args.reps)
        return _write(out, args.json)
    out["nvl72"] = compare_rows("gb200-nvl72", args.seeds, extra_long=False)
    out["nvl72"] += compare_rows("gb200-nvl72x4", args.seeds, extra_long=True)
    out["fattree"] = compare_rows("h100-fattree-2to1", args.seeds, extra_long=True)
    # Leaves smaller than the degrees long sequences take: two DGX per leaf (16 GPUs) at
    # 2:1 and 4:1, and three (24 GPUs, not a power of two) at 2:1; 128 and 96 GPUs.
    for ratio, per_leaf, leaves in ((2.0, 2, 8), (4.0, 2, 8), (2.0, 3, 4)):
        c = fat_tree_cluster(ratio, leaves, per_leaf)
        name = f"fattree-{ratio:g}to1-leaf{8 * per_leaf}"
        out["fattree"] += compare_rows(name, args.seeds, extra_long=True, cluster=c)
    batches = [long_context(s, 128) for s in range(args.seeds)]
    out["sweep"] = []
    for per_leaf in (4, 2):  # leaves of 32 GPUs (the preset) and of 16 (two DGX per ToR)
        rows = sweep_oversubscription(
            model_preset("llama-7b"),
            batches,
            (1.0, 2.0, 4.0, 8.0),
            leaves=16 // per_leaf,
            nodes_per_leaf=per_leaf,
        )
        for r in rows:
            r["leaf_gpus"] = 8 * per_leaf
            print(
                f"leaf {8 * per_leaf} GPUs, oversubscription {r['ratio']:g}:1  aware "
                f"{r['aware_step_s']:.3f} s  vs 1:1 {r['vs_nonblocking']:.4f}  blind/aware "
                f"{r['blind_over_aware']:.4f}  cross-leaf {r['cross_leaf_share']:.2f} (blind "
                f"{r['blind_cross_leaf_share']:.2f})",
                flush=True,
            )
        out["sweep"] += rows
    out["latency"] = latency_rows(args.reps)
    _write(out, args.json)


def _write(out: dict, path: str | None) -> None:
    out["loadavg_end"] = os.getloadavg()
    print(f"load average: start {out['loadavg_start']}, end {out['loadavg_end']}")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
