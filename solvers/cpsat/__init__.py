"""The CP-SAT planner (`plan_cpsat`): the formulation is in plan.py's docstring, the model
in model.py (one function per constraint group), the solution read back in extract.py."""
