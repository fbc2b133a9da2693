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

from .errors import DcpOptError, is_int, require
from .errors import short_repr as _short

# Costs square token counts in float64: 2**53 tokens (exact in a float) squared stays finite.
MAX_TOKENS = 2**53
# Sequences in one global batch: a 5,000,000-sequence batch took 2 min and 6.9 GB to plan
# (issue 29); 2**20 plan in under a minute within ~1.5 GB. A bigger one is refused with how to
# split it (one optimizer step per part).
MAX_SEQUENCES = 2**20


@dataclass(frozen=True)
class Sequence:
    id: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        require(
            is_int(self.id) and self.id >= 0,
            "sequence.id",
            f"must be an integer >= 0, got {_short(self.id)}",
        )
        require(
            len(self.shape) in (1, 3),
            f"sequence {self.id}.shape",
            f"must be (length,) or (frames, height, width), got {self.shape!r}",
        )
        require(
            all(is_int(x) and x >= 1 for x in self.shape),
            f"sequence {self.id}.shape",
            f"every entry must be an integer >= 1, got {_short(self.shape)}",
        )
        require(
            self.num_tokens <= MAX_TOKENS,
            f"sequence {self.id}.shape",
            f"{_short(self.num_tokens)} tokens is more than the {MAX_TOKENS} (2**53) dcp_opt "
            "can cost",
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
        check_num_sequences(len(self.sequences))
        ids = [s.id for s in self.sequences]
        require(len(set(ids)) == len(ids), "batch", "sequence ids must be unique")
        kinds = {s.kind for s in self.sequences}
        require(len(kinds) == 1, "batch", f"mixes 1D and 2D sequences ({sorted(kinds)})")

    @classmethod
    def from_lengths(cls, lengths: Iterable[int]) -> Batch:
        out = []
        for i, n in enumerate(lengths):
            if not (is_int(n) or isinstance(n, np.integer)) or n < 1:
                raise DcpOptError(f"length[{i}]: must be an integer >= 1, got {_short(n)}")
            out.append(Sequence(i, (int(n),)))
        return cls(tuple(out))

    @classmethod
    def from_shapes(cls, shapes: Iterable[SeqABC[int]]) -> Batch:
        out = []
        for i, s in enumerate(shapes):
            s = tuple(s)
            # exact: 1.9 is not 1, True is not 1 (numpy integers are integers)
            if len(s) != 3 or not all(
                (is_int(x) or isinstance(x, np.integer)) and x >= 1 for x in s
            ):
                raise DcpOptError(
                    f"shape[{i}]: must be 3 integers >= 1 (frames,height,width), got {_short(s)}"
                )
            out.append(Sequence(i, tuple(int(x) for x in s)))
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
        """{"sequences": [{"id": int, "shape": [int, ...]}, ...]}: ids and shapes as exact
        integers (0.7 is not 0, true is not 1), each entry named in the error."""
        seqs = d.get("sequences") if isinstance(d, dict) else None
        if not isinstance(seqs, (list, tuple)):
            raise DcpOptError("batch.sequences: missing or not a list")
        check_num_sequences(len(seqs))
        out = []
        for i, x in enumerate(seqs):
            where = f"batch.sequences[{i}]"
            if not isinstance(x, dict) or "id" not in x or "shape" not in x:
                raise DcpOptError(f"{where}: expected an object with `id` and `shape`")
            if not is_int(x["id"]):
                raise DcpOptError(f"{where}.id: must be an integer >= 0, got {_short(x['id'])}")
            shape = x["shape"]
            if not isinstance(shape, (list, tuple)) or not all(is_int(v) for v in shape):
                raise DcpOptError(f"{where}.shape: must be a list of integers, got {_short(shape)}")
            out.append(Sequence(x["id"], tuple(shape)))
        return cls(tuple(out))


def check_num_sequences(n: int) -> None:
    """Refuse a global batch of more than MAX_SEQUENCES sequences, saying how to split it."""
    if n > MAX_SEQUENCES:
        parts = -(-n // MAX_SEQUENCES)
        raise DcpOptError(
            f"batch: {n:,} sequences; at most {MAX_SEQUENCES:,} ({MAX_SEQUENCES} = 2**20) per "
            f"global batch: split it into {parts} or more batches (one optimizer step each, "
            "e.g. with dcp_opt.runtime.data's loaders) and plan each"
        )
