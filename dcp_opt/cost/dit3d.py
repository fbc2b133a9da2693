"""Full-attention video DiTs (ModelSpec kind "3d"): the attention feature, FLOPs and bytes of
one layer, in the units of the cost model's other kinds (coeffs.flops_coefficients reads them).

A 3d layer attends over all F x H x W video tokens of a sample at once (non-causal):

- joint (MMDiT: SD3, Flux, Open-Sora 2.0, HunyuanVideo): the sample's j text tokens join the
  sequence, so attention scores (v + j)^2 pairs, and every text token goes through the layer's
  projections and MLP as a video token does (its own stream's weights in a double-stream
  block, the shared ones in a single-stream block: 4h^2 + 2hf per token either way);
- cross (Wan): self-attention over the v video tokens (v^2 pairs), then cross-attention of
  every video token to the j text tokens (4hj FLOPs per video token), whose k and v the layer
  projects once per sample (2 x 2h^2 j FLOPs).

Text under Ulysses follows diffusers' context-parallel plans (the USP convention they
implement): joint models split the text tokens over the group with the video tokens
(`FluxTransformer2DModel._cp_plan` splits `encoder_hidden_states` on dim 1,
src/diffusers/models/transformers/transformer_flux.py:573-581, so the per-sample text work is
divided by d like the rest); cross models keep the whole text on every member and run the
cross-attention locally (`WanTransformer3DModel._cp_plan` leaves `encoder_hidden_states`
unsplit, transformer_wan.py:552-569, and `WanAttnProcessor` passes no parallel config when
`encoder_hidden_states` is given, transformer_wan.py:152), so only self-attention pays the
all-to-alls. xDiT's USP instead keeps joint text replicated and head-slices its k and v
(xfuser/core/long_ctx_attention/hybrid/attn_layer.py:160-177, `joint_strategy`).

What the features leave out (docs/cost-model.md, "Full-attention video DiTs"): the cost
model's token count T is the video tokens (what validate() and the planners count), so the
joint text's activations and all-to-all bytes (j per sample) and a cross model's text k, v
(2jh per layer per sample) are not in the memory and communication terms; for the samples that
bind memory (>= 30K video tokens, 512 text tokens) that is < 2 %. Its compute is charged.
"""

from __future__ import annotations

from ..model import ModelSpec


def quad(video_tokens, model: ModelSpec):
    """Attention feature Q of a 3d sample of `video_tokens` tokens (a float or an array): the
    score pairs of one layer, (v + j)^2 with the joint text tokens j (0 under cross)."""
    n = video_tokens + model.joint_text_tokens
    return n * n


def forward_flops(model: ModelSpec) -> tuple[float, float, float]:
    """(per unit of Q, per video token, per sample) FLOPs of one layer's forward.

    Matmuls: 2 FLOPs per parameter per token (Kaplan et al. 2020, sec. 2.1) over
    ModelSpec.params_per_block. Attention: QK^T and PV, 2 x 2 h FLOPs per score pair, no
    causal halving (every token sees every token)."""
    h, j = model.hidden, model.text_tokens
    per_token = 2 * model.params_per_block
    if model.text_mode == "joint":  # text tokens pass the same projections and MLP
        return 4.0 * h, float(per_token), float(j * per_token)
    # cross: scores and PV of every video token against j text tokens; the text's k and v
    return 4.0 * h, float(per_token + 4 * h * j), float(4 * h * h * j)


def activation_bytes(model: ModelSpec) -> float:
    """Bytes one kept layer saves per video token (FlashAttention: no score matrix), the
    layers' average; Korthikanti et al. 2022 eq. 1 re-derived for these blocks, in units of
    dtype_bytes. Double-stream (per stream): LayerNorm input h, modulated input h, q k v 3h,
    q and k before their RMSNorm 2h, attention output h, residual h, modulated MLP input h,
    GELU input and output 2f: 10h + 2f. Single-stream: norm input h, modulated h, q k v 3h,
    q k before norm 2h, attention output h, MLP hidden before and after GELU 2f: 8h + 2f.
    Wan's block: self-attention 8h as the double-stream's, cross-attention (norm input, its
    output, q before and after norm, output) 5h, MLP (norm input, modulated, 2f) 2h + 2f:
    15h + 2f."""
    h, f, b = model.hidden, model.ffn_hidden, model.dtype_bytes
    if model.text_mode == "cross":
        return b * (15.0 * h + 2 * f)
    single = model.single_layers / model.num_layers
    return b * ((1 - single) * (10.0 * h + 2 * f) + single * (8.0 * h + 2 * f))
