"""Certified lower bounds on the step time, beyond the analytic one of dcp_opt.bounds:
data.py (the per-sequence data they share), lp.py (packing-aware LP), rank.py (the rank
relaxation, a MILP that sees the packing's granularity), tree.py (its exact recursion over
the buddy tree), rank_plan.py (its solution as a plan: greedy's and cpsat's tree
candidate), stream.py (the bound of an epoch of steps)."""
