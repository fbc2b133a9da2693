"""The job's layout swept: tensor parallelism x optimizer-sharding mode x zero3 shard domain
for a model, a cluster and batches (issue 26). Which settings fit, the step time of each
(the median over the batches of a planner's predicted step), and the fastest.

    rows = layout_sweep(batches, cost)           # cost: the model and cluster to sweep
    dcp-opt whatif --lengths L --model llama3-70b --cluster h100x64 --layouts

Each setting is one CostModel (`tensor_parallel`, `optimizer_sharding`, `shard_domain`);
a setting whose model states alone do not fit is reported with the states' bytes per GPU
and not planned; one where some sequence fits nowhere, with that error.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..batch import Batch
from ..cost import CostModel
from ..cost.units import allowed_tensor_parallel
from ..cost.zero3 import allowed_domains
from ..errors import DcpOptError

MODES = ("zero1", "zero3")  # zero2 holds zero1's peak and sends the same (cost/memory.py)


@dataclass(frozen=True)
class Setting:
    tensor_parallel: int
    optimizer_sharding: str
    shard_domain: int

    def flags(self) -> str:
        out = f"--tp {self.tensor_parallel} --optimizer-sharding {self.optimizer_sharding}"
        return out + (f" --shard-domain {self.shard_domain}" if self.shard_domain else "")


def settings(cost: CostModel, modes=MODES, tps=None) -> list[Setting]:
    """Every TP degree the model and node allow x each mode; under zero3 the step-level
    schedule (0) and every aligned shard domain above 1 of the units."""
    out = []
    for t in tps or allowed_tensor_parallel(cost.model, cost.gpu_cluster):
        for mode in modes:
            out.append(Setting(t, mode, 0))
            if mode == "zero3":
                units = cost.with_(tensor_parallel=t, optimizer_sharding="zero3").cluster
                out += [Setting(t, mode, s) for s in allowed_domains(units) if s > 1]
    return out


def evaluate(setting: Setting, batches: list[Batch], cost: CostModel, planners) -> dict:
    """One row: fits or why not, the states per GPU, the median predicted step per planner."""
    from ..solvers import run_planner

    row = {**setting.__dict__, "flags": setting.flags()}
    try:
        c = cost.with_(
            tensor_parallel=setting.tensor_parallel,
            optimizer_sharding=setting.optimizer_sharding,
            shard_domain=setting.shard_domain,
        )
    except DcpOptError as e:
        return {**row, "fits": False, "why": str(e)}
    t = setting.tensor_parallel
    row["states_gb_per_gpu"] = c.model_state_bytes() / t / 1e9
    row["capacity_gb_per_gpu"] = c.capacity() / t / 1e9
    steps: dict[str, list[float]] = {p: [] for p in planners}
    try:
        for b in batches:
            c.check_fits(b)
            for p in planners:
                steps[p].append(run_planner(p, b, c).predicted_step_time_s)
    except DcpOptError as e:  # InfeasibleError included: the states, or a sequence
        return {**row, "fits": False, "why": str(e).split(". Needs")[0]}
    row["fits"] = True
    row["step_time_s"] = {p: statistics.median(v) for p, v in steps.items()}
    return row


def layout_sweep(
    batches: list[Batch],
    cost: CostModel,
    *,
    planners=("greedy",),
    modes=MODES,
    tps=None,
    progress=lambda message: None,
) -> dict:
    """{"rows": one per setting, "fastest": the fitting row with the least step of the first
    planner, or None}."""
    rows = []
    for s in settings(cost, modes, tps):
        rows.append(evaluate(s, batches, cost, planners))
        progress(f"layout {s.flags()}")
    fits = [r for r in rows if r["fits"]]
    key = planners[0]
    fastest = min(fits, key=lambda r: r["step_time_s"][key]) if fits else None
    return {"planners": list(planners), "rows": rows, "fastest": fastest}


def layout_lines(doc: dict) -> list[str]:
    """The sweep as a plain table, then the fastest setting."""
    p = doc["planners"]
    out = [f"{'setting':<52} {'states/GPU':>10}  " + "  ".join(f"{x:>12}" for x in p)]
    for r in doc["rows"]:
        states = f"{r['states_gb_per_gpu']:.1f} GB" if "states_gb_per_gpu" in r else "-"
        if r["fits"]:
            cells = "  ".join(f"{r['step_time_s'][x]:>10.3f} s" for x in p)
        else:
            cells = "does not fit: " + r["why"][:90]
        out.append(f"{r['flags']:<52} {states:>10}  {cells}")
    best = doc["fastest"]
    out.append(
        f"fastest: {best['flags']} ({best['step_time_s'][p[0]]:.3f} s, {p[0]})"
        if best
        else "no setting fits"
    )
    return out
