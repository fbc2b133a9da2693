"""Greedy planner (`plan_greedy`): degree, group layout, packing and recompute in milliseconds.

It is the CP-SAT planner's hint and fallback, so it must be fast, always valid, and good.

For a target makespan T (seconds of the busiest group, before the gradient sync):
1. degree: each sequence takes the degree of least GPU-work d * t(d) among those that finish
   within T (the efficiency / critical-path trade-off of FlexSP, Wang et al. 2025, sec. 4);
   a sequence no degree can finish within T takes its fastest degree;
2. layout: each degree gets groups in proportion to the group-seconds its sequences need
   (demand / T, rounded so the ranks add up to N), placed big degrees first on aligned rank
   ranges (buddy allocation), so no group straddles a node;
3. assignment: longest first (LPT, Graham 1969), each sequence goes to the least-loaded group
   of its degree if that meets T, else to whichever group finishes it earliest;
4. packing: sequences that fit without recompute share a micro-batch up to the token count
   that fits at r = 0, which saves the per-micro-batch constant (launches, all-to-all latency,
   embedding/loss overhead); a sequence that needs recompute alone runs alone at its r_min.
A second phase is tried for the sequences that need most of the cluster: they run one after
another on the widest group in phase 0, then every rank re-forms for the rest.
T is scanned on a grid above the lower bound and the best plan (exact loads) is kept.
Where a batch has few distinct sequences on a power-of-two cluster, the rank relaxation's
exact plan competes too (solvers/bounds/rank_plan.py tree_candidate: several phases, widest groups
first; milliseconds by solvers/bounds/tree.py).

The package, bottom to top (each module imports only those above it in this list):
instance.py (the cost tables of one batch, a Draft, degree preferences and group layout),
assign.py (steps 3 and 4: longest-first assignment, packing, the drafts of one target),
rules.py (the layouts a user could write down), level.py (overflow-first splits),
local.py (a local search over layouts), search.py (the candidate search over targets),
blocks.py (large clusters searched in blocks), plan.py (`plan_greedy`: the best draft that
fits, the topology-blind and tree candidates).
"""
