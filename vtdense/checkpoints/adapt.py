"""Adapting an RGB checkpoint's input convolution to another number of input channels."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adapt_input_conv"]


def adapt_input_conv(name: str, weight: Tensor, shape: torch.Size | tuple[int, ...], in_channels: int) -> Tensor:
    """An RGB input conv's ``weight`` ``(O, 3, kh, kw)`` for ``in_channels`` inputs ``(O, in_channels,
    kh, kw)``: the sum over RGB for 1 channel, else RGB repeated cyclically, scaled by ``3 / in_channels``
    (what SMP's ``patch_first_conv`` and timm's ``adapt_input_conv`` give).

    Raises:
        ValueError: ``weight`` is no 3-channel conv weight, or ``shape`` is not its form for
            ``in_channels`` inputs; the message names ``name``.
    """
    if weight.ndim != 4 or weight.shape[1] != 3 or tuple(shape) != (weight.shape[0], in_channels, *weight.shape[2:]):
        raise ValueError(f"cannot adapt {name} {tuple(weight.shape)} to {tuple(shape)} for in_channels={in_channels}")
    if in_channels == 1:
        return weight.sum(dim=1, keepdim=True)
    index = torch.arange(in_channels, device=weight.device) % 3
    return weight[:, index] * (3 / in_channels)
