"""A loss for comparing backbone gradients between two code paths.

Backbone outputs are LayerNorm'd, so ``sum(f.square().mean())`` is nearly constant (each normalised
token has mean square 1 until the norm's weights move): its gradients are rounding noise of about
1e-7, which any ``atol=1e-6`` check passes whatever the two paths compute. Projecting each output on
a fixed random tensor gives every parameter a gradient of order one instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


def probe_loss(features: Mapping[str, Tensor] | Iterable[Tensor], seed: int = 0) -> Tensor:
    """``sum_i <f_i, w_i> / sqrt(numel(f_i))`` over the outputs ``f_i`` (any dtype; summed in float32),
    with ``w_i`` standard normal, drawn from ``seed`` and the output's position, independent of the
    global RNG: the same outputs give the same loss in every call."""
    feats = list(features.values()) if isinstance(features, Mapping) else list(features)
    gen = torch.Generator().manual_seed(seed)
    total = None
    for f in feats:
        w = torch.randn(f.shape, generator=gen).to(f.device)
        term = (f.float() * w).sum() / f.numel() ** 0.5
        total = term if total is None else total + term
    assert total is not None, "no outputs"
    return total
