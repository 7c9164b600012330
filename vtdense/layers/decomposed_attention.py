"""MViTv2's attention with the decomposed relative-position term, for CPU inference, a chunk of
queries at a time, eagerly and inside ``torch.compile`` graphs.

The term of the decomposed relative positions is ``(B, nW, heads, Nq, Nk)``: 59 MiB in a stage-2
block of MViTv2-T at 512x768, 134 MiB in a global one at 1024x1024. :func:`decomposed_attention_chunked`
makes it a chunk of queries at a time (whole images, runs of windows, or bands of query rows) of
about :data:`~vtdense.layers.chunked.CHUNK_BYTES`, and attends each chunk while its term is in cache.

Inside a compiled graph the same function runs as the opaque op
``vtdense::decomposed_attention_cpu`` (float32 CPU inference only): Inductor, left to build the
whole term itself at symbolic sizes, generated a scalar loop with integer divisions per element
that took 2.2 s of a 2.9 s MViTv2-T forward at 512x768 (eager: 0.86 s).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor

from vtdense.layers import chunked
from vtdense.layers.attention import attention
from vtdense.layers.chunked import window_slices
from vtdense.layers.tracing import exporting
from vtdense.layers.position import decomposed_rel_pos_factors, sum_rel_pos_factors

__all__ = ["decomposed_attention_chunked", "compiled_decomposed_attention_applies", "compiled_decomposed_attention"]

def decomposed_attention_chunked(
    qs: Tensor, ks: Tensor, vs: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, q_win: tuple[int, int],
    k_win: tuple[int, int], grid: tuple[tuple[int, int], tuple[int, int]] | None,
    key_terms: tuple[Tensor, Tensor] | None,
) -> Tensor:
    """Attention with the decomposed bias made per chunk of queries. The same values as the
    whole-term path: bit for bit over whole windows, to float rounding over bands of query rows
    (SDPA blocks a band differently).

    Args:
        qs: ``(B, nW, heads, Nq, d)`` queries, unscaled, row-major over ``q_win``.
        ks, vs: ``(B, nW, heads, Nk, d)``, row-major over ``k_win``.
        rel_pos_h, rel_pos_w, grid, key_terms: as for
            :func:`~vtdense.layers.position.decomposed_rel_pos_bias`.

    Returns:
        ``(B, nW, heads, Nq, d)``, a view of a ``(B, nW, Nq, heads, d)`` buffer.
    """
    B, nW, h, nq, d = qs.shape
    row_bytes = h * ks.shape[3] * qs.element_size()  # one query's bias, all heads
    out = qs.new_empty((B, nW, nq, h, d))
    band = max(1, chunked.CHUNK_BYTES // (q_win[1] * row_bytes))  # query-grid rows per chunk
    # the two small factors for all queries at once: (B, nW, heads, qh, qw, kh) and (..., kw)
    f_h, f_w = decomposed_rel_pos_factors(qs, rel_pos_h, rel_pos_w, q_win, k_win, grid, key_terms)
    for images, wins in window_slices(B, nW, nq, row_bytes):
        for r0 in range(0, q_win[0], band):
            rows = slice(r0, min(r0 + band, q_win[0]))
            toks = slice(rows.start * q_win[1], rows.stop * q_win[1])
            bias = sum_rel_pos_factors(f_h[images, wins, :, rows], f_w[images, wins, :, rows])
            part = attention(qs[images, wins, :, toks], ks[images, wins], vs[images, wins], bias)
            out[images, wins, toks].copy_(part.transpose(2, 3))
    return out.transpose(2, 3)


# (typing's List / Optional: torch 2.6's schema inference reads no list[int] or Tensor | None)
@torch.library.custom_op("vtdense::decomposed_attention_cpu", mutates_args=())
def _op(qs: Tensor, ks: Tensor, vs: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, q_win: List[int], k_win: List[int],
        grid: List[int], key_h: Optional[Tensor], key_w: Optional[Tensor]) -> Tensor:
    g = ((grid[0], grid[1]), (grid[2], grid[3])) if grid else None
    keys = (key_h, key_w) if key_h is not None and key_w is not None else None
    return decomposed_attention_chunked(qs, ks, vs, rel_pos_h, rel_pos_w, tuple(q_win), tuple(k_win), g, keys)


@_op.register_fake
def _(qs, ks, vs, rel_pos_h, rel_pos_w, q_win, k_win, grid, key_h, key_w):  # type: ignore[no-untyped-def]
    B, nW, h, nq, d = qs.shape
    return qs.new_empty(B, nW, nq, h, d).transpose(2, 3)  # the layout the eager function returns


def _flops(q_shape: Any, k_shape: Any, v_shape: Any, h_shape: Any, w_shape: Any, q_win: Any, k_win: Any, *args: Any,
           out_shape: Any = None, **kwargs: Any) -> int:
    queries = 1
    for dim in q_shape[:-1]:
        queries *= dim
    factors = 2 * queries * q_shape[-1] * (k_win[0] + k_win[1])  # q . R_h and q . R_w
    return factors + 2 * queries * k_shape[-2] * (q_shape[-1] + v_shape[-1])


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if torch.ops.vtdense.decomposed_attention_cpu not in flop_registry:
        register_flop_formula(torch.ops.vtdense.decomposed_attention_cpu)(_flops)


_register_flops()


def compiled_decomposed_attention_applies(qs: Tensor, ks: Tensor, vs: Tensor, rel_pos_h: Tensor) -> bool:
    """Inside ``torch.compile`` (not ``torch.export``), float32 CPU inference: the graph calls
    :func:`compiled_decomposed_attention`."""
    if not torch.compiler.is_compiling() or exporting():
        return False
    if qs.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return False
    if not (qs.dtype == ks.dtype == vs.dtype == rel_pos_h.dtype == torch.float32):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (qs, ks, vs, rel_pos_h)))


def compiled_decomposed_attention(
    qs: Tensor, ks: Tensor, vs: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, q_win: tuple[int, int],
    k_win: tuple[int, int], grid: tuple[tuple[int, int], tuple[int, int]] | None,
    key_terms: tuple[Tensor, Tensor] | None,
) -> Tensor:
    """:func:`decomposed_attention_chunked` as the graph op ``vtdense::decomposed_attention_cpu``."""
    flat_grid = [*grid[0], *grid[1]] if grid is not None else []
    key_h, key_w = key_terms if key_terms is not None else (None, None)
    return torch.ops.vtdense.decomposed_attention_cpu(qs, ks, vs, rel_pos_h, rel_pos_w, list(q_win), list(k_win), flat_grid,
                                                      key_h, key_w)
