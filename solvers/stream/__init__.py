"""Planning over a stream of batches: step_former.py (which samples form each optimizer
step), async_plan.py (plan batch k+1 while batch k trains). The stream's lower bound is
solvers/bounds/stream.py."""
