"""Restarts under torchrun (`--max-restarts N`): a store of the attempt's own for the
process groups, and a plain explanation when a restart fails to connect.

Why restarts failed to connect: torchrun's agent hands its workers a TCPStore that lives
across restarts (TORCHELASTIC_USE_AGENT_STORE=True) and torch's env:// rendezvous adds no
per-attempt prefix to it (torch/distributed/rendezvous.py: "We create a new TCPStore for
every retry so no need to add prefix for each attempt"). That holds for neither of torchrun's
rendezvous as torch 2.13 runs them:

- `--master_port P` (no `--rdzv-backend`): the static rendezvous
  (elastic/rendezvous/static_tcp_rendezvous.py) creates its TCPStore once and reuses it for
  every attempt;
- `--standalone` / `--rdzv-backend c10d`: the dynamic rendezvous shares its own store with
  the workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (dynamic_rendezvous.py).

So a restarted rank reads the gloo addresses the previous attempt's ranks published under
the same keys (the default group's, then every `new_group`'s: their names are the same each
attempt), connects to a dead port, and fails with "Gloo connectFullMesh failed ...
Connection refused", in init_process_group or in a later new_group, depending on which rank
republishes first. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 only fixes the dynamic case.

`attempt_store()` gives `init_process_group(store=...)` the agent's store under a prefix
naming the attempt (TORCHELASTIC_RESTART_COUNT), so no attempt sees another's keys, under
either rendezvous, with or without that variable. Every later group inherits the prefix
(new_group builds on the default group's store).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from dcp_opt.errors import DcpOptError

SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_count() -> int:
    """torchrun's attempt number (0 for the first, and outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def attempt_store(timeout_s: float) -> dist.Store | None:
    """A client of torchrun's agent store whose keys are this attempt's alone, for
    `init_process_group(backend, store=..., rank=RANK, world_size=WORLD_SIZE)`; None outside
    torchrun's agent store (plain env:// then does what torch does)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"dcp_opt/{run}/attempt_{restart_count()}", store)


def init_world(backend: str, timeout_s: float) -> None:
    """init_process_group from torchrun's environment (env://), on the attempt's own store
    under torchrun (`attempt_store`); every collective bounded by `timeout_s`. A failure to
    connect on a restart says why (`restart_hint`)."""
    store = attempt_store(timeout_s)
    kw = {}
    if store is not None:
        kw = {"store": store, "rank": int(os.environ["RANK"]),
              "world_size": int(os.environ["WORLD_SIZE"])}  # fmt: skip
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kw)
    except RuntimeError as e:
        raise_with_restart_hint(e)
        raise


def raise_with_restart_hint(error: BaseException) -> None:
    """Raise a DcpOptError that explains `error` when it is a restarted rank failing to
    connect (see the module docstring); return otherwise (the caller re-raises)."""
    hint = restart_hint(error)
    if hint is not None:
        raise DcpOptError(f"{str(error).splitlines()[0][:300]}: {hint}") from error


def restart_hint(error: BaseException) -> str | None:
    """The explanation to add to a connection error of a restarted rank (None otherwise)."""
    text = str(error)
    if restart_count() == 0 or not ("Connection refused" in text or "connectFullMesh" in text):
        return None
    shared = os.environ.get(SHARE_STORE_VAR) != "1"
    return (
        f"this is torchrun restart {restart_count()}"
        + (f" without {SHARE_STORE_VAR}=1" if shared else "")
        + ": torchrun's store outlives the previous attempt and torch adds no per-attempt "
        "prefix to it, so this rank may have read the gloo address of a rank of the previous "
        "attempt (a dead port). Initialise the world with "
        "dcp_opt.runtime.elastic.init_world(backend, timeout_s) (an attempt-scoped store: "
        "works with --standalone and with --master_port)"
        + (
            f", or, with --standalone only, set {SHARE_STORE_VAR}=1 in torchrun's environment"
            if shared
            else ""
        )  # fmt: skip
        + " (docs/integration.md, rank failures)"
    )
