"""Stochastic depth (drop path)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vtdense.layers.plain import plain_module
from vtdense.layers.tracing import tracing

__all__ = ["DropPath", "residual"]


class DropPath(nn.Module):
    """Drop whole residual branches per sample with probability ``p`` during training.

    The keep probability ``1 - p`` is also held as a float32 0-d tensor (``keep``, a buffer that
    is not saved), from which the draws are made and by which the kept branches are scaled. So a
    compiled graph reads the rate as an input, not as a constant of its code, and blocks that
    differ only in their rate compile once (nested compile regions,
    :func:`vtdense.backbones.base.set_compile_regions`). ``p`` may be set at any time (a
    drop-path schedule); ``keep`` follows it and stays float32 when the module is cast.
    """

    keep: Tensor

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("keep", torch.ones(()), persistent=False)
        self.p = p

    @property
    def p(self) -> float:
        """The probability that a sample's branch is dropped."""
        return self._p

    @p.setter
    def p(self, value: float) -> None:
        value = float(value)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"drop path probability must be in [0, 1), got {value}")
        self._p = value
        self.active = value > 0.0  # (what graphs read: True or False, not the rate)
        with torch.no_grad():
            self.keep = torch.full((), 1.0 - value, dtype=torch.float32, device=self.keep.device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        """Moves and casts as any module does, then makes ``keep`` again from ``p`` in float32 on
        its new device (a cast to bf16 would round it; ``to_empty`` would leave it unset)."""
        out = super()._apply(fn, recurse)
        self.p = self._p
        return out

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (``(B, ...)``) with each sample's branch zeroed with probability ``p`` and the
        others scaled by ``1 / (1 - p)`` (training); ``x`` itself otherwise."""
        if not self.training or not self.active:
            return x
        return x * self._draws(x).div_(self.keep)

    def _draws(self, x: Tensor) -> Tensor:
        """One 0/1 draw per sample of ``x``, 1 with probability ``1 - p``: ``(B, 1, ..., 1)``."""
        return x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(self.keep)

    def add_to(self, x: Tensor, branch: Tensor) -> Tensor:
        """``x + self(branch)``, the residual sum, of ``(B, ...)`` tensors.

        On a GPU in eager training it is one ``addcmul`` with the 0/1 draws and the ``1 / (1 - p)``
        scale as its scalar: two kernels (draw, sum) where ``x + self(branch)`` launches four (draw,
        scale, product, sum), for every block's two branches. The same draws; the sum may differ
        from the unfused one by a rounding of the scale. Elsewhere (CPU, graphs, which fuse it
        themselves) it is ``x + self(branch)``."""
        if not self.training or not self.active:
            return x + branch
        if branch.device.type != "cuda" or tracing():
            return x + self(branch)
        return torch.addcmul(x, branch, self._draws(branch), value=1.0 / (1.0 - self._p))

    def extra_repr(self) -> str:
        return f"p={self._p}"


def residual(x: Tensor, drop: nn.Module, branch: Tensor) -> Tensor:
    """``x + drop(branch)``: through :meth:`DropPath.add_to` for a plain, unhooked
    :class:`DropPath`; a replaced or hooked ``drop`` module is called as it is."""
    if plain_module(drop, DropPath):
        return drop.add_to(x, branch)  # type: ignore[union-attr]
    return x + drop(branch)
