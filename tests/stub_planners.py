"""Tiny planners for CLI and bench tests, registered by monkeypatching dcp_opt.solvers.

They make valid plans with obvious structure, so the expected figures can be worked out:
- `plan_whole`: one group of the whole cluster runs every sequence, one micro-batch each;
- `plan_nodes`: one group per node; sequences dealt longest-first to the least-loaded node;
- `plan_boom`: always raises (a planner bug the bench must survive).
"""

from __future__ import annotations

import time

import numpy as np
from dcp_opt.solvers.common import finish

from dcp_opt.plan import Group, MicroBatch


def _micro_batch(seq, cost, degree: int) -> MicroBatch:
    r = int(cost.min_recompute(seq.num_tokens, degree))
    assert r >= 0, f"stub planner: sequence {seq.id} does not fit at degree {degree}"
    return MicroBatch((seq.id,), r)


def plan_whole(batch, cost, **options):
    started = time.perf_counter()
    n = cost.cluster.num_gpus
    mbs = tuple(_micro_batch(s, cost, n) for s in batch.sequences)
    return finish([[Group(0, n, mbs)]], batch, cost, planner="stub_whole", started=started)


def plan_nodes(batch, cost, *, seed: int = 0, **options):
    started = time.perf_counter()
    c = cost.cluster
    g = c.gpus_per_node
    load = np.zeros(c.num_nodes)
    per_node: list[list[MicroBatch]] = [[] for _ in range(c.num_nodes)]
    for s in sorted(batch.sequences, key=lambda s: -s.num_tokens):
        mb = _micro_batch(s, cost, g)
        k = int(np.argmin(load))
        load[k] += cost.microbatch_time([s], g, mb.recompute_layers).total_s
        per_node[k].append(mb)
    groups = [Group(k * g, g, tuple(mbs)) for k, mbs in enumerate(per_node) if mbs]
    return finish([groups], batch, cost, planner="stub_nodes", started=started)


def plan_boom(batch, cost, **options):
    raise RuntimeError("boom: injected planner failure")


def plan_none(batch, cost, **options):
    """No plan: what a planner returns when it finds nothing (the CLI must exit 1)."""
    from dcp_opt.result import PlanResult

    return PlanResult("infeasible", None, float("inf"), 0.0, 0.0, "stub_none", "nothing fits")


def plan_timeout(batch, cost, **options):
    """A budget that ran out before any plan: not infeasible, still no plan (exit 1)."""
    from dcp_opt.result import PlanResult

    return PlanResult("timeout", None, float("inf"), 0.0, 0.0, "stub_timeout", "no time")


# The stubs take **options and ignore them; they declare the options every planner shares, as
# run_planner requires of a planner with **options (solvers/__init__.py planner_options).
for _stub in (plan_whole, plan_nodes, plan_boom, plan_none, plan_timeout):
    _stub.extra_options = ("seed", "time_limit_s", "num_workers", "deterministic")
