"""Micro-step pipelines (Pipeline.micro_steps, plan schema 4; docs/plan-format.md): simulate's
finish equals an independent event simulation written here (each unit its own pointer into
the schedule), a column plan of equal counts is the same step as micro-steps, validate checks
each unit's memory and the shape, the JSON is version 4, the batch bound is below every valid
micro-step plan, and pp_greedy's micro-step answers are valid and priced as simulated."""

import json

import numpy as np
import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.pipeline.instance import Instance
from dcp_opt.solvers.pipeline.plan import bound_s
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dcp_opt import CostModel, cluster_preset, model_preset, simulate, validate
from dcp_opt.batch import Batch, Sequence
from dcp_opt.errors import PlanFormatError
from dcp_opt.pipeline import stage_actions
from dcp_opt.pipeline.build import pipeline_plan
from dcp_opt.pipeline.check import micro_step_parts
from dcp_opt.pipeline.stages import stage_layout
from dcp_opt.plan import Group, MicroBatch, Pipeline, Plan

COST = CostModel(model_preset("llama-1b"), cluster_preset("h200x8"))
TIGHT = CostModel(model_preset("llama-1b"), cluster_preset("h200x8").with_(memory_bytes=14e9))


def event_finish(parts, schedule: str, p: int, n: int) -> float:
    """Independent of lockstep.py: every (stage, unit) keeps its own pointer into the
    schedule's actions over the K micro-steps, less those it idles in; a group's pass runs
    once it is next for every member and its input has arrived; its start is the latest of
    its members' free times and that arrival."""
    K = len(parts)
    group_at = [{u: j for j, (g, *_) in enumerate(ps) for u in g.ranks} for ps in parts]
    todo = {(s, u): [a for a in stage_actions(schedule, p, K, s) if u in group_at[a.micro_batch]]
            for s in range(p) for u in range(n)}  # fmt: skip
    free = {key: 0.0 for key in todo}
    end = {}
    while any(todo.values()):
        moved = False
        for (s, u), acts in todo.items():
            if not acts:
                continue
            a = acts[0]
            k = a.micro_batch
            j = group_at[k][u]
            g, f, b, x, _, _ = parts[k][j]
            if any(not todo[(s, v)] or todo[(s, v)][0] != a for v in g.ranks):
                continue
            if a.kind == "F":
                ready = 0.0 if s == 0 else end.get(("F", s - 1, k, j))
                ready = None if ready is None else ready + (x[s - 1] if s else 0.0)
            elif s == p - 1:
                ready = end.get(("F", s, k, j))
            else:
                ready = end.get(("B", s + 1, k, j))
                ready = None if ready is None else ready + x[s]
            if ready is None:
                continue
            start = max([ready] + [free[(s, v)] for v in g.ranks])
            e = start + (f[s] if a.kind == "F" else b[s])
            end[(a.kind, s, k, j)] = e
            for v in g.ranks:
                free[(s, v)] = e
                todo[(s, v)].pop(0)
            moved = True
        assert moved, "deadlock"
    return max(end.values())


@st.composite
def micro_step_plans(draw, cost=COST, schedules=("1f1b", "gpipe")):
    """A micro-step plan by construction: K micro-steps, each a random aligned layout of the
    stage's units, the sequences dealt to the groups (some left empty), random recompute."""
    p = draw(st.sampled_from([2, 4]))
    layers = (8, 8) if p == 2 else (4, 4, 4, 4)
    pipe = Pipeline(layers, draw(st.sampled_from(schedules)), micro_steps=True)
    lay = stage_layout(cost, pipe)
    n = lay.num_units
    lengths = draw(st.lists(st.integers(64, 6144), min_size=1, max_size=12))
    batch = Batch([Sequence(i, (x,)) for i, x in enumerate(lengths)])
    K = draw(st.integers(1, 6))
    layouts = []
    for _ in range(K):
        d = draw(st.sampled_from([x for x in (1, 2, 4) if x <= n]))
        layouts.append([(j * d, d) for j in range(n // d)])
    slots = [(k, j) for k in range(K) for j in range(len(layouts[k]))]
    owner = {i: draw(st.sampled_from(slots)) for i in range(len(lengths))}
    phases = []
    for k, layout in enumerate(layouts):
        groups = []
        for j, (start, d) in enumerate(layout):
            ids = tuple(i for i, o in owner.items() if o == (k, j))
            rec = tuple(draw(st.integers(0, x)) for x in layers)
            mbs = (MicroBatch(ids, sum(rec), rec),) if ids else ()
            groups.append(Group(start, d, mbs))
        phases.append(groups)
    return pipeline_plan(phases, batch, lay, planner="random"), batch, lay


@settings(max_examples=60, deadline=None)
@given(micro_step_plans())
def test_simulate_is_the_event_simulation(arg):
    plan, batch, lay = arg
    assert validate(plan, batch, COST) == []
    sim = simulate(plan, batch, COST)
    parts = micro_step_parts(lay, batch, plan)
    want = event_finish(parts, plan.pipeline.schedule, lay.num_stages, lay.num_units)
    assert sim.finish_s == pytest.approx(want, rel=1e-12)
    assert bound_s(Instance(lay, batch)) <= sim.step_time_s * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(micro_step_plans(cost=TIGHT, schedules=("1f1b",)))
def test_the_batch_bound_is_below_every_valid_micro_step_plan_where_memory_binds(arg):
    plan, batch, lay = arg
    assume(validate(plan, batch, TIGHT) == [])
    inst = Instance(stage_layout(TIGHT, plan.pipeline), batch)
    assert bound_s(inst) <= simulate(plan, batch, TIGHT).step_time_s * (1 + 1e-12)


def _columns_and_steps(schedule="1f1b"):
    """Two columns of degree 2 with 3 micro-batches each, and the same as 3 micro-steps."""
    batch = Batch([Sequence(i, (x,)) for i, x in enumerate([900, 300, 2500, 40, 1200, 700])])
    cols = [[0, 2, 4], [1, 3, 5]]
    rec = (1, 2)

    def mb(i):
        return MicroBatch((i,), sum(rec), rec)

    col_lay = stage_layout(COST, Pipeline((8, 8), schedule))
    step_lay = stage_layout(COST, Pipeline((8, 8), schedule, micro_steps=True))
    columns = pipeline_plan([[Group(2 * c, 2, tuple(mb(i) for i in ids))
                              for c, ids in enumerate(cols)]], batch, col_lay, planner="t")  # fmt: skip
    steps = pipeline_plan([[Group(2 * c, 2, (mb(cols[c][k]),)) for c in range(2)]
                           for k in range(3)], batch, step_lay, planner="t")  # fmt: skip
    return batch, columns, steps


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_column_plan_of_equal_counts_is_the_same_step_as_micro_steps(schedule):
    batch, columns, steps = _columns_and_steps(schedule)
    assert validate(columns, batch, COST) == [] and validate(steps, batch, COST) == []
    a, b = simulate(columns, batch, COST), simulate(steps, batch, COST)
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
    assert np.allclose(b.pipeline.peak_bytes, a.pipeline.peak_bytes, rtol=1e-12)
    assert np.allclose(b.pipeline.busy_s, a.pipeline.busy_s, rtol=1e-12)


def test_validate_refuses_two_micro_batches_in_a_micro_step_group_and_checks_units():
    batch, _, steps = _columns_and_steps()
    g = steps.phases[0].groups[0]
    two = Group(g.start_rank, g.degree, g.micro_batches + steps.phases[1].groups[0].micro_batches)
    from dataclasses import replace

    from dcp_opt.plan import Phase

    bad = replace(steps, phases=(Phase((two, steps.phases[0].groups[1])), Phase(
        (Group(0, 2), steps.phases[1].groups[1])), steps.phases[2]))  # fmt: skip
    codes = [v.code for v in validate(bad, batch, COST, check_fingerprint=False)]
    assert "BAD_PIPELINE" in codes
    # the tight cluster (about 3 GB of room a unit): a 3K sequence alone at degree 1 with
    # nothing recomputed overflows unit 2 on the last stage (its activations + the logits);
    # a short one on units 0-1 and the idle unit 3 do not; every layer recomputed fits
    big = Batch([Sequence(0, (3072,)), Sequence(1, (256,))])
    lay = stage_layout(TIGHT, Pipeline((8, 8), "1f1b", micro_steps=True))

    def plan_with(rec):
        return pipeline_plan([[Group(0, 2, (MicroBatch((1,), 0, (0, 0)),)), Group(2, 1, (
            MicroBatch((0,), sum(rec), rec),)), Group(3, 1)]], big, lay, planner="t")  # fmt: skip

    out = [v.message for v in validate(plan_with((0, 0)), big, TIGHT) if v.code == "OUT_OF_MEMORY"]
    assert out and all("unit 2" in m for m in out)
    fixed = plan_with((8, 8))
    assert validate(fixed, big, TIGHT) == []


def test_validate_and_simulate_share_a_walk_only_for_the_same_plan_object():
    """check.walked_micro_steps keeps its last answer on the cost model: a plan that fits,
    then an equal-shaped one that does not (nothing recomputed), each judged as its own;
    and a plan equal to the first but another object is priced afresh, alike."""
    big = Batch([Sequence(0, (3072,)), Sequence(1, (256,))])
    lay = stage_layout(TIGHT, Pipeline((8, 8), "1f1b", micro_steps=True))

    def plan_with(rec):
        return pipeline_plan([[Group(0, 2, (MicroBatch((1,), 0, (0, 0)),)), Group(2, 1, (
            MicroBatch((0,), sum(rec), rec),)), Group(3, 1)]], big, lay, planner="t")  # fmt: skip

    fits, over = plan_with((8, 8)), plan_with((0, 0))
    for _ in range(2):  # the second round reads what the first kept
        assert validate(fits, big, TIGHT) == []
        low = simulate(fits, big, TIGHT).peak_memory_bytes.max()
        assert any(v.code == "OUT_OF_MEMORY" for v in validate(over, big, TIGHT))
        assert simulate(over, big, TIGHT).peak_memory_bytes.max() > low
    twin = plan_with((8, 8))
    assert twin == fits and twin is not fits
    fresh = CostModel(model_preset("llama-1b"), TIGHT.cluster)
    assert simulate(twin, big, TIGHT).step_time_s == simulate(fits, big, fresh).step_time_s


def test_interleaved_micro_steps_are_refused():
    batch = Batch([Sequence(0, (512,))])
    lay = stage_layout(COST, Pipeline((8, 8), "interleaved", 2, micro_steps=True))
    plan = pipeline_plan([[Group(0, 4, (MicroBatch((0,), 0, (0, 0)),))]], batch, lay,
                         planner="t")  # fmt: skip
    assert any(v.code == "BAD_PIPELINE" and "micro_steps" in v.message
               for v in validate(plan, batch, COST))  # fmt: skip


def test_json_is_version_4_and_a_version_3_document_cannot_claim_micro_steps():
    _, _, steps = _columns_and_steps()
    doc = json.loads(steps.to_json())
    assert doc["schema_version"] == 4 and doc["pipeline"]["micro_steps"] is True
    assert Plan.from_json(steps.to_json()) == steps
    doc["schema_version"] = 3
    with pytest.raises(PlanFormatError, match="micro_steps: needs schema_version 4"):
        Plan.from_dict(doc)
    doc["schema_version"], doc["pipeline"]["micro_steps"] = 4, "yes"
    with pytest.raises(PlanFormatError, match="micro_steps: expected true or false"):
        Plan.from_dict(doc)


def test_pp_greedy_plans_micro_steps_where_they_win_and_columns_when_told():
    # llama3-70b, p = 8 on 256 H200s, WLB documents: re-forming the groups per micro-step
    # beats every column draft (benchmarks/results/pipeline.json)
    from dcp_opt.workloads import standard_batch

    cost = CostModel(model_preset("llama3-70b"), cluster_preset("h200x256"))
    batch = standard_batch("1d-wlbllm", 0, num_gpus=256, tokens_per_gpu=16384)
    r = run_planner("pp_greedy", batch, cost, pp=8, time_limit_s=0.5)
    assert r.plan.pipeline.micro_steps
    assert validate(r.plan, batch, cost) == []
    assert r.predicted_step_time_s == pytest.approx(simulate(r.plan, batch, cost).step_time_s)
    assert r.lower_bound_s <= r.predicted_step_time_s
    c = run_planner("pp_greedy", batch, cost, pp=8, time_limit_s=0.5, micro_steps=False)
    assert not c.plan.pipeline.micro_steps
    assert r.predicted_step_time_s < c.predicted_step_time_s


def test_cli_pp_form_columns_writes_schema_3_and_best_may_write_4(tmp_path):
    from dcp_opt.cli import main

    common = ["--workload", "1d-wlbllm", "--cluster", "h200x256", "--model", "llama3-70b",
              "--tokens-per-gpu", "16384", "--pp", "8"]  # fmt: skip
    for form, version in (("columns", 3), ("best", 4)):
        out = tmp_path / f"{form}.json"
        assert main(["plan", *common, "--pp-form", form, "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["schema_version"] == version
        assert main(["simulate", str(out), *common[:-2]]) == 0
