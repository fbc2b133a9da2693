"""The executor and the tasks in one process: ranks are threads of torch's threaded process
group (tests/local_world.py), so the runtime's code runs where mutmut's fork sees it (the
fast stage of scripts/mutation.py) and the file stays cheap in CI. The gloo worker tests
(test_runtime_equiv, test_runtime_faults) remain the check across real processes.

The reference of every gradient check is the objective from its definition
(tests/reference.py: per-token losses summed / global token count, or per-sample means /
sample count; per-token losses written in tests/test_runtime_equiv.py), never the runtime's
weighting or the plan's normaliser. Expected bucket layouts, report rows and messages are
derived by hand from the documented contract (executor docstrings, docs/architecture.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dcp_opt.runtime import LMTask, SPState, execute_step, parallelize
from dcp_opt.runtime.executor import MicroBatchOutOfMemoryError
from dcp_opt.runtime.testing import max_relative_error

from dcp_opt import Batch, make_plan, validate
from tests.local_world import RankFailure, grads, run_world
from tests.test_runtime_equiv import (
    TASKS,
    TOL,
    _group,
    cost_for,
    make_data,
    make_model,
    reference,
)

SEED, STEP = 3, 5
# Hand-built plans: SP groups of degree 2 and 4 (a group not at rank 0 too), several and
# packed micro-batches, ranks idle in one phase and busy in the next, recompute 0..L, a cp
# group (1D), videos whose frames do not divide the degree (2D).
CASES = {
    ("1d", 2): (
        [5, 9, 3, 7],
        [[((0, 2), [((1,), 2), ((0, 3), 0)])], [((0, 1), []), ((1, 1), [((2,), 3)])]],
        "tokens",
    ),
    ("1d", 4): (
        [5, 9, 3, 7, 4, 6],
        [
            [((0, 2), [((1,), 2), ((0, 3), 0)]), ((2, 1), [((2,), 1)]), ((3, 1), [])],
            [((0, 1), []), ((1, 1), [((4,), 3)]), ((2, 2), [((5,), 1)], "cp")],
        ],
        "samples",
    ),
    ("2d", 2): (
        [(5, 2, 2), (3, 1, 2), (2, 3, 1)],
        [[((0, 2), [((0,), 1), ((1,), 0)])], [((0, 1), []), ((1, 1), [((2,), 2)])]],
        "samples",
    ),
    ("2d", 4): (
        [(5, 2, 2), (3, 1, 2), (2, 3, 1), (1, 2, 2)],
        [
            [((0, 4), [((0,), 2)])],
            [((0, 2), [((1, 2), 1)]), ((2, 1), []), ((3, 1), [((3,), 0)])],
        ],
        "tokens",
    ),
}


def case(kind: str, world: int, normalizer_kind: str | None = None):
    shapes, phases, default_kind = CASES[(kind, world)]
    batch = Batch.from_lengths(shapes) if kind == "1d" else Batch.from_shapes(shapes)
    cost = cost_for(kind, world).with_(sp_kinds=("ulysses", "cp") if kind == "1d" else ("ulysses",))
    groups = [[_group(*g[0], g[1]) if len(g) == 2 else _kind(g) for g in ph] for ph in phases]
    kind_of_loss = normalizer_kind or default_kind
    # a predicted time, as planners give: the report must carry it through unchanged
    plan = make_plan(
        groups, batch, cost, planner="hand", normalizer_kind=kind_of_loss,
        predicted_step_time_s=0.25 * world,
    )  # fmt: skip
    assert validate(plan, batch, cost) == []
    return plan, batch


def _kind(g):
    from dataclasses import replace

    return replace(_group(*g[0], g[1]), kind=g[2])


def counted_models(kind: str, world: int):
    """One model per rank (built here: the global RNG is not thread-safe) whose layers count
    their forward calls, recomputation included (the counter sits inside the checkpoint)."""
    out = []
    for _ in range(world):
        model = make_model(kind, SEED)
        model.calls = [0] * len(model.layers)
        for i, layer in enumerate(model.layers):
            layer.forward = _counting(layer.forward, model.calls, i)
        out.append(model)
    return out


def _counting(inner, calls, i):
    def forward(*args, **kwargs):
        calls[i] += 1
        return inner(*args, **kwargs)

    return forward


def job_step(pool, kind, plan, batch, models, data_mode="mapping"):
    model, state = models[pool.rank], SPState()
    parallelize(model, state)
    data, asked = make_data(kind, batch, SEED), []

    def read(sid):
        asked.append(sid)
        return data[sid]

    source = read if data_mode == "callable" else data
    report = execute_step(plan, TASKS[kind], model, source, pool=pool, state=state, step=STEP)
    left = (state.sp.degree, state.recompute_layers, state.kind)
    return report, grads(model), model.calls, left, asked


def expected_rows(plan, rank):
    return [
        (p, g.start_rank, g.degree, k, mb.sequence_ids, mb.recompute_layers)
        for p, phase in enumerate(plan.phases)
        for g in phase.groups
        if rank in g.ranks
        for k, mb in enumerate(g.micro_batches)
    ]


def check_case(kind: str, world: int, normalizer_kind=None, data_mode="mapping"):
    plan, batch = case(kind, world, normalizer_kind)
    models = counted_models(kind, world)
    results = run_world(world, job_step, kind, plan, batch, models, data_mode)
    want_loss, want_grads = reference(kind, plan.normalizer_kind, batch, SEED, STEP)
    num_layers = len(models[0].layers)
    for rank, (report, got, calls, left, asked) in enumerate(results):
        assert abs(report.loss - want_loss) <= TOL * abs(want_loss), (rank, report.loss)
        assert max_relative_error(got, want_grads) <= TOL, rank
        rows = expected_rows(plan, rank)
        assert [
            (m.phase, m.start_rank, m.degree, m.index, m.sequence_ids, m.recompute_layers)
            for m in report.micro_batches
        ] == rows
        # each layer runs once per micro-batch, and once more when recomputed in backward
        # (1D: one forward per micro-batch; 2D tasks may run one per video)
        assert kind == "2d" or calls == [
            sum(1 + (i < r) for *_, r in rows) for i in range(num_layers)
        ], rank
        assert left == (1, 0, "ulysses")  # the SP state is back to single-process
        if data_mode == "callable":  # only this rank's sequences are read, each once
            assert sorted(asked) == sorted(s for row in rows for s in row[4]), rank
        check_report(report, plan, len(rows))


def check_report(report, plan, num_rows):
    seconds = [m.seconds for m in report.micro_batches]
    assert all(0 < x < report.step_time_s for x in seconds)
    assert 0 < sum(seconds) + report.grad_sync_s <= report.step_time_s
    assert 0 < report.check_s < 60 and 0 < report.step_time_s < 600
    assert report.predicted_step_time_s == plan.predicted_step_time_s
    assert report.summary() == {
        "loss": report.loss,
        "step_time_s": report.step_time_s,
        "grad_sync_s": report.grad_sync_s,
        "predicted_step_time_s": plan.predicted_step_time_s,
        "num_micro_batches": num_rows,
    }


def test_lm_plans_equal_the_definition_world2():
    check_case("1d", 2)


def test_lm_plans_equal_the_definition_world4_read_by_callable():
    check_case("1d", 4, data_mode="callable")


def test_dit_plans_equal_the_definition_world2():
    check_case("2d", 2)


def test_dit_plans_equal_the_definition_world4():
    check_case("2d", 4)


def test_an_idle_rank_reads_nothing_and_still_sums():
    """World 2, every sequence on rank 0 alone: rank 1 runs no micro-batch, sends zero
    gradients, and ends with the full sum like rank 0."""
    batch = Batch.from_lengths([4, 6])
    cost = cost_for("1d", 2)
    plan = make_plan([[_group(0, 1, [((0, 1), 1)]), _group(1, 1, [])]], batch, cost, planner="hand")
    models = counted_models("1d", 2)
    results = run_world(2, job_step, "1d", plan, batch, models, "callable")
    want_loss, want_grads = reference("1d", plan.normalizer_kind, batch, SEED, STEP)
    (r0, g0, _, _, asked0), (r1, g1, calls1, _, asked1) = results
    assert asked0 == [0, 1] and asked1 == [] and calls1 == [0, 0, 0]
    assert r1.micro_batches == () and r1.summary()["num_micro_batches"] == 0
    for report, got in ((r0, g0), (r1, g1)):
        assert abs(report.loss - want_loss) <= TOL * want_loss
        assert max_relative_error(got, want_grads) <= TOL


# ---- the gradient sum --------------------------------------------------------------------
class Mixed(torch.nn.Module):
    """Parameters of two dtypes, one frozen: a 3 f64, b 2x2 f64, c 5 f32, frozen e, d 4 f64,
    f 2 f64 (bytes 24, 32, 20, -, 32, 16)."""

    def __init__(self):
        super().__init__()
        f64, f32 = torch.float64, torch.float32
        self.a = torch.nn.Parameter(torch.zeros(3, dtype=f64))
        self.b = torch.nn.Parameter(torch.zeros(2, 2, dtype=f64))
        self.c = torch.nn.Parameter(torch.zeros(5, dtype=f32))
        self.e = torch.nn.Parameter(torch.zeros(2, dtype=f64), requires_grad=False)
        self.d = torch.nn.Parameter(torch.zeros(4, dtype=f64))
        self.f = torch.nn.Parameter(torch.zeros(2, dtype=f64))


def rank_grad(p, rank: int, k: int):
    # distinct per element, parameter and rank, so a shifted slice or a missing sum shows
    return (torch.arange(p.numel(), dtype=p.dtype) + 10 * k + 100 * rank + 1).view_as(p)


class Recording:
    """Patch a torch.distributed collective for the whole (threaded) world, from the main
    thread: each call is recorded with the calling rank, its tensor's dtype and size."""

    def __init__(self, name: str):
        self.name, self.calls = name, []

    def __enter__(self):
        self.real = real = getattr(dist, self.name)

        def record(t, *a, **k):
            first = t[0] if isinstance(t, list) else t
            self.calls.append((dist.get_rank(), first.dtype, first.numel()))
            return real(t, *a, **k)

        setattr(dist, self.name, record)
        return self

    def __exit__(self, *exc):
        setattr(dist, self.name, self.real)

    def of(self, rank: int) -> list:
        return [(dtype, n) for r, dtype, n in self.calls if r == rank]


def job_sum(pool, bucket_bytes, extra_dtype, rank_without_grads):
    from dcp_opt.runtime import sum_gradients

    model = Mixed()
    for k, p in enumerate(model.parameters()):
        if p.requires_grad and pool.rank != rank_without_grads:
            p.grad = rank_grad(p, pool.rank, k)
    extra = None if extra_dtype is None else torch.tensor(pool.rank + 0.5, dtype=extra_dtype)
    out = sum_gradients(model, extra=extra, bucket_bytes=bucket_bytes)
    return out, {n: p.grad for n, p in model.named_parameters()}


F64, F32 = torch.float64, torch.float32


def check_sum(world, bucket_bytes, extra_dtype, want_sent, rank_without_grads=-1):
    with Recording("all_reduce") as sent:
        results = run_world(world, job_sum, bucket_bytes, extra_dtype, rank_without_grads)
    ranks = [r for r in range(world) if r != rank_without_grads]
    model = Mixed()
    for rank, (out, got) in enumerate(results):
        assert sent.of(rank) == want_sent, rank
        for k, (name, p) in enumerate(model.named_parameters()):
            if name == "e":
                assert got[name] is None  # frozen: no gradient invented
                continue
            assert torch.equal(got[name], sum(rank_grad(p, r, k) for r in ranks)), name
        if extra_dtype is None:
            assert out is None
        else:
            assert out.dtype == extra_dtype and float(out) == sum(r + 0.5 for r in range(world))


def test_buckets_close_once_full_and_never_mix_dtypes():
    # 40 bytes: [a 24 < 40, + b = 56] [c: f32] [d 32 < 40, + f = 48]; the f64 extra rides
    # in the first f64 bucket, as its last element
    check_sum(2, 40, F64, [(F64, 8), (F32, 5), (F64, 6)])
    # 24 bytes: a alone fills its bucket (24 is not < 24)
    check_sum(2, 24, F32, [(F64, 3), (F64, 4), (F32, 6), (F64, 4), (F64, 2)])
    check_sum(3, 1, None, [(F64, 3), (F64, 4), (F32, 5), (F64, 4), (F64, 2)])


def test_an_extra_of_no_buckets_dtype_travels_alone_and_missing_grads_are_zeros():
    check_sum(2, 1000, torch.float16, [(F64, 7), (F32, 5), (F64, 6), (torch.float16, 1)], 0)


# ---- what execute_step checks, and what it passes on --------------------------------------
def failures(world, *args, **kw) -> dict:
    """Each rank's exception (as str, type name) from one run that must fail on every rank."""
    import pytest

    with pytest.raises(RankFailure) as info:
        run_world(world, *args, **kw)
    errors = info.value.errors
    assert sorted(errors) == list(range(world)), info.value
    return {r: (type(e).__name__, str(e)) for r, e in errors.items()}


def lm_setup(world, plan_kind="tokens"):
    plan, batch = case("1d", world, plan_kind)
    return plan, make_data("1d", batch, SEED), [make_model("1d", SEED) for _ in range(world)]


def job_models(pool, plan, task, models, data, kwargs):
    model, state = models[pool.rank], SPState()
    # copies of one model: no weight check, so the recordings count execute_step's collectives
    parallelize(model, state, sync_weights=False)
    return execute_step(plan, task, model, data, pool=pool, state=state, step=STEP, **kwargs)


def test_ranks_holding_different_plans_fail_together_naming_them():
    plans = [case("1d", 4, k)[0] for k in ("tokens", "samples")]
    per_rank = [plans[r % 2] for r in range(4)]
    _, data, models = lm_setup(4)

    def job(pool):
        return job_models(pool, per_rank[pool.rank], LMTask(), models, data, {})

    h0, h1 = (p.content_hash() for p in plans)
    want = f"plan: ranks hold different plans (ranks [0, 2]: plan {h0}; ranks [1, 3]: plan {h1})"
    assert set(failures(4, job).values()) == {("PlanMismatchError", want)}


def test_a_plan_for_another_world_is_refused_before_any_step_collective():
    plan, data, models = lm_setup(2)
    want = (
        "plan.num_ranks: 2 but the world has 4 ranks; allowed: a plan made for exactly this world"
    )
    got = failures(4, lambda pool: job_models(pool, plan, LMTask(), models * 2, data, {}))
    assert set(got.values()) == {("PlanMismatchError", want)}


def test_check_same_plan_runs_over_the_group_it_is_given():
    from dcp_opt.runtime.executor import check_same_plan

    plan = case("1d", 2)[0]

    def job(pool):  # ranks 0..1 and 2..3 check their own two-rank plan in their own group
        check_same_plan(plan, group=pool.get(2 * (pool.rank // 2), 2))
        return True

    assert run_world(4, job, timeout_s=20) == [True] * 4


def test_check_plan_false_skips_the_hash_all_gather():
    plan, data, models = lm_setup(2)
    with Recording("all_gather") as gathers:
        run_world(2, job_models, plan, LMTask(), models, data, {"check_plan": False})
    assert gathers.calls == []
    with Recording("all_gather") as gathers:
        run_world(2, job_models, plan, LMTask(), models, data, {})
    assert [gathers.of(r) for r in (0, 1)] == [[(torch.uint8, 8)]] * 2  # the 8-byte hash


class FailingTask:
    """Runs nothing; raises `error` at micro-batch `at` of every group (all members alike)."""

    supports_cp = True

    def __init__(self, error, at: int):
        self.error, self.at, self.seen = error, at, 0

    def run(self, model, samples, state, **kw):
        self.seen += 1
        if self.seen > self.at:
            raise self.error
        return torch.zeros(())


LONG = "CUDA out of memory. Tried to allocate 2.00 GiB " + "x" * 300


def test_out_of_memory_names_the_plan_entry():
    plan, data, models = lm_setup(2)  # phase 0: group ranks 0..1, micro-batches (1,) r2, (0, 3)

    def job(pool, error):
        return job_models(pool, plan, FailingTask(error, 1), models, data, {})

    for error in (torch.OutOfMemoryError(LONG), RuntimeError(LONG.replace("out of", "Out Of"))):
        got = failures(2, job, error)
        for rank in (0, 1):
            want = (
                f"rank {rank}: out of memory in phase 0, group ranks 0..1 (degree 2), "
                "micro-batch 1: sequences [0, 3], recompute_layers 0; lower "
                "CostModel.usable_memory_fraction or re-profile the model "
                f"({type(error).__name__}: {str(error)[:200]})"
            )
            assert got[rank] == ("MicroBatchOutOfMemoryError", want)
    for other in (RuntimeError("device-side assert"), ValueError("out of memory")):
        got = failures(2, job, other)
        assert set(got.values()) == {(type(other).__name__, str(other))}  # unchanged


def test_is_oom():
    from dcp_opt.runtime.executor import _is_oom

    assert _is_oom(torch.OutOfMemoryError("")) and _is_oom(RuntimeError("x OUT OF MEMORY x"))
    assert not _is_oom(RuntimeError("out of range")) and not _is_oom(ValueError("out of memory"))
    assert issubclass(MicroBatchOutOfMemoryError, RuntimeError)


def test_cp_groups_are_refused_for_a_task_without_cp_before_any_collective():
    from dataclasses import replace

    from dcp_opt.runtime.executor import check_kinds

    plan = case("1d", 4)[0]  # phase 1 holds a cp group of degree 2

    class NoCp:  # a task that does not declare supports_cp
        pass

    want = (
        "plan: a group of kind 'cp' needs a 1D task that runs it (LMTask, HFCausalLMTask); "
        "{} runs only 'ulysses'"
    )
    for task in (NoCp(), TASKS["2d"]):
        try:
            check_kinds(plan, task)
        except ValueError as e:
            assert str(e) == want.format(type(task).__name__)
        else:
            raise AssertionError("no error")
    check_kinds(plan, LMTask())
    # cp of degree 1 is no SP at all: any task runs it (and plain ulysses plans, of course)
    for one_kind in ("cp", "ulysses"):
        phases = tuple(
            replace(ph, groups=tuple(
                replace(g, kind=one_kind if g.degree == 1 else "ulysses") for g in ph.groups
            ))
            for ph in plan.phases
        )  # fmt: skip
        check_kinds(replace(plan, phases=phases), NoCp())


class RecordingSharding:
    """A stand-in for runtime/sharding.py's object: records what execute_step hands it."""

    def __init__(self):
        self.calls = []

    def check_plan(self, plan, model):
        self.calls.append(("check_plan", plan, model))

    def begin_step(self):
        self.calls.append(("begin_step",))

    def finish_step(self, task, state, *, step, kind, loss):
        self.calls.append(("finish_step", task, state, step, kind, float(loss)))
        return loss * 10


def test_a_sharded_step_hands_the_reduction_to_the_sharding():
    plan, data, models = lm_setup(2)
    shardings, task = [RecordingSharding() for _ in range(2)], LMTask()

    def job(pool):
        model, state = models[pool.rank], SPState()
        parallelize(model, state, sync_weights=False)  # as job_models
        report = execute_step(
            plan, task, model, data, pool=pool, state=state, step=STEP,
            sharding=shardings[pool.rank],
        )  # fmt: skip
        return report, state, [p.grad.clone() for p in model.parameters()]

    with Recording("all_reduce") as reduces:
        results = run_world(2, job)
    assert reduces.calls == []  # no gradient sum of its own
    want_loss, _ = reference("1d", plan.normalizer_kind, batch_of("1d", 2), SEED, STEP)
    local = 0.0
    for rank, (report, state, _) in enumerate(results):
        calls = shardings[rank].calls
        assert [c[0] for c in calls] == ["check_plan", "begin_step", "finish_step"]
        assert calls[0][1] is plan and calls[0][2] is models[rank]
        _, t, s, step, kind, loss = calls[2]
        assert (t, s, step, kind) == (task, state, STEP, plan.normalizer_kind)
        assert report.loss == 10 * loss
        local += loss
    assert abs(local - want_loss) <= TOL * want_loss  # the ranks' unsummed shares


def batch_of(kind, world):
    return case(kind, world)[1]


def test_bucket_bytes_is_checked_first_with_its_allowed_values():
    import pytest

    for bad in (0, True, 2.0):
        with pytest.raises(ValueError) as info:
            execute_step(None, None, None, {}, pool=None, state=None, step=0, bucket_bytes=bad)
        assert str(info.value) == f"bucket_bytes: {bad!r}; allowed: an integer >= 1"


# ---- the tasks' pieces -------------------------------------------------------------------
def test_lm_pack_is_the_documented_stream():
    """pack: inputs = each sample's first L tokens, labels its last L, positions 0..L-1 per
    sample, segment = the sample's index, weight = 1 (tokens) or 1/L (samples); the stream
    padded to a multiple of the degree with inert entries (token 0, label -100, position 0,
    segment -1, weight 0)."""
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])
    for kind, wa, wb in (("tokens", 1.0, 1.0), ("samples", 1 / 3, 1 / 2)):
        got = LMTask().pack([(4, a), (7, b)], kind, 4)
        want = {
            "tokens": [5, 6, 7, 9, 10, 0, 0, 0],
            "labels": [6, 7, 8, 10, 11, -100, -100, -100],
            "positions": [0, 1, 2, 0, 1, 0, 0, 0],
            "segments": [0, 0, 0, 1, 1, -1, -1, -1],
            "weights": [wa] * 3 + [wb] * 2 + [0.0] * 3,
        }
        assert sorted(got) == sorted(want)
        for key, values in want.items():
            assert got[key].tolist() == values, (kind, key)
        assert got["weights"].dtype == torch.float64
    assert LMTask().pack([(0, a)], "tokens", 3)["tokens"].tolist() == [5, 6, 7]  # no padding


def test_an_unknown_normaliser_kind_is_named():
    import pytest

    with pytest.raises(ValueError) as info:
        LMTask().pack([(0, torch.tensor([1, 2, 3]))], "mean", 1)
    assert str(info.value) == "normalizer_kind: 'mean' not allowed; allowed: ['tokens', 'samples']"


def test_seeded_generator_depends_on_seed_step_sequence_and_salt_only():
    from dcp_opt.runtime import seeded_generator

    def draw(*args, **kw):
        return torch.rand(4, generator=seeded_generator(*args, **kw)).tolist()

    base = draw(3, 7, seed=1, salt="a")
    assert draw(3, 7, seed=1, salt="a") == base  # reproducible by any rank
    assert draw(3, 7) == draw(3, 7, seed=0, salt="")  # the documented defaults
    others = [draw(4, 7, seed=1, salt="a"), draw(3, 8, seed=1, salt="a"),
              draw(3, 7, seed=2, salt="a"), draw(3, 7, seed=1, salt="b"), draw(7, 3, seed=1, salt="a")]  # fmt: skip
    assert all(o != base for o in others)
    assert len({tuple(o) for o in others}) == len(others)


def test_one_byte_buckets_are_allowed_and_send_one_parameter_each():
    """bucket_bytes=1, the smallest allowed: every parameter is its own all-reduce (the loss
    rides in the first), and the step still equals the definition."""
    plan, batch = case("1d", 2)
    models = [make_model("1d", SEED) for _ in range(2)]
    data = make_data("1d", batch, SEED)
    with Recording("all_reduce") as sent:
        results = run_world(2, job_models, plan, LMTask(), models, data, {"bucket_bytes": 1})
    want_loss, want_grads = reference("1d", plan.normalizer_kind, batch, SEED, STEP)
    sizes = [p.numel() for p in models[0].parameters()]
    for rank, report in enumerate(results):
        assert [n for _, n in sent.of(rank)] == [sizes[0] + 1, *sizes[1:]]
        assert abs(report.loss - want_loss) <= TOL * want_loss
        assert max_relative_error(grads(models[rank]), want_grads) <= TOL


def test_a_float32_models_loss_rides_in_its_gradient_bucket():
    """The step's loss travels as the model's dtype, in the gradients' only bucket: one
    all-reduce per step for a float32 model too (not a second one for a float64 loss)."""
    plan, batch = case("1d", 2)
    models = [make_model("1d", SEED).float() for _ in range(2)]
    data = make_data("1d", batch, SEED)
    with Recording("all_reduce") as sent:
        results = run_world(2, job_models, plan, LMTask(), models, data, {})
    want_loss, _ = reference("1d", plan.normalizer_kind, batch, SEED, STEP)
    size = sum(p.numel() for p in models[0].parameters())
    for rank, report in enumerate(results):
        assert sent.of(rank) == [(torch.float32, size + 1)]
        assert abs(report.loss - want_loss) <= 1e-5 * want_loss


def test_under_nccl_the_hash_and_loss_live_on_the_current_cuda_device(monkeypatch):
    """_device(): the current CUDA device under NCCL (its collectives take CUDA tensors),
    the CPU otherwise. Checked without a GPU: a torch.device is only a name."""
    from dcp_opt.runtime import executor

    monkeypatch.setattr(executor.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(executor.torch.cuda, "current_device", lambda: 3)
    assert executor._device() == torch.device("cuda", 3)
    monkeypatch.setattr(executor.dist, "get_backend", lambda: "gloo")
    assert executor._device() == torch.device("cpu")
