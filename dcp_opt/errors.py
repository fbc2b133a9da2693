"""Exceptions raised for user errors. Each message names the field or sequence at fault."""

from __future__ import annotations

import codecs
import json
import math
import numbers
from pathlib import Path

# Seeds reach OR-Tools' CP-SAT as a 32-bit integer (its `random_seed` parameter): a larger one
# would fail inside the solver, not here.
MAX_SEED = 2**31 - 1


class DcpOptError(ValueError):
    """Base class: bad input that the user can fix. The CLI prints it on one line."""


class InfeasibleError(DcpOptError):
    """A sequence (or batch) cannot fit in memory under any allowed choice."""

    def __init__(
        self,
        message: str,
        *,
        sequence_id: int | None = None,
        need_bytes: float | None = None,
        capacity_bytes: float | None = None,
    ):
        super().__init__(message)
        self.sequence_id = sequence_id
        self.need_bytes = need_bytes
        self.capacity_bytes = capacity_bytes


class PlanFormatError(DcpOptError):
    """A plan JSON that does not parse into a Plan (wrong version, type or shape)."""


def is_int(x) -> bool:
    """An int, not a bool (True is an int to Python, never a count to us)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A finite int or float (not a bool; an int too big for a float is not finite here)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def short_repr(value) -> str:
    """repr(value) for an error message, cut to a readable length: a 400-digit integer or a
    long list is shown by its start and its length, not in full."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:40]}...({len(text)} characters)"


def require(cond: bool, field: str, message: str) -> None:
    """Raise DcpOptError('<field>: <message>') unless cond holds."""
    if not cond:
        raise DcpOptError(f"{field}: {message}")


# The largest seed and worker count a planner takes: CP-SAT's `random_seed` and
# `num_workers` are 32-bit fields (OR-Tools raises a TypeError above 2**31 - 1), and every
# planner takes the same range so that a seed means the same thing to each. Workers are
# threads: more than MAX_WORKERS is a typo, not a machine.
MAX_SEED = 2**31 - 1
MAX_WORKERS = 1024


def check_planner_options(
    *, time_limit_s=None, seed=None, num_workers=None, where: str = "planner"
) -> None:
    """The options every searching planner takes, checked once for the API and the CLI
    (None: not given): a finite budget > 0 s, a seed in 0..MAX_SEED, 1..MAX_WORKERS worker
    threads."""
    if time_limit_s is not None:
        require(
            is_real(time_limit_s) and time_limit_s > 0,
            f"{where}.time_limit_s",
            f"must be a finite number of seconds > 0, got {time_limit_s!r}",
        )
    if seed is not None:
        require(
            is_int(seed) and seed >= 0,
            f"{where}.seed",
            f"must be an integer >= 0, got {_short(seed)}",
        )
        require(
            seed <= MAX_SEED,
            f"{where}.seed",
            f"must be at most {MAX_SEED} (2**31 - 1: CP-SAT's seed is 32-bit), got {_short(seed)}",
        )
    if num_workers is not None:
        require(
            is_int(num_workers) and num_workers >= 1,
            f"{where}.num_workers",
            f"must be an integer >= 1, got {_short(num_workers)}",
        )
        require(
            num_workers <= MAX_WORKERS,
            f"{where}.num_workers",
            f"must be at most {MAX_WORKERS} threads, got {_short(num_workers)}",
        )


def _short(value) -> str:
    """repr of a value for a message, cut to 60 characters (a 400-digit seed stays one line)."""
    if is_int(value) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def loads_json(text: str, where: str, error: type[DcpOptError] = DcpOptError):
    """json.loads whose every failure is `error("<where>: not valid JSON (<why>)")`, so each
    input (plan, profile, lengths, model and cluster files) says the same thing."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # a recursion bomb ("[[[[..."), not a document
        raise error(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer past Python's 4300-digit limit
        raise error(f"{where}: not valid JSON ({e})") from None


# Byte-order marks of the encodings a JSON or text file must not be in (RFC 8259 sec. 8.1: JSON
# is UTF-8); UTF-32's before UTF-16's, whose mark begins it.
_FOREIGN_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def read_text(path: str | Path, where: str, error: type[DcpOptError] = DcpOptError) -> str:
    """The UTF-8 text of `path` (a UTF-8 byte-order mark is dropped). Every failure is
    `error("<where>: ...")`: unreadable (with the OS's reason), UTF-16 or UTF-32 (saved by an
    editor that does so: "save it as UTF-8"), or not text (the first bad byte)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{where}: cannot read ({e.strerror or e})") from None
    for bom, name in _FOREIGN_BOMS:
        if data.startswith(bom):
            raise error(f"{where}: {name} text; save it as UTF-8") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        hint = "; save it as UTF-8" if b"\x00" in data[:64] else ""
        raise error(f"{where}: not UTF-8 text (byte {e.start}){hint}") from None


def format_bytes(n: float) -> str:
    """A byte count people read: "512 B", "3.2 MB", "141.0 GB" (decimal units, as GB is
    elsewhere), never "0.0 GB" for a small model's megabytes."""
    n = float(n)
    if not math.isfinite(n):
        return f"{n} B"
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
