"""Every planner of dcp_opt, behind one signature:

    plan(batch, cost, **options) -> PlanResult

`get_planner(name)` imports lazily, so listing planners costs nothing and a planner's
dependencies (OR-Tools for cpsat) load only when it is used.

The package by concern: `baselines/` (the methods users run instead: static layouts,
the VideoSys methods with their profile stage and stream samplers, Megatron's dynamic CP,
verl), `greedy/` and `cpsat/` (the project's planners), `bounds/` (the certified lower
bounds: LP, rank relaxation, tree recursion, stream), `stream/` (over a stream of batches:
the step former, planning ahead), with `common.py` (every planner's shared tail) and
`kinds.py` (each group's SP kind) beside this registry.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable

from dcp_opt.errors import DcpOptError, check_planner_options

# name -> "module:function" inside dcp_opt.solvers
PLANNERS: dict[str, str] = {
    "bucket": "baselines.static:plan_bucket",
    "static_tuned": "baselines.static:plan_static_tuned",
    "packed": "baselines.static:plan_packed",
    "dcp_intra": "baselines.videosys.methods:plan_dcp_intra",
    "dcp_inter": "baselines.videosys.methods:plan_dcp_inter",
    "dcp_inter_pac": "baselines.videosys.methods:plan_dcp_inter_pac",
    "greedy": "greedy.plan:plan_greedy",
    "cpsat": "cpsat.plan:plan_cpsat",
    "megatron_dynamic_cp": "baselines.megatron:plan_megatron_dynamic_cp",
    "verl_balanced": "baselines.verl:plan_verl_balanced",
    "megatron_hybrid_cp": "baselines.megatron_hybrid:plan_megatron_hybrid_cp",
}

# Pipeline planners (issue 30): they take `pp` and plan a pipeline's columns (schema 3), so
# they sit apart from PLANNERS, whose every member plans any batch on any cluster as is
# (the property tests run each on random instances); get_planner and run_planner reach both.
PIPELINE_PLANNERS: dict[str, str] = {
    "pp_greedy": "pipeline.plan:plan_pp_greedy",
    "pp_cpsat": "pipeline.cpsat:plan_pp_cpsat",
    "pp_fixed": "baselines.pipeline:plan_pp_fixed",
    "pp_verl": "baselines.pipeline:plan_pp_verl",
    "pp_wlb": "baselines.pipeline:plan_pp_wlb",
    "pp_dynapipe": "baselines.pipeline:plan_pp_dynapipe",
}

BASELINES = ("bucket", "static_tuned", "packed", "dcp_intra", "dcp_inter", "dcp_inter_pac")
# Baselines of issue 16 (1D frameworks users pick instead; docs/baselines.md)
FRAMEWORK_BASELINES = ("megatron_dynamic_cp", "verl_balanced")
# Pipeline baselines of issue 30 (solvers/baselines/pipeline.py; Megatron's under PP is
# priced by baselines/pipeline_megatron.py, its groups change per micro-step)
PIPELINE_BASELINES = ("pp_fixed", "pp_verl", "pp_wlb", "pp_dynapipe")


def available_planners() -> list[str]:
    """Planners whose module exists in this checkout."""
    out = []
    for name, target in PLANNERS.items():
        mod = target.split(":")[0]
        if importlib.util.find_spec(f"dcp_opt.solvers.{mod}") is not None:
            out.append(name)
    return out


def get_planner(name: str) -> Callable:
    """Planner `name` as a function of (batch, cost, **options) that checks first what every
    planner must refuse: an option it does not take, a bad shared option, a batch above the
    sequence cap (checked_planner). Its signature is the planner's own (inspect follows
    __wrapped__), so callers that map options onto it see the planner's parameters."""
    return _checked(name, _import_planner(name))


@functools.cache
def _checked(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def planner(batch, cost, **options):
        from .common import check_batch_size

        check_options(name, fn, options)
        check_batch_size(batch, where=name)
        return fn(batch, cost, **options)

    return planner


def _import_planner(name: str) -> Callable:
    every = PLANNERS | PIPELINE_PLANNERS
    if name not in every:
        raise DcpOptError(f"planner: {name!r} not allowed; allowed: {list(every)}")
    mod, fn = every[name].split(":")
    try:
        module = importlib.import_module(f"dcp_opt.solvers.{mod}")
    except ModuleNotFoundError as e:
        if e.name == f"dcp_opt.solvers.{mod}":
            raise DcpOptError(f"planner: {name!r} is not built yet in this checkout") from None
        raise
    return getattr(module, fn)


@functools.cache
def planner_options(fn: Callable) -> tuple[str, ...]:
    """The options planner `fn` takes: its keyword parameters after (batch, cost), and, for
    a planner that takes **options, the names it declares in `fn.extra_options` (a planner
    that takes **options without declaring them is a bug of the registry: refused)."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    names = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        extra = getattr(fn, "extra_options", None)
        if not isinstance(extra, tuple) or not all(isinstance(x, str) for x in extra):
            raise TypeError(
                f"planner {fn.__qualname__} takes **options: it must list them in "
                "`extra_options` (a tuple of names) so that run_planner can check them"
            )
        names += [x for x in extra if x not in names]
    return tuple(names)


def check_options(name: str, fn: Callable, options: dict) -> None:
    """Refuse options planner `name` does not take (a misspelt option would be ignored
    without a word otherwise), naming them and listing the ones it takes; then check the
    shared ones (time_limit_s, seed, num_workers) so a bad value names its field instead of
    failing inside numpy or CP-SAT."""
    allowed = planner_options(fn)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise DcpOptError(
            f"{name}: unknown option{'s' if len(unknown) > 1 else ''} {unknown}; "
            f"allowed: {list(allowed)}"
        )
    check_planner_options(
        **{k: options.get(k) for k in ("time_limit_s", "seed", "num_workers")}, where=name
    )


def run_planner(name: str, batch, cost, **options):
    """Plan with planner `name`, its options checked first (check_options) and the batch
    within every planner's cap (common.check_batch_size): get_planner's checked function."""
    return get_planner(name)(batch, cost, **options)


# Stream tools (issue 13), loaded on first use like the planners: the step former and the
# stream lower bound (solvers/stream/step_former.py, solvers/bounds/stream.py).
STREAM_TOOLS: dict[str, str] = {
    "data_order_steps": "stream.step_former",
    "form_steps": "stream.step_former",
    "form_steps_report": "stream.step_former",
    "stream_lower_bound": "bounds.stream",
}


def __getattr__(name: str):
    if name in STREAM_TOOLS:
        module = importlib.import_module(f"dcp_opt.solvers.{STREAM_TOOLS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
