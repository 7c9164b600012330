"""Relative position encodings: Swin's bias-table index, Swin V2's log-spaced coordinates
(Log-CPB input) and MViTv2's decomposed relative positions.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "relative_position_index",
    "log_spaced_coords",
    "resize_bias_table",
    "rel_pos_lookup",
    "decomposed_rel_pos_bias",
]


@functools.lru_cache(maxsize=64)
def _rel_index(window: tuple[int, int], table_window: tuple[int, int], device: torch.device) -> Tensor:
    with torch.inference_mode(False):
        coords = torch.stack(
            torch.meshgrid(torch.arange(window[0]), torch.arange(window[1]), indexing="ij")
        ).flatten(1)  # 2, N
        rel = coords[:, :, None] - coords[:, None, :]  # 2, N, N
        rows = rel[0] + table_window[0] - 1
        cols = rel[1] + table_window[1] - 1
        return (rows * (2 * table_window[1] - 1) + cols).to(device)


def relative_position_index(
    window: tuple[int, int], table_window: tuple[int, int], device: torch.device | str = "cpu"
) -> Tensor:
    """``(N, N)`` index into a ``(2Th-1)*(2Tw-1)`` table for every token pair of a window.

    ``window`` may be smaller than the ``table_window`` the table was made for (a feature map
    smaller than the window): an offset keeps its entry, so the bias keeps its meaning.
    """
    if window[0] > table_window[0] or window[1] > table_window[1]:
        raise ValueError(f"window {window} is larger than the position table's window {table_window}")
    return _rel_index(tuple(window), tuple(table_window), torch.device(device))


def log_spaced_coords(table_window: tuple[int, int], norm_window: tuple[int, int]) -> Tensor:
    """Swin V2 Log-CPB input: ``((2Th-1)*(2Tw-1), 2)`` relative offsets, normalised by
    ``norm_window - 1`` to [-1, 1], scaled to [-8, 8] and mapped through ``sign(x) log2(1+|x|) / 3``.
    """
    axes = [torch.arange(-(t - 1), t, dtype=torch.float32) / max(n - 1, 1) for t, n in zip(table_window, norm_window)]
    table = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1) * 8.0
    table = torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)
    return table.reshape(-1, 2)


def resize_bias_table(table: Tensor, old_window: tuple[int, int], new_window: tuple[int, int]) -> Tensor:
    """Bicubic resize of a ``((2h-1)*(2w-1), heads)`` bias table to another window size."""
    heads = table.shape[1]
    old = (2 * old_window[0] - 1, 2 * old_window[1] - 1)
    new = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    if table.shape[0] != old[0] * old[1]:
        raise ValueError(f"bias table of {table.shape[0]} rows does not match window {old_window}")
    grid = table.float().t().reshape(1, heads, *old)
    grid = F.interpolate(grid, size=new, mode="bicubic", align_corners=False)
    return grid.reshape(heads, -1).t().to(table.dtype).contiguous()


def rel_pos_lookup(q_size: int, k_size: int, rel_pos: Tensor) -> Tensor:
    """MViTv2 / ViTDet decomposed table lookup for one axis: ``(q_size, k_size, C)``.

    The table is linearly interpolated when the query/key grid differs from the one it was made
    for, and offsets are scaled so a pooled grid (smaller side) uses the right stride.
    """
    span = int(2 * max(q_size, k_size) - 1)
    if rel_pos.shape[0] != span:
        rel_pos = (
            F.interpolate(rel_pos.t()[None].float(), size=span, mode="linear")[0].t().to(rel_pos.dtype)
        )
    q_ratio = max(k_size / q_size, 1.0)
    k_ratio = max(q_size / k_size, 1.0)
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * q_ratio
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * k_ratio
    rel = (q_coords - k_coords) + (k_size - 1) * k_ratio
    return rel_pos[rel.long()]


def decomposed_rel_pos_bias(
    q: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, q_size: tuple[int, int], k_size: tuple[int, int]
) -> Tensor:
    """Additive attention term ``(..., Nq, Nk)`` from decomposed height/width tables.

    Args:
        q: queries ``(..., Nq, C)`` with ``Nq = q_size[0] * q_size[1]`` (unscaled).
    """
    qh, qw = q_size
    kh, kw = k_size
    Rh = rel_pos_lookup(qh, kh, rel_pos_h)  # qh, kh, C
    Rw = rel_pos_lookup(qw, kw, rel_pos_w)  # qw, kw, C
    r_q = q.reshape(*q.shape[:-2], qh, qw, q.shape[-1])
    bias_h = torch.einsum("...hwc,hkc->...hwk", r_q, Rh)
    bias_w = torch.einsum("...hwc,wkc->...hwk", r_q, Rw)
    bias = bias_h[..., :, None] + bias_w[..., None, :]  # ..., qh, qw, kh, kw
    return bias.reshape(*q.shape[:-2], qh * qw, kh * kw)
