"""A parameter's gradient in the parameter's own strides.

A kernel may return a weight gradient whose strides differ from the weight's only in a dimension of
size 1: a depthwise conv's ``(C, 1, kh, kw)`` weight gradient comes back channels-last from oneDNN,
strides ``(kh*kw, 1, kw, 1)`` against the weight's ``(kh*kw, kh*kw, kw, 1)``. The two address the
same elements, and autograd keeps such a gradient as it is; DDP compares the strides exactly, and
warns once per process that "grad strides do not match bucket view strides", which "may impair
performance". :func:`param_layout` is the parameter itself in the forward and gives its gradient the
parameter's strides in the backward, as a view where only size-1 strides differ (no copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vtdense.layers.tracing import tracing

__all__ = ["param_layout", "restride"]


def restride(grad: Tensor, size: torch.Size, stride: tuple[int, ...]) -> Tensor:
    """``grad`` with ``stride``: a view where the two differ only in size-1 dimensions, else a copy."""
    if grad.stride() == stride:
        return grad
    if all(g == s for g, s, n in zip(grad.stride(), stride, size) if n > 1):  # same elements: a view
        return grad.as_strided(size, stride, grad.storage_offset())
    return torch.empty_strided(size, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


class _ParamLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: Tensor) -> Tensor:
        ctx.size, ctx.stride = weight.shape, weight.stride()
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return restride(grad, ctx.size, ctx.stride)


def param_layout(weight: Tensor) -> Tensor:
    """``weight`` (any shape), whose gradient reaches it in ``weight``'s strides. Outside autograd
    (no gradient wanted), and while a graph is built or a ``torch.func`` transform runs
    (:func:`~vtdense.layers.tracing.tracing`: compiled graphs stay as they were), ``weight`` itself;
    there the ops give their weight gradients the weight's strides themselves
    (:func:`vtdense.layers.depthwise_conv.depthwise_conv_nhwc`)."""
    if not (weight.requires_grad and torch.is_grad_enabled()) or tracing():
        return weight
    return _ParamLayout.apply(weight)
