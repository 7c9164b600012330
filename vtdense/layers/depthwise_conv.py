"""A depthwise conv on channels-last maps as one opaque op with its own backward, for compiled
training.

MViTv2 pools its queries, keys and values with depthwise 3x3 convs over ``(B, H, W, C)`` maps.
Compiled training cannot run them as ``F.conv2d`` on the channels-last ``permute`` view: autograd
saves that view for the filters' gradient, and Inductor, laying out a saved view, sorts its
symbolic strides with sympy alone and stops (torch 2.14, dynamic sizes). MViTv2 once pooled by the
conv's nine taps there, strided slices of a padded copy that Inductor fused; their forward and
backward were about a third of the kernels Inductor had to generate for MViTv2-T, each with long
index expressions over the pooled sizes, and half of the C++ code generation's time in its first
compile on the CPU. :func:`depthwise_conv_nhwc` runs the conv as the custom op
``vtdense::depthwise_conv_nhwc`` instead: one call to the device's own conv (oneDNN, cuDNN) that
Inductor does not look into, which saves the map (as rows) for a backward that is a second op of
the same kind (``aten.convolution_backward``).
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.nn.functional as F
from torch import Tensor

from vtdense.layers.grad_layout import restride

__all__ = ["depthwise_conv_nhwc"]


def _out_size(n: Any, k: int, s: int, p: int) -> Any:
    return (n + 2 * p - k) // s + 1


def _conv_input(rows: Tensor, H: Any, W: Any) -> Tensor:
    """``(B * H * W, C)`` rows as the conv's ``(B, C, H, W)`` input, a channels-last view."""
    return rows.view(-1, H, W, rows.shape[1]).permute(0, 3, 1, 2)


# The op reads the map as rows, (B * H * W, C), and writes (B, H', W', heads, d): what autograd saves
# for the backward (the rows) and what the head norm reads (the output) are then either tensors of
# their own or views with static strides. Inductor lays out a saved view, or an op's output viewed,
# by sorting its strides with sympy alone, which cannot order symbolic ones such as (H*W*C, W*C, C, 1)
# ("cannot determine truth value of Relational: 1 < s81").
@torch.library.custom_op("vtdense::depthwise_conv_nhwc", mutates_args=(),
                         schema="(Tensor rows, Tensor filters, SymInt B, SymInt H, SymInt W, int heads, int[] stride, "
                                "int[] padding) -> Tensor")
def _op(rows: Tensor, filters: Tensor, B: int, H: int, W: int, heads: int, stride: List[int],
        padding: List[int]) -> Tensor:
    with torch.autocast(rows.device.type, enabled=False):
        out = F.conv2d(_conv_input(rows, H, W), filters, None, stride, padding, groups=rows.shape[1])
    return out.permute(0, 2, 3, 1).reshape(*out.shape[:1], *out.shape[2:], heads, -1).contiguous()


@_op.register_fake
def _(rows: Tensor, filters: Tensor, B: Any, H: Any, W: Any, heads: int, stride: List[int], padding: List[int]) -> Tensor:
    C = rows.shape[1]
    kh, kw = filters.shape[2:]
    return rows.new_empty(B, _out_size(H, kh, stride[0], padding[0]), _out_size(W, kw, stride[1], padding[1]),
                          heads, C // heads)


@torch.library.custom_op("vtdense::depthwise_conv_nhwc_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor rows, Tensor filters, SymInt H, SymInt W, int[] stride, "
                                "int[] padding) -> Tensor[]")
def _op_backward(grad: Tensor, rows: Tensor, filters: Tensor, H: int, W: int, stride: List[int],
                 padding: List[int]) -> List[Tensor]:
    with torch.autocast(rows.device.type, enabled=False):
        g = grad.flatten(3).permute(0, 3, 1, 2)
        gy, gw, _ = torch.ops.aten.convolution_backward(
            g, _conv_input(rows, H, W), filters, None, stride, padding, [1, 1], False, [0, 0], rows.shape[1],
            [True, True, False])
    # the weight gradient in the filters' strides: oneDNN returns a (C, 1, kh, kw) one channels-last, which
    # differs only in the size-1 dimension (a view), and DDP warns where a parameter's gradient and its
    # bucket differ in strides (see vtdense.layers.grad_layout)
    return [gy.permute(0, 2, 3, 1).reshape(rows.shape).contiguous(), restride(gw.contiguous(), filters.shape, filters.stride())]


@_op_backward.register_fake
def _(grad: Tensor, rows: Tensor, filters: Tensor, H: Any, W: Any, stride: List[int], padding: List[int]) -> List[Tensor]:
    return [torch.empty_like(rows, memory_format=torch.contiguous_format),
            torch.empty_strided(filters.shape, filters.stride(), dtype=filters.dtype, device=filters.device)]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    rows, filters, _, H, W, _, stride, padding = inputs
    ctx.save_for_backward(rows, filters)
    ctx.size, ctx.stride, ctx.padding = (H, W), stride, padding


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    rows, filters = ctx.saved_tensors
    gy, gw = torch.ops.vtdense.depthwise_conv_nhwc_backward(grad.contiguous(), rows, filters, *ctx.size, ctx.stride,
                                                            ctx.padding)
    return gy, gw, None, None, None, None, None, None


_op.register_autograd(_backward, setup_context=_setup)


def depthwise_conv_nhwc(y: Tensor, filters: Tensor, stride: tuple[int, int], padding: tuple[int, int],
                        heads: int = 1) -> Tensor:
    """``F.conv2d`` with ``groups=C`` on a channels-last map, as one op with its own backward.

    Args:
        y: ``(B, H, W, C)``.
        filters: ``(C, 1, kh, kw)``.
        stride, padding: of the conv.
        heads: the output's channels split as ``(heads, C // heads)``.

    Returns:
        ``(B, H', W', heads, C // heads)``, contiguous, ``H' = (H + 2 * ph - kh) // sh + 1``: the
        conv's values, in autocast's dtype where autocast is on (the conv's own rule), else in ``y``'s.
    """
    if torch.is_autocast_enabled(y.device.type):
        dtype = torch.get_autocast_dtype(y.device.type)
        y, filters = y.to(dtype), filters.to(dtype)
    B, H, W, C = y.shape
    return _op(y.reshape(-1, C), filters, B, H, W, heads, list(stride), list(padding))
