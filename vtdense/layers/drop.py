"""Stochastic depth (drop path)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vtdense.layers.plain import plain_module
from vtdense.layers.tracing import tracing

__all__ = ["DropPath", "residual"]


class DropPath(nn.Module):
    """Drop whole residual branches per sample with probability ``p`` during training."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (``(B, ...)``) with each sample's branch zeroed with probability ``p`` and the
        others scaled by ``1 / (1 - p)`` (training); ``x`` itself otherwise."""
        if not self.training or self.p == 0.0:  # (in this order: an eval graph does not read, nor guard on, p)
            return x
        return x * self._draws(x).div_(1.0 - self.p)

    def _draws(self, x: Tensor) -> Tensor:
        """One 0/1 draw per sample of ``x``, 1 with probability ``1 - p``: ``(B, 1, ..., 1)``."""
        return x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)

    def add_to(self, x: Tensor, branch: Tensor) -> Tensor:
        """``x + self(branch)``, the residual sum, of ``(B, ...)`` tensors.

        On a GPU in eager training it is one ``addcmul`` with the 0/1 draws and the ``1 / (1 - p)``
        scale as its scalar: two kernels (draw, sum) where ``x + self(branch)`` launches four (draw,
        scale, product, sum), for every block's two branches. The same draws; the sum may differ
        from the unfused one by a rounding of the scale. Elsewhere (CPU, graphs, which fuse it
        themselves) it is ``x + self(branch)``."""
        if not self.training or self.p == 0.0:
            return x + branch
        if branch.device.type != "cuda" or tracing():
            return x + self(branch)
        return torch.addcmul(x, branch, self._draws(branch), value=1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


def residual(x: Tensor, drop: nn.Module, branch: Tensor) -> Tensor:
    """``x + drop(branch)``: through :meth:`DropPath.add_to` for a plain, unhooked
    :class:`DropPath`; a replaced or hooked ``drop`` module is called as it is."""
    if plain_module(drop, DropPath):
        return drop.add_to(x, branch)  # type: ignore[union-attr]
    return x + drop(branch)
