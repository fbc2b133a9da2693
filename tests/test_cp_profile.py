"""cp's communication as the profiler measures it: the runtime's all-gather and reduce-scatter
timed on gloo (world 2), stored in the profile (schema 2; a schema-1 file loads), and charged
by the cost model when present (dcp_opt/cost/cp.py, Measured rates)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dcp_opt.cost import CostModel
from dcp_opt.cost.cp import CPMeasurement, comm_time_per_layer
from dcp_opt.errors import DcpOptError
from dcp_opt.profile_io import (
    ProfileError,
    cost_model_from_profile,
    load_profile,
    save_profile,
)
from tests.test_cp_cost import CLUSTER, COEFFS, COST, MODEL, _seq
from tests.test_profile_io import CLUSTER as H200X8
from tests.test_profile_io import LLAMA, _profile

# measured at group size 4: all-gather 2e9 B/s and 3e-6 s per call, reduce-scatter 1e9 B/s
# and 6e-6 s per call
M4 = CPMeasurement(4, 2e9, 3e-6, 1e9, 6e-6)
MEASURED = COST.with_(cp_comm=(M4,))


def test_measured_rates_inside_a_node_by_hand():
    # d=4, T=1000, 64 B of K/V per token (test_cp_cost): 3/4 * 1000 * 64 = 48000 B sent.
    # all-gather: 48000 / 2e9 + 3e-6 = 2.7e-5 s; reduce-scatter 48000 / 1e9 + 6e-6 = 5.4e-5 s
    assert MEASURED.comm_time_per_layer(1000, 4, False, "cp") == pytest.approx(2.7e-5, rel=1e-12)
    # d=2 was not measured: the largest measured group's rates, latency 3e-6 / 3 per ring
    # step: 1/2 * 1000 * 64 = 32000 B / 2e9 + 1e-6 = 1.7e-5 s
    assert MEASURED.comm_time_per_layer(1000, 2, False, "cp") == pytest.approx(1.7e-5, rel=1e-12)
    # across nodes the cluster's NIC rates, as unmeasured (6.3e-4 s, test_cp_cost)
    assert MEASURED.comm_time_per_layer(1000, 8, True, "cp") == pytest.approx(6.3e-4, rel=1e-12)
    # Ulysses is untouched
    assert MEASURED.comm_time_per_layer(1000, 4, False) == COST.comm_time_per_layer(1000, 4, False)


def test_time_parts_backward_pays_the_reduce_scatter():
    # L=2, r=1: forward and the recomputed forward gather, (L + r) x 2.7e-5 s; backward
    # reduce-scatters, L x 5.4e-5 s: 8.1e-5 + 1.08e-4 = 1.89e-4 s
    f = COST.features(_seq(1000))
    c, r, m = MEASURED.time_parts(f, 4, 1, spans_nodes=False, kind="cp")
    assert m == pytest.approx(1.89e-4, rel=1e-12)
    assert (c, r) == pytest.approx((3e-3, 5e-4), rel=1e-12)  # compute as unmeasured
    # across nodes: no measurement applies, (2L + r) x 6.3e-4 s
    _, _, m8 = MEASURED.time_parts(f, 8, 1, spans_nodes=True, kind="cp")
    assert m8 == pytest.approx(5 * 6.3e-4, rel=1e-12)


def test_measured_rates_vectorised_match_scalar():
    # a column of degrees against a row of token counts, some groups across nodes: each
    # entry as the scalar call (the measured rates inside a node, the NIC's across)
    tokens, d = np.array([100.0, 1000.0, 5000.0]), np.array([[2], [4], [8]])
    for collective in ("all_gather", "reduce_scatter"):
        got = comm_time_per_layer(MEASURED, tokens, d, d > 4, collective)
        for i, dd in enumerate((2, 4, 8)):
            for j, t in enumerate(tokens):
                assert got[i, j] == comm_time_per_layer(MEASURED, t, dd, dd > 4, collective)
    assert got[1, 1] == pytest.approx(5.4e-5, rel=1e-12)  # d=4, 1000 tokens: reduce-scatter


def test_cp_comm_checked_and_fingerprinted():
    assert MEASURED.fingerprint() != COST.fingerprint()
    for bad in ((CPMeasurement(1, 1e9, 0.0, 1e9, 0.0),), (M4, M4), (replace(M4, all_gather_bandwidth_bytes_per_s=0.0),), ("x",), 3, (replace(M4, reduce_scatter_latency_s="1"),)):  # fmt: skip
        with pytest.raises(DcpOptError, match="^cp_comm: must be CPMeasurements"):
            CostModel(MODEL, CLUSTER, COEFFS, cp_comm=bad)


def test_profile_stores_cp_and_the_cost_model_uses_it(tmp_path):
    m2 = CPMeasurement(2, 3e9, 2e-5, 1.5e9, 4e-5)
    p = save_profile(replace(_profile(), cp=(m2,)), tmp_path / "p.json")
    back = load_profile(p, model=LLAMA)
    assert back.cp == (m2,)
    doc = json.loads(p.read_text())
    assert doc["cp"][0]["reduce_scatter_latency_s"] == 4e-5 and doc["schema_version"] == 2
    # as the measured all-to-all: only with use_measured_a2a (the cluster's rates otherwise)
    assert cost_model_from_profile(p, LLAMA, H200X8).cp_comm == ()
    cost = cost_model_from_profile(p, LLAMA, H200X8, use_measured_a2a=True, sp_kinds=("ulysses", "cp"))  # fmt: skip
    assert cost.cp_comm == (m2,)
    # llama-1b (preset without GQA): 32 kv heads x 64 dims x 2 (K, V) x 2 B = 8192 B per
    # token; d=2, T=4096: 8192 * 4096 / 2 = 16777216 B at 3e9 B/s + 2e-5 s (one ring step)
    want = 16777216 / 3e9 + 2e-5
    assert float(cost.comm_time_per_layer(4096, 2, False, "cp")) == pytest.approx(want, rel=1e-12)


def test_schema_1_profile_loads_without_cp(tmp_path):
    # a profile without cp is written as schema 1 (older readers keep reading it) and loads
    p = save_profile(_profile(), tmp_path / "p.json")
    doc = json.loads(p.read_text())
    assert doc["schema_version"] == 1 and "cp" not in doc
    assert load_profile(p, model=LLAMA).cp == ()
    doc["schema_version"] = 3
    p.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"schema_version: 3 not supported; .* \[1, 2\]"):
        load_profile(p)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(group_size=1), r"profile\.cp\[0\]: needs group_size >= 2"),
        (
            lambda c: c.pop("all_gather_latency_s"),
            r"profile\.cp\[0\]\.all_gather_latency_s: missing",
        ),  # fmt: skip
        (
            lambda c: c.update(reduce_scatter_bandwidth_bytes_per_s=-1),
            r"profile\.cp\[0\]\.reduce_scatter_bandwidth_bytes_per_s: must be",
        ),  # fmt: skip
    ],
)
def test_bad_cp_entry_is_a_one_line_error(tmp_path, edit, match):
    p = save_profile(replace(_profile(), cp=(CPMeasurement(2, 1e9, 0.0, 1e9, 0.0),)), tmp_path / "p.json")  # fmt: skip
    d = json.loads(p.read_text())
    edit(d["cp"][0])
    p.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=match):
        load_profile(p)
