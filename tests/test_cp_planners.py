"""Planners choosing each group's SP kind (cost.sp_kinds with "cp"): never slower than
Ulysses-only greedy, bounds stay below every plan, tables are the least over the kinds."""

from __future__ import annotations

import numpy as np
import pytest
from dcp_opt.solvers import run_planner
from dcp_opt.solvers.bounds.lp import lp_bound
from dcp_opt.solvers.kinds import kind_shares
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_opt import Batch, CostModel, cluster_preset, validate
from dcp_opt.bounds import lower_bound
from dcp_opt.errors import DcpOptError
from dcp_opt.model import model_preset
from dcp_opt.table import seq_table

BASE = {m: CostModel(model_preset(m), cluster_preset("h200x64")) for m in ("llama-7b", "llama3-8b")}


def both(model: str) -> tuple[CostModel, CostModel]:
    base = BASE[model]
    return base, base.with_(sp_kinds=("ulysses", "cp"))


def test_table_is_the_least_over_the_kinds():
    u, k = both("llama-7b")
    # cp holds the gathered K/V of every saved layer (16 GB per layer at 1M llama-7b tokens),
    # so it recomputes more: it wins at degree 64 only from about 2M tokens
    batch = Batch.from_lengths([512, 8192, 65536, 2_000_000])
    tu, tk = seq_table(batch, u), seq_table(batch, k)
    cp_only = [float(k.time(k.features(s), d, r, kind="cp")) for s in batch.sequences[3:]
               for d, r in [(64, int(k.min_recompute(s.num_tokens, 64, kind="cp")))]]  # fmt: skip
    assert tk.time[3, -1] == pytest.approx(min(tu.time[3, -1], cp_only[0]), rel=1e-12)
    assert np.all(tk.time <= tu.time) and np.all(tk.time_marginal <= tu.time_marginal)
    assert np.array_equal(tk.r_min, tu.r_min)
    assert tk.kind[3, -1] == 1  # cp past the 32 heads (docs/cost-model.md)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(sorted(BASE)),
    lengths=st.lists(st.integers(256, 400_000), min_size=4, max_size=24),
)
def test_greedy_with_kinds_is_never_slower_than_ulysses_greedy(model, lengths):
    u, k = both(model)
    batch = Batch.from_lengths(lengths)
    ref = run_planner("greedy", batch, u)
    got = run_planner("greedy", batch, k)
    assert validate(got.plan, batch, k) == []
    assert got.predicted_step_time_s <= ref.predicted_step_time_s * (1 + 1e-12)
    assert got.lower_bound_s <= got.predicted_step_time_s
    lp = lp_bound(batch, k)
    assert lp.value_s <= got.predicted_step_time_s * (1 + 1e-9)
    assert lower_bound(batch, k).value_s <= lower_bound(batch, u).value_s * (1 + 1e-12)
    assert set(got.stats["sp_kind_shares"]) <= {"ulysses", "cp"}


def test_greedy_chooses_cp_past_the_heads_and_gains():
    # llama-7b has 32 heads: a 2M-token sequence on 64 GPUs gains from cp at degree 64
    u, k = both("llama-7b")
    batch = Batch.from_lengths([2_000_000, 4096, 2048])
    ref, got = run_planner("greedy", batch, u), run_planner("greedy", batch, k)
    shares = kind_shares(got.plan)
    assert shares.get("cp", 0) > 0
    assert got.predicted_step_time_s < ref.predicted_step_time_s
    assert got.plan.fingerprint != ref.plan.fingerprint  # planned for another cost model


def test_cpsat_with_kinds_is_never_slower_than_ulysses_greedy():
    u, k = both("llama3-8b")
    batch = Batch.from_lengths([300_000, 120_000, 64_000, 30_000, 8000, 4000, 2000, 1000])
    ref = run_planner("greedy", batch, u)
    got = run_planner("cpsat", batch, k, time_limit_s=0.5, deterministic=True)
    assert got.planner == "cpsat" and got.plan.planner == "cpsat"
    assert validate(got.plan, batch, k) == []
    assert got.predicted_step_time_s <= ref.predicted_step_time_s * (1 + 1e-12)
    assert got.lower_bound_s <= got.predicted_step_time_s


def test_baselines_keep_ulysses():
    _, k = both("llama-7b")
    batch = Batch.from_lengths([1_000_000, 4096])
    for name in ("static_tuned", "bucket", "packed"):
        res = run_planner(name, batch, k)
        assert {g.kind for ph in res.plan.phases for g in ph.groups} == {"ulysses"}


@pytest.mark.parametrize(
    "kinds, match",
    [(("cp",), "'ulysses' included"), (("ulysses", "star"), "not allowed"),
     (("ulysses", "ulysses"), "distinct")],
)  # fmt: skip
def test_sp_kinds_errors(kinds, match):
    with pytest.raises(DcpOptError, match=f"sp_kinds: .*{match}"):
        BASE["llama-7b"].with_(sp_kinds=kinds)
    dit = CostModel(model_preset("opensora-stdit3-xl"), cluster_preset("h200x8"))
    with pytest.raises(DcpOptError, match="'cp' not allowed for the 2d model"):
        dit.with_(sp_kinds=("ulysses", "cp"))
    with pytest.raises(DcpOptError, match="'ring' not allowed for the 2d model"):
        dit.with_(sp_kinds=("ulysses", "ring"))
