"""What a Swin V2 checkpoint's own Log-CPB coordinate buffers say about its windows.

The official Swin V2 code and torchvision persist each block's ``relative_coords_table``: the
Log-CPB input ``(1, 2h-1, 2w-1, 2)`` for the window ``(h, w)`` the block ran, with offsets
normalised by the window of pre-training (``pretrained_window_size``) or, where none was given, by
``(h, w)`` itself. vtdense recomputes that buffer; before it is dropped, its shape gives the window
in use and its largest coordinate the normalising window: an offset of ``w - 1`` normalised by
``p`` is ``log2(1 + 8 (w - 1) / (p - 1)) / 3``, so ``p = 1 + 8 (w - 1) / (2^(3 m) - 1)`` for the
largest value ``m``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from vtdense.layers.position import log_spaced_coords

__all__ = ["log_cpb_windows_from_buffers"]

# official ``layers.<stage>.blocks.<block>``, torchvision ``features.<stage>.<block>``, under any prefix
_TABLE_KEY = re.compile(r"(?:^|\.)(?:layers|features)\.(\d+)\.(?:blocks\.)?(\d+)\.attn\.relative_coords_table$")


def _normalising_window(table: Tensor, window: tuple[int, int]) -> tuple[int, int]:
    sides = []
    for axis, side in enumerate(window):
        if side == 1:  # one offset, 0: any window normalises it alike
            sides.append(1)
            continue
        top = float(table[..., axis].abs().max())
        sides.append(round(1 + 8 * (side - 1) / (2.0 ** (3 * top) - 1)) if top > 0 else side)
    return sides[0], sides[1]


def log_cpb_windows_from_buffers(
    state_dict: Mapping[str, object],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
    """Per stage (in stage order), the window its first block ran and the window its Log-CPB
    coordinates were normalised by, read from the ``relative_coords_table`` buffers of an official
    Swin V2 or torchvision ``swin_v2_*`` state dict.

    Returns:
        ``(windows_in_use, normalising_windows)``, each a list of ``(h, w)``; ``None`` when the
        state dict holds no such buffer, or one that is not the references' table for any window
        (checked value by value against the table recomputed from the two windows).
    """
    first: dict[int, tuple[int, Tensor]] = {}
    for key, value in state_dict.items():
        m = _TABLE_KEY.search(key)
        if m is None or not isinstance(value, Tensor):
            continue
        stage, block = int(m[1]), int(m[2])
        if stage not in first or block < first[stage][0]:
            first[stage] = (block, value)
    if not first:
        return None
    in_use: list[tuple[int, int]] = []
    normalising: list[tuple[int, int]] = []
    for stage in sorted(first):
        table = first[stage][1]
        if table.ndim != 4 or table.shape[0] != 1 or table.shape[3] != 2 or table.shape[1] % 2 == 0 or table.shape[2] % 2 == 0:
            return None
        table = table[0].detach().float().cpu()
        window = ((table.shape[0] + 1) // 2, (table.shape[1] + 1) // 2)
        norm = _normalising_window(table, window)
        if min(norm) < 1:
            return None
        expected = log_spaced_coords(window, norm).reshape(table.shape)
        if not torch.allclose(table, expected, atol=1e-4):
            return None
        in_use.append(window)
        normalising.append(norm)
    return in_use, normalising
