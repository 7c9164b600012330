"""Stochastic depth (drop path)."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["DropPath"]


class DropPath(nn.Module):
    """Drop whole residual branches per sample with probability ``p`` during training."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        return x * x.new_empty(shape).bernoulli_(keep).div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"
