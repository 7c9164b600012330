"""The one attention kernel of vtdense: ``scaled_dot_product_attention`` with an additive mask.

Swin V1, Swin V2 and MViTv2 differ only in what they feed it (a bias table, Log-CPB with
cosine logits, or decomposed relative positions).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["attention"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """Multi-head attention over the last two dims.

    Args:
        q: ``(..., heads, Nq, d)``; ``k``, ``v``: ``(..., heads, Nk, d)``. Leading dims are flattened
            into one batch dim so the fused SDPA kernels apply.
        mask: additive mask broadcastable to ``(..., heads, Nq, Nk)``; cast to ``q``'s dtype.
        scale: logit scale; ``None`` means ``d ** -0.5``.
        dropout: dropout on the attention weights (pass 0 in eval).

    Returns:
        ``(..., heads, Nq, d)``.
    """
    lead = q.shape[:-3]
    h, nq, d = q.shape[-3:]
    nk = k.shape[-2]
    q4 = q.reshape(-1, h, nq, d)
    k4 = k.reshape(-1, h, nk, k.shape[-1])
    v4 = v.reshape(-1, h, nk, v.shape[-1])
    if mask is not None:
        # A view when the mask is shared over the leading dims; a copy only when it varies
        # along some but not all of them (e.g. per-window masks shared over the batch).
        mask = mask.to(q.dtype).expand(*lead, h, nq, nk).reshape(-1, h, nq, nk)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.reshape(*lead, h, nq, v.shape[-1])
