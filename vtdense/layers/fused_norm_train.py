"""Training's pre-norm + projection with the Triton LayerNorm of :mod:`vtdense.layers.fused_norm`
(CUDA, bf16 autocast). Off by default: not yet timed on a GPU.

Under CUDA autocast a pre-norm runs PyTorch's float32 LayerNorm and a cast to bf16, and training
with the recomputation (:func:`vtdense.layers.mlp.set_activation_recompute`) runs both again in the
backward pass. At Swin's first stage PyTorch's LayerNorm is ten times slower than the memory allows
(334 us against the Triton kernel's 31 us for 200,704 rows of 96 channels on an H200,
``benchmarks/RESULTS.md``). :class:`_TritonNormLinear` makes the bf16 normalised input in one Triton
kernel that also stores each row's float32 mean and 1/std (8 bytes a row), keeps ``x`` and those for
the backward pass, and there remakes the normalised input from them in one pass that gives the
forward's values bit for bit. The norm's gradient is one more Triton kernel (:func:`_backward_kernel`):
it reads the bf16 gradient and ``x`` as they are (PyTorch's backward wants both in float32, two more
casts) and writes the input's gradient in ``x``'s dtype, with per-block partial sums of the weight's
and bias's gradients that one ``sum`` finishes.

It keeps what the recomputation keeps (:func:`vtdense.layers.mlp.set_activation_recompute`), and
its own recomputation costs one fast kernel, so it runs with the recomputation switched off too.

Where it applies (:func:`triton_norm_training_applies`): switched on with
:func:`set_triton_norm_training`, a gradient being recorded on a plain CUDA tensor (not a fake or
subclass tensor, no graph being built) under bf16 autocast, with at least
:data:`~vtdense.layers.fused_norm.AUTO_MIN_ELEMENTS` values (smaller inputs run at the host's pace,
where the Triton launch costs more than PyTorch's two ops). Its values differ from PyTorch's
LayerNorm + cast as the inference kernel's do: about 1 in 10,000 by one bf16 step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vtdense.layers import fused_norm
from vtdense.layers.scoped import scoped_setting
from vtdense.layers.tracing import tracing

__all__ = ["set_triton_norm_training", "triton_norm_training", "triton_norm_training_applies", "triton_norm_linear"]

_enabled = False
_bwd: Any = None


def _backward_kernel() -> Any:
    """The LayerNorm backward kernel, defined on first use (Triton imports wherever the forward
    kernel does: :func:`triton_norm_training_applies` checks that one)."""
    global _bwd
    if _bwd is not None:
        return _bwd
    import triton
    import triton.language as tl

    @triton.jit
    def _layer_norm_backward(DY, X, W, MEAN, RSTD, DX, DW, DB, M, C, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                             HAS_W: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                             NEED_DB: tl.constexpr, DX_BF16: tl.constexpr):
        # rows contiguous, C apart. dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy * xhat)); the
        # weight's and bias's gradients, sum(dy * xhat) and sum(dy) over rows, per program into DW / DB
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows = rows.to(tl.int64)
        offs = rows[:, None] * C + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            wdy = dy * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        else:
            wdy = dy
        if NEED_DX:
            c1 = tl.sum(xhat * wdy, axis=1) / C
            c2 = tl.sum(wdy, axis=1) / C
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if DX_BF16:  # round to nearest even on the bits, as the forward kernel does
                bits = dx.to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                dx = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if NEED_DW:
            tl.store(DW + pid * C + cols, tl.sum(dy * xhat, axis=0), mask=cmask)
        if NEED_DB:
            tl.store(DB + pid * C + cols, tl.sum(dy, axis=0), mask=cmask)

    _bwd = _layer_norm_backward
    return _bwd


def _norm_backward(grad_a: Tensor, x: Tensor, norm_w: Tensor | None, mean: Tensor, rstd: Tensor,
                   need: tuple[bool, bool, bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``x``, the norm's weight and its bias from ``grad_a`` ``(rows, C)`` (any
    float dtype) and the forward's statistics, by :func:`_backward_kernel`."""
    kernel, (_, next_pow2, cdiv) = _backward_kernel(), fused_norm._triton_kernel()
    M, C = grad_a.shape
    x2 = x.reshape(M, C).contiguous()
    grad_a = grad_a.contiguous()
    block = next_pow2(C)
    rows = max(1, min(64, 4096 // block))
    programs = cdiv(M, rows)
    dx = torch.empty_like(x2) if need[0] else None
    dw = torch.empty(programs, C, dtype=torch.float32, device=x.device) if need[1] else None
    db = torch.empty(programs, C, dtype=torch.float32, device=x.device) if need[2] else None
    if M:
        with fused_norm.launch_device(x2):
            kernel[(programs,)](grad_a, x2, norm_w, mean, rstd, dx, dw, db, M, C, BLOCK_C=block, ROWS=rows,
                                HAS_W=norm_w is not None, NEED_DX=need[0], NEED_DW=need[1], NEED_DB=need[2],
                                DX_BF16=x.dtype == torch.bfloat16, num_warps=8 if block >= 2048 else 4)
    grad_x = dx.view(x.shape) if dx is not None else None
    grad_w = dw.sum(0).to(norm_w.dtype) if dw is not None else None  # type: ignore[union-attr]
    grad_b = db.sum(0) if db is not None else None
    return grad_x, grad_w, grad_b


def set_triton_norm_training(enabled: bool) -> None:
    """Switch the Triton LayerNorm on or off for training's pre-norms (off by default)."""
    global _enabled
    _enabled = bool(enabled)


def triton_norm_training(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context-manager form of :func:`set_triton_norm_training`."""
    return scoped_setting(lambda: _enabled, set_triton_norm_training, enabled)


def triton_norm_training_applies(x: Tensor) -> bool:
    """Whether :func:`triton_norm_linear` may run for a plain ``nn.LayerNorm`` on ``x`` followed by a
    plain ``nn.Linear`` in training (see the module's docstring; the caller checks the modules)."""
    if not _enabled or type(x) is not Tensor or x.device.type != "cuda" or not torch.is_grad_enabled() or tracing():
        return False  # (tracing first: a size test in a graph being built would guard on the size)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] > fused_norm.MAX_CHANNELS:
        return False
    if not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") != torch.bfloat16:
        return False
    if x.numel() < fused_norm.AUTO_MIN_ELEMENTS:
        return False
    return fused_norm._usable_on(x.device)


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


class _TritonNormLinear(torch.autograd.Function):
    """``linear(layer_norm(x).to(bf16))`` in bf16, keeping ``x`` and the rows' statistics (see the
    module's docstring). ``x``: ``(..., C)`` float32 or bf16 -> ``(..., out)`` bf16."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, weight: Tensor,
                bias: Tensor | None) -> Tensor:
        a, mean, rstd = fused_norm._run(x, norm_w, norm_b, eps, 1)
        w16 = weight.to(torch.bfloat16)
        out = F.linear(a, w16, _cast(bias, torch.bfloat16))
        ctx.save_for_backward(x, norm_w, norm_b, mean, rstd, weight, w16)
        ctx.eps, ctx.has_bias = eps, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_w, norm_b, mean, rstd, weight, w16 = ctx.saved_tensors
        need = ctx.needs_input_grad
        C = x.shape[-1]
        g2 = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)
        if torch.is_grad_enabled():  # create_graph: gradients that are themselves differentiable
            return _differentiable_backward(ctx, g2, x, norm_w, norm_b, weight)
        grad_x = grad_nw = grad_nb = grad_w = grad_b = None
        if need[4]:
            a = fused_norm._run(x, norm_w, norm_b, ctx.eps, 2, mean, rstd)[0]
            grad_w = g2.t().mm(a.reshape(-1, C)).to(weight.dtype)
        if ctx.has_bias and need[5]:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        if need[0] or need[1] or need[2]:
            mask = (need[0], need[1] and norm_w is not None, need[2] and norm_b is not None)
            grad_x, grad_nw, grad_nb = _norm_backward(g2.mm(w16), x, norm_w, mean, rstd, mask)
            grad_nb = grad_nb.to(norm_b.dtype) if grad_nb is not None else None  # type: ignore[union-attr]
        return grad_x, grad_nw, grad_nb, None, grad_w, grad_b


def _differentiable_backward(ctx: Any, g2: Tensor, x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None,
                             weight: Tensor) -> tuple[Tensor | None, ...]:
    """The backward under ``create_graph``, from PyTorch's differentiable LayerNorm (whose values
    may differ from the kernel's by one bf16 step, about 1 in 10,000)."""
    need = ctx.needs_input_grad
    C = x.shape[-1]
    a = F.layer_norm(x.float(), (C,), _cast(norm_w, torch.float32), _cast(norm_b, torch.float32), ctx.eps)
    a = a.to(torch.bfloat16)
    grad_w = g2.t().mm(a.reshape(-1, C)).to(weight.dtype) if need[4] else None
    grad_b = g2.sum(0).to(ctx.bias_dtype) if ctx.has_bias and need[5] else None
    leaves = [t if (t is not None and n) else None for t, n in zip((x, norm_w, norm_b), need[:3])]
    wanted = [t for t in leaves if t is not None]
    grads: list[Tensor | None] = [None, None, None]
    if wanted:
        grad_a = g2.mm(weight.to(torch.bfloat16)).view(x.shape)
        found = iter(torch.autograd.grad(a, wanted, grad_a, create_graph=True))
        grads = [next(found) if t is not None else None for t in leaves]
    return grads[0], grads[1], grads[2], None, grad_w, grad_b


def triton_norm_linear(x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, weight: Tensor,
                       bias: Tensor | None) -> Tensor:
    """``linear(norm(x))`` through :class:`_TritonNormLinear`: ``(..., C)`` -> ``(..., out)`` bf16.
    Callers check :func:`triton_norm_training_applies` first."""
    return _TritonNormLinear.apply(x, norm_w, norm_b, eps, weight, bias)
