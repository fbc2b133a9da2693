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
# # The paper's table, and what a user gains at fixed step semantics
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
# Every figure below names its **framing**:
#
# - **stream** (`dcp-opt bench --stream`, dcp_opt.analysis.stream): one epoch per workload; the
#   published methods run as published (their sampler forms its own optimizer steps, memory
#   cap 0.7, PAC's minimum accumulation 15, drop_last); the project's planners run at a fixed
#   number of tokens per step, nothing dropped. This is the framing to compare methods in.
# - **one batch** (`dcp-opt bench`, dcp_opt.analysis.bench): one fixed 2M-token batch per step for
#   every method; the published methods are then "the published profile forced into a fixed
#   batch" (cap 0.9, no drop, PAC min 2, one step per batch). It flatters the project's
#   planners: the published sampler forms no step at all from such a batch.
#
# Every number is a prediction of `simulate()` on the preset cost model, not a measurement.
# `DCP_OPT_NB_SMALL=1` (CI) runs small epochs.

# %%
import os

from IPython.display import Markdown, display

from dcp_opt.analysis.bench import BenchConfig, run_bench
from dcp_opt.analysis.stream import PAPER_RATIOS, StreamConfig, run_stream
from dcp_opt.analysis.whatif_display import markdown_table

SMALL = os.environ.get("DCP_OPT_NB_SMALL") == "1"
EPOCH_BATCHES = 8 if SMALL else 128  # x 2M tokens per workload (`--stream` default: 250)
README = {
    "2d-short": [0.90, 1.40, 1.92, 2.24],
    "2d-balanced": [1.16, 1.42, 1.95, 2.06],
    "2d-long": [1.54, 1.64, 1.96, 1.97],
}
PUBLISHED = ["bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac"]


def fmt(x, spec=".2f", suffix="x"):
    return "-" if x is None else f"{x:{spec}}{suffix}"


# %% [markdown]
# ## Framing: stream, 8 GPUs: the README figure, published methods as published
#
# Ratios of tokens/s over published bucket parallel (trained tokens only: the published
# samplers drop some; the "dropped" column says how many).

# %%
doc8 = run_stream(
    StreamConfig(cluster="h200x8", workloads=tuple(README), num_batches=EPOCH_BATCHES,
                 planners=(), step_sizes=(), nodrop=False)
)  # fmt: skip
rows8 = {(r["workload"], r["method"]): r for r in doc8["methods"]}
table = []
for w, paper in README.items():
    ours = [rows8[(w, m)] for m in PUBLISHED]
    table.append(
        [w, " / ".join(f"{x / paper[0]:.2f}" for x in paper[1:]),
         " / ".join(fmt(r["speedup_vs_bucket"], ".2f", "") for r in ours[1:]),
         " / ".join(fmt(r["dropped_share"], ".0%", "") for r in ours)]
    )  # fmt: skip
display(
    Markdown(
        markdown_table(
            ["workload", "README: intra / inter / +PAC over bucket",
             "this model: intra / inter / +PAC over bucket", "dropped: bucket / intra / inter / PAC"],
            table,
        )
    )
)  # fmt: skip

# %% [markdown]
# ## Framing: stream, 32 H200: published methods and the project's planners at matched steps
#
# `greedy@<size>`: fixed steps of that many tokens (M = 2^20) in data order, nothing dropped;
# `=dcp_inter_pac-median` is the published PAC's median step, so that row compares the two at
# matched tokens per optimizer step. This is what a user gains at fixed step semantics.

# %%
doc32 = run_stream(
    StreamConfig(cluster="h200x32", workloads=tuple(README), num_batches=EPOCH_BATCHES,
                 planners=("greedy",), step_sizes=(2 << 20,) if SMALL else (2 << 20, 16 << 20),
                 nodrop=False)
)  # fmt: skip
display(
    Markdown(
        markdown_table(
            ["workload", "method", "Mtok/s", "tokens/step p50 (M)", "dropped", "vs bucket",
             "vs PAC", "gap to stream bound"],
            [[r["workload"], r["method"], fmt(r["tokens_per_s"] and r["tokens_per_s"] / 1e6,
              ".3f", ""), fmt(r["step_tokens"]["median"] and r["step_tokens"]["median"] / 2**20,
              ".1f", ""), fmt(r["dropped_share"], ".1%", ""), fmt(r["speedup_vs_bucket"]),
              fmt(r["speedup_vs_pac"]), fmt(r["gap_to_bound"], ".1%", "")]
             for r in doc32["methods"] if not r["step_former"]],
        )
    )
)  # fmt: skip
paper32 = PAPER_RATIOS[32]["*"]
print(f"paper, 32 H200: inter {paper32['dcp_inter']}, PAC up to {paper32['dcp_inter_pac'][1]}")
for line in doc32["notes"]:
    print("note:", line)

# %% [markdown]
# ## Framing: one batch (kept for reference; not the published methods as they run)
#
# The same three 2D workloads on 32 H200, one 2M-token batch per step, the published methods
# forced into it. Compare the `vs bucket` column with the stream table above: most of the
# one-batch advantage of the project's planners is the framing.

# %%
doc1 = run_bench(
    BenchConfig(cluster="h200x32", workloads=tuple(README),
                planners=("bucket", "dcp_inter_pac", "greedy"), num_batches=1 if SMALL else 3)
)  # fmt: skip
print(doc1["framing"])
display(
    Markdown(
        markdown_table(
            ["workload", "planner", "vs bucket (one batch)"],
            [[r["workload"], r["planner"], fmt(r["median_speedup_vs_bucket"])]
             for r in doc1["summary"]],
        )
    )
)  # fmt: skip

# %% [markdown]
# ## Where we agree, where we differ, and why
#
# docs/baselines.md has the measured detail (fidelity table, every deviation from the
# published code and its effect). In short, on the preset cost model:
#
# 1. **Absolute rates agree, the baseline does not.** The published DCP-inter / PAC reach
#    about 0.5M patch tokens/s on 8 GPUs here; the README's 1.9-2.2 M/s count latent voxels,
#    4x patch tokens (VideoSys' counter, research/videosys_dcp.md sec. 4), i.e. ~0.5-0.56M.
#    The README's bucket parallel is much slower on short data (0.90 -> 0.23M patch tokens/s)
#    than this model's (~0.38M/s), and about equal on long data. The disagreement is in the
#    baseline on short, image-heavy data.
# 2. **Sourced candidates move it only partly.** Caption work repeated on every rank of an SP
#    group (VideoSys splits only the video tokens) adds 1-3 %; the dummy dataset's per-sample
#    CPU caption (300 x 4096 fp32, drawn on every rank of a group; 1-2 ms per sample per rank
#    measured) adds 4-10 % on short data and 20-40 % on VideoSys' own image-heavy dataset;
#    collective latency and per-step fixed costs barely move them.
# 3. **The yaml's bucket_config batch sizes** (which the published code ignores) put the
#    32-GPU ratios inside the paper's range, but not the 8-GPU short panel; a different
#    baseline, reported apart.
# 4. **At matched tokens per step**, the project's greedy planner reaches 1.05-1.14x of
#    published PAC's tokens/s on the 2D workloads with nothing dropped (default-size stream,
#    benchmarks/results/stream.json), not the 1.4-2.0x the one-batch framing shows; the
#    stream bound caps any plan of those steps at 1.06-1.16x.
# 5. **1D text** is not in the paper; `dcp-opt bench --stream` covers it with llama-7b, with
#    the text frameworks users run instead (verl's dynamic batch size, Megatron-Core's dynamic
#    CP) on the same fixed 2M-token global batches (docs/baselines.md, "Framework baselines").
