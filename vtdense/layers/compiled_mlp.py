"""The MLP of compiled float32 CPU inference as one opaque op, over row chunks as eager runs it.

Eager CPU inference runs each block's MLP over cache-sized row chunks (:meth:`vtdense.layers.mlp.Mlp.add_to_`):
the hidden activation, four times the block's width, never exists for the whole batch. A
``torch.compile`` graph cannot loop over a number of chunks that depends on a symbolic size, so
it ran the MLP whole: ``fc1`` (the ``vtdense::onednn_linear`` op) wrote the hidden activation of
every row, Inductor's GELU read and wrote it, and ``fc2`` read it back. For Swin-T at batch 8 and
224 that activation is 38.5 MiB in the first stage, above the 32 MiB up to which glibc's ``malloc``
reuses freed memory, so each forward mapped it afresh and faulted its pages in.

Inside compiled graphs, float32 CPU inference without gradients calls ``vtdense::cpu_mlp``
instead: the pre-norm (when the block fuses one), ``fc1``, GELU and ``fc2`` over the same row
chunks as eager inference, with the weights reordered for oneDNN once per call
(:func:`~vtdense.layers.cpu_linear.packed_weights`). So compiled code computes what eager code
does. With gradients, under autocast, in ``torch.export`` graphs, or with the BLAS chosen for CPU
linears, graphs keep the plain layers.

Measured on a 2-core Zen 4 host (``benchmarks/RESULTS.md``): about even in speed (Swin-T at batch 8
and 224 471.7 -> 464.5 ms in a default process, 431.5 -> 432.3 with ``keep_freed_memory()``; one
image of 512x768 488.1 -> 492.4 ms), and a smaller graph: the first compile of Swin-T at 512x768
took 52 s instead of 63-66.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.layers.chunked import row_slices
from vtdense.layers.cpu_linear import _compiled_applies, linear, linear_into, packed_weights
from vtdense.layers.plain import plain_gelu, plain_layer_norm, plain_linear

__all__ = ["compiled_cpu_mlp_applies", "compiled_cpu_mlp"]


def compiled_cpu_mlp_applies(x: Tensor, mlp: nn.Module, norm: nn.Module | None) -> bool:
    """Whether :func:`compiled_cpu_mlp` serves ``mlp(norm(x))`` (``mlp`` a
    :class:`~vtdense.layers.mlp.Mlp`): inside ``torch.compile`` (not ``torch.export``), without
    gradients, float32 CPU tensors, autocast off, oneDNN chosen for CPU linears, and plain layers
    (no hooks, exact GELU, no dropout in training)."""
    if torch.is_grad_enabled() or not _compiled_applies(x, mlp.fc1.weight):
        return False
    if mlp.training and mlp.drop.p:
        return False
    if norm is not None and not plain_layer_norm(norm):
        return False
    return plain_linear(mlp.fc1) and plain_linear(mlp.fc2) and plain_gelu(mlp.act)


def compiled_cpu_mlp(x: Tensor, mlp: nn.Module, norm: nn.Module | None) -> Tensor:
    """``fc2(gelu(fc1(norm(x))))`` as the op ``vtdense::cpu_mlp``. ``x``: ``(..., dim)`` ->
    ``(..., out_dim)``. Callers check :func:`compiled_cpu_mlp_applies` first."""
    has_norm = norm is not None
    return torch.ops.vtdense.cpu_mlp(
        x, has_norm, norm.weight if has_norm else None, norm.bias if has_norm else None, norm.eps if has_norm else 0.0,
        mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)


@torch.library.custom_op("vtdense::cpu_mlp", mutates_args=())
def _cpu_mlp(x: Tensor, has_norm: bool, norm_w: Optional[Tensor], norm_b: Optional[Tensor], eps: float,
             w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor]) -> Tensor:  # (typing's Optional: see decomposed_attention)
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], w2.shape[0])
    if not rows.shape[0]:  # (an empty batch: no chunks)
        return out.view(*x.shape[:-1], w2.shape[0])
    with torch.no_grad(), packed_weights():  # each weight reordered once for all the chunks
        for sl in row_slices(rows.shape[0], w1.shape[0] * rows.element_size()):
            r = rows[sl]
            if has_norm:
                r = F.layer_norm(r, r.shape[-1:], norm_w, norm_b, eps)
            linear_into(out[sl], torch.ops.aten.gelu_(linear(r, w1, b1)), w2, b2)
    return out.view(*x.shape[:-1], w2.shape[0])


@_cpu_mlp.register_fake
def _(x: Tensor, has_norm: bool, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, w1: Tensor,
      b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], w2.shape[0])
