"""pp_greedy's parts (solvers/pipeline/): mixed-degree columns, the layer splits it tries,
the vectorised packing and local search; every answer a valid plan."""

import numpy as np
import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.pipeline.compose import pack, split_by_degree
from dcp_opt.solvers.pipeline.instance import Instance, make_pipeline
from dcp_opt.solvers.pipeline.order import local_search, neighbours
from dcp_opt.solvers.pipeline.plan import mixed_draft, stage_splits

from dcp_opt import CostModel, cluster_preset, model_preset, simulate, validate
from dcp_opt.pipeline.stages import stage_layout
from dcp_opt.plan import Pipeline
from dcp_opt.workloads import standard_batch

COST = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"))
BATCH = standard_batch("1d-wlbllm", 0, num_gpus=32, tokens_per_gpu=8192)


def _inst(pp=4):
    return Instance(stage_layout(COST, make_pipeline(COST, pp)), BATCH)


def test_stage_splits_are_balanced_then_even():
    # llama3-70b: 80 layers at p = 4: parameter-balanced (19, 21, 21, 19), Megatron's even
    cost = CostModel(model_preset("llama3-70b"), cluster_preset("h200x64"))
    assert stage_splits(cost, 4) == [(19, 21, 21, 19), (20, 20, 20, 20)]
    # 80 layers at p = 3: the remainder 2 goes to the middle stages
    assert stage_splits(cost, 3)[-1] == (27, 27, 26)


def test_pack_covers_every_sequence_once_within_the_token_cap():
    inst = _inst()
    mbs = pack(inst, 2, 8, 32768)
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(BATCH)))
    longest = float(inst.tokens.max())
    assert all(inst.tokens[mb].sum() <= max(32768, longest) for mb in mbs)


def test_split_by_degree_sends_long_sequences_high():
    inst = _inst()
    hi, lo = split_by_degree(inst, 8, 1, 16384.0, 4)
    assert sorted(hi + lo) == list(range(len(BATCH)))
    assert all(inst.tokens[i] <= 16384 for i in lo)  # every longer one went high
    assert set(np.flatnonzero(inst.tokens > 16384).tolist()) <= set(hi)


def test_mixed_draft_is_a_valid_plan():
    from dcp_opt.solvers.pipeline.plan import finish_pipeline

    inst = _inst()  # 8 units a stage: a column of 4 for the long ones, of 1 or 2 for the rest
    got = mixed_draft(inst, 4, 2, 4, 8, 131072.0)
    assert got is not None
    degrees = sorted({c.degree for _, c in got[1]})
    assert degrees == [2, 4]
    r = finish_pipeline(inst, got[1], planner="pp_greedy", started=0.0)
    assert validate(r.plan, BATCH, COST) == []
    assert r.predicted_step_time_s == pytest.approx(simulate(r.plan, BATCH, COST).step_time_s)
    assert r.lower_bound_s <= r.stats["single_phase_bound_s"] <= r.predicted_step_time_s


def test_local_search_never_worsens_and_moves_are_permutations():
    order = np.arange(5)
    cand = neighbours(order)
    assert len(cand) == 10 + 5 * 5 - 5 - 4  # swaps + moves (no-op moves left out)
    assert all(sorted(c) == list(range(5)) for c in cand.tolist())
    inst = _inst()
    from dcp_opt.solvers.pipeline.compose import columns

    col = columns(inst, 8, pack(inst, 8, 6, 131072))[0]
    times = col.times(inst)
    start = col.makespan(inst)
    got, v = local_search(col, inst, times, range(len(col.mbs)), start, float("inf"))
    assert v <= start
    assert v == pytest.approx(col.makespan(inst, got))


@pytest.mark.parametrize("pp", [2, 4])
def test_greedy_answers_valid_plans_above_the_bounds(pp):
    # columns only: the single-phase bound (5), (6) holds for them
    r = run_planner("pp_greedy", BATCH, COST, pp=pp, time_limit_s=1.0, micro_steps=False)
    assert validate(r.plan, BATCH, COST) == []
    assert not r.plan.pipeline.micro_steps
    assert r.lower_bound_s <= r.stats["single_phase_bound_s"] <= r.predicted_step_time_s
    assert r.plan.pipeline.stage_layers in stage_splits(COST, pp)
    both = run_planner("pp_greedy", BATCH, COST, pp=pp, time_limit_s=1.0)
    assert validate(both.plan, BATCH, COST) == []
    assert both.lower_bound_s <= both.predicted_step_time_s


def test_split_summaries_from_prefix_sums_equal_the_direct_ones():
    from dcp_opt.solvers.pipeline.window import split_summary, summary

    inst = _inst()
    order = np.argsort(-inst.tokens, kind="stable")
    for d in (1, 2, 8):
        for j in (1, 5, len(order) // 2, len(order) - 1):
            for side, ids in ((0, order[:j]), (1, order[j:])):
                got, want = split_summary(inst, d, j, side), summary(inst, d, ids)
                assert np.allclose(got[:3], want[:3], rtol=1e-12)
                assert np.allclose(got[3], want[3], rtol=1e-12)


def test_the_collector_is_paused_while_planning_and_restored_after():
    import gc

    from dcp_opt.solvers.pipeline import plan as P

    seen = []
    orig = P.search

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return orig(*a, **k)

    P.search = spy
    try:
        for was in (True, False):
            (gc.enable if was else gc.disable)()
            run_planner("pp_greedy", BATCH, COST, pp=2)
            assert gc.isenabled() == was
    finally:
        P.search = orig
        gc.enable()
    assert seen == [False, False]


def test_a_fixed_layer_split_is_kept_and_a_bad_one_named():
    from dcp_opt.errors import DcpOptError

    for layers in ((8, 8, 8, 8), (6, 10, 10, 6)):  # llama-7b: 32 layers
        for name in ("pp_greedy", "pp_cpsat"):
            opts = {"time_limit_s": 1.0} if name == "pp_cpsat" else {}
            r = run_planner(name, BATCH, COST, pp=4, stage_layers=layers, **opts)
            assert r.plan.pipeline.stage_layers == layers
            assert validate(r.plan, BATCH, COST) == []
    with pytest.raises(DcpOptError, match="stage_layers: \\[8, 8, 8\\]; allowed: 4 integers"):
        run_planner("pp_greedy", BATCH, COST, pp=4, stage_layers=(8, 8, 8))
    with pytest.raises(DcpOptError, match="summing to the model's 32 layers"):
        run_planner("pp_greedy", BATCH, COST, pp=4, stage_layers=(8, 8, 8, 9))


def test_cli_pp_layers(tmp_path, capsys):
    import json

    from dcp_opt.cli import main

    common = ["--workload", "1d-wlbllm", "--cluster", "h200x32", "--model", "llama-7b",
              "--tokens-per-gpu", "8192", "--pp", "4"]  # fmt: skip
    out = tmp_path / "p.json"
    assert main(["plan", *common, "--pp-layers", "7,9,9,7", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["pipeline"]["stage_layers"] == [7, 9, 9, 7]
    assert main(["plan", *common, "--pp-layers", "7,x"]) == 2
    assert "pp-layers: '7,x'" in capsys.readouterr().err


def test_local_search_starts_no_chunk_it_cannot_finish_by_the_limit(monkeypatch):
    """A limit already passed: the probe (order.PROBE rows) is priced to time a row, and no
    chunk after it; the answer is still a permutation no worse than the start."""
    import dcp_opt.solvers.pipeline.order as order_mod
    from dcp_opt.solvers.pipeline.compose import columns

    inst = _inst()
    col = columns(inst, 8, pack(inst, 8, 24, 131072))[0]
    times, start = col.times(inst), col.makespan(inst)
    priced = []
    real = order_mod._price
    monkeypatch.setattr(order_mod, "_price", lambda i, t, o: priced.append(len(o)) or real(i, t, o))
    got, v = local_search(col, inst, times, range(len(col.mbs)), start, float("inf"), limit=0.0)
    assert priced == [order_mod.PROBE]
    assert sorted(got) == list(range(len(col.mbs))) and v <= start
    priced.clear()  # no limit: it prices on until no neighbour improves
    local_search(col, inst, times, range(len(col.mbs)), start, float("inf"))
    assert len(priced) > 1


def test_past_the_deadline_a_form_is_drafted_only_within_the_margin():
    """search: the form with the lower estimate first; past the deadline the other form's
    first draft is made only if its best estimate is within FORM_MARGIN of the best value,
    and with the limit at which it is given up."""
    from types import SimpleNamespace

    from dcp_opt.solvers.pipeline.plan import FORM_MARGIN, search

    def inst(micro_steps):
        return SimpleNamespace(
            layout=SimpleNamespace(pipeline=Pipeline((2, 2), micro_steps=micro_steps))
        )

    made = []

    limits = {}

    def thunk(name, value):
        def make(limit=None):
            made.append(name)
            limits[name] = limit
            return value, name

        return make

    cols, ms = inst(False), inst(True)
    for other, drafted in ((10.0 * (1 + FORM_MARGIN) * 1.01, False), (10.5, True)):
        made.clear()
        scored = [(9.0, ms, thunk("steps", 10.0)), (9.5, ms, thunk("steps2", 9.0)),
                  (other, cols, thunk("cols", 8.0))]  # fmt: skip
        best = search(scored, deadline=0.0, limit=1.5)  # already past
        assert made[0] == "steps" and limits["steps"] is None  # the first draft runs whole
        assert ("cols" in made) == drafted
        assert not drafted or limits["cols"] == 1.5  # a late draft is given up at the limit
        assert best[1] == ("cols" if drafted else "steps")


def test_a_column_draft_is_given_up_past_its_limit_and_whole_without_one():
    from dcp_opt.solvers.pipeline.compose import columns
    from dcp_opt.solvers.pipeline.plan import priced

    inst = _inst()
    cols = columns(inst, 8, pack(inst, 8, 24, 131072))
    assert priced(inst, cols, limit=0.0) is None  # the CPU clock is past 0 s
    worst, out = priced(inst, cols)
    assert len(out) == len(cols) and worst == max(v for v, _ in out)
