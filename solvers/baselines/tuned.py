"""`megatron_tuned`, `verl_tuned`: the frameworks at the setting their users would pick.

A user of either framework tries its settings on a few steps and keeps the fastest that
does not run out of memory. Here the same, on the cost model: every setting of the grid is
planned, a setting whose plan needs more recompute than the setting gives (the framework
would run out of memory: stats["oom_micro_batches"] > 0) or that the framework refuses
(InfeasibleError: Megatron's or verl's assertion) is dropped, and the fastest predicted step
of the rest is returned with its setting (stats["setting"], and every setting's step time in
stats["sweep"]). If every setting runs out of memory, the fastest of them is returned and
stats["all_oom"] says so.

Grids (issue 25 item 4):
- Megatron: max_seqlen_per_rank in powers of two 2K..128K x recompute none / selective / full
  (megatron.py: selective is priced as none in dcp_opt's activation model, so it is planned
  once and reported with none's time), dev's scheduler (`megatron_dynamic_cp`) or the
  released one (`released=True`: `megatron_hybrid_cp`), on ring groups (Megatron's kind,
  megatron.KIND) where the cost model offers ring: the whole sweep runs on the kind the
  setting then runs on (`plan_megatron_tuned(kind=)`, `tune(fixed={"kind": "ring"})`), and
  the setting names it;
- verl: ppo_max_token_len_per_gpu in powers of two 2K..128K x balance workload / tokens x
  gradient checkpointing off / on, the degree tuned as in verl_balanced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import InfeasibleError
from dcp_opt.result import PlanResult

from .megatron import plan_megatron_dynamic_cp, resolve_kind
from .megatron_hybrid import plan_megatron_hybrid_cp
from .verl import plan_verl_balanced

LENGTHS = tuple(2**k for k in range(11, 18))  # 2K .. 128K tokens
MEGATRON_GRID = tuple((m, r) for m in LENGTHS for r in ("none", "selective", "full"))
VERL_GRID = tuple((m, b, c) for m in LENGTHS for b in ("workload", "tokens") for c in (False, True))


def megatron_settings(grid: Iterable = MEGATRON_GRID, *, kind: str | None = None) -> list[dict]:
    """Megatron's settings of `grid`, each on SP kind `kind` (None: the planner's default)."""
    fixed = {} if kind is None else {"kind": kind}
    return [{"max_seqlen_per_rank": m, "recompute": r, **fixed} for m, r in grid]


def verl_settings(grid: Iterable = VERL_GRID) -> list[dict]:
    return [{"max_token_len_per_gpu": m, "balance": b, "checkpointing": c} for m, b, c in grid]


def best_setting(
    plan: Callable, settings: list[dict], batch: Batch, cost: CostModel, *, alias=None
):
    """(the best PlanResult, its setting, {setting: step time or why not}) (module doc).
    `alias(setting)` names a setting whose plan is another's (Megatron's selective)."""
    sweep, results = {}, {}
    for setting in settings:
        key = _key(setting)
        same = alias(setting) if alias else None
        if same is not None and _key(same) in results:
            results[key] = results[_key(same)]
            sweep[key] = sweep[_key(same)]
            continue
        try:
            res = plan(batch, cost, **setting)
        except InfeasibleError as e:
            sweep[key] = f"refused: {e}"
            continue
        results[key] = (res, setting)
        oom = res.stats.get("oom_micro_batches", 0)
        sweep[key] = res.predicted_step_time_s if not oom else f"oom ({oom} micro-batches)"
    fits = [k for k, v in sweep.items() if isinstance(v, float)]
    pool = fits or list(results)
    if not pool:
        raise InfeasibleError("tuned: every setting of the grid is refused")
    best = min(pool, key=lambda k: results[k][0].predicted_step_time_s)
    res, setting = results[best]
    return res, setting, sweep, not fits


def _key(setting: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items())


def _finish(res: PlanResult, planner: str, setting, sweep, all_oom, t0) -> PlanResult:
    stats = {**res.stats, "setting": setting, "sweep": sweep, "all_oom": all_oom}
    wall = time.perf_counter() - t0
    return replace(res, planner=planner, stats=stats, wall_time_s=wall)


def plan_megatron_tuned(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    released: bool = False,
    settings=None,
    kind: str | None = None,
) -> PlanResult:
    """Megatron's dynamic CP at its best setting of MEGATRON_GRID (module doc), every setting
    on SP kind `kind` (None: megatron.resolve_kind's, ring where the cost model offers it;
    the setting names the kind either way)."""
    t0 = time.perf_counter()
    plan = plan_megatron_hybrid_cp if released else plan_megatron_dynamic_cp

    def alias(s):
        return {**s, "recompute": "none"} if s.get("recompute") == "selective" else None

    settings = settings or megatron_settings(kind=resolve_kind(cost, kind))
    res, setting, sweep, all_oom = best_setting(plan, settings, batch, cost, alias=alias)
    return _finish(res, "megatron_tuned", setting, sweep, all_oom, t0)


def plan_verl_tuned(batch: Batch, cost: CostModel, *, seed: int = 0, settings=None) -> PlanResult:
    """verl's dynamic batch size at its best setting of VERL_GRID (module doc)."""
    t0 = time.perf_counter()
    res, setting, sweep, all_oom = best_setting(
        plan_verl_balanced, settings or verl_settings(), batch, cost
    )
    return _finish(res, "verl_tuned", setting, sweep, all_oom, t0)


PLANNER_GRIDS = {  # planner -> (its settings, the setting another's plan stands for)
    "megatron_dynamic_cp": (megatron_settings, "megatron"),
    "megatron_hybrid_cp": (megatron_settings, "megatron"),
    "verl_balanced": (verl_settings, None),
}


def tune(
    planner: str, batches: list[Batch], cost: CostModel, *, fixed: dict | None = None
) -> tuple[dict, dict]:
    """(the best setting of `planner` over a few batches, {setting: summed step time or why
    not}): as a user tunes on the first steps of a run; a setting that runs out of memory
    or is refused on any batch is dropped (module doc). {} if every setting is. `fixed`:
    options held in every setting of the sweep and in the one returned (Megatron's
    {"kind": "ring"}: the sweep runs on the kind the setting then runs on)."""
    from dcp_opt.solvers import get_planner

    make, alias_kind = PLANNER_GRIDS[planner]
    grid = [{**setting, **(fixed or {})} for setting in make()]
    fn, sweep = get_planner(planner), {}
    for setting in grid:
        key = _key(setting)
        if alias_kind == "megatron" and setting["recompute"] == "selective":
            sweep[key] = sweep[_key({**setting, "recompute": "none"})]
            continue
        total = 0.0
        for batch in batches:
            try:
                res = fn(batch, cost, **setting)
            except InfeasibleError as e:
                total = f"refused: {e}"
                break
            if res.stats.get("oom_micro_batches", 0):
                total = "oom"
                break
            total += res.predicted_step_time_s
        sweep[key] = total
    fits = {k: v for k, v in sweep.items() if isinstance(v, float)}
    if not fits:
        return {}, sweep
    best = min(fits, key=fits.get)
    return next(s for s in grid if _key(s) == best), sweep
