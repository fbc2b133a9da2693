"""The ring's P2P step as the profiler measures it: the runtime's own step timed on gloo (world
2), stored in the profile (`ring`, schema 2), and charged by the cost model when present
(dcp_opt/cost/ring.py, Measured rates)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from dcp_opt.runtime.testing import DistWorkers

from dcp_opt.cost import CostModel
from dcp_opt.cost.ring import RingMeasurement
from dcp_opt.errors import DcpOptError
from dcp_opt.profile_io import ProfileError, cost_model_from_profile, load_profile, save_profile
from tests.test_cp_cost import CLUSTER, COEFFS, MODEL
from tests.test_profile_io import CLUSTER as H200X8
from tests.test_profile_io import LLAMA, _profile
from tests.test_ring_cost import COST, _f

# measured at group size 4: 4e8 B/s and 2e-6 s per step
M4 = RingMeasurement(4, 4e8, 2e-6)
MEASURED = COST.with_(ring_comm=(M4,))


def test_measured_step_inside_a_node_by_hand():
    # T = 1000 at d = 4 (test_ring_cost): a block 16000 B at 4e8 B/s + 2e-6 s: X1 = 4.2e-5 s,
    # X2 = 8.2e-5 s; a step's attention 6.25e-5 s forward (hides X1), 1.25e-4 s backward
    # (hides both): nothing exposed
    assert MEASURED.time_parts(_f(1000), 4, 0, spans_nodes=False, kind="ring")[2] == 0.0
    # T = 200: a block 3200 B: X1 = 8e-6 + 2e-6 = 1e-5 s, X2 = 1.8e-5 s; steps 2.5e-6 s
    # forward, 5e-6 s backward: forward 3 * 7.5e-6 = 2.25e-5 s, backward 2 * 5e-6 + 2 * 1.3e-5
    # = 3.6e-5 s; L = 2: 2 * (2.25e-5 + 3.6e-5) = 1.17e-4 s
    m = MEASURED.time_parts(_f(200), 4, 0, spans_nodes=False, kind="ring")[2]
    assert m == pytest.approx(1.17e-4, rel=1e-9)
    # d = 2 was not measured: the largest measured group's rates: a block 6400 B: X1 = 1.8e-5
    # s against 1e-5 s forward steps: 1 * 8e-6 s; backward steps 2e-5 s hide it; L = 2: 1.6e-5 s
    m2 = MEASURED.time_parts(_f(200), 2, 0, spans_nodes=False, kind="ring")[2]
    assert m2 == pytest.approx(1.6e-5, rel=1e-9)
    # across nodes the cluster's NIC rates, as unmeasured (test_ring_cost: 3.461875e-3 s)
    got = MEASURED.time_parts(_f(1000), 8, 1, spans_nodes=True, kind="ring")[2]
    assert got == pytest.approx(3.461875e-3, rel=1e-12)
    # the fingerprint changes only when measured; cp's figures do not move
    assert MEASURED.fingerprint() != COST.fingerprint()
    assert MEASURED.time(_f(200), 4, 0, kind="cp") == COST.time(_f(200), 4, 0, kind="cp")


@pytest.mark.parametrize(
    "bad", [(RingMeasurement(1, 1e9, 0.0),), (RingMeasurement(2, 0.0, 0.0),), ("x",),
            (RingMeasurement(2, 1e9, 0.0), RingMeasurement(2, 2e9, 0.0))],
)  # fmt: skip
def test_bad_measurements_are_one_line_errors(bad):
    with pytest.raises(DcpOptError, match="^ring_comm: must be RingMeasurements"):
        CostModel(MODEL, CLUSTER, COEFFS, ring_comm=bad)


def test_profile_stores_ring_and_the_cost_model_uses_it(tmp_path):
    m2 = RingMeasurement(2, 3e9, 2e-5)
    p = save_profile(replace(_profile(), ring=(m2,)), tmp_path / "p.json")
    assert load_profile(p, model=LLAMA).ring == (m2,)
    doc = json.loads(p.read_text())
    assert doc["ring"][0]["latency_s"] == 2e-5 and doc["schema_version"] == 2
    assert cost_model_from_profile(p, LLAMA, H200X8).ring_comm == ()  # the cluster's rates
    cost = cost_model_from_profile(p, LLAMA, H200X8, use_measured_a2a=True)
    assert cost.ring_comm == (m2,)
    doc["ring"][0]["group_size"] = 1
    p.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"profile\.ring\[0\]: needs group_size >= 2"):
        load_profile(p)


def _measure(ctx):
    from dcp_opt.runtime.profile.fit import measure_ring_steps

    return measure_ring_steps(None, sizes_bytes=(1 << 16, 1 << 19, 1 << 21), repeats=3)


@pytest.mark.dist
def test_ring_step_measured_on_gloo():
    # the runtime's own P2P step (runtime/ring.py exchange_step) on 2 gloo ranks, blocks up to
    # 2 MB; every rank fits the same group-wide (slowest member's) times
    workers = DistWorkers(2, timeout_s=60.0)
    try:
        got = workers.run(_measure)
    finally:
        workers.close()
    assert all(g == got[0] for g in got) and got[0].group_size == 2
    assert 1e5 < got[0].bandwidth_bytes_per_s <= 1e15 and 0 <= got[0].latency_s < 1.0
    CostModel(MODEL, CLUSTER, COEFFS, ring_comm=(got[0],))  # usable as measured
