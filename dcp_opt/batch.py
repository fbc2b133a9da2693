"""Sequences and global batches. A 1D sequence has shape (length,); a 2D one has shape
(frames, height_tokens, width_tokens) in latent patches."""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Iterable
from collections.abc import Sequence as SeqABC
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .errors import DcpOptError, require

# Costs square token counts in float64: 2**53 tokens (exact in a float) squared stays finite.
MAX_TOKENS = 2**53


@dataclass(frozen=True)
class Sequence:
    id: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        require(
            isinstance(self.id, int) and self.id >= 0,
            "sequence.id",
            f"must be an integer >= 0, got {self.id!r}",
        )
        require(
            len(self.shape) in (1, 3),
            f"sequence {self.id}.shape",
            f"must be (length,) or (frames, height, width), got {self.shape!r}",
        )
        require(
            all(isinstance(x, int) and x >= 1 for x in self.shape),
            f"sequence {self.id}.shape",
            f"every entry must be an integer >= 1, got {self.shape!r}",
        )
        require(
            self.num_tokens <= MAX_TOKENS,
            f"sequence {self.id}.shape",
            f"{self.num_tokens} tokens is more than the {MAX_TOKENS} (2**53) dcp_opt can cost",
        )

    @property
    def kind(self) -> str:
        return "1d" if len(self.shape) == 1 else "2d"

    @property
    def num_tokens(self) -> int:
        return math.prod(self.shape)  # math.prod: ~20x faster than np.prod on a tuple

    @property
    def frames(self) -> int:
        return self.shape[0] if self.kind == "2d" else 1

    @property
    def spatial_tokens(self) -> int:
        return self.shape[1] * self.shape[2] if self.kind == "2d" else self.shape[0]


@dataclass(frozen=True)
class Batch:
    """A global batch: every sequence of it is trained exactly once per step."""

    sequences: tuple[Sequence, ...]

    def __post_init__(self) -> None:
        require(len(self.sequences) > 0, "batch", "is empty; give at least one sequence")
        ids = [s.id for s in self.sequences]
        require(len(set(ids)) == len(ids), "batch", "sequence ids must be unique")
        kinds = {s.kind for s in self.sequences}
        require(len(kinds) == 1, "batch", f"mixes 1D and 2D sequences ({sorted(kinds)})")

    @classmethod
    def from_lengths(cls, lengths: Iterable[int]) -> Batch:
        out = []
        for i, n in enumerate(lengths):
            if not isinstance(n, (int, np.integer)) or n < 1:
                raise DcpOptError(f"length[{i}]: must be an integer >= 1, got {n!r}")
            out.append(Sequence(i, (int(n),)))
        return cls(tuple(out))

    @classmethod
    def from_shapes(cls, shapes: Iterable[SeqABC[int]]) -> Batch:
        out = []
        for i, s in enumerate(shapes):
            s = tuple(int(x) for x in s)
            if len(s) != 3 or min(s) < 1:
                raise DcpOptError(
                    f"shape[{i}]: must be 3 integers >= 1 (frames,height,width), got {s!r}"
                )
            out.append(Sequence(i, s))
        return cls(tuple(out))

    @property
    def kind(self) -> str:
        return self.sequences[0].kind

    def __len__(self) -> int:
        return len(self.sequences)

    @cached_property
    def by_id(self) -> dict[int, Sequence]:
        return {s.id: s for s in self.sequences}

    @cached_property
    def tokens_by_id(self) -> dict[int, int]:
        """Tokens of each sequence, by id (computed once: validate, simulate and the planners
        all ask for it on every plan)."""
        return {s.id: math.prod(s.shape) for s in self.sequences}

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.tokens_by_id.values())

    def fingerprint(self) -> str:
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        # Cached: planners, tables and validate() ask for it many times per batch. Ids and
        # shapes as packed int64 (3x faster than JSON: the greedy planner's budget is ~10 ms
        # at 512 sequences); ids beyond int64 take the JSON form.
        width = len(self.sequences[0].shape)
        try:
            packed = array("q", [x for s in self.sequences for x in (s.id, *s.shape)])
            payload = b"%d|" % width + packed.tobytes()
        except OverflowError:
            payload = json.dumps([[s.id, list(s.shape)] for s in self.sequences]).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"sequences": [{"id": s.id, "shape": list(s.shape)} for s in self.sequences]}

    @classmethod
    def from_dict(cls, d: dict) -> Batch:
        try:
            return cls(
                tuple(
                    Sequence(int(x["id"]), tuple(int(v) for v in x["shape"]))
                    for x in d["sequences"]
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DcpOptError):
                raise
            raise DcpOptError(f"batch: malformed ({e})") from None
