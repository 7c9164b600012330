"""The MLP's CPU training step in cache-sized row chunks.

``fc2(gelu(fc1(norm(x))))`` is computed, forward and backward, over slices of rows
(:func:`~vtdense.layers.chunked.row_slices`): only ``x`` and the ``fc1`` output ``h`` are kept for
the backward pass (as :func:`~vtdense.layers.mlp.norm_linear` and
:func:`~vtdense.layers.mlp.gelu_linear` keep them), and every other hidden-width tensor of the
step (the GELU output, its gradient, the gradient of ``h``, the recomputed norm) exists one chunk
at a time. On the CPU that keeps them in cache between the matmul that writes them and the op
that reads them, and it spares the allocator the large blocks that glibc maps afresh (and the
kernel faults in page by page) each time: the stage-1 MLP of Swin-T at batch 2 and 512x768 made
five 72 MiB tensors per block and step. :func:`chunked_mlp_applies` takes this path only for
hidden activations of :data:`~vtdense.layers.chunked.TRAIN_CHUNK_MIN_BYTES` or more; smaller
ones run whole.

The values are those of plain autograd over the same operations; the weight gradients are sums
over chunks (added in place), which changes only the order of a float sum. ``h`` is kept as one
tensor per chunk, so no single allocation is hidden-width x all rows either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from vtdense.layers.chunked import NormLinearGrads, row_slices, training_chunking_applies
from vtdense.layers.cpu_linear import linear, linear_into, mm, mm_tn

__all__ = ["TRAIN_CHUNK_BYTES", "chunked_mlp", "chunked_mlp_applies"]

#: Target size (bytes) of one chunk's hidden-width temporaries in a training step. Larger chunks
#: make fewer, larger matmuls (the weight gradients sum over a chunk's rows, and short sums run
#: slower); smaller ones keep fewer bytes live. Swin-T's step at batch 2 and 512x768 on a 2-core
#: Zen 4 took 3273 / 3131 / 3066 ms at 4 / 16 / 24 MiB, with a peak RSS growth of 1505 / 1502 /
#: 1606 MiB (timm 2046): 16 MiB keeps the memory of 4 MiB and most of the speed.
TRAIN_CHUNK_BYTES = 16 << 20


def _accumulate(acc: Tensor | None, g: Tensor, x: Tensor) -> Tensor:
    """``acc + g.T @ x`` in place (``g.T @ x`` for the first chunk)."""
    gx = mm_tn(g, x)
    return gx if acc is None else acc.add_(gx)


class _ChunkedMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, has_norm: bool,
                w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, budget: int) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty((rows.shape[0], w2.shape[0]))
        slices = row_slices(rows.shape[0], w1.shape[0] * rows.element_size(), budget)
        hs = []
        for sl in slices:
            r = rows[sl]
            if has_norm:
                r = F.layer_norm(r, r.shape[-1:], norm_w, norm_b, eps)
            h = linear(r, w1, b1)
            hs.append(h)
            linear_into(out[sl], F.gelu(h), w2, b2)
        ctx.save_for_backward(rows, norm_w, norm_b, w1, b1, w2, *hs)
        ctx.slices, ctx.eps, ctx.has_norm, ctx.in_shape = slices, eps, has_norm, x.shape
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        return out.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, norm_w, norm_b, w1, b1, w2, *hs = ctx.saved_tensors
        need_x, need_nw, need_nb, _, _, need_w1, need_b1, need_w2, need_b2, _ = ctx.needs_input_grad
        fc1 = NormLinearGrads(norm_w, norm_b, ctx.eps, ctx.has_norm, w1, ctx.has_b1,
                              (need_x, need_nw, need_nb, need_w1, need_b1))
        g_out = grad.reshape(-1, grad.shape[-1])
        g_rows = torch.empty_like(rows) if need_x else None
        g_w2 = g_b2 = None
        for sl, h in zip(ctx.slices, hs):
            go = g_out[sl]
            if need_w2:
                g_w2 = _accumulate(g_w2, go, F.gelu(h))
            if need_b2 and ctx.has_b2:
                g_b2 = go.sum(0) if g_b2 is None else g_b2.add_(go.sum(0))
            if fc1.needed:
                fc1.add(torch.ops.aten.gelu_backward(mm(go, w2), h), rows[sl], g_rows[sl] if need_x else None)
        g_nw, g_nb, g_w1, g_b1 = fc1.grads
        g_x = g_rows.view(ctx.in_shape) if g_rows is not None else None
        return g_x, g_nw, g_nb, None, None, g_w1, g_b1, g_w2, g_b2, None


def chunked_mlp_applies(x: Tensor, hidden: int) -> bool:
    """Whether an MLP of ``hidden`` channels on ``x`` takes :func:`chunked_mlp`: a CPU step with
    gradients, outside autocast and graph capture
    (:func:`~vtdense.layers.chunked.training_chunking_applies`) whose hidden activation would
    be at least :data:`~vtdense.layers.chunked.TRAIN_CHUNK_MIN_BYTES`."""
    rows = x.numel() // max(x.shape[-1], 1)
    return training_chunking_applies(x, rows * hidden * x.element_size())


def chunked_mlp(x: Tensor, fc1: torch.nn.Linear, fc2: torch.nn.Linear, norm: torch.nn.LayerNorm | None = None,
                budget: int | None = None) -> Tensor:
    """``fc2(gelu(fc1(norm(x))))`` with its forward and backward over row chunks (see the module
    docstring); for CPU training steps without dropout or autocast. ``norm``: a LayerNorm over
    the last dimension, or ``None``. ``budget``: bytes of one chunk's hidden activation (default
    :data:`TRAIN_CHUNK_BYTES`). ``x``: ``(..., in)`` -> ``(..., out)``."""
    nw = nb = None
    eps = 0.0
    if norm is not None:
        nw, nb, eps = norm.weight, norm.bias, norm.eps
    return _ChunkedMlp.apply(x, nw, nb, eps, norm is not None, fc1.weight, fc1.bias, fc2.weight, fc2.bias,
                             TRAIN_CHUNK_BYTES if budget is None else budget)
