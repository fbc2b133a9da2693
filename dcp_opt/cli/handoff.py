"""What the CLI says when inputs travel between commands: a plan moved to `simulate`/`show`,
a default model, a profile planned on another device, the violations of an invalid plan.

Every line here goes to stderr as `dcp-opt: ...`; none changes what is computed."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from ..batch import Batch
from ..cost import CostModel
from ..errors import DcpOptError
from ..model import model_preset
from ..plan import Plan, fingerprint_differences

PROG = "dcp-opt"
# An invalid plan prints its first violations, then a count per code: a phase of 10^6
# overlapping groups printed 8,000,000 lines (630 MB of stderr) before (issue 29).
MAX_VIOLATION_LINES = 20


def note(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)


# Defaults a command chose for the user ("model llama-7b, the default for 1d inputs"): said
# once the command ends (flush_defaults), or inside its one error line (defaults_suffix), so
# bad input stays one line.
_DEFAULTS: list[str] = []


def said_default(what: str) -> None:
    _DEFAULTS.append(what)


def flush_defaults() -> None:
    for what in _DEFAULTS:
        note(f"note: {what}")
    _DEFAULTS.clear()


def defaults_suffix(error: Exception | None = None) -> str:
    """` (with --model not given: ...)` for the line of an error that depends on the model (a
    sequence that fits nowhere: InfeasibleError), and forget them."""
    from ..errors import InfeasibleError

    out = (
        f" (with {'; '.join(_DEFAULTS)})"
        if _DEFAULTS and isinstance(error, InfeasibleError)
        else ""
    )
    _DEFAULTS.clear()
    return out


def model_choice(args: argparse.Namespace, recorded: dict, kind: str, default: str) -> str | None:
    """The `--model` to use: the one given; None with a profile (its own model); the preset
    a plan records (simulate, show); else the default of the batch's kind. A default is
    printed: a forgotten --model silently planned llama-7b before (issue 28)."""
    if args.model is not None or args.profile is not None:
        return args.model
    name = recorded.get("model", "").split(" #")[0]
    if name:
        try:
            model_preset(name)
        except DcpOptError:
            name = ""
    if name:
        if name != default:
            said_default(f"--model not given: {name}, as the plan records")
        return name
    said_default(f"--model not given: {default}, the default for {kind} inputs")
    return default


def cluster_choice(given: str | None, recorded: dict, default: str) -> str:
    """`--cluster` as given, else the preset a plan records (said), else `default`."""
    from ..topology.presets import cluster_preset

    if given is not None:
        return given
    name = recorded.get("cluster", "").split(" #")[0]
    if name:
        try:
            cluster_preset(name)
        except DcpOptError:
            name = ""
    if name and name != default:
        said_default(f"--cluster not given: {name}, as the plan records")
        return name
    return default


def print_violations(violations: list, plan: Plan, batch: Batch, cost: CostModel) -> None:
    """The first MAX_VIOLATION_LINES violations, a count per code of the rest, what differs
    when the fingerprint does not match, and the hint for a cp plan simulated without cp."""
    flush_defaults()
    note(f"invalid plan: {len(violations)} violation(s)")
    for v in violations[:MAX_VIOLATION_LINES]:
        print(f"  {v}", file=sys.stderr)
    rest = violations[MAX_VIOLATION_LINES:]
    if rest:
        codes = Counter(v.code for v in rest)
        counts = ", ".join(f"{c} x{k:,}" for c, k in codes.most_common())
        print(f"  ... and {len(rest):,} more ({counts})", file=sys.stderr)
    codes = {v.code for v in violations}
    if "FINGERPRINT_MISMATCH" in codes:
        diffs = fingerprint_differences(plan, batch, cost)
        recorded = "" if plan.fingerprint_inputs else " (the plan records no inputs)"
        note(f"the plan was made for other inputs{recorded}:" + ("" if diffs else " unknown"))
        for line in diffs:
            print(f"  {line}", file=sys.stderr)
        note(
            "pass the inputs it was planned with (--model, --cluster, --optimizer-sharding, "
            "--sp-kinds, --profile, the same batch), or --ignore-fingerprint to judge it on "
            "these (what-if)"
        )
    kinds = sorted({g.kind for ph in plan.phases for g in ph.groups} - set(cost.sp_kinds))
    if "BAD_KIND" in codes and kinds:
        want = ",".join(k for k in ("ulysses", "cp", "ring") if k in {*cost.sp_kinds, *kinds})
        note(
            f"the plan has {'/'.join(kinds)} groups: pass --sp-kinds {want} as when it was planned"
        )


def profile_warning(path: str, cluster) -> None:
    """Warn when the profile was measured on another device than the cluster's GPUs."""
    from pathlib import Path

    from ..profile_io import device_mismatch, load_profile

    found = device_mismatch(load_profile(path), cluster)
    if found:
        note(f"warning: profile {Path(path).name}: {found}")
