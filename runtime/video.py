"""A micro-batch of videos as one packed token stream, and the DSP switch between its two
layouts, so every attention and every all-to-all of a 2D micro-batch is one call for all its
videos (runtime/attention.py packed_attention; DSP: Zhao et al. 2024, sec. 3).

Video v has F_v frames of S_v spatial tokens. Over a group of degree d, F_v and S_v are
padded to multiples of d (Fp_v, Sp_v) and member r holds:
- spatial layout (spatial blocks): frames [r * Fp_v/d, (r+1) * Fp_v/d) of every video, all
  S_v tokens of each; video-major, then frame, then spatial token. Self-attention sequences:
  one per frame (S_v tokens).
- temporal layout (temporal blocks): spatial tokens [r * Sp_v/d, (r+1) * Sp_v/d) of every
  video, all Fp_v frames of each; video-major, then spatial token, then frame.
  Self-attention sequences: per spatial token, its F_v real frames, then its Fp_v - F_v
  padded frames as a sequence of their own, so no real query ever sees a padded key (no mask
  needed) and padded frames, which carry no loss, never reach a real token.
The switch is a gather into a send buffer (d equal chunks, spatial padding from a zero row),
one all_to_all over the group, and a gather into the other layout; its backward is the
inverse all-to-all (sp.all_to_all). The bytes handed are the sum over videos of the
per-video switch, Fp_v/d * Sp_v * C, what the cost model charges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .sp import SPGroup, all_to_all


@dataclass(frozen=True)
class PackedRows:
    """How a DiT block's packed tokens [T, C] split: `lengths` its self-attention sequences,
    `videos` the tokens of each video (whole runs of consecutive sequences), `text` each
    video's caption tokens (cross-attention keys)."""

    lengths: tuple[int, ...]
    videos: tuple[int, ...]
    text: tuple[int, ...]


@dataclass(frozen=True)
class VideoLayout:
    """This member's share of a micro-batch of videos of `shapes` (F_v, S_v), with captions
    of `text_lengths` tokens, over a group of `degree` (module docstring)."""

    shapes: tuple[tuple[int, int], ...]
    text_lengths: tuple[int, ...]
    degree: int = 1
    rank: int = 0
    device: torch.device | str = "cpu"
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.shapes or len(self.shapes) != len(self.text_lengths):
            raise ValueError(
                f"shapes: {len(self.shapes)} videos with {len(self.text_lengths)} captions; "
                "allowed: >= 1 video, one caption length each"
            )
        if min(min(f, s) for f, s in self.shapes) < 1 or min(self.text_lengths) < 1:
            raise ValueError("shapes: frames, spatial tokens and caption tokens must be >= 1")
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"rank: {self.rank} not allowed; allowed: 0 <= rank < {self.degree}")
        self._index.update(_build_index(self))

    def _pad(self, n: int) -> int:
        return -(-n // self.degree) * self.degree

    @cached_property
    def spatial(self) -> PackedRows:
        """Sequences of the spatial layout: one per held frame."""
        d = self.degree
        lengths = tuple(s for f, s in self.shapes for _ in range(self._pad(f) // d))
        videos = tuple(self._pad(f) // d * s for f, s in self.shapes)
        return PackedRows(lengths, videos, self.text_lengths)

    @cached_property
    def temporal(self) -> PackedRows:
        """Sequences of the temporal layout: per held spatial token, real then padded frames."""
        d, lengths = self.degree, []
        for f, s in self.shapes:
            one = (f,) if self._pad(f) == f else (f, self._pad(f) - f)
            lengths += one * (self._pad(s) // d)
        videos = tuple(self._pad(s) // d * self._pad(f) for f, s in self.shapes)
        return PackedRows(tuple(lengths), videos, self.text_lengths)

    @property
    def frame_ids(self) -> torch.Tensor:
        """[T] absolute frame index of each token of the spatial layout."""
        return self._index["frame_ids"]

    @property
    def spatial_ids(self) -> torch.Tensor:
        """[T] absolute spatial index of each token of the spatial layout."""
        return self._index["spatial_ids"]

    @property
    def real(self) -> torch.Tensor:
        """[T] bool: the token of the spatial layout is in a real (not padded) frame."""
        return self._index["real"]


def _build_index(lay: VideoLayout) -> dict[str, torch.Tensor]:
    """Gather indices of the switch, built once per micro-batch (module docstring)."""
    d, r = lay.degree, lay.rank
    per = [(lay._pad(f) // d, lay._pad(s) // d) for f, s in lay.shapes]  # (frames, spatial)
    chunk = sum(fl * sl for fl, sl in per)  # tokens each member sends to each member
    num_spatial = sum(fl * s for (fl, _), (_, s) in zip(per, lay.shapes, strict=True))
    send = torch.full((d * chunk,), num_spatial, dtype=torch.long)  # default: the zero row
    back = torch.empty(num_spatial, dtype=torch.long)
    recv = torch.empty(d * chunk, dtype=torch.long)
    ids = {"frame_ids": [], "spatial_ids": [], "real": []}
    off_s = off_m = off_t = 0
    for (fl, sl), (f, s) in zip(per, lay.shapes, strict=True):
        j, fr, sc = torch.meshgrid(
            torch.arange(d), torch.arange(fl), torch.arange(sl), indexing="ij"
        )
        slot = j * chunk + off_m + fr * sl + sc
        s_glob = j * sl + sc
        real = s_glob < s
        src = off_s + fr * s + s_glob
        send[slot[real]] = src[real]
        back[src[real]] = slot[real]
        # temporal token (spatial sc of mine, frame j*fl + fr) came from member j at `slot`
        recv[off_t + sc * (fl * d) + j * fl + fr] = slot
        frames = torch.arange(r * fl, (r + 1) * fl)
        ids["frame_ids"].append(frames.repeat_interleave(s))
        ids["spatial_ids"].append(torch.arange(s).repeat(fl))
        ids["real"].append((frames < f).repeat_interleave(s))
        off_s, off_m, off_t = off_s + fl * s, off_m + fl * sl, off_t + sl * fl * d
    out = {k: torch.cat(v) for k, v in ids.items()}
    inverse = torch.empty_like(recv)
    inverse[recv] = torch.arange(recv.numel())
    out.update(send=send, back=back, recv=recv, recv_inverse=inverse)
    return {k: v.to(lay.device) for k, v in out.items()}


def _check_degree(layout: VideoLayout, sp: SPGroup) -> None:
    if sp.degree != layout.degree:
        raise ValueError(
            f"layout: built for degree {layout.degree}, group has degree {sp.degree}; "
            "allowed: the group's degree"
        )


def to_temporal(x: torch.Tensor, layout: VideoLayout, sp: SPGroup | None = None) -> torch.Tensor:
    """Spatial layout [T_s, C] -> temporal layout [T_t, C] (one all-to-all when d > 1)."""
    sp = sp or SPGroup.single()
    _check_degree(layout, sp)
    idx = layout._index
    buf = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx["send"]]
    buf = all_to_all(buf, sp, scatter_dim=0, gather_dim=0)
    return buf[idx["recv"]]


def to_spatial(x: torch.Tensor, layout: VideoLayout, sp: SPGroup | None = None) -> torch.Tensor:
    """Temporal layout [T_t, C] -> spatial layout [T_s, C] (drops the spatial padding)."""
    sp = sp or SPGroup.single()
    _check_degree(layout, sp)
    idx = layout._index
    buf = all_to_all(x[idx["recv_inverse"]], sp, scatter_dim=0, gather_dim=0)
    return buf[idx["back"]]
