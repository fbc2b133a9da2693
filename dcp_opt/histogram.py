"""A length distribution: shapes with weights, read from a histogram or a lengths file, and
sampled into global batches the way dcp_opt.workloads draws the standard ones.

Histogram file: CSV, one bin per row, `length,count` for text or `frames,height,width,count`
for video (height/width in latent patches, as batch files); an optional header row naming
those columns; `#` starts a comment. A count is a weight (any finite number >= 0, not
necessarily an integer; rows of the same shape add up); every bin is sampled at its given
shape. Example:

    length,count
    512,1200
    2048,800
    8192,150
    32768,20

Lengths file: any batch file `load_batch` reads (one length or `frames,height,width` per line,
or JSON); each distinct shape becomes a bin weighted by how often it occurs.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batch import Batch, Sequence
from .errors import DcpOptError, read_text
from .workloads import load_batch

HEADERS = {1: ("length", "count"), 3: ("frames", "height", "width", "count")}


@dataclass(frozen=True)
class LengthDistribution:
    """Bins of sequence shapes with weights: `(length,)` for text, `(f, h, w)` for video."""

    shapes: tuple[tuple[int, ...], ...]
    weights: tuple[float, ...]
    source: str = "histogram"

    def __post_init__(self) -> None:
        if not self.shapes:
            raise DcpOptError(f"{self.source}: no bins; give at least one shape with a count")
        if len(self.shapes) != len(self.weights):
            raise DcpOptError(
                f"{self.source}: {len(self.shapes)} shapes but {len(self.weights)} weights"
            )
        if len({len(s) for s in self.shapes}) > 1:
            raise DcpOptError(f"{self.source}: mixes 1D lengths and 2D shapes")
        for s in self.shapes:
            Sequence(0, tuple(s))  # names a bad shape
        if any(not w >= 0 for w in self.weights) or sum(self.weights) <= 0:
            raise DcpOptError(f"{self.source}: counts must be >= 0 with a positive total")

    @property
    def kind(self) -> str:
        return "1d" if len(self.shapes[0]) == 1 else "2d"

    @property
    def tokens(self) -> np.ndarray:
        return np.array([int(np.prod(s)) for s in self.shapes], dtype=float)

    @property
    def probabilities(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        return w / w.sum()

    @classmethod
    def from_counts(cls, counts: dict[tuple[int, ...], float], source: str) -> LengthDistribution:
        keys = sorted(counts, key=lambda s: (int(np.prod(s)), s))
        return cls(tuple(keys), tuple(float(counts[k]) for k in keys), source)

    @classmethod
    def from_lengths(cls, path: str | Path) -> LengthDistribution:
        batch = load_batch(path)
        counts = Counter(s.shape for s in batch.sequences)
        return cls.from_counts(dict(counts), f"lengths file {Path(path).name}")

    @classmethod
    def from_histogram(cls, path: str | Path) -> LengthDistribution:
        p = Path(path)
        # read_text: an unreadable, UTF-16/32 or non-UTF-8 file is a DcpOptError naming it
        text = read_text(p, f"histogram file {str(p)!r}")
        return cls.from_histogram_text(text, source=f"histogram {p.name}")

    @classmethod
    def from_histogram_text(cls, text: str, source: str = "histogram") -> LengthDistribution:
        """CSV rows `length,count` or `frames,height,width,count` (module docstring)."""
        counts: dict[tuple[int, ...], float] = {}
        width = None
        for lineno, row in _csv_rows(text):
            if width is None and not _is_number(row[0]):
                if tuple(c.lower() for c in row) not in HEADERS.values():
                    raise DcpOptError(
                        f"{source}:{lineno}: header {row} not allowed; allowed: "
                        f"{[','.join(h) for h in HEADERS.values()]}"
                    )
                width = len(row)
                continue
            shape, count = _parse_bin(row, lineno, source, width)
            width = len(row)
            counts[shape] = counts.get(shape, 0.0) + count
        if not counts:
            raise DcpOptError(f"{source}: no bins; expected rows `length,count`")
        return cls.from_counts(counts, source)

    def sample_batch(self, seed: int, token_budget: int) -> Batch:
        """Sequences drawn i.i.d. until `token_budget` tokens are reached (the last one may
        cross it), as dcp_opt.workloads draws the standard global batches."""
        if token_budget < 1:
            raise DcpOptError(f"token_budget: must be >= 1, got {token_budget}")
        rng = np.random.default_rng(seed)
        p, tok = self.probabilities, self.tokens
        chunk = int(token_budget / float(p @ tok) * 1.2) + 16
        idx = np.empty(0, dtype=int)
        while True:
            idx = np.concatenate([idx, rng.choice(len(p), size=chunk, p=p)])
            total = np.cumsum(tok[idx])
            if total[-1] >= token_budget:
                idx = idx[: int(np.searchsorted(total, token_budget)) + 1]
                break
        return Batch(tuple(Sequence(i, self.shapes[k]) for i, k in enumerate(idx.tolist())))

    def summary(self) -> dict:
        p, tok = self.probabilities, self.tokens
        order = np.argsort(tok)
        cdf = np.cumsum(p[order])
        pct = {q: float(tok[order][int(np.searchsorted(cdf, q / 100 - 1e-12))]) for q in (50, 90)}
        return {
            "source": self.source,
            "kind": self.kind,
            "num_bins": len(self.shapes),
            "mean_tokens": float(p @ tok),
            "p50_tokens": pct[50],
            "p90_tokens": pct[90],
            "max_tokens": float(tok.max()),
        }

    def token_histogram(self) -> dict:
        """Shares of sequences and of tokens per power-of-two bin of tokens per sequence."""
        p, tok = self.probabilities, self.tokens
        # [2^k, 2^(k+1)) bins from the shortest to past the longest sequence
        lo, hi = int(np.floor(np.log2(tok.min()))), int(np.floor(np.log2(tok.max()))) + 1
        edges = 2.0 ** np.arange(lo, hi + 1)
        seq, _ = np.histogram(tok, bins=edges, weights=p)
        toks, _ = np.histogram(tok, bins=edges, weights=p * tok)
        return {
            "edges": edges.tolist(),
            "sequence_share": seq.tolist(),
            "token_share": (toks / toks.sum()).tolist(),
        }


def _csv_rows(text: str):
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            yield lineno, [c.strip() for c in next(csv.reader(io.StringIO(line)))]


def _is_number(x: str) -> bool:
    try:
        float(x)
    except ValueError:
        return False
    return True


def _parse_bin(row: list[str], lineno: int, source: str, width: int | None):
    where = f"{source}:{lineno}"
    if len(row) - 1 not in HEADERS:
        raise DcpOptError(
            f"{where}: expected `length,count` or `frames,height,width,count`, got {row}"
        )
    if width is not None and len(row) != width:
        raise DcpOptError(f"{where}: {len(row)} columns but earlier rows have {width}")
    try:
        shape = tuple(int(v) for v in row[:-1])
    except ValueError:
        raise DcpOptError(f"{where}: shape must be integers, got {row[:-1]}") from None
    if min(shape) < 1:
        raise DcpOptError(f"{where}: shape entries must be >= 1, got {shape}")
    try:
        count = float(row[-1])
    except ValueError:
        raise DcpOptError(f"{where}: count must be a number >= 0, got {row[-1]!r}") from None
    if not count >= 0 or count == float("inf"):
        raise DcpOptError(f"{where}: count must be a finite number >= 0, got {row[-1]!r}")
    return shape, count
