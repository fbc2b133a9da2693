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
# # What if: your own length distribution
#
# Will dynamic parallelism pay on *your* data and cluster? Describe your dataset by a
# histogram of sequence lengths (or video shapes), and this notebook predicts, before any GPU
# is touched:
#
# - the speedup of every planner over bucket parallel, with its spread over sampled batches;
# - which SP degrees the best plan uses (so you know which process groups matter) and how
#   much memory headroom is left;
# - how the speedup changes with the GPU count and with the inter-node bandwidth.
#
# It is the same analysis as `dcp-opt whatif --histogram FILE` (docs/analysis.md). All figures
# are predictions of the cost model (docs/cost-model.md); fit a profile of your own model for
# tighter ones.
#
# **Framing: one batch.** Every planner, the published ones included, plans the same sampled
# fixed-size batches, one optimizer step each; the published DCP methods are then "the
# published profile forced into a fixed batch" (memory cap 0.9, no drop_last, PAC's minimum
# accumulation 2), not the published sampler, which forms its own larger steps over an epoch.
# So the speedups say which planner handles a batch of your lengths best; over published
# bucket or PAC as they actually run, the gain at matched tokens per step is smaller
# (`dcp-opt bench --stream` and notebook 02 measure it on the standard workloads).
#
# **Edit the `HISTOGRAM` cell below**: one `length,count` row per bin for text, or
# `frames,height,width,count` for video (latent patches). Counts are weights: raw counts,
# percentages or fractions all work.

# %%
# %matplotlib inline
import os

from IPython.display import display
from rich.console import Console

from dcp_opt.analysis.whatif import WhatIfConfig, run_whatif
from dcp_opt.analysis.whatif_display import plot_whatif, recommendation, render_tables
from dcp_opt.histogram import LengthDistribution

# %%
HISTOGRAM = """
length,count
256,900
1024,1400
4096,700
16384,180
65536,25
131072,4
"""
CLUSTER = "h200x32"  # any preset, or h200xN
MODEL = None  # None: llama-7b for text, opensora-stdit3-xl for video

# %%
SMALL = os.environ.get("DCP_OPT_NB_SMALL") == "1"
# Small (CI): 2 batches, 1 per sweep point, 3 GPU counts; full: the CLI defaults.
config = WhatIfConfig(
    cluster=CLUSTER,
    model=MODEL,
    **(
        dict(num_batches=2, sweep_batches=1, gpus=(8, 16, 32), inter_bw_scales=(0.5, 1.0, 2.0),
             time_limit_s=0.5)
        if SMALL
        else {}
    ),
)  # fmt: skip
dist = LengthDistribution.from_histogram_text(HISTOGRAM, source="my histogram")
print(dist.summary())

# %% [markdown]
# ## Run the analysis
# A few seconds to a minute: every planner on every sampled batch, then the sweeps (bucket,
# the published DCP-inter+PAC and the best planner only).

# %%
doc = run_whatif(dist, config)
console = Console(width=130)
for table in render_tables(doc):
    console.print(table)

# %% [markdown]
# ## Recommendation

# %%
for line in recommendation(doc):
    print(line)
for line in doc["warnings"]:
    print("note:", line)

# %% [markdown]
# ## The picture
# Top: your distribution (share of sequences and of tokens per power-of-two length bin), the
# speedup per planner (bar: median over batches, whiskers: p10-p90), and the degrees the best
# plan uses. Bottom: peak memory of the fullest rank against the usable capacity, and the
# speedups as the GPU count (token budget scaled with it) and the inter-node bandwidth change.

# %%
fig = plot_whatif(doc)
display(fig)
out_dir = os.environ.get("DCP_OPT_NB_OUT")
if out_dir:
    fig.savefig(os.path.join(out_dir, "whatif.png"), dpi=90)

# %% [markdown]
# ## Reading it
#
# - Speedups are per fixed batch (the one-batch framing above): read them as a ranking of
#   planners on your lengths, not as the throughput gain over the published methods.
# - A speedup near 1x for every planner means your lengths are uniform enough that one static
#   degree already balances; the tuned static degree (`static_tuned`) then does as well.
# - If the degrees table shows most GPU-time at degree 1 with a small share at wide degrees,
#   a few long sequences set the bucket baseline's degree for everyone: that is where dynamic
#   plans gain most.
# - A small headroom is expected: planners fill memory to avoid recompute. A negative or
#   missing row means a planner found no valid plan; see the notes.
# - To keep the result: `import json; json.dump(doc, open("whatif.json", "w"))`, or run
#   `dcp-opt whatif --histogram FILE --json OUT --plot OUT.png` from a shell.
