"""The smallest job layouts that fit (issue 26, "errors that say what to change"): the least
tensor-parallel degree, the least zero3 shard domain, for the model states alone or for a
sequence at the largest SP degree. The errors of memory.py name them; the CLI's
`--optimizer-sharding zero3` without `--shard-domain` takes `least_shard_domain`, and without
`--optimizer-sharding` `least_sharded` (the note says why: `shortfall`)."""

from __future__ import annotations

from ..errors import format_bytes
from .units import allowed_tensor_parallel
from .zero3 import allowed_domains


def fits(cost, tokens: int | None = None) -> bool:
    """Whether the model states and the reserve fit some unit (tokens None), or a sequence
    of `tokens` fits the largest degree's best placement with every layer recomputed."""
    c = cost.cluster
    if tokens is None:
        return cost.fixed_bytes() < max(cost.capacity(s, 1) for s in range(c.num_gpus))
    d = max(c.allowed_degrees)
    cap = max(cost.capacity(s, d) for s in c.placements(d))
    return int(cost.min_recompute(tokens, d, cap)) >= 0


def least_shard_domain(cost, tokens: int | None = None) -> int | None:
    """The least zero3 shard domain (> 1) at the cost model's TP degree under which
    `fits(tokens)`; None if none does."""
    units = cost.with_(optimizer_sharding="zero3", shard_domain=0).cluster
    for s in allowed_domains(units):
        if s > 1 and fits(cost.with_(optimizer_sharding="zero3", shard_domain=s), tokens):
            return s
    return None


STEP_LEVEL_MODES = ("zero1", "zero2", "zero3")  # least sharded first


def least_sharded(cost, tokens: int | None = None):
    """The least-sharded setting at the cost model's TP degree under which `fits(tokens)`:
    the step-level modes in the order zero1, zero2, zero3, then per-layer zero3 over the
    least shard domain; None if none does."""
    for mode in STEP_LEVEL_MODES:
        c = cost.with_(optimizer_sharding=mode, shard_domain=0)
        if fits(c, tokens):
            return c
    s = least_shard_domain(cost, tokens)
    return None if s is None else cost.with_(optimizer_sharding="zero3", shard_domain=s)


def shortfall(cost, tokens: int | None = None) -> str:
    """Why `cost` does not fit, bytes per GPU: its model states (+ the reserve) against the
    capacity, or with a sequence of `tokens` at the largest degree, every layer recomputed
    (as memory.check_fits measures it)."""
    c, t = cost.cluster, cost.tensor_parallel
    states = format_bytes(cost.model_state_bytes() / t)
    if tokens is None or not fits(cost):
        cap = max(cost.capacity(s, 1) for s in range(c.num_gpus)) / t
        return (
            f"model states {states} + {format_bytes(cost.coeffs.reserved_bytes / t)} reserved "
            f"exceed {format_bytes(cap)}"
        )
    d = max(c.allowed_degrees)
    cap = max(cost.capacity(s, d) for s in c.placements(d)) / t
    need = float(cost.memory(tokens, d, cost.model.num_layers)) / t
    return (
        f"model states {states} + the longest sequence ({tokens} tokens) need "
        f"{format_bytes(need)} of {format_bytes(cap)}"
    )


def fitting_settings(cost, tokens: int | None = None) -> str:
    """The smallest settings that fit, as CLI flags: the least TP degree under the mode's
    step-level schedule (zero1 where the cost model runs per-layer zero3), and the least
    zero3 shard domain at the least TP degree that has one."""
    tps = allowed_tensor_parallel(cost.model, cost.gpu_cluster)
    mode = cost.optimizer_sharding if not cost.shard_domain else "zero1"
    out = []
    for t in tps:
        if fits(cost.with_(tensor_parallel=t, optimizer_sharding=mode, shard_domain=0), tokens):
            flag = "" if mode == cost.optimizer_sharding else f" --optimizer-sharding {mode}"
            out.append(f"--tp {t}{flag}")
            break
    # the least TP degree with a domain, and the user's own TP degree if it is another
    for t in tps:
        s = least_shard_domain(cost.with_(tensor_parallel=t, shard_domain=0), tokens)
        if s is not None:
            out.append(_zero3_flags(t, s))
            break
    own = cost.tensor_parallel
    if own > 1 and not any(f.startswith(f"--tp {own} --opt") for f in out):
        s = least_shard_domain(cost.with_(shard_domain=0), tokens)
        if s is not None:
            out.append(_zero3_flags(own, s))
    what = "the states" if tokens is None else "it"
    if not out:
        return (
            f"No tensor-parallel degree or zero3 shard domain fits {what} on this cluster: "
            "more GPUs or more memory per GPU"
        )
    return f"Needs {', or '.join(out)} (the smallest settings that fit {what})"


def _zero3_flags(t: int, s: int) -> str:
    return (f"--tp {t} " if t > 1 else "") + f"--optimizer-sharding zero3 --shard-domain {s}"
