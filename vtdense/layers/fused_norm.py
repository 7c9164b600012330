"""A LayerNorm that writes the bf16 input of the next projection (CUDA inference under bf16 autocast).

CUDA autocast runs ``layer_norm`` in float32: on a float32 residual stream it reads and writes
float32, and the projection after it casts that output to bf16 in a second kernel. On the H200
(``benchmarks/RESULTS.md``) the two took about a quarter of Swin-T's inference kernels, PyTorch's
LayerNorm kernel being slow for the few channels of early stages (one thread block per row). The
Triton kernel here normalises a block of rows per program in float32, as autocast does, and rounds
to bf16, to nearest even, as the cast does: one pass that reads the input once and writes half the
bytes. Its statistics are summed in another order than PyTorch's, so a value can differ by one
bf16 step where the float32 result sits on a rounding boundary (about 1 in 10,000 values).

Off by default until it is timed on a GPU: :func:`set_triton_norm` switches it on. It runs only in
eager CUDA inference (no gradient recorded, no graph being built) under bf16 autocast, for a plain
``nn.LayerNorm`` followed by a plain ``nn.Linear`` (:func:`vtdense.layers.mlp.norm_linear`), where
Triton imports. As the op ``vtdense::layer_norm_bf16`` it has a fake implementation, so the GPU
code paths' tests run it on fake CUDA tensors.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.layers.plain import plain_layer_norm
from vtdense.layers.scoped import scoped_setting
from vtdense.layers.tracing import tracing

__all__ = ["set_triton_norm", "triton_norm", "triton_norm_applies", "layer_norm_bf16"]

_enabled = False
#: Widest row the kernel takes in one block.
MAX_CHANNELS = 8192
_kernel: Any = None


def set_triton_norm(enabled: bool) -> None:
    """Switch the fused LayerNorm + bf16 cast of CUDA inference on or off (off by default)."""
    global _enabled
    _enabled = bool(enabled)


def triton_norm(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context-manager form of :func:`set_triton_norm`."""
    return scoped_setting(lambda: _enabled, set_triton_norm, enabled)


def _triton_kernel() -> Any:
    """The Triton kernel, defined on first use (``None`` where Triton does not import)."""
    global _kernel
    if _kernel is not None:
        return _kernel or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _kernel = False
        return None

    @triton.jit
    def _layer_norm_bf16(X, W, B, Y, M, C, stride_x, eps, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (rows < M)[:, None] & cmask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / C
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # round to nearest even on the bits, so every backend (the CPU interpreter truncates) agrees
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        tl.store(Y + rows[:, None] * C + cols[None, :], y.to(tl.bfloat16), mask=mask)

    _kernel = (_layer_norm_bf16, triton.next_power_of_2, triton.cdiv)
    return _kernel


def _launch(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """Run the kernel on ``x`` ``(..., C)`` (rows contiguous): ``(..., C)`` bf16."""
    kernel, next_pow2, cdiv = _triton_kernel()
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(x2.shape, dtype=torch.bfloat16, device=x.device)
    M = x2.shape[0]
    if M:
        block = next_pow2(C)
        rows = max(1, min(64, 4096 // block))
        kernel[(cdiv(M, rows),)](x2, weight, bias, y, M, C, x2.stride(0), eps, BLOCK_C=block, ROWS=rows,
                                 HAS_W=weight is not None, HAS_B=bias is not None, num_warps=8 if block >= 2048 else 4)
    return y.view(x.shape)


@torch.library.custom_op("vtdense::layer_norm_bf16", mutates_args=())
def layer_norm_bf16(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:  # typing's: see decomposed_attention
    """``layer_norm(x.float(), weight, bias).to(bfloat16)`` over the last dimension, in one Triton
    kernel on CUDA (elsewhere, and without Triton, the two ops). ``x``: ``(..., C)`` float32 or
    bf16; ``weight``, ``bias``: ``(C,)`` or ``None`` -> ``(..., C)`` bf16."""
    if x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        if _triton_kernel() is not None:
            return _launch(x, weight, bias, eps)
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), x.shape[-1:], w, b, eps).to(torch.bfloat16)


@layer_norm_bf16.register_fake
def _(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)


def triton_norm_applies(x: Tensor, norm: nn.Module) -> bool:
    """Whether :func:`layer_norm_bf16` may stand in for ``norm(x)`` before a plain linear layer:
    switched on, CUDA inference under bf16 autocast (no gradient to record, no graph being built),
    ``norm`` a plain ``nn.LayerNorm`` over at most :data:`MAX_CHANNELS` channels, ``x`` float32 or
    bf16, and Triton available."""
    if not _enabled or x.device.type != "cuda" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in norm.parameters())):
        return False
    if not plain_layer_norm(norm) or x.shape[-1] > MAX_CHANNELS or tracing():
        return False
    return _triton_kernel() is not None
