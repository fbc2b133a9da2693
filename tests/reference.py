"""The training objective from its definition, written here and imported from nowhere in the
library, so an equivalence test checks the runtime against an independent statement of what
"single-process training on the same global batch" means (issue 18: the runtime's own
weighting function and the plan's own normaliser are never the reference).

The objective of a global batch of sequences s_1..s_n, where sequence i has per-token losses
l_i1..l_iL_i (cross-entropy for a language model, mean squared error over channels for a
diffusion model):

- "tokens":  sum_i sum_j l_ij / sum_i L_i        (every token weighs the same)
- "samples": (1/n) sum_i (1/L_i) sum_j l_ij       (every sample weighs the same)
"""

from __future__ import annotations

KINDS = ("tokens", "samples")


def objective(per_token_losses: list, kind: str):
    """The batch objective from each sequence's per-token losses (1-D tensors, one per
    sequence of the global batch, in any order). Differentiable: call .backward() on it."""
    if kind == "tokens":
        total_tokens = sum(int(x.numel()) for x in per_token_losses)
        return sum(x.sum() for x in per_token_losses) / total_tokens
    if kind == "samples":
        return sum(x.mean() for x in per_token_losses) / len(per_token_losses)
    raise ValueError(f"kind: {kind!r}; allowed: {KINDS}")


def lm_objective(model, data: dict, kind: str):
    """The objective of a TinyLM (or any model called as model(tokens, positions, segments))
    on `data` {sequence id: L + 1 token ids}: each sequence alone, unpacked, next-token
    cross-entropy per token, then `objective`."""
    import torch
    import torch.nn.functional as F

    per_token = []
    for sid in sorted(data):
        x = data[sid]
        pos = torch.arange(x.shape[0] - 1)
        logits = model(x[:-1], pos, torch.zeros_like(pos))
        per_token.append(F.cross_entropy(logits, x[1:], reduction="none"))
    return objective(per_token, kind)
