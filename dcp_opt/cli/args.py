"""Argument types of the `dcp-opt` command line: integers in a range, one-line errors.

Every count or size an option takes is capped: a value past the cap is a typo or would not
finish (`--tokens-per-gpu 10000000000000` drew sequences for ever, `--dpi 100000` asked for a
gigapixel image). argparse turns the ArgumentTypeError into `dcp-opt: error: argument ...`."""

from __future__ import annotations

import argparse

from ..cluster import MAX_GPUS
from ..errors import MAX_SEED, DcpOptError
from ..workloads import MAX_TOKENS_PER_GPU

MAX_BATCHES = 10_000  # seeds per workload (bench), sampled batches (whatif)
MAX_EPOCH_BATCHES = 1_000  # an epoch of 1,000 x 2M tokens: ~620K sequences of 1d-short
MAX_WORKERS = 1024
MAX_DPI = 600  # a 14 x 30 inch Gantt chart at 600 dpi is already 150 Mpx
MIN_DPI = 10


def split(text: str | None) -> tuple[str, ...] | None:
    """Comma-separated values, blanks dropped (None stays None)."""
    return None if text is None else tuple(x.strip() for x in text.split(",") if x.strip())


def int_in(low: int, high: int, what: str = "an integer"):
    """An argparse type: an integer in [low, high] (decimal digits only, as typed)."""

    def parse(text: str) -> int:
        digits = text.strip().removeprefix("-").removeprefix("+")
        if not digits.isdigit() or len(digits) > 20:
            raise argparse.ArgumentTypeError(
                f"must be {what} in [{low}, {high}], got {text[:40]!r}"
            )
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {what} in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def at_most(high: int):
    """An argparse type: an integer at most `high`. The lower bound is the library's to check
    (its message names the field as the Python API does: `num_batches: must be >= 1`)."""

    def parse(text: str) -> int:
        digits = text.strip().removeprefix("-").removeprefix("+")
        if not digits.isdigit() or len(digits) > 20:
            raise argparse.ArgumentTypeError(
                f"must be an integer, at most {high}, got {text[:40]!r}"
            )
        value = int(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be an integer, at most {high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


tokens_per_gpu = at_most(MAX_TOKENS_PER_GPU)
batches = at_most(MAX_BATCHES)
epoch_batches = at_most(MAX_EPOCH_BATCHES)
workers = at_most(MAX_WORKERS)
gpus = at_most(MAX_GPUS)
dpi = int_in(MIN_DPI, MAX_DPI)  # matplotlib's own errors for 0 or -1 are no one-line message
former_shift = int_in(0, 64)  # steps a sample may move (the step former's K)


# ---- --sp-kinds (plan, simulate, show, bench, whatif) -----------------------------------------
def add_sp_kinds(p: argparse.ArgumentParser, *, note: str = "", default="ulysses") -> None:
    p.add_argument(
        "--sp-kinds",
        default=default,
        metavar="KINDS",
        help="SP kinds a group may take: ulysses (default), or ulysses with cp (all-gather-KV "
        "context parallelism) and/or ring (ring attention), e.g. ulysses,cp,ring (1D models; "
        f"the planners choose per group){note}",
    )


def sp_kinds(args: argparse.Namespace, input_kind: str | None = None) -> tuple[str, ...]:
    """--sp-kinds as CostModel.sp_kinds; one-line errors naming the flag and the values."""
    from ..cost.cp import SP_KINDS

    kinds = split(args.sp_kinds) or ()
    if (
        any(k not in SP_KINDS for k in kinds)
        or "ulysses" not in kinds
        or len(set(kinds)) < len(kinds)
    ):
        raise DcpOptError(
            f"--sp-kinds: {args.sp_kinds!r} not allowed; allowed: 'ulysses' with any of "
            "'cp', 'ring' (e.g. 'ulysses,cp,ring'), each once"
        )
    other = [k for k in kinds if k != "ulysses"]
    if other and input_kind == "2d":
        raise DcpOptError(
            f"--sp-kinds: {other[0]!r} not allowed for 2d (video) inputs; allowed: 'ulysses' "
            f"({other[0]} is for 1D causal models)"
        )
    return tuple(kinds)


def check_seed(seed: int | None, count: int = 1) -> None:
    """The seeds seed .. seed + count - 1 reach the planners (CP-SAT takes 32 bits): refuse a
    larger one here, as the planners would (a negative one: the library says so)."""
    if seed is not None and seed + count - 1 > MAX_SEED:
        raise DcpOptError(
            f"seed: must be an integer in [0, {MAX_SEED}] (2**31 - 1; with --batches "
            f"{count}: at most {MAX_SEED - count + 1}), got {seed}"
        )
