"""The column makespan (dcp_opt/pipeline/makespan.py) against an independent event
simulation written here (stages as servers, messages as timed arrivals), on random
instances; GPipe's closed form; the interleaved schedule's actions; memory by hand."""

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_opt.errors import DcpOptError
from dcp_opt.pipeline import stage_actions
from dcp_opt.pipeline.makespan import column_makespan, stage_peaks


def event_sim(f, b, x, schedule, p, v):
    """Discrete-event simulation: a stage starts its next action once it is idle and that
    action's input has arrived; a finished action sends its output (after x) onward."""
    V, m = len(f), len(f[0])
    acts = [list(stage_actions(schedule, p, m, s, virtual_stages=v)) for s in range(p)]
    arrived = {("F", 0, k): 0.0 for k in range(m)}
    nxt, idle_at = [0] * p, [0.0] * p
    heap, seq = [], 0
    for s in range(p):
        heapq.heappush(heap, (0.0, seq, "wake", s, None))
        seq += 1
    running = [False] * p
    while heap:
        now, _, what, s, act = heapq.heappop(heap)
        if what == "done":
            kind, c, k = act
            running[s] = False
            if kind == "F":
                key = ("F", c + 1, k) if c < V - 1 else ("B", c, k)
                arrived[key] = now + (x[c][k] if c < V - 1 else 0.0)
                dest = (c + 1) % p if c < V - 1 else s
            elif c > 0:
                arrived[("B", c - 1, k)] = now + x[c - 1][k]
                dest = (c - 1) % p
            else:
                dest = None
            for t in {s, dest} - {None}:
                at = arrived.get(("F", c + 1, k) if kind == "F" else ("B", max(c - 1, 0), k), now)
                heapq.heappush(heap, (max(now, at if t != s else now), seq, "wake", t, None))
                seq += 1
            continue
        if running[s] or nxt[s] == len(acts[s]):
            continue
        a = acts[s][nxt[s]]
        c = a.chunk * p + s
        key = (a.kind, c, a.micro_batch)
        if key not in arrived:
            continue  # woken again when it arrives
        if arrived[key] > now:
            heapq.heappush(heap, (arrived[key], seq, "wake", s, None))
            seq += 1
            continue
        dur = f[c][a.micro_batch] if a.kind == "F" else b[c][a.micro_batch]
        running[s] = True
        nxt[s] += 1
        idle_at[s] = now + dur
        heapq.heappush(heap, (now + dur, seq, "done", s, key))
        seq += 1
    assert nxt == [len(a) for a in acts], "event simulation stalled"
    return max(idle_at)


@st.composite
def instances(draw):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 3)) if schedule == "interleaved" else 1
    m = p * draw(st.integers(1, 3)) if schedule == "interleaved" else draw(st.integers(1, 7))
    V = p * v
    t = st.floats(0.01, 10.0)
    f = [[draw(t) for _ in range(m)] for _ in range(V)]
    b = [[draw(t) for _ in range(m)] for _ in range(V)]
    x = [[draw(st.floats(0.0, 2.0)) for _ in range(m)] for _ in range(V - 1)]
    return f, b, x, schedule, p, v


@settings(max_examples=150, deadline=None)
@given(instances())
def test_makespan_equals_an_event_simulation(inst):
    f, b, x, schedule, p, v = inst
    got = column_makespan(f, b, x, schedule=schedule, num_stages=p, virtual=v).makespan_s
    assert got == pytest.approx(event_sim(f, b, x, schedule, p, v), rel=1e-12, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.floats(0.01, 10.0), min_size=1, max_size=9), st.randoms())
def test_gpipe_is_sum_plus_p_minus_one_max_for_every_order(p, t, rnd):
    # stage-uniform costs, forward 1/3 and backward 2/3 of t, no transfers
    rnd.shuffle(t)
    f = [[x / 3 for x in t]] * p
    b = [[2 * x / 3 for x in t]] * p
    x = [[0.0] * len(t)] * (p - 1)
    got = column_makespan(f, b, x, schedule="gpipe", num_stages=p).makespan_s
    assert got == pytest.approx(sum(t) + (p - 1) * max(t), rel=1e-12)


def test_1f1b_order_matters_by_hand():
    # p = 2, micro-batches of t = 3 and 30 (f = t/3, b = 2t/3); stage 0 runs F0 F1 B0 B1,
    # stage 1 F0 B0 F1 B1.
    p = 2

    def ms(t):
        f = [[x / 3 for x in t]] * p
        b = [[2 * x / 3 for x in t]] * p
        return column_makespan(f, b, [[0.0] * 2], schedule="1f1b", num_stages=p).makespan_s

    # light first: s0 F0 [0,1] F1 [1,11]; s1 F0 [1,2] B0 [2,4] F1 [11,21] B1 [21,41];
    # s0 B0 [11,13] B1 [41,61] -> 61
    assert ms([3, 30]) == pytest.approx(61.0)
    # heavy first: s0 F0 [0,10] F1 [10,11]; s1 F0 [10,20] B0 [20,40] F1 [40,41] B1 [41,43];
    # s0 B0 [40,60] B1 [60,62] -> 62
    assert ms([30, 3]) == pytest.approx(62.0)


def test_interleaved_actions_by_hand():
    # p = 2, v = 2, m = 4 (Megatron's rule): stage 0 warms up 2 (p-1) + (v-1) p = 4 forwards
    text = " ".join(map(str, stage_actions("interleaved", 2, 4, 0, virtual_stages=2)))
    assert text == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"


def test_interleaved_needs_a_multiple_of_p():
    with pytest.raises(DcpOptError, match="num_micro_batches"):
        stage_actions("interleaved", 4, 6, 0, virtual_stages=2)


def test_virtual_stages_need_interleaved():
    with pytest.raises(DcpOptError, match="virtual_stages"):
        stage_actions("1f1b", 2, 2, 0, virtual_stages=2)


def test_stage_peaks_by_hand():
    # p = 2, 1f1b, m = 3; stage 0 runs F0 F1 B0 F2 B1 B2: holds 2 at most; stage 1 one.
    stored = np.array([[10.0, 20.0, 30.0], [1.0, 2.0, 3.0]])
    work = np.array([[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    peaks = stage_peaks(stored, work, schedule="1f1b", num_stages=2)
    # stage 0: F0 10+1, F1 30+1, B0 30+1, then 20 held, F2 50+1 -> 51; stage 1: 3 + 5 = 8
    assert peaks == [51.0, 8.0]


@settings(max_examples=60, deadline=None)
@given(instances())
def test_lockstep_with_one_fixed_group_is_the_column_makespan(inst):
    from dcp_opt.pipeline.lockstep import lockstep_makespan

    f, b, x, schedule, p, v = inst
    m = len(f[0])
    steps = [[(range(0, 2), [r[k] for r in f], [r[k] for r in b], [r[k] for r in x])]
             for k in range(m)]  # fmt: skip
    got = lockstep_makespan(steps, schedule=schedule, num_stages=p, virtual=v)
    want = column_makespan(f, b, x, schedule=schedule, num_stages=p, virtual=v).makespan_s
    assert got == pytest.approx(want, rel=1e-12)


def test_lockstep_groups_wait_for_all_their_units_by_hand():
    # p = 1, two micro-steps: step 0 groups {0} (f 1, b 2) and {1} (f 5, b 5); step 1 one
    # group {0, 1} (f 1, b 1): its forward waits for unit 1, free at 10 -> ends 12.
    from dcp_opt.pipeline.lockstep import lockstep_makespan

    steps = [[(range(0, 1), [1.0], [2.0], []), (range(1, 2), [5.0], [5.0], [])],
             [(range(0, 2), [1.0], [1.0], [])]]  # fmt: skip
    assert lockstep_makespan(steps, schedule="1f1b", num_stages=1) == 12.0


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved"]), st.integers(1, 4), st.integers(1, 7),
       st.randoms(use_true_random=False))  # fmt: skip
def test_batch_makespans_equal_column_makespan_for_every_order(schedule, p, m, rnd):
    from dcp_opt.pipeline.makespan import batch_makespans

    v = 2 if schedule == "interleaved" else 1
    m = p * max(1, m // p) if schedule == "interleaved" else m
    V = p * v
    f = [[rnd.uniform(0.01, 5) for _ in range(m)] for _ in range(V)]
    b = [[rnd.uniform(0.01, 5) for _ in range(m)] for _ in range(V)]
    x = [[rnd.uniform(0, 1) for _ in range(m)] for _ in range(V - 1)]
    orders = [rnd.sample(range(m), m) for _ in range(5)]
    got = batch_makespans(f, b, x, orders, schedule=schedule, num_stages=p, virtual=v)
    for o, g in zip(orders, got, strict=True):
        pick = lambda t: [[row[k] for k in o] for row in t]  # noqa: E731, B023
        want = column_makespan(pick(f), pick(b), pick(x), schedule=schedule, num_stages=p,
                               virtual=v).makespan_s  # fmt: skip
        assert g == pytest.approx(want, rel=1e-12, abs=1e-12)
