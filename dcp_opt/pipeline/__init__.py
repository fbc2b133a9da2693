"""Pipeline parallelism (issue 30), bottom to top: `actions.py` (each stage's ordered
forwards and backwards: the one order the simulator prices and the runtime executes),
`stages.py` (a pipeline's stages priced from the per-layer cost model: time, P2P, memory),
`makespan.py` (the exact makespan of a column: a longest path on the dependency graph; its
memory over time), `lockstep.py` (the finish and per-unit memory of micro-steps whose
groups change: Megatron's shape and plans of schema 4), `bound.py` (certified lower bounds
of a column and of a batch), `check.py` (what validate and simulate ask of a plan with a
pipeline)."""

from .actions import SCHEDULES, Action, gpipe_actions, one_f_one_b_actions, stage_actions

__all__ = ["SCHEDULES", "Action", "gpipe_actions", "one_f_one_b_actions", "stage_actions"]
