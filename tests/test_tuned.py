"""The frameworks tuned as their users tune them (solvers/baselines/tuned.py, issue 25):
settings that run out of memory or that the framework refuses are dropped, the fastest of
the rest is kept, Megatron's selective recompute is planned once as none; Megatron's sweep
runs on its own kind, ring, where the cost model offers it."""

from __future__ import annotations

from dcp_opt.solvers.baselines.tuned import (
    megatron_settings,
    plan_megatron_tuned,
    plan_verl_tuned,
    tune,
    verl_settings,
)

from dcp_opt import Batch, CostModel, cluster_preset, validate
from dcp_opt.model import model_preset

COST = CostModel(model_preset("llama3-8b"), cluster_preset("h200x32"), sp_kinds=("ulysses", "cp"))
RING = COST.with_(sp_kinds=("ulysses", "cp", "ring"))
BATCH = Batch.from_lengths([8192] * 64 + [40_000] * 4)


def test_megatron_tuned_drops_what_megatron_cannot_run():
    grid = [(2048, "none"), (8192, "selective"), (8192, "none"), (131072, "none")]
    res = plan_megatron_tuned(BATCH, COST, settings=megatron_settings(grid))
    sweep = res.stats["sweep"]
    # 40,000 tokens at M = 2048 need CP 32 (2^ceil(log2 19.5)): Megatron runs it, so it stays;
    # 131,072 tokens a rank without recompute: every pack over the memory -> dropped
    assert str(sweep["max_seqlen_per_rank=131072,recompute=none"]).startswith("oom")
    assert (
        sweep["max_seqlen_per_rank=8192,recompute=selective"]
        == sweep["max_seqlen_per_rank=8192,recompute=none"]
    )
    fits = {k: v for k, v in sweep.items() if isinstance(v, float)}
    assert res.predicted_step_time_s == min(fits.values())
    assert res.planner == "megatron_tuned" and not res.stats["all_oom"]
    assert res.stats["oom_micro_batches"] == 0
    assert validate(res.plan, BATCH, COST) == []


def test_verl_tuned_refuses_a_max_token_len_below_the_longest():
    grid = [(1024, "workload", False), (16384, "workload", False), (16384, "tokens", True)]
    res = plan_verl_tuned(BATCH, COST, settings=verl_settings(grid))
    sweep = res.stats["sweep"]
    # 1024 per GPU x any degree up to 32 = 32K < 40,000: verl's assertion at every degree
    assert sweep["max_token_len_per_gpu=1024,balance=workload,checkpointing=False"].startswith(
        "refused"
    )
    assert res.stats["setting"]["max_token_len_per_gpu"] == 16384
    assert validate(res.plan, BATCH, COST) == []


def test_tune_over_steps_keeps_a_setting_that_fits_every_step():
    steps = [BATCH, Batch.from_lengths([4096] * 128)]
    setting, sweep = tune("megatron_dynamic_cp", steps, COST)
    assert setting and isinstance(sweep[",".join(f"{k}={v}" for k, v in setting.items())], float)
    assert all(isinstance(v, (float, str)) for v in sweep.values())


def _kinds(res) -> set[str]:
    return {g.kind for ph in res.plan.phases for g in ph.groups if g.degree > 1}


def test_megatron_is_tuned_on_ring_groups_where_ring_is_offered(monkeypatch):
    """Issue 25: Megatron-Core's CP is TransformerEngine's P2P ring; the whole sweep runs on
    ring, so the setting kept is the best on ring, and it names the kind."""
    import dcp_opt.solvers.baselines.megatron as megatron

    made = []

    def spy(*args, **kw):
        res = real(*args, **kw)
        made.append(_kinds(res))
        return res

    real = megatron.plan_of_steps
    monkeypatch.setattr(megatron, "plan_of_steps", spy)
    res = plan_megatron_tuned(BATCH, RING)
    assert res.stats["setting"]["kind"] == "ring" and _kinds(res) == {"ring"}
    assert all(k.endswith(",kind=ring") for k in res.stats["sweep"])
    assert len(made) == len(megatron_settings()) * 2 // 3  # selective reuses none's plan
    assert all(kinds == {"ring"} for kinds in made)
    made.clear()
    setting, sweep = tune("megatron_dynamic_cp", [BATCH], RING, fixed={"kind": "ring"})
    assert setting["kind"] == "ring" and all(k.endswith(",kind=ring") for k in sweep)
    assert made and all(kinds == {"ring"} for kinds in made)
    # where ring is not offered, the sweep names the kind it ran on: cp
    assert plan_megatron_tuned(BATCH, COST).stats["setting"]["kind"] == "cp"
