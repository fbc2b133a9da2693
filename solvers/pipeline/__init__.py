"""Pipeline planners (issue 30), bottom to top: `instance.py` (one batch on one pipeline:
draft columns priced exactly), `compose.py` (micro-batch composition and columns),
`order.py` (named orders and local search), `recompute.py` (per-stage recompute within the
memory windows), `plan.py` (`plan_pp_greedy` and the shared tail), `cpsat.py` (the order
by CP-SAT, `plan_pp_cpsat`)."""
