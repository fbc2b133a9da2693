"""benchmarks/bench_cp.py (issue 25): Megatron's rows, default and tuned, run on ring groups
(its own kind, TransformerEngine's P2P ring), on the cost model offering the three kinds that
the project's planners get; verl's stay Ulysses."""

from __future__ import annotations

from tests.scripts import load_script


def test_megatron_rows_are_ring(monkeypatch):
    import dcp_opt.solvers.baselines.megatron as megatron

    bench = load_script("benchmarks/bench_cp.py")
    assert bench.KINDS == ("ulysses", "cp", "ring") and bench.MEGATRON == {"kind": "ring"}
    made = []

    def spy(steps, batch, cost, st, **kw):
        res = real(steps, batch, cost, st, **kw)
        groups = {g.kind for ph in res.plan.phases for g in ph.groups if g.degree > 1}
        made.append((cost.sp_kinds, groups))
        return res

    real = megatron.plan_of_steps
    monkeypatch.setattr(megatron, "plan_of_steps", spy)
    row = bench.one("llama3-8b", "1d-long", 0, "h200x8")
    assert row["tuned_settings"]["megatron_tuned"]["kind"] == "ring"
    assert len(made) > 2  # the default run and the sweep's plans
    assert all(kinds == bench.KINDS and groups == {"ring"} for kinds, groups in made), made
    assert "max_seqlen_per_rank" in row["tuned_settings"]["megatron_tuned"]
    assert "kind" not in row["tuned_settings"]["verl_tuned"]
