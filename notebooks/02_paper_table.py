# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The paper's table, reproduced in simulation
#
# The DCP paper ("Training Variable Long Sequences With Data-centric Parallel", REFERENCE.md
# sec. 2) reports, against bucket parallel:
#
# - on **32 H200**: DCP-inter **1.68-2.70x** faster, with PAC **up to 2.88x**;
# - in the VideoSys README figure (**8 GPUs**, Open-Sora, M tokens/s, baseline -> intra ->
#   inter -> inter+PAC): short-dominated 0.90 -> 1.40 -> 1.92 -> 2.24 (**2.48x**), balanced
#   1.16 -> 1.42 -> 1.95 -> 2.06 (**1.78x**), long-dominated 1.54 -> 1.64 -> 1.96 -> 1.97
#   (**1.28x**).
#
# Here the same comparison runs on our standard workloads (1D text and 2D video x short /
# balanced / long, REFERENCE.md sec. 4) under our preset cost model, with our emulations of
# the published planners (`bucket`, `dcp_intra`, `dcp_inter`, `dcp_inter_pac`) beside our own
# planners. Every number below is a prediction of `simulate()`, median over seeded global
# batches of GPUs x 64K tokens; none is a measurement. The differences are discussed at the end.
#
# `DCP_OPT_NB_SMALL=1` (CI) runs one batch per workload and short solver budgets.

# %%
import os

from dcp_opt.solvers import available_planners
from IPython.display import Markdown, display

from dcp_opt.bench import BenchConfig, run_bench
from dcp_opt.whatif_display import markdown_table

SMALL = os.environ.get("DCP_OPT_NB_SMALL") == "1"
NUM_BATCHES = 1 if SMALL else 5
TIME_LIMIT_S = 1.0 if SMALL else 5.0
PUBLISHED = ["bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac"]
OURS = [p for p in ("static_tuned", "greedy", "cpsat") if p in available_planners()]
PLANNERS = PUBLISHED + OURS
print(f"planners: {PLANNERS}; {NUM_BATCHES} batch(es) per workload")


def bench(cluster, workloads):
    return run_bench(
        BenchConfig(
            cluster=cluster,
            workloads=tuple(workloads),
            planners=tuple(PLANNERS),
            num_batches=NUM_BATCHES,
            planner_options={"time_limit_s": TIME_LIMIT_S},
        )
    )


def speedup_cell(row):
    x = row["median_speedup_vs_bucket"]
    if x is None:
        return "-"
    bad = "" if row["all_valid"] else f" ({row['num_valid']}/{row['num_batches']} valid)"
    return f"{x:.2f}x{bad}"


# %% [markdown]
# ## 32 H200: speedup over bucket parallel, per workload

# %%
doc32 = bench(
    "h200x32", ["2d-short", "2d-balanced", "2d-long", "1d-short", "1d-balanced", "1d-long"]
)
rows32 = {(r["workload"], r["planner"]): r for r in doc32["summary"]}
workloads = list(dict.fromkeys(r["workload"] for r in doc32["summary"]))
best_ours = {
    w: max(OURS, key=lambda p: rows32[(w, p)]["median_speedup_vs_bucket"] or 0) for w in workloads
}
display(
    Markdown(
        markdown_table(
            ["workload", *PLANNERS[1:], "paper (32 H200)"],
            [
                [w, *[speedup_cell(rows32[(w, p)]) for p in PLANNERS[1:]],
                 "inter 1.68-2.70x; +PAC up to 2.88x" if w.startswith("2d") else "(video only)"]
                for w in workloads
            ],
        )
    )
)  # fmt: skip
for line in [r for r in doc32["warnings"]] + [
    f"{r['workload']} / {r['planner']}: {r['errors'][0]}" for r in doc32["summary"] if r["errors"]
]:
    print("note:", line)

# %% [markdown]
# ## 8 GPUs: the README figure, in M tokens/s
#
# Tokens/s = tokens of the global batch / predicted step time (median over batches). Absolute
# rates depend on the model, the GPU and the cost constants; the ratios to the baseline are
# what can be compared.

# %%
README = {
    "2d-short": [0.90, 1.40, 1.92, 2.24],
    "2d-balanced": [1.16, 1.42, 1.95, 2.06],
    "2d-long": [1.54, 1.64, 1.96, 1.97],
}
doc8 = bench("h200x8", list(README))


def tokens_per_s(doc, workload, planner):
    recs = [
        b["num_tokens"] / b["step_time_s"]
        for b in doc["batches"]
        if b["workload"] == workload and b["planner"] == planner and b["valid"]
    ]
    return sorted(recs)[len(recs) // 2] / 1e6 if recs else None


table = []
for w, paper in README.items():
    ours = [tokens_per_s(doc8, w, p) for p in PLANNERS]
    base = ours[0]
    table.append(
        [w, " -> ".join(f"{x:.2f}" for x in paper), f"{max(paper) / paper[0]:.2f}x",
         " -> ".join("-" if x is None else f"{x:.2f}" for x in ours[:4]),
         f"{max(x for x in ours[:4] if x) / base:.2f}x",
         ", ".join(f"{p} {x / base:.2f}x" for p, x in zip(PLANNERS[4:], ours[4:], strict=True) if x)]
    )  # fmt: skip
display(
    Markdown(
        markdown_table(
            ["workload", "README (M tok/s): base -> intra -> inter -> +PAC", "README best",
             "ours (M tok/s): bucket -> intra -> inter -> +PAC", "ours best of those",
             "our planners vs bucket"],
            table,
        )
    )
)  # fmt: skip

# %% [markdown]
# ## Checks: the claims the comparison rests on
#
# The cell below states, from the runs above: whether each planner beats bucket parallel on
# each 2D workload, whether the *order* of the gains over short / balanced / long matches the
# README figure (short gains most, long least), and how many sequences one global batch holds
# together with bucket parallel's idle share, which explains most of the disagreement.


# %%
def ordering(values):
    return " > ".join(k for k, _ in sorted(values.items(), key=lambda kv: -kv[1]))


readme_gain = {w.split("-")[1]: max(v) / v[0] for w, v in README.items()}
print(f"README, best DCP over baseline (8 GPUs): {ordering(readme_gain)}")
for label, doc in (("8 GPUs", doc8), ("32 GPUs", doc32)):
    rows = {(r["workload"], r["planner"]): r for r in doc["summary"]}
    for p in PLANNERS[1:]:
        gains = {w.split("-")[1]: rows[(w, p)]["median_speedup_vs_bucket"] for w in README}
        if all(gains.values()):
            print(f"ours, {p} over bucket ({label}): {ordering(gains)}; "
                  f"beats bucket on {sum(g > 1 for g in gains.values())}/3")  # fmt: skip
grain = []
for label, doc in (("8 GPUs", doc8), ("32 GPUs", doc32)):
    rows = {(r["workload"], r["planner"]): r for r in doc["summary"]}
    for w in README:
        seqs = [b["num_sequences"] for b in doc["batches"] if b["workload"] == w]
        imb = rows[(w, "bucket")]["median_imbalance"]
        grain.append(
            [label, w, f"{sorted(seqs)[len(seqs) // 2]}", "-" if imb is None else f"{imb:.0%}"]
        )
display(
    Markdown(markdown_table(["cluster", "workload", "sequences per batch", "bucket idle"], grain))
)

# %% [markdown]
# ## Where we agree, where we differ, and why
#
# **What agrees.** Our own planners (greedy, CP-SAT, and even the tuned static degree) beat
# bucket parallel on every workload; on 32 H200 the 2D gains are in the paper's range
# (1.68-2.88x) or above. The emulated DCP-inter+PAC beats bucket on most workloads, and PAC
# lifts the emulated inter a long way, as in the paper. Bucket parallel runs every sequence at the degree the
# longest one needs and recomputes every layer, so short sequences pay all-to-alls and
# recompute they do not need, and its groups get unequal work.
#
# **What differs, and why.** The check above shows the gains' *order* over short / balanced /
# long is not the README's: the published figure gains most on short-dominated data, our
# simulation (typically) on balanced and long. The reasons, most important first:
#
# 1. *One global batch, not an epoch.* The published sampler plans a stream of steps over the
#    whole dataset (100,000 images and 2,000 videos); each of our planners sees one global
#    batch of GPUs x 64K tokens. A long- or balanced-video batch then holds only a few dozen
#    sequences (table above), so bucket parallel's fixed groups of 4 cannot even out and idle
#    most of the step, which inflates every speedup over it on balanced and long data. On
#    short data a batch holds hundreds of images, bucket parallel packs them into large
#    power-of-two micro-batches, and there is less to gain. The same batch size also starves the
#    published inter: a bucket's profiled batch size often exceeds its count in the batch, so
#    inter has nothing left to chain and its plan is one phase of whole buckets
#    (`solvers/videosys.py`, point 4). Our dcp_inter is therefore far weaker than the
#    published one, and without PAC often slower than bucket.
# 2. *Our dcp_\* planners are emulations, not the published code running on GPUs.* Their
#    profile is emulated from our cost model (`solvers/videosys_profile.py`): times and memory
#    come from FLOP-derived presets (docs/cost-model.md), not from two profiled layers
#    extrapolated to depth. The speedups depend mostly on the memory constants (activation
#    bytes, the usable fraction): docs/cost-model.md measures that a 70% cap (VideoSys') instead
#    of our 90% moves the speedups over bucket by tens of percent.
# 3. *No samples dropped.* The published code drops bucket tails, partially filled steps and
#    buckets that cannot meet their GA quota (~16% of samples at 32 GPUs in a simulation of it,
#    research/videosys_dcp.md sec. 6.E); the dropped samples are the awkward ones, so dropping
#    flatters its tokens/s. Every plan here trains every sequence exactly once.
# 4. *The published inter's GA objective* is a sum of deviations from a target time, not
#    weighted by group width, so an overshooting wide group costs as little as a narrow one.
#    Our emulation keeps that objective, as published, and inherits the imbalance; greedy and
#    CP-SAT minimise the step time itself.
# 5. *Communication.* The published planner does not model SP communication (it is folded into
#    profiled times at one SP size); our simulator charges every all-to-all at the NVLink or
#    NIC rate for every planner alike, including the cross-node all-to-alls of degrees > 8.
# 6. *Absolute tokens/s.* Our rates are several times below the README's: the README does not
#    say its model, GPU count per panel or token counting (VideoSys counts latent voxels per SP
#    rank, research/videosys_dcp.md sec. 4); ours are STDiT3-XL latent tokens per second on
#    H200 under the preset MFU. Only ratios are comparable.
# 7. *1D text* is not in the paper (its experiments are Open-Sora video); the 1D rows show the
#    same planners on log-normal text lengths with llama-7b.
#
# So what this simulation supports is the *direction* (dynamic plans over bucket parallel; PAC
# over plain inter), not the published per-distribution ratios, which depend on the epoch-level
# sampler, on dropping, and on measured rather than FLOP-derived costs. `dcp_opt.fit` replaces
# the presets with measured coefficients; rerun this notebook with those to tighten the numbers.
