"""Convolutions of compiled graphs as one opaque op each, so that a graph serves every batch size.

While ``torch.compile`` traces ``F.conv2d``, PyTorch asks which conv backend the input would take,
and the answer depends on the batch size: on the CPU the trace guards ``2 <= B <= 15``. A graph
traced at a batch of 2 then compiled again for a batch of 1, and again for a batch of 16 or more.
With the batch traced as an unbacked size (:func:`vtdense.models.compile.compile_backbone`) there is
nothing to guard on, but then the traced conv cannot tell its output's memory format either, and
states one that the real conv does not return.

:class:`OpaqueConv2d` is an ``nn.Conv2d`` (the same parameters, ``state_dict`` and eager forward)
that inside a compiled graph runs as the custom op ``vtdense::conv2d``: the device's own conv on
an input of a stated memory format, returning that same format, which its fake kernel states
without looking at the batch. Its backward is a second op of the same kind. The format is the one
eager code gives the conv: channels-last on the CPU for the patch embeddings (which eager code makes
channels-last there, :func:`vtdense.backbones.base.cpu_channels_last`), contiguous otherwise (the
backbones' maps reach the FPN contiguous), so compiled code computes what eager code does. Eager
calls, ``torch.export`` / ONNX graphs and ``torch.func`` transforms keep ``nn.Conv2d.forward``.
MViTv2's pooling convs are of this class too; a plain one runs through its own channels-last op
(:mod:`vtdense.layers.depthwise_conv`), a hooked one is called as a module and so runs as this op.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.layers.chunked import functorch_transform
from vtdense.layers.depthwise_conv import _out_size
from vtdense.layers.tracing import exporting

__all__ = ["OpaqueConv2d", "conv2d_op", "opaque_convs", "patch_conv"]


def _format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


@torch.library.custom_op("vtdense::conv2d", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int groups, "
                                "bool channels_last) -> Tensor")
def _op(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int], groups: int,
        channels_last: bool) -> Tensor:
    with torch.autocast(x.device.type, enabled=False):
        out = F.conv2d(x, weight, bias, stride, padding, 1, groups)
    return out.contiguous(memory_format=_format(channels_last))


@_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int], groups: int,
      channels_last: bool) -> Tensor:
    B, _, H, W = x.shape
    kh, kw = weight.shape[2:]
    shape = (B, weight.shape[0], _out_size(H, kh, stride[0], padding[0]), _out_size(W, kw, stride[1], padding[1]))
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_format(channels_last))


@torch.library.custom_op("vtdense::conv2d_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor x, Tensor weight, int[] stride, int[] padding, int groups, "
                                "bool channels_last, bool[] needed) -> Tensor[]")
def _op_backward(grad: Tensor, x: Tensor, weight: Tensor, stride: List[int], padding: List[int], groups: int,
                 channels_last: bool, needed: List[bool]) -> List[Tensor]:
    fmt = _format(channels_last)
    with torch.autocast(x.device.type, enabled=False):
        g_x, g_w, g_b = torch.ops.aten.convolution_backward(
            grad.contiguous(memory_format=fmt), x, weight, [weight.shape[0]], stride, padding, [1, 1], False, [0, 0],
            groups, needed)
    return [g_x.contiguous(memory_format=fmt) if needed[0] else x.new_empty(0),
            g_w.contiguous() if needed[1] else weight.new_empty(0),
            g_b if needed[2] else weight.new_empty(0)]


@_op_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, stride: List[int], padding: List[int], groups: int,
      channels_last: bool, needed: List[bool]) -> List[Tensor]:
    g_x = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=_format(channels_last))
    return [g_x if needed[0] else x.new_empty(0),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if needed[1] else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if needed[2] else weight.new_empty(0)]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, bias, stride, padding, groups, channels_last = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (stride, padding, groups, channels_last)
    ctx.has_bias = bias is not None


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    needed = [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)]
    g_x, g_w, g_b = torch.ops.vtdense.conv2d_backward(grad, x, weight, *ctx.args, needed)
    return (g_x if needed[0] else None, g_w if needed[1] else None, g_b if needed[2] else None, None, None, None, None)


_op.register_autograd(_backward, setup_context=_setup)


def conv2d_op(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int], padding: tuple[int, int],
              groups: int = 1, channels_last: bool = False) -> Tensor:
    """``F.conv2d`` (zero padding, no dilation) as one op with its own backward (module docstring).

    Args:
        x: ``(B, C_in, H, W)``; it is made ``channels_last`` or contiguous first, as asked.
        weight: ``(C_out, C_in / groups, kh, kw)``; ``bias``: ``(C_out,)`` or ``None``.
        stride, padding, groups: of the conv.
        channels_last: the memory format of the conv's input and output.

    Returns:
        ``(B, C_out, H', W')`` in that memory format, ``H' = (H + 2 * ph - kh) // sh + 1``, in
        autocast's dtype where autocast is on (the conv's own rule), else in ``x``'s.
    """
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    x = x.contiguous(memory_format=_format(channels_last))
    return _op(x, weight, bias, list(stride), list(padding), groups, channels_last)


class OpaqueConv2d(nn.Conv2d):
    """``nn.Conv2d`` that runs as :func:`conv2d_op` inside ``torch.compile`` graphs (module docstring):
    ``(B, C_in, H, W)`` -> ``(B, C_out, H', W')``, channels-last on the CPU where
    :attr:`cpu_channels_last` is set (the patch embeddings), contiguous otherwise. Eager calls are
    ``nn.Conv2d``'s own."""

    #: whether compiled calls on the CPU run channels-last (the format eager callers give the input there)
    cpu_channels_last: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if (not torch.compiler.is_compiling() or exporting() or functorch_transform() or x.dim() != 4
                or self.padding_mode != "zeros" or self.dilation != (1, 1) or isinstance(self.padding, str)):
            return super().forward(x)
        channels_last = self.cpu_channels_last and x.device.type == "cpu"
        return conv2d_op(x, self.weight, self.bias, self.stride, self.padding, self.groups, channels_last)


def opaque_convs(module: nn.Module) -> nn.Module:
    """Make every plain ``nn.Conv2d`` in ``module`` (exactly that class) an :class:`OpaqueConv2d`, in
    place: parameters, buffers, hooks and ``state_dict`` stay as they are. Returns ``module``."""
    for m in module.modules():
        if type(m) is nn.Conv2d:
            m.__class__ = OpaqueConv2d
    return module


def patch_conv(in_chans: int, dim: int, **kwargs: Any) -> OpaqueConv2d:
    """A patch embedding's conv: an :class:`OpaqueConv2d` that runs channels-last on the CPU."""
    conv = OpaqueConv2d(in_chans, dim, **kwargs)
    conv.cpu_channels_last = True
    return conv
