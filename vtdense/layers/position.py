"""Relative position encodings: Swin's bias-table index, Swin V2's log-spaced coordinates
(Log-CPB input) and MViTv2's decomposed relative positions.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vtdense.layers.attention import aligned_term
from vtdense.layers.autocast import autocast_inputs
from vtdense.layers.tracing import fresh_tables, tracing
from vtdense.layers.windows import mask_value

__all__ = [
    "relative_position_index",
    "log_spaced_coords",
    "log_cpb_coords",
    "resize_bias_table",
    "resize_rel_pos_table",
    "rel_pos_lookup",
    "decomposed_rel_pos_bias",
    "decomposed_rel_pos_factors",
    "sum_rel_pos_factors",
    "decomposed_rel_pos_fold",
]


def _rel_index(window: tuple[int, int], table_window: tuple[int, int], device: torch.device) -> Tensor:
    coords = torch.stack(
        torch.meshgrid(torch.arange(window[0], device=device), torch.arange(window[1], device=device), indexing="ij")
    ).flatten(1)  # 2, N
    rel = coords[:, :, None] - coords[:, None, :]  # 2, N, N
    rows = rel[0] + table_window[0] - 1
    cols = rel[1] + table_window[1] - 1
    return rows * (2 * table_window[1] - 1) + cols


@functools.lru_cache(maxsize=64)
def _rel_index_cached(window: tuple[int, int], table_window: tuple[int, int], device: torch.device) -> Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return _rel_index(window, table_window, device)


def relative_position_index(
    window: tuple[int, int], table_window: tuple[int, int], device: torch.device | str = "cpu"
) -> Tensor:
    """``(N, N)`` index into a ``(2Th-1)*(2Tw-1)`` table for every token pair of a window.

    ``window`` may be smaller than the ``table_window`` the table was made for (a feature map
    smaller than the window): an offset keeps its entry, so the bias keeps its meaning. Cached per
    argument set; built anew instead (:func:`~vtdense.layers.tracing.fresh_tables`) inside graphs,
    from tensor ops (Dynamo would trace through the cache and specialise on its arguments), and
    while a CUDA graph records.
    """
    if window[0] > table_window[0] or window[1] > table_window[1]:
        raise ValueError(f"window {window} is larger than the position table's window {table_window}")
    device = torch.device(device)
    if fresh_tables(device):  # never cache traced tensors, nor read a cache while a CUDA graph records
        return _rel_index(tuple(window), tuple(table_window), device)
    return _rel_index_cached(tuple(window), tuple(table_window), device)


def log_spaced_coords(
    table_window: tuple[int, int], norm_window: tuple[int, int], device: torch.device | str | None = None
) -> Tensor:
    """Swin V2 Log-CPB input: ``((2Th-1)*(2Tw-1), 2)`` relative offsets, normalised by
    ``norm_window - 1`` to [-1, 1], scaled to [-8, 8] and mapped through ``sign(x) log2(1+|x|) / 3``.
    """
    axes = [
        torch.arange(-(t - 1), t, dtype=torch.float32, device=device) / max(n - 1, 1)
        for t, n in zip(table_window, norm_window)
    ]
    table = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1) * 8.0
    table = torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)
    return table.reshape(-1, 2)


@functools.lru_cache(maxsize=64)
def _log_cpb_coords(window: tuple[int, int], pretrained_window: tuple[int, int], device: torch.device) -> Tensor:
    with torch.inference_mode(False):
        norm = pretrained_window if pretrained_window[0] > 0 else window
        return log_spaced_coords(window, norm, device="cpu").to(device)


def log_cpb_coords(
    window: tuple[int, int], pretrained_window: tuple[int, int] = (0, 0), device: torch.device | str = "cpu"
) -> Tensor:
    """Swin V2 Log-CPB input for the window *in use*, as the reference implementations compute it.

    The coordinates cover ``window`` (a window already shrunk to a small feature map) and are
    normalised by ``pretrained_window`` when it is given (``> 0``), else by ``window`` itself,
    per axis. Cached per (window, pretrained window, device), except inside graphs and while a
    CUDA graph records (:func:`~vtdense.layers.tracing.fresh_tables`).

    Returns:
        ``((2h-1)*(2w-1), 2)`` float32 coordinates, row-major over (dy, dx).
    """
    # graphs build them in place (Dynamo would trace through the cache anyway, with a warning)
    device = torch.device(device)
    build = _log_cpb_coords.__wrapped__ if fresh_tables(device) else _log_cpb_coords
    return build(tuple(window), tuple(pretrained_window), device)


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


def centre_bias_table(table: Tensor, old_window: tuple[int, int], new_window: tuple[int, int]) -> Tensor:
    """A ``((2h-1)*(2w-1), heads)`` bias table of a smaller window placed at the centre of one for
    ``new_window`` (each offset keeps its value; offsets beyond the old window are 0)."""
    heads = table.shape[1]
    old = (2 * old_window[0] - 1, 2 * old_window[1] - 1)
    new = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    if table.shape[0] != old[0] * old[1] or old[0] > new[0] or old[1] > new[1]:
        raise ValueError(f"bias table of {table.shape[0]} rows (window {old_window}) does not fit inside window {new_window}")
    grid = table.new_zeros(new[0], new[1], heads)
    top, left = (new[0] - old[0]) // 2, (new[1] - old[1]) // 2
    grid[top : top + old[0], left : left + old[1]] = table.reshape(old[0], old[1], heads)
    return grid.reshape(-1, heads)


@functools.lru_cache(maxsize=256)
def _decomposed_index(q_size: int, k_size: int, device: torch.device) -> Tensor:
    with torch.inference_mode(False):
        # A pooled (shorter) side is stretched so both sides are measured in the same units;
        # the arithmetic is done in float32 and truncated, as in the reference implementations.
        q_ratio = max(k_size / q_size, 1.0)
        k_ratio = max(q_size / k_size, 1.0)
        q_coords = torch.arange(q_size)[:, None] * q_ratio
        k_coords = torch.arange(k_size)[None, :] * k_ratio
        rel = (q_coords - k_coords) + (k_size - 1) * k_ratio
        return rel.long().to(device)


def resize_rel_pos_table(rel_pos: Tensor, length: int) -> Tensor:
    """Linearly resample a decomposed ``(L, C)`` table to ``(length, C)`` (identity if equal).

    Under ``torch.compile`` the table is always resampled (exactly the identity at equal length:
    every output row is one input row times 1), so whether the input size matches the size the
    table was made for is not a guard that recompiles the graph.
    """
    if not torch.compiler.is_compiling() and rel_pos.shape[0] == length:
        return rel_pos
    grid = rel_pos.t()[None].float()  # 1, C, L
    return F.interpolate(grid, size=length, mode="linear")[0].t().to(rel_pos.dtype)


def rel_pos_lookup(
    q_size: int, k_size: int, rel_pos: Tensor, grid: tuple[int, int] | None = None
) -> Tensor:
    """MViTv2 decomposed table lookup along one axis: ``(q_size, k_size, C)``.

    Args:
        q_size: query positions along the axis.
        k_size: key positions along the axis (smaller than ``q_size`` for pooled keys).
        rel_pos: ``(L, C)`` table. It is linearly resampled to ``2 * max(gq, gk) - 1`` rows when
            its length differs (a grid other than the one it was made for).
        grid: ``(gq, gk)`` grid the offsets are measured on, ``None`` = ``(q_size, k_size)``.
            Smaller ``q_size``/``k_size`` take the top-left block of that grid's lookup: a window
            clipped to a small map keeps the offsets (and values) of the full window.

    Returns:
        Table rows gathered for every (query, key) pair.
    """
    gq, gk = grid if grid is not None else (q_size, k_size)
    if q_size > gq or k_size > gk:
        raise ValueError(f"positions ({q_size}, {k_size}) exceed the lookup grid ({gq}, {gk})")
    table = resize_rel_pos_table(rel_pos, 2 * max(gq, gk) - 1)
    build = _decomposed_index.__wrapped__ if fresh_tables(table.device) else _decomposed_index  # no traced tensors cached
    idx = build(int(gq), int(gk), table.device)
    if (q_size, k_size) != (gq, gk):
        idx = idx[:q_size, :k_size]
    return table[idx]


def decomposed_rel_pos_factors(
    q: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    q_size: tuple[int, int],
    k_size: tuple[int, int],
    grid: tuple[tuple[int, int], tuple[int, int]] | None = None,
    key_terms: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The two small factors of the decomposed bias: ``q_ij . R_h[i, m]`` as ``(..., qh, qw, kh)``
    and ``q_ij . R_w[j, n]`` as ``(..., qh, qw, kw)``, ``key_terms`` added (arguments as for
    :func:`decomposed_rel_pos_bias`). :func:`sum_rel_pos_factors` of any slice of them over the
    leading dims and the query rows is that slice of the bias."""
    qh, qw = q_size
    kh, kw = k_size
    gh = (grid[0][0], grid[1][0]) if grid is not None else None
    gw = (grid[0][1], grid[1][1]) if grid is not None else None
    r_h = rel_pos_lookup(qh, kh, rel_pos_h, gh).to(q.dtype)  # qh, kh, C
    r_w = rel_pos_lookup(qw, kw, rel_pos_w, gw).to(q.dtype)  # qw, kw, C
    (r_q,) = autocast_inputs(q.reshape(*q.shape[:-2], qh, qw, q.shape[-1]))  # read by both products
    bias_h = torch.einsum("...hwc,hkc->...hwk", r_q, r_h)
    bias_w = torch.einsum("...hwc,wkc->...hwk", r_q, r_w)
    if key_terms is not None:
        bias_h = bias_h + key_terms[0].to(bias_h.dtype)
        bias_w = bias_w + key_terms[1].to(bias_w.dtype)
    return bias_h, bias_w


def decomposed_rel_pos_bias(
    q: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    q_size: tuple[int, int],
    k_size: tuple[int, int],
    grid: tuple[tuple[int, int], tuple[int, int]] | None = None,
    key_terms: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Additive attention term ``(..., Nq, Nk)`` from decomposed height/width tables.

    The term for query ``(i, j)`` and key ``(m, n)`` is ``q_ij . (R_h[i, m] + R_w[j, n])``, added to
    the logits before the softmax (MViTv2, Li et al. 2022, eq. 4).

    Args:
        q: queries ``(..., Nq, C)`` with ``Nq = q_size[0] * q_size[1]``, row-major, *unscaled*.
        rel_pos_h: ``(Lh, C)`` height table.
        rel_pos_w: ``(Lw, C)`` width table.
        q_size: query grid ``(h, w)``.
        k_size: key grid ``(h, w)``.
        grid: nominal ``(q_grid, k_grid)`` the offsets are measured on (a window that was clipped
            to a smaller map); ``None`` = the actual grids. See :func:`rel_pos_lookup`.
        key_terms: optional per-key-row and per-key-column additions ``(add_h, add_w)``,
            broadcastable to ``(..., qh, qw, kh)`` and ``(..., qh, qw, kw)``: key ``(m, n)`` gets
            ``add_h[m] + add_w[n]`` (e.g. ``MASK_VALUE`` on a window's padded rows and columns),
            folded into the two small factors, so the ``(Nq, Nk)`` term takes no extra pass.

    Returns:
        ``(..., Nq, Nk)`` with ``Nk = k_size[0] * k_size[1]``, row-major keys.
    """
    return sum_rel_pos_factors(*decomposed_rel_pos_factors(q, rel_pos_h, rel_pos_w, q_size, k_size, grid, key_terms))


def sum_rel_pos_factors(bias_h: Tensor, bias_w: Tensor) -> Tensor:
    """``(..., qh, qw, kh)`` and ``(..., qh, qw, kw)`` -> the bias ``(..., qh * qw, kh * kw)``:
    ``bias_h[..., i, j, m] + bias_w[..., i, j, n]`` for query ``(i, j)`` and key ``(m, n)``."""
    *lead, qh, qw, kh = bias_h.shape
    shape = (*lead, qh * qw, kh * bias_w.shape[-1])
    if tracing() or (torch.is_grad_enabled() and (bias_h.requires_grad or bias_w.requires_grad)):
        return (bias_h[..., :, None] + bias_w[..., None, :]).reshape(shape)  # ..., qh, qw, kh, kw
    # Without autograd, summed straight into a dense term: left to itself the broadcast sum
    # follows the strides of its inputs (q's layout), and the reshape would copy the whole term
    # once more. On a GPU its rows are padded for SDPA (aligned_term), which would copy it again.
    bias = aligned_term(shape, bias_h, torch.result_type(bias_h, bias_w))
    torch.add(bias_h[..., :, None], bias_w[..., None, :], out=bias.view(*bias_h.shape, bias_w.shape[-1]))
    return bias


@functools.lru_cache(maxsize=32)
def _key_one_hot(kh: int, kw: int, device: torch.device) -> Tensor:
    """``(kh * kw, kh + kw)``: for the key at ``(m, n)``, ones at columns ``m`` and ``kh + n``,
    zeros elsewhere."""
    with torch.inference_mode(False), torch.no_grad():
        rows = torch.arange(kh, device=device).repeat_interleave(kw)
        cols = torch.arange(kw, device=device).repeat(kh) + kh
        out = torch.zeros(kh * kw, kh + kw, device=device)
        idx = torch.arange(kh * kw, device=device)
        out[idx, rows] = 1.0
        out[idx, cols] = 1.0
        return out


def decomposed_rel_pos_fold(
    q: Tensor,
    k: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    q_size: tuple[int, int],
    k_size: tuple[int, int],
    scale: float,
    grid: tuple[tuple[int, int], tuple[int, int]] | None = None,
    key_mask: Tensor | None = None,
    align: int = 8,
) -> tuple[Tensor, Tensor]:
    """MViTv2's decomposed relative positions folded into the head dimension.

    Returns ``(q', k')`` with ``q' k'^T = scale * q k^T + decomposed_rel_pos_bias(q, ...)``, so
    attention runs with no additive term (``scale=1``): ``q'`` is ``q * scale`` followed by the
    query's ``kh`` height terms and ``kw`` width terms (the two small factors of the bias), ``k'``
    is ``k`` followed by the key's one-hot row and column. No ``(Nq, Nk)`` tensor is made, in the
    forward or the backward pass, and SDPA is free to choose a kernel that takes no mask. The
    head dimension grows by ``kh + kw`` (one more with ``key_mask``), padded with zeros to a
    multiple of ``align``.

    ``key_mask`` (True = blocked key, e.g. a window's padding) becomes one more column:
    ``MASK_VALUE`` in every query, 1 in blocked keys and 0 elsewhere, so blocked keys get
    ``MASK_VALUE`` added to their logits (zero weight after the softmax, as with the bias path's
    ``where``) and the others are unchanged.

    Args:
        q: queries ``(..., Nq, C)``, row-major over ``q_size``, unscaled.
        k: keys ``(..., Nk, C)``, row-major over ``k_size``.
        rel_pos_h, rel_pos_w, q_size, k_size, grid: as for :func:`decomposed_rel_pos_bias`.
        scale: the logit scale of ``q k^T``.
        key_mask: boolean, broadcastable to ``k.shape[:-1]``, or ``None``.
        align: head-dimension multiple of the results.

    Returns:
        ``q'``: ``(..., Nq, D)`` and ``k'``: ``(..., Nk, D)`` with ``D = C + kh + kw`` rounded up to
        ``align``, in ``q``'s dtype.
    """
    kh, kw = k_size
    lead, nq, c = q.shape[:-2], q.shape[-2], q.shape[-1]
    bias_h, bias_w = decomposed_rel_pos_factors(q, rel_pos_h, rel_pos_w, q_size, k_size, grid)
    q_parts = [q * scale, bias_h.reshape(*lead, nq, kh), bias_w.reshape(*lead, nq, kw)]
    one_hot = _key_one_hot.__wrapped__ if fresh_tables(k.device) else _key_one_hot
    k_parts = [k, one_hot(int(kh), int(kw), k.device).to(k.dtype).expand(*k.shape[:-1], kh + kw)]
    if key_mask is not None:
        q_parts.append(q.new_full((*lead, nq, 1), mask_value()))
        k_parts.append(key_mask.to(k.dtype).expand(k.shape[:-1]).unsqueeze(-1))
    pad = -sum(t.shape[-1] for t in q_parts) % align
    if pad:
        q_parts.append(q.new_zeros(*lead, nq, pad))
        k_parts.append(k.new_zeros(*k.shape[:-1], pad))
    return torch.cat(q_parts, -1), torch.cat(k_parts, -1)
