import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from dcp_opt import (
    Batch,
    Cluster,
    CostModel,
    DcpOptError,
    Group,
    InfeasibleError,
    MicroBatch,
    ModelSpec,
    Plan,
    PlanFormatError,
    Sequence,
    cluster_preset,
    load_batch,
    lower_bound,
    make_plan,
    model_preset,
    simulate,
    standard_batch,
    validate,
)
from dcp_opt.cost import plan_fingerprint
from dcp_opt.model import ulysses_kv_heads
from dcp_opt.validate import CODES
from tests.toy import toy_cost


def test_import_pulls_in_neither_torch_nor_ortools():
    code = (
        "import sys, dcp_opt, dcp_opt.solvers; "
        "print('torch' in sys.modules, 'ortools' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_runtime_does_not_import_solver_internals():
    """runtime/ may use the public `dcp_opt.solvers` entry (run_planner), never a submodule."""
    import ast
    import pathlib

    public = {"run_planner", "get_planner", "available_planners", "PLANNERS"}
    for path in pathlib.Path("runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                assert not any(n.startswith("dcp_opt.solvers.") for n in names), path
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("dcp_opt.solvers."), (path, node.module)
                if node.module == "dcp_opt.solvers":
                    assert {a.name for a in node.names} <= public, (path, node.lineno)


def test_allowed_degrees_and_placements():
    c = cluster_preset("h200x24")
    assert c.num_gpus == 24
    assert c.allowed_degrees == (1, 2, 4, 8, 16, 24)
    assert c.placements(8) == (0, 8, 16)
    assert c.placements(16) == (0,)  # 16 at rank 8 is not aligned
    assert c.placements(24) == (0,)
    with pytest.raises(DcpOptError, match="degree: 3 not allowed"):
        c.placements(3)


def test_unknown_presets_name_the_field():
    with pytest.raises(DcpOptError, match="cluster: unknown preset 'nope'"):
        cluster_preset("nope")
    with pytest.raises(DcpOptError, match="model: unknown preset"):
        model_preset("gpt-17")


def test_toy_time_and_memory_arithmetic():
    cm = toy_cost()
    s = Sequence(0, (8,))
    # 8 tokens at degree 2, no recompute: 6*8/2 + 0.5 = 24.5 s
    assert cm.microbatch_time([s], 2, 0).total_s == pytest.approx(24.5)
    # with 1 recomputed layer: + 8/2 = 28.5 s
    assert cm.microbatch_time([s], 2, 1).total_s == pytest.approx(28.5)
    # memory 9 + 4*(30 - 8r): r=0 -> 129, r=1 -> 97, r=2 -> 65
    assert [float(cm.memory(8, 2, r)) for r in (0, 1, 2)] == [129.0, 97.0, 65.0]
    # capacity 100 -> fewest recomputed layers is 1 at degree 2; at degree 4: 9+2*30=69 -> 0
    assert int(cm.min_recompute(8, 2)) == 1
    assert int(cm.min_recompute(8, 4)) == 0
    # 8 tokens at degree 1: 9 + 8*14 = 121 > 100 even with r=2 -> infeasible
    assert int(cm.min_recompute(8, 1)) == -1


def test_packing_adds_features():
    cm = toy_cost()
    a, b = Sequence(0, (3,)), Sequence(1, (5,))
    # 8 tokens at degree 4: 6*8/4 + 0.5 = 12.5, one overhead for both sequences
    assert cm.microbatch_time([a, b], 4).total_s == pytest.approx(12.5)


def test_simulate_tiny_plan():
    cm = toy_cost()
    batch = Batch.from_lengths([8, 2, 2])
    # group A: ranks 0-1, seq 0 with r=1: 28.5 s. group B: rank 2, seqs 1 and 2 one after the
    # other: (6*2 + 0.5) * 2 = 25 s. rank 3 idle. finish 28.5; idle = 0+0+3.5+28.5 = 32
    plan = make_plan(
        [[Group(0, 2, (MicroBatch((0,), 1),)), Group(2, 1, (MicroBatch((1,)), MicroBatch((2,))))]],
        batch,
        cm,
        planner="hand",
    )
    assert validate(plan, batch, cm) == []
    sim = simulate(plan, batch, cm)
    assert sim.step_time_s == pytest.approx(28.5)
    assert sim.idle_s.tolist() == pytest.approx([0, 0, 3.5, 28.5])
    assert sim.imbalance == pytest.approx(32 / (4 * 28.5))
    assert sim.peak_memory_bytes[0] == pytest.approx(97.0)


def test_phases_start_when_members_are_free():
    cm = toy_cost()
    batch = Batch.from_lengths([2, 3, 1, 2, 4])
    # Phase 0: rank 0 runs 2 tokens (12.5 s), rank 1 3 tokens (18.5 s), rank 2 1 token
    # (6.5 s), rank 3 idle. Phase 1: ranks 0..1 start at 18.5 (the later member is not the
    # first one) and run 2 tokens at degree 2 (6.5 s) -> 25; ranks 2..3 start at 6.5 (free
    # long before the others: no barrier between phases) and run 4 tokens at degree 2
    # (12.5 s) -> 19. Step 25; a first-member clock gives 19, a barrier 31.
    plan = make_plan(
        [
            [Group(0, 1, (MicroBatch((0,)),)), Group(1, 1, (MicroBatch((1,)),)),
             Group(2, 1, (MicroBatch((2,)),))],
            [Group(0, 2, (MicroBatch((3,)),)), Group(2, 2, (MicroBatch((4,)),))],
        ],
        batch,
        cm,
        planner="hand",
    )  # fmt: skip
    assert validate(plan, batch, cm) == []
    sim = simulate(plan, batch, cm)
    starts = {(e.phase, e.start_rank): (e.start_s, e.end_s) for e in sim.events}
    assert starts == {  # halves and integers: exact in binary floating point
        (0, 0): (0, 12.5), (0, 1): (0, 18.5), (0, 2): (0, 6.5), (1, 0): (18.5, 25.0),
        (1, 2): (6.5, 19.0),
    }  # fmt: skip
    assert sim.step_time_s == pytest.approx(25.0)
    assert sim.busy_s.tolist() == pytest.approx([19.0, 25.0, 19.0, 12.5])
    assert sim.idle_s.tolist() == pytest.approx([6.0, 0.0, 6.0, 12.5])


def _plan_with(groups, batch, cm, **kw):
    p = make_plan([groups], batch, cm, planner="hand")
    if kw:
        d = p.to_dict()
        d.update(kw)
        p = Plan.from_dict(d)
    return p


@pytest.mark.parametrize(
    "code, groups, extra",
    [
        ("BAD_DEGREE", [Group(0, 3, (MicroBatch((0, 1)),)), Group(3, 1)], {}),
        ("MISALIGNED", [Group(0, 1), Group(1, 2, (MicroBatch((0, 1)),)), Group(3, 1)], {}),
        ("OUT_OF_RANGE", [Group(0, 2), Group(2, 4, (MicroBatch((0, 1)),))], {}),
        ("RANK_OVERLAP", [Group(0, 2, (MicroBatch((0,)),)), Group(0, 1, (MicroBatch((1,)),))], {}),
        (
            "EMPTY_MICRO_BATCH",
            [
                Group(
                    0,
                    2,
                    (
                        MicroBatch((0, 1)),
                        MicroBatch(()),
                    ),
                )
            ],
            {},
        ),
        ("UNKNOWN_SEQUENCE", [Group(0, 2, (MicroBatch((0, 1, 7)),))], {}),
        (
            "DUPLICATE_SEQUENCE",
            [Group(0, 2, (MicroBatch((0, 1)),)), Group(2, 1, (MicroBatch((1,)),))],
            {},
        ),
        ("MISSING_SEQUENCE", [Group(0, 2, (MicroBatch((0,)),))], {}),
        ("BAD_RECOMPUTE", [Group(0, 2, (MicroBatch((0, 1), 3),))], {}),
        ("OUT_OF_MEMORY", [Group(0, 1, (MicroBatch((0, 1)),))], {}),
        ("FINGERPRINT_MISMATCH", [Group(0, 2, (MicroBatch((0, 1)),))], {"fingerprint": "x"}),
        ("BAD_NORMALIZER", [Group(0, 2, (MicroBatch((0, 1)),))], {"loss_normalizer": 5.0}),
        ("WRONG_NUM_RANKS", [Group(0, 2, (MicroBatch((0, 1)),))], {"num_ranks": 8}),
    ],
)
def test_each_violation_code(code, groups, extra):
    cm = toy_cost()
    batch = Batch.from_lengths([2, 2])  # 4 tokens; at degree 1: 9 + 4*30 = 129 > 100
    plan = _plan_with(groups, batch, cm, **extra)
    codes = {v.code for v in validate(plan, batch, cm)}
    assert code in codes, codes
    assert code in CODES


def test_uncovered_and_straddle_and_no_phase():
    cm = toy_cost(num_nodes=2, gpus_per_node=2)
    batch = Batch.from_lengths([1])
    plan = Plan((), 4, 1.0, "tokens", "")
    assert "NO_PHASES" in {v.code for v in validate(plan, batch, cm)}
    from dcp_opt.plan import Phase

    plan = Plan((Phase((Group(0, 1, (MicroBatch((0,)),)),)),), 4, 1.0)
    assert "RANK_UNCOVERED" in {v.code for v in validate(plan, batch, cm)}
    # a degree-2 group at ranks 1..2 both misaligns and straddles nodes 0 and 1; degree 2 is
    # allowed on 2-GPU nodes
    plan = Plan((Phase((Group(0, 1), Group(1, 2, (MicroBatch((0,)),)), Group(3, 1))),), 4, 1.0)
    codes = {v.code for v in validate(plan, batch, cm, check_fingerprint=False)}
    assert {"NODE_STRADDLE", "MISALIGNED"} <= codes


def test_plan_json_round_trip(tmp_path):
    cm = toy_cost()
    batch = Batch.from_lengths([8, 2, 2])
    plan = make_plan(
        [[Group(0, 2, (MicroBatch((0,), 1),)), Group(2, 1, (MicroBatch((1, 2)),))]],
        batch,
        cm,
        planner="hand",
        predicted_step_time_s=1.5,
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(schema_version=99), "schema_version: 99 not supported"),
        (lambda d: d.pop("phases"), "plan.phases: missing"),
        (lambda d: d["phases"][0]["groups"][0].update(degree="2"), "degree: expected int"),
        (lambda d: d.update(normalizer_kind="bytes"), "normalizer_kind"),
    ],
)
def test_bad_plan_json_names_the_field(mutate, match):
    cm = toy_cost()
    batch = Batch.from_lengths([8])
    d = make_plan([[Group(0, 2, (MicroBatch((0,), 1),))]], batch, cm, planner="h").to_dict()
    mutate(d)
    with pytest.raises(PlanFormatError, match=match):
        Plan.from_json(json.dumps(d))
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.from_json("{")


def test_lower_bound_tiny():
    cm = toy_cost()
    batch = Batch.from_lengths([8, 2])
    # seq 0 (8 tokens): fits at d=2 (r=1): 28.5 s, or d=4 (r=0): 12.5 s. work less overhead:
    # d=2: 2*28 = 56, d=4: 4*12 = 48 -> 48. seq 1 (2 tokens) at d=1: 9+2*30 = 69 fits, 12 s of
    # work. work bound = (48+12)/4 + 0.5 = 15.5; longest = 12.5 -> bound 15.5
    lb = lower_bound(batch, cm)
    assert lb.work_s == pytest.approx(15.5)
    assert lb.longest_s == pytest.approx(12.5)
    assert lb.value_s == pytest.approx(15.5)


def test_infeasible_sequence_named():
    cm = toy_cost()
    batch = Batch.from_lengths([2, 100])
    with pytest.raises(InfeasibleError, match="sequence 1 .* cannot fit: needs .* capacity"):
        lower_bound(batch, cm)


def test_model_states_too_big_are_named_not_a_sequence():
    # llama-70b on h100x64 under zero3: 2 + 4 B per parameter held by every rank (141 + 282
    # GB) plus 12 / 64 B of optimizer states; capacity 0.9 x 80 = 72 GB. The error names the
    # states and the capacity, not the first sequence (issue 26: it blamed sequence 0).
    spec = ModelSpec(
        "l70", "1d", 80, 8192, 64, 28672, vocab_size=128256, num_kv_heads=8, gated_mlp=True
    )
    cost = CostModel(spec, cluster_preset("h100x64"), optimizer_sharding="zero3")
    with pytest.raises(InfeasibleError, match="model states do not fit") as err:
        lower_bound(Batch.from_lengths([100, 9000]), cost)
    text = str(err.value)
    assert "parameters 141.1 GB, gradients 282.2 GB, optimizer states 13.2 GB" in text
    assert "capacity 72.0 GB" in text and err.value.sequence_id is None
    small = CostModel(
        model_preset("llama-7b"), cluster_preset("h100x64"), optimizer_sharding="zero3"
    )
    small.check_states_fit()  # 7B fits: no error


def test_bad_batches():
    with pytest.raises(DcpOptError, match="batch: is empty"):
        Batch(())
    with pytest.raises(DcpOptError, match=r"length\[1\]: must be an integer >= 1, got -3"):
        Batch.from_lengths([4, -3])


def test_load_batch_formats(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("# lengths\n100\n2000\n\n")
    assert [s.shape for s in load_batch(p).sequences] == [(100,), (2000,)]
    p.write_text("30,30,54\n1,9,16\n")
    assert load_batch(p).kind == "2d"
    p.write_text("100\nabc\n")
    with pytest.raises(DcpOptError, match="l.txt:2: expected integers"):
        load_batch(p)
    p.write_text("0\n")
    with pytest.raises(DcpOptError, match="l.txt:1"):
        load_batch(p)
    j = tmp_path / "b.json"
    j.write_text("[[1, 9, 16], [30, 30, 54]]")
    assert len(load_batch(j)) == 2
    with pytest.raises(DcpOptError, match="cannot read"):
        load_batch(tmp_path / "missing.txt")


def test_standard_workloads_reproducible():
    a = standard_batch("2d-short", 3)
    b = standard_batch("2d-short", 3)
    assert a == b
    assert a.num_tokens >= 32 * 65536
    long = standard_batch("1d-long", 0)
    assert all(128 <= s.num_tokens <= 131072 for s in long.sequences)
    with pytest.raises(DcpOptError, match="workload: '4d-short' not allowed"):
        standard_batch("4d-short", 0)  # (3d-short is a workload since issue 27)


def test_presets_are_sane():
    cm = CostModel(model_preset("llama-7b"), cluster_preset("h200x32"))
    # 7B with zero1 over 32: 6.74e9 * (2 + 4 + 12/32) = 42.97 GB
    assert cm.model_state_bytes() == pytest.approx(6.74e9 * 6.375)
    # longer sequences take more time per token; more degree takes less time
    t = [cm.microbatch_time([Sequence(0, (n,))], 8).total_s for n in (4096, 65536)]
    assert t[1] / 65536 > t[0] / 4096
    assert int(cm.min_recompute(131072, 1)) > int(cm.min_recompute(131072, 8)) >= 0
    assert int(cm.min_recompute(400_000, 1)) == -1
    assert np.all(cm.min_recompute(np.array([1024, 8192]), 8) == 0)


def test_grouped_query_attention_sends_only_the_kv_heads_members_need():
    # Llama 3 8B: 32 query heads share 8 kv heads (groups of 4 consecutive query heads).
    m = model_preset("llama3-8b")
    assert [ulysses_kv_heads(32, 8, d) for d in (1, 2, 4, 8, 16, 32, 3)] == [8, 8, 8, 8, 16, 32, 32]
    # q and output full, k and v at 8/32: (2 + 2/4) / 4 of multi-head attention's bytes
    assert m.a2a_volume_share(8) == pytest.approx(0.625)
    assert m.a2a_volume_share(16) == pytest.approx(0.75)
    mha = replace(m, num_kv_heads=None)
    assert mha.a2a_volume_share(8) == 1.0
    c = cluster_preset("h200x32")
    gqa_cost, mha_cost = CostModel(m, c), CostModel(mha, c)
    assert np.allclose(
        gqa_cost.a2a_bytes_per_token(np.array([[2], [16], [32]])) / 4 / 4096 / 2,
        [[0.625], [0.75], [1.0]],
    )
    t = [cm.comm_time_per_layer(65536, 8, False) for cm in (gqa_cost, mha_cost)]
    assert t[0] < t[1]
    # k and v projections are 4096 x 1024: fewer FLOPs and saved bytes than multi-head
    assert m.params_per_block == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert gqa_cost.coeffs.act_bytes_per_token_layer < mha_cost.coeffs.act_bytes_per_token_layer
    # the documents of multi-head models are unchanged (no null field), GQA round-trips
    assert "num_kv_heads" not in mha.to_dict()
    assert ModelSpec.from_dict(m.to_dict()) == m
    for bad in (3, 0, 64, True, 2.0):
        with pytest.raises(DcpOptError, match="model.num_kv_heads"):
            replace(m, num_kv_heads=bad)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("name", 3, "cluster.name: must be a string"),
        ("num_nodes", "2", "cluster.num_nodes: must be an integer >= 1"),
        ("memory_bytes", "80GB", "cluster.memory_bytes: must be a finite number > 0"),
        ("peak_flops", float("nan"), "cluster.peak_flops: must be a finite number > 0"),
        (
            "inter_node_latency_s",
            -1e-6,
            "cluster.inter_node_latency_s: must be a finite number >= 0",
        ),
        ("intra_node_latency_s", 10**400, "cluster.intra_node_latency_s: must be a finite number"),
        ("speed_factors", "fast", "cluster.speed_factors: must hold 8 positive numbers"),
        ("degrees", [1.5], "cluster.degrees: must be a list of integers or null"),
    ],
)
def test_cluster_fields_are_checked_by_type(field, value, match):
    # A cluster file (CLI --cluster) goes through from_dict: a wrong type names its field.
    d = cluster_preset("h200x8").to_dict()
    d[field] = value
    with pytest.raises(DcpOptError, match=match):
        Cluster.from_dict(d)
    # lists become tuples, so a cluster stays hashable
    ok = cluster_preset("h200x8").to_dict() | {"speed_factors": [1.0] * 8}
    assert hash(Cluster.from_dict(ok)) == hash(Cluster(**ok))


def test_mixed_cluster_validation():
    with pytest.raises(DcpOptError, match="cluster.speed_factors: must hold 4"):
        Cluster("x", 1, 4, 1e9, 1e12, 1e9, 1e9, speed_factors=(1.0, 1.0))


# ---- the cost model's memo ---------------------------------------------------------------
def test_memo_is_bounded_over_a_long_run_and_never_changes_a_result():
    """One CostModel plans a new batch every step of a training run: its memo (tables,
    bounds, fingerprints) keeps the last few batches, not all of them, and an evicted entry
    is recomputed to the same value."""
    from dcp_opt.cost import MemoCache

    cost = CostModel(model_preset("llama-7b"), cluster_preset("h200x8"))

    def figures(batch):
        plan = make_plan([[Group(0, 8, (MicroBatch((0, 1)),))]], batch, cost, planner="hand")
        return lower_bound(batch, cost).value_s, plan.fingerprint, validate(plan, batch, cost)

    first = Batch.from_lengths([4096, 1024])
    before = figures(first)
    assert before[2] == [] and plan_fingerprint(first, cost) == before[1]
    for step in range(3 * MemoCache.MAX_ENTRIES):
        figures(Batch.from_lengths([1000 + step, 3 + step % 7]))
    assert len(cost._cache) <= MemoCache.MAX_ENTRIES
    assert ("lower_bound", first.fingerprint()) not in cost._cache  # evicted ...
    assert figures(first) == before  # ... and recomputed to the same figures


def test_batch_fingerprint_names_ids_and_shapes():
    a = Batch.from_lengths([5, 7])
    assert a.fingerprint() == Batch.from_lengths([5, 7]).fingerprint()
    assert a.fingerprint() != Batch.from_lengths([7, 5]).fingerprint()
    assert a.fingerprint() != Batch((Sequence(1, (5,)), Sequence(0, (7,)))).fingerprint()
    assert Batch.from_shapes([(1, 2, 3)]).fingerprint() != Batch.from_lengths([1, 2]).fingerprint()
    huge = Batch((Sequence(2**70, (5,)),))  # ids beyond int64 hash through JSON
    assert huge.fingerprint() != Batch((Sequence(2**70 + 1, (5,)),)).fingerprint()


# ---- the cost model over a column of degrees -----------------------------------------------
def _mixed_cost(kind: str) -> CostModel:
    """Two nodes of 4 GPUs with unequal memory and speed: groups of 8 span nodes."""
    cluster = cluster_preset("h200x8").with_(
        num_nodes=2,
        gpus_per_node=4,
        speed_factors=(1.0, 0.7) * 4,
        memory_per_rank=(141e9, 80e9) * 4,
    )
    return CostModel(model_preset("llama-7b" if kind == "1d" else "opensora-stdit3-xl"), cluster)


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_degree_column_equals_one_call_per_degree_bit_for_bit(kind):
    """time_parts, min_recompute and memory over a column of degrees are the per-degree
    calls stacked, to the last bit (planners compare these times for ties)."""
    cost = _mixed_cost(kind)
    batch = standard_batch(f"{kind}-balanced", 3, num_gpus=8)
    feats = cost.batch_features(batch)
    tokens = feats[:, -2]
    degrees = np.array(cost.cluster.allowed_degrees)
    rng = np.random.default_rng(0)
    rec = rng.integers(0, cost.model.num_layers + 1, (len(degrees), len(feats)))
    spans = np.array([d > 2 for d in degrees])  # forced, so both branches meet in one call
    speed = np.linspace(0.5, 1.0, len(degrees))
    fixed = cost.fixed_bytes()
    room = np.geomspace(1e-4, 1.0, len(degrees))  # little room at small degrees: rows misfit
    caps = fixed + room * (np.array([cost.capacity(0, d) for d in degrees]) - fixed)
    col = degrees[:, None]
    parts = cost.time_parts(feats, col, rec, spans_nodes=spans[:, None], speed=speed[:, None])
    r_min = cost.min_recompute(tokens, col, caps[:, None])
    assert (r_min == -1).any() and (r_min >= 0).any()
    for j, d in enumerate(degrees):
        one = cost.time_parts(feats, int(d), rec[j], spans_nodes=bool(spans[j]), speed=speed[j])
        for k in range(3):
            assert np.array_equal(parts[k][j], one[k]), (d, k)
        assert np.array_equal(r_min[j], cost.min_recompute(tokens, int(d), caps[j]))
    assert np.array_equal(
        cost.memory(tokens, col, rec),
        [cost.memory(tokens, int(d), rec[j]) for j, d in enumerate(degrees)],
    )


def test_a_subclass_that_reprices_per_degree_gets_one_call_per_degree():
    """A subclass of CostModel that overrides time_parts for one degree at a time (as
    RecalibratedCostModel does) gets scalar degrees from the table and the simulator, and the
    same figures as the vectorised path where it changes nothing."""
    from dcp_opt.table import seq_table

    seen = []

    class PerDegree(CostModel):
        def time_parts(self, feats, d: int, recompute_layers, **kw):
            seen.append(int(d))  # fails on a column of degrees
            return super().time_parts(feats, d, recompute_layers, **kw)

    base = _mixed_cost("1d")
    sub = PerDegree(base.model, base.cluster)
    assert base.takes_degree_vectors and not sub.takes_degree_vectors
    batch = standard_batch("1d-balanced", 1, num_gpus=8)
    a, b = seq_table(batch, base), seq_table(batch, sub)
    for name in ("r_min", "time", "time_no_overhead", "time_marginal", "const"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert sorted(seen) == list(base.cluster.allowed_degrees)
    groups = [Group(0, 8, (MicroBatch((0, 1)),)), Group(0, 4, (MicroBatch((2,)),))]
    phases = [[groups[0]], [groups[1], Group(4, 2, (MicroBatch((3,)),)), Group(6, 1, ())]]
    plan = make_plan(phases, batch, base, planner="hand")
    sa, sb = simulate(plan, batch, base), simulate(plan, batch, sub)
    assert sa.events == sb.events and sa.step_time_s == sb.step_time_s
    assert np.array_equal(sa.peak_memory_bytes, sb.peak_memory_bytes)
