"""A micro-batch of images and videos under 3-D full attention as packed token streams, and
Ulysses over its joint sequence (the tiny MMDiT and Wan-style DiT of runtime/models.py).

Sample v has F_v x H_v x W_v latent patches (an image: F_v = 1) and a caption of Tt_v
tokens. Over a group of degree d:
- the video stream is every sample's tokens back to back (frame, row, column order), zero
  padded to a multiple of d; member r holds the r-th contiguous 1/d of it;
- the text stream is every caption back to back, padded likewise; member r holds its 1/d
  when the model joins text to the attention sequence (MMDiT), and every caption whole when
  text is only a cross-attention key (Wan).
This is diffusers' context-parallel convention (its `_cp_plan`s split both
`hidden_states` and `encoder_hidden_states` of a joint-attention model along the sequence,
and leave a cross-attention model's `encoder_hidden_states` whole: diffusers v0.42.1
models/transformers/transformer_flux.py and transformer_wan.py `_cp_plan`), i.e. USP's
Ulysses with the text split, not xDiT's replicated "joint tensor" (Fang and Zhao 2024, USP,
sec. 4; xDiT's `split_text_embed_in_sp`). So every member holds (Nt + Nv) / d tokens.

Joint attention (`joint_attention`): each member passes q, k, v of its own tokens, text
shard first then video shard ([Lt + Lv, H, Dh]); the all-to-all of runtime/sp.py gathers
the whole of both streams for H/d heads, member-major; one gather (`order`) puts every
sample's text then video tokens together, so a sample's attention sees only its own tokens
(block-diagonal, one packed kernel call: runtime/attention.py), padding a sequence of its
own; the inverse gather and the second all-to-all return to the shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import packed_attention
from .sp import SPGroup, ulysses_attention


@dataclass(frozen=True)
class JointLayout:
    """This member's share of a micro-batch of `shapes` (F, H, W) with captions of
    `text_lengths` tokens, over a group of `degree` (module docstring). `joint`: the text
    joins the attention sequence (MMDiT) or is only a cross-attention key (Wan)."""

    shapes: tuple[tuple[int, int, int], ...]
    text_lengths: tuple[int, ...]
    joint: bool = True
    degree: int = 1
    rank: int = 0
    device: torch.device | str = "cpu"
    index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.shapes or len(self.shapes) != len(self.text_lengths):
            raise ValueError(
                f"shapes: {len(self.shapes)} samples with {len(self.text_lengths)} captions; "
                "allowed: >= 1 sample, one caption length each"
            )
        if any(len(s) != 3 or min(s) < 1 for s in self.shapes) or min(self.text_lengths) < 1:
            raise ValueError(
                f"shapes: {self.shapes} / text_lengths: {self.text_lengths}; allowed: "
                "(frames, height, width) >= 1 each, caption tokens >= 1"
            )
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"rank: {self.rank} not allowed; allowed: 0 <= rank < {self.degree}")
        _build_index(self)

    @property
    def video_tokens(self) -> tuple[int, ...]:
        return tuple(f * h * w for f, h, w in self.shapes)

    @property
    def video_shard(self) -> int:
        """Lv: video tokens each member holds (padding included)."""
        return -(-sum(self.video_tokens) // self.degree)

    @property
    def text_shard(self) -> int:
        """Lt: text tokens each member holds under joint attention (padding included); 0
        without joint attention (then every member holds every caption whole)."""
        return -(-sum(self.text_lengths) // self.degree) if self.joint else 0

    def shard(self, stream: torch.Tensor, per_member: int) -> torch.Tensor:
        """This member's contiguous share of a stream [N, ...], zero padded to d x per_member."""
        lo = self.rank * per_member
        part = stream[lo : lo + per_member]
        pad = per_member - part.shape[0]
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part


def _build_index(lay: JointLayout) -> None:
    """Per-token indices of this member's video shard and the joint gather (built once)."""
    d, lt, lv = lay.degree, lay.text_shard, lay.video_shard
    sample, frame, row, col = [], [], [], []
    for i, (f, h, w) in enumerate(lay.shapes):
        fi, hi, wi = torch.meshgrid(
            torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"
        )
        sample.append(torch.full((f * h * w,), i))
        frame, row, col = frame + [fi.reshape(-1)], row + [hi.reshape(-1)], col + [wi.reshape(-1)]
    ids = {"sample": sample, "frame": frame, "row": row, "col": col}
    out = {k: lay.shard(torch.cat(v), lv) for k, v in ids.items()}
    out["real"] = lay.shard(torch.ones(sum(lay.video_tokens), dtype=torch.bool), lv)
    captions = torch.cat([torch.full((n,), i) for i, n in enumerate(lay.text_lengths)])
    out["text_sample"] = lay.shard(captions, lt) if lay.joint else captions
    # gathered position of global text token a / video token b (member-major after the
    # all-to-all: member j's block is its text shard then its video shard)
    text_at = torch.arange(d * lt).div(max(lt, 1), rounding_mode="floor") * lv
    text_at += torch.arange(d * lt)
    video_at = torch.arange(d * lv).div(lv, rounding_mode="floor") * (lt + lv) + lt
    video_at += torch.arange(d * lv) % lv
    order, t0, v0, lengths = [], 0, 0, []
    for tt, nv in zip(lay.text_lengths, lay.video_tokens, strict=True):
        tt = tt if lay.joint else 0
        order += [text_at[t0 : t0 + tt], video_at[v0 : v0 + nv]]
        lengths.append(tt + nv)
        t0, v0 = t0 + tt, v0 + nv
    order += [text_at[t0:], video_at[v0:]]  # padding: one sequence of its own
    num_pad = d * (lt + lv) - t0 - v0
    out["order"] = torch.cat(order)
    out["inverse"] = torch.empty_like(out["order"])
    out["inverse"][out["order"]] = torch.arange(out["order"].numel())
    lay.index.update({k: v.to(lay.device) for k, v in out.items()})
    lay.index["lengths"] = lengths + ([num_pad] if num_pad else [])
    _cross_index(lay)


def _cross_index(lay: JointLayout) -> None:
    """Cross-attention of this member's video shard to whole captions (Wan): the samples it
    holds tokens of, their query counts and the caption rows they attend to."""
    local = lay.index["sample"].cpu()[lay.index["real"].cpu()]
    held, counts = torch.unique_consecutive(local, return_counts=True)
    starts = [0]
    for n in lay.text_lengths:
        starts.append(starts[-1] + n)
    rows = [torch.arange(starts[i], starts[i + 1]) for i in held.tolist()]
    num_pad = lay.video_shard - int(counts.sum())
    lay.index["cross_q"] = counts.tolist() + ([num_pad] if num_pad else [])
    lay.index["cross_k"] = [lay.text_lengths[i] for i in held.tolist()] + ([1] if num_pad else [])
    rows.append(torch.full((1 if num_pad else 0,), starts[-1]))  # the zero row (caption pad)
    lay.index["cross_rows"] = torch.cat(rows).to(lay.device)


def _local_joint(q, k, v, *, layout: JointLayout, scale=None):
    """Block-diagonal attention over the gathered joint stream (all heads of this call)."""
    order, inverse = layout.index["order"], layout.index["inverse"]
    out = packed_attention(
        q[order], k[order], v[order], lengths=layout.index["lengths"], causal=False, scale=scale
    )
    return out[inverse]


def joint_attention(q, k, v, layout: JointLayout, sp: SPGroup | None = None, *, scale=None):
    """Self-attention of every sample's tokens to its own tokens, over the group: q, k, v
    [Lt + Lv, H, Dh], text shard first (Lt = 0 for a layout without joint text) -> same
    shape."""
    sp = sp or SPGroup.single()
    if sp.degree != layout.degree:
        raise ValueError(
            f"layout: built for degree {layout.degree}, group has degree {sp.degree}; "
            "allowed: the group's degree"
        )
    if q.shape[0] != layout.text_shard + layout.video_shard:
        raise ValueError(
            f"q: {q.shape[0]} tokens; allowed: the layout's text + video shard "
            f"({layout.text_shard} + {layout.video_shard})"
        )
    return ulysses_attention(q, k, v, sp, _local_joint, layout=layout, scale=scale)


def cross_attention(q, k, v, layout: JointLayout, *, scale=None):
    """Each held video token of sample i to caption i (no communication: every member holds
    every caption). q [Lv, H, Dh]; k, v [sum Tt, H, Dh] (all captions back to back)."""
    rows = layout.index["cross_rows"]
    k = torch.cat([k, k.new_zeros(1, *k.shape[1:])])[rows]
    v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])[rows]
    return packed_attention(
        q, k, v, lengths=layout.index["cross_q"], k_lengths=layout.index["cross_k"],
        causal=False, scale=scale,
    )  # fmt: skip
