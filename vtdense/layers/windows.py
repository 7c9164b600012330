"""Window partition, padding, cyclic shift and the additive masks they need.

Everything about non-overlapping windows lives here so Swin (V1/V2) and the hybrid-window
MViTv2 share one implementation. Feature maps are channels-last ``(B, H, W, C)``.

Padding convention: a map whose sides are not multiples of the window is zero-padded at the
bottom/right *before* the cyclic shift (as the original Swin detection code does), and padded
tokens are masked out as keys, so they never change the result for real tokens.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "MASK_VALUE",
    "to_2tuple",
    "effective_window",
    "pad_to_window",
    "window_partition",
    "window_reverse",
    "window_attention_mask",
]

#: Additive value for masked logits. Finite (a fully masked row of a padded query stays
#: finite instead of NaN) yet far below any logit, cosine logits included (<= 116).
MASK_VALUE = -1e4


def to_2tuple(v: int | Sequence[int], name: str = "value") -> tuple[int, int]:
    """``7 -> (7, 7)``; ``(7, 9) -> (7, 9)``; anything else is an error naming ``name``."""
    if isinstance(v, int):
        out = (v, v)
    else:
        out = tuple(int(x) for x in v)
        if len(out) != 2:
            raise ValueError(f"{name} must be an int or a pair (h, w), got {v!r}")
    if min(out) < 1:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return out  # type: ignore[return-value]


def effective_window(
    size: tuple[int, int], window: tuple[int, int], shift: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per axis: a map no larger than the window gets a window of the map's size and no shift."""
    win = tuple(min(s, w) for s, w in zip(size, window))
    sh = tuple(0 if s <= w else sf for s, w, sf in zip(size, window, shift))
    return win, sh  # type: ignore[return-value]


def pad_to_window(x: Tensor, window: tuple[int, int]) -> Tensor:
    """Zero-pad ``(B, H, W, C)`` at the bottom/right up to multiples of ``window``."""
    H, W = x.shape[1:3]
    pad_h = -H % window[0]
    pad_w = -W % window[1]
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    return x


def window_partition(x: Tensor, window: tuple[int, int]) -> Tensor:
    """``(B, Hp, Wp, C) -> (B, nW, wh*ww, C)``; ``Hp, Wp`` must be multiples of the window."""
    B, H, W, C = x.shape
    wh, ww = window
    x = x.view(B, H // wh, wh, W // ww, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // wh) * (W // ww), wh * ww, C)


def window_reverse(windows: Tensor, window: tuple[int, int], H: int, W: int) -> Tensor:
    """Inverse of :func:`window_partition`: ``(B, nW, wh*ww, C) -> (B, H, W, C)``."""
    B, _, _, C = windows.shape
    wh, ww = window
    x = windows.view(B, H // wh, W // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def _region_labels(n_pad: int, window: int, shift: int) -> Tensor:
    """Shift-region id of each position of the rolled axis (0 for no shift)."""
    labels = torch.zeros(n_pad, dtype=torch.long)
    if shift:
        labels[n_pad - window : n_pad - shift] = 1
        labels[n_pad - shift :] = 2
    return labels


# Bool masks (1 byte per entry) and a bounded cache: multi-scale training visits many sizes, and
# a stage-1 mask at 1333x800 holds ~1400 windows x 49 x 49 entries.
@functools.lru_cache(maxsize=64)
def _window_mask_cached(
    H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device
) -> Tensor | None:
    Hp, Wp = H + (-H % window[0]), W + (-W % window[1])
    if not any(shift) and (Hp, Wp) == (H, W):
        return None
    with torch.inference_mode(False), torch.no_grad():
        # Labels on the rolled grid: region id (3 per axis) and key validity.
        rh, rw = _region_labels(Hp, window[0], shift[0]), _region_labels(Wp, window[1], shift[1])
        region = (rh[:, None] * 3 + rw[None, :]).float()
        valid = torch.zeros(Hp, Wp)
        valid[:H, :W] = 1.0
        valid = torch.roll(valid, shifts=(-shift[0], -shift[1]), dims=(0, 1))
        grid = torch.stack([region, valid], dim=-1)[None]  # 1, Hp, Wp, 2
        win = window_partition(grid, window)[0]  # nW, N, 2
        reg, val = win[..., 0], win[..., 1]
        blocked = (reg[:, :, None] != reg[:, None, :]) | (val[:, None, :] == 0)
        return blocked.to(device)


def window_attention_mask(
    H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device | str = "cpu"
) -> Tensor | None:
    """Boolean mask ``(nW, N, N)``, True where a query may not attend to a key, for (shifted)
    window attention on an ``H x W`` map.

    Blocks attention across shift regions (SW-MSA) and to padded keys; callers turn it into the
    additive term with ``torch.where(mask, MASK_VALUE, bias)``. ``None`` when nothing needs
    masking. Cached per (H, W, window, shift, device): built once per feature-map size.
    """
    return _window_mask_cached(int(H), int(W), tuple(window), tuple(shift), torch.device(device))
