"""DCP-intra, DCP-inter and DCP-inter+PAC: the published profile forced into a fixed batch.

This is NOT the published method as it runs. The published sampler
(`videosys/training/datasets/open_sora/sampler.py`, research/videosys_dcp.md sec. 2.2-2.5)
plans a whole epoch and forms its own optimizer steps, each holding however many samples its
fill and GA solver choose (PAC: 6.6-24.7M tokens per step, p10-p90 over the 2D workloads of
`dcp-opt bench --stream`, benchmarks/results/stream.json). Given one
standard 2M-token batch (32 GPUs x 64K) it forms **zero** steps: with drop_last (every
benchmark yaml) inter and PAC truncate each bucket to a multiple of its profiled bs, which
empties nearly every bucket of such a batch, and a step whose groups cannot fill all the GPUs
is discarded (sampler.py:386-390, 422-425, 613-616); measured with
solvers/baselines/videosys/stream.py on seeds 0-2 of every standard workload at the published 0.7 cap:
0 steps for every 2D workload and every method, 0 for inter and PAC on every 1D workload too.
The published form over an epoch is solvers/baselines/videosys/stream.py (`dcp-opt bench --stream`).

Here, for the one-batch bench, the published per-bucket profile and step rules are applied to
one global batch with no sample dropped, and each published step becomes one Phase of one
plan (the group layout changes between phases; gradients are still synchronised once, after
the last phase). Published settings this changes (docs/baselines.md measures each):
memory cap 0.9 instead of 0.7; drop_last off; PAC's min accumulation 2 instead of 15; one
optimizer step per batch instead of one per sampler step; the unbiased sp-size draw for inter.
Randomness (per-bucket shuffle, sp-size and bucket choice) comes from
`numpy.random.default_rng(seed)`.

Where faithfulness and the no-drop rule clash (every sequence is trained exactly once):

1. Bucket tails. Inter truncates every bucket to a multiple of its bs and intra drops the
   fastest partial group of a step (both under drop_last, which every benchmark yaml sets).
   We run the master code path as with drop_last off: tails stay, as partial micro-batches,
   where the fill put them. An earlier revision (01cc02b) had a `keep_last` mode for this;
   `plan_dcp_intra(keep_last=True)` adds its rule (the target t_min is taken over groups whose
   bucket still has samples, and last batches faster than it are left alone and ignored by
   step e), which stops a 1-sample tail from setting the pace of its step.
2. Partially filled steps. When no remaining bucket's sp fits the free GPUs the published code
   discards the step's samples; we run the step with the rest of the GPUs idle.
3. Inter's GA pruning (drop a group whose bucket cannot supply its GA quota, and the rest of
   that bucket; drop_last only) is skipped; the chain ends when the bucket runs out (the
   published realised-gas behaviour, sec. 6.A7).
4. One global batch is small against the profile: a bucket's memory-bound bs often exceeds its
   count in the batch, so the first phase takes whole buckets, and inter has nothing left to
   chain (its plan is then one phase of whole buckets, mostly at sp=1). The published
   algorithm would form no step from such a batch at all (see above); we do not rescale the
   profile.
5. Intra's pop (sec. 2.3 d) returns the popped groups' samples to the pool (as published); if
   the pops leave fewer than N GPUs busy (only on non-power-of-two clusters) the rest idle.
6. PAC's min_gas 15 (dcp_inter_ckpt.yaml) is a per-optimizer-step rule; applied to every phase
   of one batch it only unbalances the first phase, so the default is dcp_inter's 2 (see
   `plan_dcp_inter_pac`).

Other adaptations: SP degrees and widening steps come from `cluster.allowed_degrees` (so 24 =
3x8 and 6 = 1x6 work; the published powers of two break there, sec. 6.A6); groups are laid out
largest first on aligned ranks (sampler.py:510-512), which the divisibility chain of the
allowed degrees makes always valid. The sp-size draw is the intended one (weighted by bucket
count, as intra's `torch.multinomial`); `biased_sp_pick=True` reproduces inter's buggy loop
(sec. 6.A1). Memory: same capacity as every other planner, not VideoSys' 70% cap.
"""

from __future__ import annotations

import time

import numpy as np
from dcp_opt.solvers.baselines.videosys.profile import BucketProfile, emulate_profile
from dcp_opt.solvers.baselines.videosys.sampler import (
    Pool,
    fill_step,
    inter_entries,
    layout,
    pop_overflow,
    rebalance_bs,
    retune,
    step_groups,
)
from dcp_opt.solvers.common import finish

from dcp_opt.batch import Batch
from dcp_opt.cluster import GIB
from dcp_opt.cost import CostModel
from dcp_opt.plan import Group, MicroBatch
from dcp_opt.result import PlanResult


# ---- DCP-inter (sec. 2.4) --------------------------------------------------------------------
def _inter_phases(
    pool: Pool, cost: CostModel, rng, max_gas: int, min_gas: int, biased: bool
) -> tuple[list[list[Group]], list[list[int]]]:
    phases, gas_log = [], []
    n = cost.cluster.num_gpus
    while pool.any_left():
        before = pool.num_left()
        step = fill_step(pool, n, rng, biased)
        pool.check_progress(before, "dcp_inter")
        entries = inter_entries(step, pool, max_gas, min_gas)
        starts = layout([sp for sp, _ in entries], cost)
        phases.append(step_groups(entries, starts))
        gas_log.append([len(m) for _, m in entries])
    return phases, gas_log


def _plan_inter(batch, cost, name, mode, seed, max_gas, min_gas, biased, unit) -> PlanResult:
    t0 = time.perf_counter()
    cost.check_fits(batch)
    rng = np.random.default_rng(seed)
    profiles = emulate_profile(batch, cost, mode, unit=unit)
    pool = Pool(profiles, rng)
    phases, gas_log = _inter_phases(pool, cost, rng, max_gas, min_gas, biased)
    stats = {
        "num_steps": len(phases),
        "gas_per_step": gas_log,
        "max_gas": max_gas,
        "min_gas": min_gas,
        "profile": _profile_stats(profiles),
    }
    return finish(phases, batch, cost, planner=name, started=t0, stats=stats)


def _profile_stats(profiles: list[BucketProfile]) -> list[dict]:
    return [
        {
            "bucket": list(p.bucket.key),
            "count": len(p.bucket.ids),
            "sp": p.best.sp,
            "bs": p.best.bs,
            "time_s": p.best.time,
            "recompute": p.best.recompute,
        }
        for p in profiles
    ]


def plan_dcp_inter(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_gas: int = 5,
    min_gas: int = 2,
    biased_sp_pick: bool = False,
) -> PlanResult:
    """DCP-inter: profiled (sp, bs) per bucket at full recompute; per step the GA solver picks
    each group's chain length (dcp_inter.yaml: max 5, min 2)."""
    return _plan_inter(
        batch, cost, "dcp_inter", "inter", seed, max_gas, min_gas, biased_sp_pick, GIB
    )


def plan_dcp_inter_pac(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_gas: int = 5,
    min_gas: int = 2,
    biased_sp_pick: bool = False,
    memory_unit: float = GIB,
) -> PlanResult:
    """DCP-inter with pyramid activation checkpointing: the profile picks (sp, bs, recompute)
    per bucket by the GiB knapsack (sec. 1.8), then as dcp_inter.

    min_gas: dcp_inter_ckpt.yaml sets max 5, min 15: each optimizer step's longest chain has
    at least 15 micro-batches. Here the optimizer step is the whole plan and a phase is only
    part of it, so the yaml's rule is a statement about the batch size, not one a phase
    should enforce: applied per phase it scales every chain of the first phase by up to 15x,
    the chains then run dry unevenly and the step is 1.0-1.5x slower (median over the
    standard workloads on h200x32). We therefore use dcp_inter's min 2; pass min_gas=15 for
    the yaml value."""
    return _plan_inter(
        batch, cost, "dcp_inter_pac", "pac", seed, max_gas, min_gas, biased_sp_pick, memory_unit
    )


def plan_dcp_intra(
    batch: Batch, cost: CostModel, *, seed: int = 0, keep_last: bool = False
) -> PlanResult:
    """DCP-intra: per step, random buckets at their profiled (sp, bs); then every group is
    re-tuned towards the fastest one (shrink bs, widen sp up to the node), overflowing groups
    are popped, and faster groups regain samples. One micro-batch per group, full recompute."""
    t0 = time.perf_counter()
    cost.check_fits(batch)
    rng = np.random.default_rng(seed)
    profiles = emulate_profile(batch, cost, "intra")
    pool = Pool(profiles, rng)
    n, L = cost.cluster.num_gpus, cost.model.num_layers
    max_sp = cost.cluster.gpus_per_node
    phases = []
    while pool.any_left():
        before = pool.num_left()
        step = fill_step(pool, n, rng)
        frozen = retune(step, pool, max_sp, keep_last)
        step, frozen = pop_overflow(step, frozen, pool, n)
        rebalance_bs(step, frozen, pool)
        starts = layout([sp for _, sp, _ in step], cost)
        entries = [(sp, [MicroBatch(pool.take(b, k), L)]) for b, sp, k in step]
        pool.check_progress(before, "dcp_intra")
        phases.append(step_groups(entries, starts))
    stats = {"num_steps": len(phases), "profile": _profile_stats(profiles)}
    return finish(phases, batch, cost, planner="dcp_intra", started=t0, stats=stats)
