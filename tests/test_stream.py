"""The stream benchmark (dcp_opt.analysis.stream) and the published samplers over an epoch
(solvers/baselines/videosys/stream.py): accounting, published settings, JSON keys, the CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from dcp_opt.solvers.baselines.videosys.stream import MIN_GAS, PUBLISHED_METHODS, published_epoch

from dcp_opt.analysis.stream import (
    DEFAULT_MODELS,
    MILLION,
    QUICK,
    STREAM_SCHEMA,
    StreamConfig,
    data_order_steps,
    method_row,
    run_fixed,
    run_published,
    run_stream,
    stream_epoch,
)
from dcp_opt.analysis.stream_frameworks import CP_KINDS, FRAMEWORKS, framework_runs
from dcp_opt.analysis.stream_steps import StepCache
from dcp_opt.cli import main
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError
from dcp_opt.inputs import load_cluster
from dcp_opt.model import model_preset

CLUSTER = load_cluster("h200x32")
COSTS = {k: CostModel(model_preset(m), CLUSTER) for k, m in DEFAULT_MODELS.items()}
EPOCHS = {w: stream_epoch(w, 3, 8, 2 * MILLION) for w in ("2d-balanced", "1d-long")}


def _ids(steps) -> list[int]:
    return [i for st in steps for g in st for mb in g.micro_batches for i in mb.sequence_ids]


@pytest.mark.parametrize("workload", sorted(EPOCHS))
@pytest.mark.parametrize("method", PUBLISHED_METHODS)
@pytest.mark.parametrize("drop_last", [True, False])
def test_published_epoch_trains_every_kept_sample_once(workload, method, drop_last):
    epoch, cost = EPOCHS[workload], COSTS[workload[:2]]
    pub = published_epoch(epoch, cost, method, seed=1, drop_last=drop_last)
    trained = _ids(pub.steps)
    assert not [i for i, n in Counter(trained + pub.dropped).items() if n > 1]
    assert sorted(trained + pub.dropped) == list(range(len(epoch)))
    if not drop_last:
        assert pub.dropped == []
    capped = cost.with_(usable_memory_fraction=0.7).capacity()
    for st in pub.steps:  # the published 0.7 cap holds for every micro-batch
        for g in st:
            for mb in g.micro_batches:
                tok = sum(epoch.sequences[i].num_tokens for i in mb.sequence_ids)
                assert cost.memory(tok, g.degree, mb.recompute_layers) <= capped * (1 + 1e-9)


def test_pac_chains_reach_the_published_minimum():
    """dcp_inter_ckpt.yaml: the longest chain of every PAC step has >= 15 micro-batches."""
    epoch = stream_epoch("2d-balanced", 0, 64, 2 * MILLION)
    pub = published_epoch(epoch, COSTS["2d"], "dcp_inter_pac", seed=0)
    assert pub.steps
    assert (
        min(max(len(g.micro_batches) for g in st) for st in pub.steps) >= MIN_GAS["dcp_inter_pac"]
    )


def test_one_standard_batch_forms_no_published_step():
    """The claim solvers/baselines/videosys/methods.py makes: a 2M-token batch is too small for the sampler."""
    from dcp_opt.workloads import standard_batch

    batch = standard_batch("2d-short", 0)
    for method in PUBLISHED_METHODS:
        pub = published_epoch(batch, COSTS["2d"], method, seed=0)
        assert pub.steps == [] and len(pub.dropped) == len(batch)


def test_bad_method_and_cap_are_refused():
    epoch = EPOCHS["1d-long"]
    with pytest.raises(DcpOptError, match="method"):
        published_epoch(epoch, COSTS["1d"], "dcp_magic")
    with pytest.raises(DcpOptError, match="memory_cap"):
        published_epoch(epoch, COSTS["1d"], "dcp_inter", memory_cap=1.5)


def test_rows_add_up():
    """Per method: trained + dropped = the epoch; tokens/s = trained / summed step times."""
    epoch, cost = EPOCHS["1d-long"], COSTS["1d"]
    runs = {
        "pac": run_published(epoch, cost, "dcp_inter_pac", seed=0, drop_last=True, memory_cap=0.7),
        "greedy": run_fixed(epoch, cost, "greedy", data_order_steps(epoch, MILLION), {}),
    }
    for name, run in runs.items():
        row = method_row("1d-long", name, run, epoch)
        assert row["trained_tokens"] + row["dropped_tokens"] == epoch.num_tokens
        assert row["num_steps"] == len(run.steps) == len(run.step_times)
        assert row["tokens_per_s"] == pytest.approx(row["trained_tokens"] / sum(run.step_times))
        assert row["step_tokens"]["p10"] <= row["step_tokens"]["median"]
        assert row["step_tokens"]["median"] <= row["step_tokens"]["p90"]
    ids = [i for s in runs["greedy"].steps for i in s]
    assert sorted(ids) == list(range(len(epoch)))  # fixed steps: every sample once


def test_data_order_steps_keep_order_and_size():
    epoch = EPOCHS["2d-balanced"]
    steps = data_order_steps(epoch, 2 * MILLION)
    assert [i for s in steps for i in s] == list(range(len(epoch)))
    tok = epoch.tokens_by_id
    assert all(sum(tok[i] for i in s[:-1]) < 2 * MILLION for s in steps)


ROW_KEYS = {
    "workload", "method", "family", "planner", "drop_last", "step_former", "target_tokens",
    "num_steps", "trained_tokens", "dropped_tokens", "dropped_share", "epoch_time_s",
    "tokens_per_s", "step_tokens", "step_time_s", "planning_s", "planning_ms_per_step",
    "bound_s", "gap_to_bound", "steps_bound_s", "gap_to_steps_bound", "speedup_vs_bucket",
    "speedup_vs_pac", "sp_kinds", "setting",
}  # fmt: skip


def test_cli_quick_json(tmp_path):
    out = tmp_path / "s.json"
    rc = main(
        ["bench", "--stream", "--quick", "--workloads", "1d-long", "--no-progress",
         "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == STREAM_SCHEMA
    assert set(doc) >= {"config", "epochs", "methods", "matched", "fidelity", "notes", "frameworks"}
    assert doc["config"]["num_batches"] == QUICK["num_batches"]
    names = {r["method"] for r in doc["methods"]}
    assert set(PUBLISHED_METHODS) | {f"{m}/nodrop" for m in PUBLISHED_METHODS} <= names
    assert "greedy@2M" in names
    for r in doc["methods"]:
        assert set(r) == ROW_KEYS
        assert r["trained_tokens"] + r["dropped_tokens"] == doc["epochs"][0]["num_tokens"]
        if not r["drop_last"]:
            assert r["dropped_tokens"] == 0
        # no plan of a row's own steps beats their bound; data-order steps: the same bound
        assert r["epoch_time_s"] >= r["steps_bound_s"] * (1 - 1e-9)
        if not r["step_former"]:
            assert r["steps_bound_s"] == r["bound_s"]
    assert any(r["step_former"] and r["steps_bound_s"] != r["bound_s"] for r in doc["methods"])
    bucket = next(r for r in doc["methods"] if r["method"] == "bucket")
    assert bucket["speedup_vs_bucket"] == pytest.approx(1.0)
    assert doc["fidelity"] == []  # the paper has no 1D figures
    _check_framework_rows(doc["methods"])
    by = {r["method"]: r["tokens_per_s"] for r in doc["methods"]}
    assert [f["size"] for f in doc["frameworks"]] == ["2M"]
    for f in doc["frameworks"]:  # the table's ratios are the rows' tokens/s
        cp = by[f"greedy+cp@{f['size']}"]
        assert f["vs_verl_balanced"] == pytest.approx(cp / by[f"verl_balanced@{f['size']}"])
        assert f["vs_greedy"] >= 1 - 1e-9
    for m in doc["matched"]:
        assert set(m) == MATCHED_KEYS
        # no plan beats the stream bound: the planner's ratio stays below the bound's
        if m["bound_vs_pac"] is not None:
            assert m["vs_pac"] <= m["bound_vs_pac"] * (1 + 1e-9)


def _check_framework_rows(rows: list[dict]) -> None:
    """issue 16 item 5: megatron_dynamic_cp and verl_balanced at each step size the project's
    planner runs, on a cost model offering both kinds, none under the stream bound; greedy
    there (greedy+cp) may always choose Ulysses, so it is never slower than Ulysses-only."""
    by = {r["method"]: r for r in rows}
    sizes = [m.split("@", 1)[1] for m in by if m.startswith("greedy+cp@")]
    assert sizes == ["2M"]  # StreamConfig.framework_sizes: 2M by default
    for size in sizes:
        for name in FRAMEWORKS:
            r = by[f"{name}@{size}"]
            assert r["family"] == "framework" and r["sp_kinds"] == ["ulysses", "cp", "ring"]
            assert r["dropped_tokens"] == 0 and r["epoch_time_s"] >= r["bound_s"] * (1 - 1e-9)
            # issue 25: each at the setting tuned on the first steps (tuned.py's grid), on
            # its own kind: Megatron's ring (TransformerEngine's P2P ring), verl's Ulysses
            assert isinstance(r["setting"], dict) and r["setting"], r["setting"]
            assert "max_seqlen_per_rank" in r["setting"] or "max_token_len_per_gpu" in r["setting"]
        assert by[f"megatron_dynamic_cp@{size}"]["setting"]["kind"] == "ring"
        assert "kind" not in by[f"verl_balanced@{size}"]["setting"]
        cp, ulysses = by[f"greedy+cp@{size}"], by[f"greedy@{size}"]
        assert cp["family"] == "project" and ulysses["sp_kinds"] == ["ulysses"]
        assert cp["tokens_per_s"] >= ulysses["tokens_per_s"] * (1 - 1e-9)


@pytest.mark.parametrize("tune_steps", [2, 0])
def test_megatron_is_tuned_and_run_on_ring_groups(monkeypatch, tune_steps):
    """Issue 25: every plan Megatron makes in the stream, its tuning sweep included, has ring
    groups (its own kind), on a cost model offering the three kinds that greedy+cp gets too;
    verl's groups stay Ulysses."""
    import dcp_opt.solvers.baselines.megatron as megatron
    import dcp_opt.solvers.baselines.verl as verl

    seen = {"megatron": [], "verl": []}

    def spy(name, real):
        def wrapped(*args, **kw):
            res = real(*args, **kw)
            kinds = {g.kind for ph in res.plan.phases for g in ph.groups if g.degree > 1}
            seen[name].append((args[2].sp_kinds, kinds))
            return res

        return wrapped

    monkeypatch.setattr(megatron, "plan_of_steps", spy("megatron", megatron.plan_of_steps))
    monkeypatch.setattr(verl, "finish", spy("verl", verl.finish))
    epoch, cost = EPOCHS["1d-long"], COSTS["1d"]
    costs = []

    def run(epoch, cost, planner, steps, options, *args, **kw):
        costs.append((planner, cost.sp_kinds))
        return run_fixed(epoch, cost, planner, steps[:2], options, *args, **kw)

    cfg = StreamConfig(workloads=("1d-long",), framework_tune_steps=tune_steps)
    rows = framework_runs(
        cfg, "1d-long", epoch, cost, {2 * MILLION: "2M"}, steps_of=data_order_steps,
        run_fixed=run, cache_of=StepCache, on_done=lambda w, m: None,
    )  # fmt: skip
    assert {p for p, _ in costs} == {*FRAMEWORKS, "greedy"}
    assert all(kinds == CP_KINDS == ("ulysses", "cp", "ring") for _, kinds in costs)
    assert len(seen["megatron"]) > (2 if tune_steps else 0)  # the sweep's plans and the row's
    assert all(kinds == CP_KINDS for kinds, _ in seen["megatron"])
    assert all(groups == {"ring"} for _, groups in seen["megatron"]), seen["megatron"]
    assert seen["verl"] and all(groups <= {"ulysses"} for _, groups in seen["verl"])
    by = {r["method"]: r for r in rows}
    assert by["megatron_dynamic_cp@2M"]["setting"]["kind"] == "ring"


def test_frameworks_skip_2d_and_name_the_field():
    with pytest.raises(DcpOptError, match="frameworks"):
        StreamConfig(frameworks=("deepspeed",))
    with pytest.raises(DcpOptError, match="^planners: .*framework"):
        StreamConfig(planners=("greedy", "verl_balanced"))
    with pytest.raises(DcpOptError, match="^framework_tune_steps: "):
        StreamConfig(framework_tune_steps=-1)
    with pytest.raises(DcpOptError, match="^framework_sizes: "):
        StreamConfig(framework_sizes=(0,))
    with pytest.raises(DcpOptError, match="^former_budget_per_step_s: "):
        StreamConfig(former_budget_per_step_s=-1.0)
    cfg = StreamConfig(workloads=("2d-long",))
    assert framework_runs(cfg, "2d-long", None, None, {1: "1"}, steps_of=None, run_fixed=None,
                          cache_of=None, on_done=None) == []  # fmt: skip


MATCHED_KEYS = {
    "workload", "matched_to", "target_tokens", "step_former", "method", "tokens_per_s",
    "vs_pac", "vs_bucket", "gap_to_bound", "bound_vs_pac", "bound_vs_bucket",
}  # fmt: skip


def test_config_errors_name_the_field(capsys):
    with pytest.raises(DcpOptError, match="workload"):
        StreamConfig(workloads=("4d-short",))  # 3d-short is one since issue 27
    with pytest.raises(DcpOptError, match="published"):
        StreamConfig(published=("dcp_magic",))
    assert main(["bench", "--stream", "--step-sizes", "two", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-sizes" in err[0]


def test_run_stream_reports_every_workload():
    doc = run_stream(
        StreamConfig(workloads=("1d-long",), num_batches=4, step_sizes=(MILLION,),
                     planners=("greedy",), published=("bucket", "dcp_inter_pac"), nodrop=False)
    )  # fmt: skip
    assert [e["workload"] for e in doc["epochs"]] == ["1d-long"]
    assert {r["method"] for r in doc["methods"]} >= {"bucket", "dcp_inter_pac", "greedy@1M"}


def test_the_memoised_step_bounds_sum_to_the_stream_bound(monkeypatch):
    import dcp_opt.solvers.bounds.stream as sb

    from dcp_opt.analysis.stream_steps import StepCache, _bound

    epoch, cost = EPOCHS["2d-balanced"], COSTS["2d"]
    steps = data_order_steps(epoch, 2 * MILLION)
    cache = StepCache(epoch, cost)
    batches = [cache.batch(s) for s in steps]
    # lp=False is deterministic (no LP time limit): the memoised sum is the stream bound
    fixed = _bound(cache, steps, 0, lp=False)
    assert fixed == pytest.approx(sb.stream_lower_bound(batches, cost, lp_time_limit_s=0))
    assert _bound(cache, steps, 0) >= fixed * (1 - 1e-12)  # the LP and tree terms only raise
    calls = []
    real = sb.step_lower_bound
    monkeypatch.setattr(sb, "step_lower_bound", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = _bound(cache, steps, 0, lp=False)  # every step already bounded: no new call
    assert again == fixed and calls == []
    moved = [steps[1] + steps[0][:1], steps[0][1:], *steps[2:]]  # a former moves one sample
    _bound(cache, moved, 0, lp=False)
    assert len(calls) == 2  # only the two steps that changed
    with pytest.raises(DcpOptError, match="lp_time_limit_s"):
        real(batches[0], cost, lp_time_limit_s=-1)
