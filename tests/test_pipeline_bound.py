"""The pipeline lower bounds (dcp_opt/pipeline/bound.py): at or below every order's makespan
(random instances), the exhaustive optimum (small ones) and every valid random plan of a
batch; CP-SAT's order is the exhaustive optimum; pp_greedy's answers carry a valid gap."""

import itertools

import numpy as np
import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.pipeline.cpsat import solve_order
from dcp_opt.solvers.pipeline.instance import Instance
from dcp_opt.solvers.pipeline.plan import bound_s
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_opt import CostModel, cluster_preset, model_preset, simulate, validate
from dcp_opt.batch import Batch, Sequence
from dcp_opt.pipeline.bound import column_lower_bound
from dcp_opt.pipeline.build import pipeline_plan
from dcp_opt.pipeline.makespan import column_makespan
from dcp_opt.pipeline.stages import stage_layout
from dcp_opt.plan import Group, MicroBatch, Pipeline


def _ms(f, b, x, order, **kw):
    pick = lambda t: [[row[k] for k in order] for row in t]  # noqa: E731
    return column_makespan(pick(f), pick(b), pick(x), **kw).makespan_s


@st.composite
def columns(draw, max_m=7):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2)) if schedule == "interleaved" else 1
    m = p * draw(st.integers(1, 2)) if schedule == "interleaved" else draw(st.integers(1, max_m))
    t = st.floats(0.01, 10.0)
    f = [[draw(t) for _ in range(m)] for _ in range(p * v)]
    b = [[draw(t) for _ in range(m)] for _ in range(p * v)]
    x = [[draw(st.floats(0.0, 1.0)) for _ in range(m)] for _ in range(p * v - 1)]
    return f, b, x, {"schedule": schedule, "num_stages": p, "virtual": v}


@settings(max_examples=150, deadline=None)
@given(columns(), st.randoms())
def test_column_bound_is_below_every_order(col, rnd):
    f, b, x, kw = col
    order = list(range(len(f[0])))
    rnd.shuffle(order)
    lb = column_lower_bound(f, b, x, num_stages=kw["num_stages"], schedule=kw["schedule"])
    assert lb <= _ms(f, b, x, order, **kw) * (1 + 1e-12)


@settings(max_examples=25, deadline=None)
@given(columns(max_m=5))
def test_column_bound_is_below_the_exhaustive_optimum(col):
    f, b, x, kw = col
    m = len(f[0])
    best = min(_ms(f, b, x, o, **kw) for o in itertools.permutations(range(m)))
    lb = column_lower_bound(f, b, x, num_stages=kw["num_stages"], schedule=kw["schedule"])
    assert lb <= best * (1 + 1e-12)


def test_1f1b_window_bound_by_hand():
    # p = 2, stage-uniform f = (1, 9), b = (2, 18), no transfers: (1) on stage 1 is
    # 1 + 30 + 2 = 33; the window of k = 1 on stage 0 spans its round trip 2 x 27 = 54, of
    # which stage 0 works 27 on k and at most f 1 + b 2 on the other: idle 24 -> (3) = 30 + 24
    f = [[1.0, 9.0]] * 2
    b = [[2.0, 18.0]] * 2
    x = [[0.0, 0.0]]
    assert column_lower_bound(f, b, x, num_stages=2) == 54.0  # (2): p max t = 2 x 27
    assert column_lower_bound(f, b, x, num_stages=2, schedule="1f1b") == 54.0
    # with three micro-batches of t = 3, 27, 3: (2) 54; (3) on stage 0: 33 + (54 - 27 - 1
    # - 2) = 57 -- the window holds one other forward and one other backward
    f = [[1.0, 9.0, 1.0]] * 2
    b = [[2.0, 18.0, 2.0]] * 2
    x = [[0.0, 0.0, 0.0]]
    assert column_lower_bound(f, b, x, num_stages=2, schedule="1f1b") == 57.0
    best = min(_ms(f, b, x, o, schedule="1f1b", num_stages=2)
               for o in itertools.permutations(range(3)))  # fmt: skip
    assert best >= 57.0


def test_column_bound_by_hand():
    # p = 2, stage-uniform, f = (1, 3), b = (2, 6), no transfers: (1) sum(t) = 12 + (p - 1)
    # (min f + min b) = 3 -> 15; (2) p max t = 2 * 9 = 18
    f = [[1.0, 3.0]] * 2
    b = [[2.0, 6.0]] * 2
    assert column_lower_bound(f, b, [[0.0, 0.0]], num_stages=2) == 18.0


@pytest.mark.parametrize("p,m", [(3, 5), (2, 6)])
def test_cpsat_order_is_the_exhaustive_optimum(p, m):
    rnd = np.random.default_rng(p * 10 + m)
    f = rnd.integers(1, 20, (p, m)).tolist()
    b = (2 * np.array(f) + rnd.integers(0, 3, (p, m))).tolist()
    x = rnd.integers(0, 3, (p - 1, m)).tolist()
    kw = {"schedule": "1f1b", "num_stages": p}
    got = solve_order(f, b, x, **kw, resolution=1, time_limit_s=60)
    best = min(_ms(f, b, x, o, **kw) for o in itertools.permutations(range(m)))
    assert got["status"] == "optimal"
    assert _ms(f, b, x, got["order"], **kw) == best == got["objective_s"]


def test_cpsat_proves_the_optimal_order_at_eight_micro_batches():
    rnd = np.random.default_rng(8)
    f = rnd.integers(1, 30, (2, 8)).tolist()
    b = (2 * np.array(f)).tolist()
    x = [[1] * 8]
    got = solve_order(f, b, x, schedule="1f1b", num_stages=2, resolution=1, time_limit_s=60)
    assert got["status"] == "optimal"
    lb = column_lower_bound(f, b, x, num_stages=2)
    assert lb <= got["objective_s"]


COST = CostModel(model_preset("llama-1b"), cluster_preset("h200x8"))


@st.composite
def random_plans(draw):
    """A valid plan by construction: short sequences (they fit anywhere), a random layout
    of columns over a stage's 4 units, random micro-batches, random orders."""
    p = draw(st.sampled_from([1, 2]))
    pipe = Pipeline((16,) if p == 1 else (8, 8), draw(st.sampled_from(["1f1b", "gpipe"])))
    lay = stage_layout(COST, pipe)
    n = lay.num_units
    lengths = draw(st.lists(st.integers(16, 4096), min_size=1, max_size=12))
    batch = Batch([Sequence(i, (x,)) for i, x in enumerate(lengths)])
    d = draw(st.sampled_from([x for x in (1, 2, 4) if x <= n]))
    ncol = n // d
    owner = [draw(st.integers(0, ncol - 1)) for _ in lengths]
    groups = []
    for c in range(ncol):
        ids = [i for i, o in enumerate(owner) if o == c]
        draw(st.randoms()).shuffle(ids)
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=4))))
        parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        mbs = tuple(MicroBatch(tuple(q), 0, (0,) * p) for q in parts if q)
        groups.append(Group(c * d, d, mbs))
    return pipeline_plan([groups], batch, lay, planner="random"), batch, lay


@settings(max_examples=60, deadline=None)
@given(random_plans())
def test_batch_bound_is_below_every_valid_plan(arg):
    plan, batch, lay = arg
    assert validate(plan, batch, COST) == []
    lb = bound_s(Instance(lay, batch))
    assert lb <= simulate(plan, batch, COST).step_time_s * (1 + 1e-12)


@pytest.mark.parametrize("planner", ["pp_greedy", "pp_cpsat"])
def test_pipeline_planners_answer_valid_plans_with_a_gap(planner):
    from dcp_opt.workloads import standard_batch

    batch = standard_batch("1d-balanced", 0, num_gpus=8, tokens_per_gpu=4096)
    opts = {"time_limit_s": 2.0} if planner == "pp_cpsat" else {}
    r = run_planner(planner, batch, COST, pp=2, **opts)
    assert validate(r.plan, batch, COST) == []
    assert r.plan.pipeline.num_stages == 2 and r.plan.num_ranks == 4
    assert 0 < r.lower_bound_s <= r.predicted_step_time_s
    assert r.predicted_step_time_s == pytest.approx(simulate(r.plan, batch, COST).step_time_s)


# Memory-tight: llama-1b, 2 stages of 8 layers on 4 units of 14 GB (9.6 GB of states and
# reserve per unit): a 4K-token sequence alone at degree 1 stores 4096 x 8 x 98 KB = 3.2 GB
# on a stage, so the windows force recompute or degree.
TIGHT = CostModel(model_preset("llama-1b"), cluster_preset("h200x8").with_(memory_bytes=14e9))


@st.composite
def tight_plans(draw, *, max_phases=1):
    """A valid plan by construction where memory binds: random columns, micro-batches and
    orders, each column's recompute the least fit_recompute finds plus random extra; an
    instance no recompute fits is discarded (assume), never counted."""
    from dcp_opt.solvers.pipeline.instance import Column
    from dcp_opt.solvers.pipeline.recompute import fit_recompute
    from hypothesis import assume

    pipe = Pipeline((8, 8), draw(st.sampled_from(["1f1b", "gpipe"])))
    lay = stage_layout(TIGHT, pipe)
    lengths = draw(st.lists(st.integers(256, 6144), min_size=1, max_size=10))
    batch = Batch([Sequence(i, (x,)) for i, x in enumerate(lengths)])
    inst = Instance(lay, batch)
    num_phases = draw(st.integers(1, max_phases))
    phase_of = [draw(st.integers(0, num_phases - 1)) for _ in lengths]
    phases = []
    for ph in range(num_phases):
        d = draw(st.sampled_from([1, 2, 4]))
        ncol = lay.num_units // d
        owner = [draw(st.integers(0, ncol - 1)) for _ in lengths]
        groups = []
        for c in range(ncol):
            ids = [i for i, o in enumerate(owner) if o == c and phase_of[i] == ph]
            draw(st.randoms()).shuffle(ids)
            cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=5))))
            parts = [
                q
                for q in (ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True))
                if q
            ]
            if not parts:
                groups.append(Group(c * d, d, ()))
                continue
            col = Column(d, c * d, parts, np.zeros((len(parts), 2), dtype=int))
            assume(fit_recompute(col, inst))
            extra = np.array([[draw(st.integers(0, 2)) for _ in range(2)] for _ in parts])
            rec = np.minimum(col.rec + extra, 8)
            mbs = tuple(MicroBatch(tuple(q), int(r.sum()), tuple(int(v) for v in r))
                        for q, r in zip(parts, rec, strict=True))  # fmt: skip
            groups.append(Group(c * d, d, mbs))
        phases.append(groups)
    return pipeline_plan(phases, batch, lay, planner="random"), batch, inst


@settings(max_examples=80, deadline=None)
@given(tight_plans())
def test_memory_bounds_are_below_every_valid_single_phase_plan(arg):
    from dcp_opt.solvers.pipeline.plan import single_phase_bound_s

    plan, batch, inst = arg
    assert validate(plan, batch, TIGHT) == []
    step = simulate(plan, batch, TIGHT).step_time_s
    assert bound_s(inst) <= single_phase_bound_s(inst) <= step * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(tight_plans(max_phases=3))
def test_the_batch_bound_is_below_every_valid_plan_of_several_phases(arg):
    plan, batch, inst = arg
    assert validate(plan, batch, TIGHT) == []
    assert bound_s(inst) <= simulate(plan, batch, TIGHT).step_time_s * (1 + 1e-12)


def test_memory_bounds_bind_where_memory_does():
    # eight 6K-token sequences on the tight cluster: alone at degree 1 a 6K sequence stores
    # 6144 x 8 x 98 KB = 4.8 GB > the 3 GB of room, so (4) charges recompute and (5) the
    # windows: both bounds exceed the memory-blind work bound (1)
    from dcp_opt.pipeline.bound import batch_bound_parts

    lay = stage_layout(TIGHT, Pipeline((8, 8), "1f1b"))
    batch = Batch([Sequence(i, (6144,)) for i in range(8)])
    parts = batch_bound_parts(lay, batch, [1, 2, 4])
    blind = stage_layout(CostModel(model_preset("llama-1b"), cluster_preset("h200x8")),
                         Pipeline((8, 8), "1f1b"))  # fmt: skip
    free = batch_bound_parts(blind, batch, [1, 2, 4])
    assert parts["bound_s"] >= free["bound_s"]
    assert parts["single_phase_bound_s"] > parts["bound_s"] * 1.01
    r = run_planner("pp_greedy", batch, TIGHT, pp=2)
    assert parts["single_phase_bound_s"] <= r.predicted_step_time_s


@settings(max_examples=10, deadline=None)
@given(columns(max_m=5))
def test_cpsat_certified_bound_is_below_the_exhaustive_optimum(col):
    # real-valued times: CP-SAT rounds each to `unit`; its certified bound takes the worst
    # rounding of a path off its dual bound
    f, b, x, kw = col
    if kw["schedule"] == "interleaved" or len(f[0]) < 2:
        return
    got = solve_order(f, b, x, schedule=kw["schedule"], num_stages=kw["num_stages"],
                      virtual=kw["virtual"], time_limit_s=5)  # fmt: skip
    best = min(_ms(f, b, x, o, **kw) for o in itertools.permutations(range(len(f[0]))))
    assert got["certified_bound_s"] <= best * (1 + 1e-12)


def test_pp_cpsat_reports_an_order_bound_at_or_below_its_step():
    from dcp_opt.workloads import standard_batch

    batch = standard_batch("1d-balanced", 0, num_gpus=8, tokens_per_gpu=4096)
    r = run_planner("pp_cpsat", batch, COST, pp=2, time_limit_s=2.0)
    assert r.stats["order_bound_s"] <= r.predicted_step_time_s * (1 + 1e-9)


def test_the_degree_coupled_window_bound_is_tighter_here_and_below_the_plan():
    # eight 6K sequences on the tight cluster: (5) prices every byte at the cheapest degree's
    # micro-batch and recompute; (6) keeps each degree's own prices, so it charges more
    from dcp_opt.pipeline import bound as B

    lay = stage_layout(TIGHT, Pipeline((8, 8), "1f1b"))
    batch = Batch([Sequence(i, (6144,)) for i in range(8)])
    degs = [1, 2, 4]
    f, b, _, ok = B.sequence_stage_times(lay, batch, degs)
    big = np.where(ok, 0.0, np.inf)[:, None, :]
    a = np.maximum(f + b - B.per_micro_batch_seconds(lay, degs)[:, :, None], 0.0) + big
    parts = B.batch_bound_parts(lay, batch, degs)
    ends = parts["head_s"] + parts["tail_s"]
    gpu_s = (np.array(degs, dtype=float)[:, None, None] * a).min(axis=0).sum(axis=1)
    pooled = B.window_bounds(lay, batch, degs, ok, ends, gpu_s)
    coupled = B.window_dual(lay, batch, degs, a, ends)
    assert (coupled > pooled * 1.005).all()
    assert np.allclose(parts["window_s"], coupled)
    r = run_planner("pp_greedy", batch, TIGHT, pp=2)
    assert coupled.max() <= r.predicted_step_time_s
