"""The transformer MLP shared by the backbones."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["Mlp"]


class Mlp(nn.Module):
    """Two-layer GELU MLP (names ``fc1``/``fc2`` as in timm), optionally changing the width.

    Args:
        dim: input channels.
        hidden: hidden channels.
        out_dim: output channels (``None``: ``dim``).
        drop: dropout after the activation and after ``fc2``.
    """

    def __init__(self, dim: int, hidden: int, out_dim: int | None = None, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out_dim or dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))
