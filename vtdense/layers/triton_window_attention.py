"""Swin's windowed attention (V1, and V2's scaled cosine) for training in two Triton kernels (CUDA).
On by default (``"auto"``) for half-precision training wherever Triton runs on the GPU; ``True`` takes
float32 too (its products are then exact float32, not TF32, and untimed), ``False`` leaves it all to
SDPA (:func:`set_triton_window_attention`). On an H200 in bf16 at batch 8 and 512x768 it took the
Swin-T training step from 52.5 to 44.6 ms and SwinV2-T's from 56.8 to 40.2 ms, with less memory
(``benchmarks/RESULTS.md``).

In training, Swin's attention runs SDPA's memory-efficient kernel (its additive term needs a
gradient, which the cuDNN and flash kernels do not give). Around it, every block then also runs:
the copy of q, k and v into the heads-first layout SDPA reads, the build of the additive term
(the position bias cast to the compute dtype and written, masked, into an aligned ``(nW, heads,
N, N)`` buffer), and in the backward pass the matching kernels the other way: the term's full
gradient reduced over the batch and the windows, the cast back, the masked fill's gradient and
the gradients of q, k and v gathered back into the projection's layout.

:func:`window_attention` does the attention of every window of one head in one program,
reading q, k and v where the qkv projection wrote them, ``(B, nW, N, 3, heads, d)``, the float32
``(heads, N, N)`` position bias and the ``(nW, N, N)`` shift mask as they are, and writing the
output straight in the ``(B, nW, N, C)`` layout the output projection reads. A window holds at
most 64 tokens (Swin's 7x7 and 8x8), so a program holds its whole score matrix: no tiling and no
online softmax. The backward pass is one more kernel: each program walks a run of windows of one
head, recomputes their probabilities from the forward's row log-sum-exps, writes the gradients of
q, k and v into one tensor in the projection's layout, and sums the bias gradient of its windows
in registers; one ``sum`` over the programs' partial sums finishes it (deterministic: no atomics).

Swin V2 (``logit_scale`` given): each program also scales its q rows by ``exp(min(logit_scale,
log(100))) / |q|`` and its k rows by ``1 / |k|`` in float32 and rounds them to the inputs' dtype, as
the SDPA path writes them, and the backward takes the gradients of q and k through those norms and
sums the logit scale's gradient per program. What that saves besides the above: the norms, the
scaled q and k written heads-first, and their gradients.

Values: the score matrix is accumulated in float32, the probabilities are rounded to the inputs'
dtype before multiplying ``v`` (as SDPA's fused kernels do), and the bias enters in float32 where
the SDPA path adds it rounded to the compute dtype. Blocked pairs take :data:`~vtdense.layers.
windows.MASK_VALUE` in place of the bias, as :meth:`~vtdense.backbones.swin.WindowAttention.
attn_term` builds them, and give the bias no gradient.

Where it applies (:func:`triton_window_attention_applies`): not switched off with
:func:`set_triton_window_attention` (or :func:`triton_window_attention`), a gradient being recorded
on a plain CUDA tensor, no attention dropout, windows of at most 64 tokens, a head width of 16, 32,
64 or 128, a float32 / bf16 / fp16 projection, a boolean mask. Its backward pass is not itself
differentiable (no ``create_graph``).

In a graph ``torch.compile`` builds (``compile_backbone``'s included; not ``torch.export``'s) the
kernels run as two custom ops, ``vtdense::triton_window_attention`` and
``vtdense::triton_window_attention_backward``, opaque to the compiler (Inductor calls them as they
are and fuses what lies around them), with shapes for symbolic sizes. Eager code can fall back to
SDPA where a launch fails; a compiled graph cannot, so graphs take the ops only on a device where a
small probe launch has worked (once per device and process, while the first graph is traced).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from vtdense.layers import fused_norm
from vtdense.layers.scoped import is_auto_switch, scoped_setting
from vtdense.layers.tracing import exporting, tracing
from vtdense.layers.windows import mask_value

__all__ = ["set_triton_window_attention", "triton_window_attention", "triton_window_attention_applies",
           "triton_window_attention_enabled", "takes_dtype", "window_attention", "DTYPES", "LABEL", "MAX_WINDOW_TOKENS"]

#: the profiler label of the forward kernel's launch (``LABEL + "_backward"``: the backward's), recorded
#: only while a profiler runs (``benchmarks/attention_kernels.py`` counts them as fused attention)
LABEL = "vtdense::triton_window_attention"
#: the dtypes the kernels take (the qkv projection's output)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the most tokens a window may hold for the kernels (one program holds a window's whole score matrix)
MAX_WINDOW_TOKENS = 64
_HEAD_WIDTHS = (16, 32, 64, 128)
#: programs the backward pass aims for (several per multiprocessor of an H100), and its warps per
#: program: the fastest of ``benchmarks/triton_attention_check.py``'s sweep on an H200 (Swin-T's first
#: stage, bf16: 2558 us per forward + backward, against 2569 for 1024 x 4, 2776 for 1024 x 8, 2814
#: for 2048 x 8 and 2723 for 4096 x 4)
_BACKWARD_PROGRAMS = 512
_BACKWARD_WARPS = 4

_enabled: bool | str = "auto"
#: what the ``"auto"`` mode takes: half precision (float32's kernels, exact products, were not timed)
_AUTO_DTYPES = (torch.bfloat16, torch.float16)
_kernels: Any = None
#: why the forward kernel failed on this machine (then the SDPA path runs), or None
_failed: str | None = None


def _build() -> Any:
    """``(forward, backward, cdiv)``: the Triton kernels, defined on first use, and Triton's ``cdiv``."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def _forward(QKV, BIAS, MASK, OUT, LSE, LOGIT, nW, N, H, scale, MASKED_VALUE, LOGIT_MAX, LSE_ROW,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
                 UPCAST: tl.constexpr, COSINE: tl.constexpr):
        # one program: window bw (of B * nW), head hh; q, k, v at (bw, n, 0/1/2, hh, :) of (B*nW, N, 3, H, D)
        bw = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        C = H * D
        rows = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, D)
        rvalid = rows < N
        lmask = rvalid[:, None]
        offs = bw * N * 3 * C + rows[:, None] * (3 * C) + hh * D + cols[None, :]
        q = tl.load(QKV + offs, mask=lmask, other=0.0)
        k = tl.load(QKV + offs + C, mask=lmask, other=0.0)
        v = tl.load(QKV + offs + 2 * C, mask=lmask, other=0.0)
        if COSINE:  # Swin V2: q * logit_scale / |q| and k / |k|, rounded to the inputs' dtype
            qf, kf = q.to(tl.float32), k.to(tl.float32)
            iq = 1.0 / tl.maximum(tl.sqrt(tl.sum(qf * qf, 1)), 1e-12)
            ik = 1.0 / tl.maximum(tl.sqrt(tl.sum(kf * kf, 1)), 1e-12)
            sc = tl.exp(tl.minimum(tl.load(LOGIT + hh).to(tl.float32), LOGIT_MAX))
            q = (qf * (iq * sc)[:, None]).to(QKV.dtype.element_ty)
            k = (kf * ik[:, None]).to(QKV.dtype.element_ty)
        if UPCAST:  # (see _upcast)
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        pair = rows[:, None] * N + rows[None, :]
        pvalid = rvalid[:, None] & rvalid[None, :]
        t = tl.load(BIAS + hh * N * N + pair, mask=pvalid, other=0.0).to(tl.float32)
        if HAS_MASK:
            blocked = tl.load(MASK + (bw % nW) * N * N + pair, mask=pvalid, other=0)
            t = tl.where(blocked != 0, MASKED_VALUE, t)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale + t
        s = tl.where(rvalid[None, :], s, float("-inf"))
        m = tl.max(s, 1)
        p = tl.exp(s - m[:, None])
        denom = tl.sum(p, 1)
        p = p / denom[:, None]
        p = p.to(QKV.dtype.element_ty)  # rounded to the inputs' dtype, as SDPA's fused kernels do
        if UPCAST:
            p = p.to(tl.float32)
        o = tl.dot(p, v, input_precision=PREC)
        out_offs = bw * N * C + rows[:, None] * C + hh * D + cols[None, :]
        tl.store(OUT + out_offs, o.to(OUT.dtype.element_ty), mask=lmask)
        tl.store(LSE + (bw * H + hh) * LSE_ROW + rows, m + tl.log(denom))

    @triton.jit
    def _backward(QKV, BIAS, MASK, OUT, DOUT, LSE, DQKV, DBIAS, LOGIT, DLOGIT, BW, nW, N, H, scale, MASKED_VALUE,
                  LOGIT_MAX, WPP, LSE_ROW, D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                  PREC: tl.constexpr, NEED_DBIAS: tl.constexpr, UPCAST: tl.constexpr, COSINE: tl.constexpr):
        # one program: head hh, windows [chunk * WPP, (chunk + 1) * WPP) of B * nW (WPP a run-time
        # value: a new image size must not compile the kernel again)
        hh = tl.program_id(0)
        chunk = tl.program_id(1)
        C = H * D
        rows = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, D)
        rvalid = rows < N
        pair = rows[:, None] * N + rows[None, :]
        pvalid = rvalid[:, None] & rvalid[None, :]
        t0 = tl.load(BIAS + hh * N * N + pair, mask=pvalid, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
        if COSINE:
            sc = tl.exp(tl.minimum(tl.load(LOGIT + hh).to(tl.float32), LOGIT_MAX))
            dsc = tl.zeros((BLOCK_N,), dtype=tl.float32)  # the logit scale's gradient, per row, summed
        for i in range(WPP):
            bw = chunk.to(tl.int64) * WPP + i
            live = bw < BW
            lmask = rvalid[:, None] & live
            offs = bw * N * 3 * C + rows[:, None] * (3 * C) + hh * D + cols[None, :]
            out_offs = bw * N * C + rows[:, None] * C + hh * D + cols[None, :]
            q = tl.load(QKV + offs, mask=lmask, other=0.0)
            k = tl.load(QKV + offs + C, mask=lmask, other=0.0)
            v = tl.load(QKV + offs + 2 * C, mask=lmask, other=0.0)
            o = tl.load(OUT + out_offs, mask=lmask, other=0.0)
            do = tl.load(DOUT + out_offs, mask=lmask, other=0.0)
            lse = tl.load(LSE + (bw * H + hh) * LSE_ROW + rows, mask=rvalid & live, other=0.0)
            if COSINE:  # the forward's scaled q and k again, and what their gradients need
                qf, kf = q.to(tl.float32), k.to(tl.float32)
                nq = tl.sqrt(tl.sum(qf * qf, 1))
                nk = tl.sqrt(tl.sum(kf * kf, 1))
                iq = 1.0 / tl.maximum(nq, 1e-12)
                ik = 1.0 / tl.maximum(nk, 1e-12)
                qn = qf * iq[:, None]
                kn = kf * ik[:, None]
                q = (qf * (iq * sc)[:, None]).to(QKV.dtype.element_ty)
                k = kn.to(QKV.dtype.element_ty)
            if UPCAST:
                q, k, v, do = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), do.to(tl.float32)
            t = t0
            if HAS_MASK:
                blocked = tl.load(MASK + (bw % nW) * N * N + pair, mask=pvalid, other=0)
                t = tl.where(blocked != 0, MASKED_VALUE, t0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale + t
            s = tl.where(rvalid[None, :], s, float("-inf"))
            p = tl.exp(s - lse[:, None])
            pr = p.to(QKV.dtype.element_ty)
            if UPCAST:
                pr = pr.to(tl.float32)
            dv = tl.dot(tl.trans(pr), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            ds = tl.where(lmask, p * (dp - delta[:, None]), 0.0)
            dsr = ds.to(QKV.dtype.element_ty)
            if UPCAST:
                dsr = dsr.to(tl.float32)
            dq = tl.dot(dsr, k, input_precision=PREC) * scale
            dk = tl.dot(tl.trans(dsr), q, input_precision=PREC) * scale
            if COSINE:  # through q * sc / |q| and k / |k| (a norm clamped at 1e-12 passes no gradient)
                dsc += tl.sum(dq * qn, 1)
                dqn = dq * sc
                dq = tl.where((nq >= 1e-12)[:, None], (dqn - qn * tl.sum(dqn * qn, 1)[:, None]), dqn) * iq[:, None]
                dk = tl.where((nk >= 1e-12)[:, None], (dk - kn * tl.sum(dk * kn, 1)[:, None]), dk) * ik[:, None]
            tl.store(DQKV + offs, dq.to(DQKV.dtype.element_ty), mask=lmask)
            tl.store(DQKV + offs + C, dk.to(DQKV.dtype.element_ty), mask=lmask)
            tl.store(DQKV + offs + 2 * C, dv.to(DQKV.dtype.element_ty), mask=lmask)
            if NEED_DBIAS:
                if HAS_MASK:
                    ds = tl.where(blocked != 0, 0.0, ds)
                acc += ds
        if NEED_DBIAS:
            square = rows[:, None] * BLOCK_N + rows[None, :]
            tl.store(DBIAS + (hh * tl.num_programs(1) + chunk).to(tl.int64) * BLOCK_N * BLOCK_N + square, acc)
        if COSINE:  # d(logit_scale) = d(sc) * sc where the clamp passes it
            ls = tl.load(LOGIT + hh).to(tl.float32)
            g = tl.where(ls <= LOGIT_MAX, tl.sum(dsc, 0) * sc, 0.0)
            tl.store(DLOGIT + hh * tl.num_programs(1) + chunk, g)

    _kernels = (_forward, _backward, triton.cdiv)
    return _kernels


def set_triton_window_attention(enabled: bool | str) -> None:
    """Where Swin's training attention runs the Triton kernels: ``"auto"`` (the default) for a bf16 or
    fp16 qkv projection, ``True`` for any of :data:`DTYPES`, ``False`` nowhere (SDPA's memory-efficient
    kernel with the bias and mask as an additive term)."""
    global _enabled
    if not is_auto_switch(enabled):
        raise ValueError(f"set_triton_window_attention takes True, False or 'auto'; got {enabled!r}")
    _enabled = "auto" if enabled == "auto" else bool(enabled)


def triton_window_attention_enabled() -> bool | str:
    """The mode :func:`set_triton_window_attention` set: ``"auto"`` (the default), ``True`` or ``False``."""
    return _enabled


def takes_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernels take a qkv projection of ``dtype`` in the current mode."""
    return dtype in (_AUTO_DTYPES if _enabled == "auto" else DTYPES)


def triton_window_attention(enabled: bool | str) -> contextlib.AbstractContextManager[None]:
    """Context-manager form of :func:`set_triton_window_attention`."""
    return scoped_setting(triton_window_attention_enabled, set_triton_window_attention, enabled)


def triton_window_attention_applies(x: Tensor, tokens: int, head_width: int, dropout: float) -> bool:
    """Whether :func:`window_attention` may run for the windows ``x`` ``(B, nW, N, C)`` of a block
    in training (see the module's docstring), in eager code or in a graph ``torch.compile`` builds.
    The caller also checks that its qkv projection's output needs a gradient and has one of
    :data:`DTYPES`."""
    if not _enabled:
        return False
    if tracing():  # (first: graphs being built see nothing else of this check)
        return _applies_in_graph(x, tokens, head_width, dropout)
    interpreted = _interpreted(x)
    if type(x) is not Tensor or (x.device.type != "cuda" and not interpreted):
        return False
    if not torch.is_grad_enabled() or dropout:
        return False
    if tokens > MAX_WINDOW_TOKENS or head_width not in _HEAD_WIDTHS or _failed is not None:
        return False
    return interpreted or fused_norm._usable_on(x.device)


def _labelled(label: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function(label)`` while a profiler runs; nothing otherwise (no host time per launch)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()


def _interpreted(x: Tensor) -> bool:
    """Whether the kernels run in Triton's CPU interpreter (the tests' way to run them without a GPU)."""
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _upcast(qkv: Tensor) -> bool:
    """Whether the kernels multiply in float32: a half-precision input in Triton's CPU interpreter,
    which multiplies bf16 tiles wrongly (Triton 3.8). The operands are the same rounded values, so
    the products are what the GPU's half-precision products accumulated in float32 give."""
    return qkv.dtype != torch.float32 and _interpreted(qkv)


def _precision(qkv: Tensor) -> str:
    """The dots' ``input_precision``: float32 operands are multiplied exactly, not as TF32."""
    return "ieee" if qkv.dtype == torch.float32 or _upcast(qkv) else "tf32"


def _block(tokens: int) -> int:
    """The kernels' tile side for windows of ``tokens``: the next power of two, at least 16 (``tl.dot``'s least)."""
    return max(16, 1 << (tokens - 1).bit_length())


def _launch_forward(qkv: Tensor, bias: Tensor, masks: Tensor | None, scale: float, heads: int,
                    logit: Tensor | None = None, logit_max: float = 0.0, lse_row: int | None = None) -> tuple[Tensor, Tensor]:
    """The forward kernel: ``(out (B, nW, N, C), lse (B * nW, heads, lse_row) float32)`` (see
    :func:`window_attention`; ``masks`` the mask's bytes, ``logit`` the ``(heads,)`` logit scale;
    ``lse_row`` at least the kernels' tile side, which it is by default: the graphs' ops, whose
    shapes may not depend on the tile side of a symbolic window, use :data:`MAX_WINDOW_TOKENS`)."""
    fwd = _build()[0]
    B, nW, N, C3 = qkv.shape
    C = C3 // 3
    block = _block(N)
    out = qkv.new_empty((B, nW, N, C))
    row = lse_row or block
    # (the kernel writes a row's first `block` entries; any beyond are zeros, so that the op's output is defined)
    lse = (torch.zeros if row > block else torch.empty)((B * nW, heads, row), dtype=torch.float32, device=qkv.device)
    if out.numel():
        with fused_norm.launch_device(qkv), _labelled(LABEL):
            fwd[(B * nW, heads)](qkv, bias, masks, out, lse, logit, nW, N, heads, scale, mask_value(), logit_max,
                                 lse.shape[-1],
                                 D=C // heads, BLOCK_N=block, HAS_MASK=masks is not None, PREC=_precision(qkv),
                                 UPCAST=_upcast(qkv), COSINE=logit is not None, num_warps=4)
    return out, lse


def _launch_backward(qkv: Tensor, bias: Tensor, masks: Tensor | None, out: Tensor, grad_out: Tensor, lse: Tensor,
                     logit: Tensor | None, scale: float, heads: int, logit_max: float,
                     need_bias: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The backward kernel: ``(dqkv, grad_bias (heads, N, N) in bias's dtype or None, grad_logit
    (heads,) float32 or None)`` from the forward's inputs (as :func:`_launch_forward` took them),
    its output and row log-sum-exps, and the output's gradient."""
    _, bwd, cdiv = _build()
    B, nW, N, C3 = qkv.shape
    BW = B * nW
    block = _block(N)
    grad_out = grad_out.to(out.dtype).contiguous()
    per = max(1, cdiv(BW * heads, _BACKWARD_PROGRAMS))
    chunks = cdiv(BW, per) if BW else 0
    dqkv = torch.empty_like(qkv)
    parts = torch.empty((heads, chunks, block, block) if need_bias else (1,), dtype=torch.float32, device=qkv.device)
    logit_parts = torch.zeros((heads, chunks), dtype=torch.float32, device=qkv.device) if logit is not None else None
    if chunks:
        with fused_norm.launch_device(qkv), _labelled(LABEL + "_backward"):
            bwd[(heads, chunks)](qkv, bias, masks, out, grad_out, lse, dqkv, parts, logit, logit_parts, BW, nW, N,
                                 heads, scale, mask_value(), logit_max, per, lse.shape[-1], D=C3 // 3 // heads,
                                 BLOCK_N=block, HAS_MASK=masks is not None, PREC=_precision(qkv),
                                 NEED_DBIAS=need_bias, UPCAST=_upcast(qkv), COSINE=logit is not None,
                                 num_warps=_BACKWARD_WARPS)
    grad_bias = None
    if need_bias:
        grad_bias = (parts.sum(1)[:, :N, :N] if chunks else parts.new_zeros((heads, N, N))).to(bias.dtype)
    return dqkv, grad_bias, logit_parts.sum(1) if logit_parts is not None else None


def _kernel_operands(mask: Tensor | None, logit_scale: Tensor | None, heads: int) -> tuple[Tensor | None, Tensor | None]:
    """The mask's bytes and the ``(heads,)`` logit scale, as the kernels read them (``None`` stays ``None``)."""
    masks = mask.contiguous().view(torch.uint8) if mask is not None else None
    logit = logit_scale.reshape(heads).contiguous() if logit_scale is not None else None
    return masks, logit


class _WindowAttention(torch.autograd.Function):
    """See :func:`window_attention`."""

    @staticmethod
    def forward(ctx: Any, qkv: Tensor, bias: Tensor, mask: Tensor | None, scale: float, heads: int,
                logit_scale: Tensor | None, logit_max: float) -> Tensor:
        qkv = qkv.contiguous()
        bias = bias.contiguous()
        masks, logit = _kernel_operands(mask, logit_scale, heads)
        out, lse = _launch_forward(qkv, bias, masks, scale, heads, logit, logit_max)
        ctx.save_for_backward(qkv, bias, masks, out, lse, logit)
        ctx.scale, ctx.heads, ctx.logit_max = scale, heads, logit_max
        ctx.logit_shape = logit_scale.shape if logit_scale is not None else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        qkv, bias, masks, out, lse, logit = ctx.saved_tensors
        need_bias, need_logit = ctx.needs_input_grad[1], logit is not None and ctx.needs_input_grad[5]
        dqkv, grad_bias, grad_logit = _launch_backward(qkv, bias, masks, out, grad_out, lse, logit, ctx.scale,
                                                       ctx.heads, ctx.logit_max, need_bias)
        grad_logit = grad_logit.view(ctx.logit_shape).to(logit.dtype) if need_logit else None
        return dqkv if ctx.needs_input_grad[0] else None, grad_bias, None, None, None, grad_logit, None


def window_attention(qkv: Tensor, bias: Tensor, mask: Tensor | None, scale: float, heads: int,
                     logit_scale: Tensor | None = None, logit_max: float = 0.0) -> Tensor | None:
    """Attention within windows from the qkv projection's output, in the Triton kernels.

    Args:
        qkv: ``(B, nW, N, 3C)``, laid out ``(B, nW, N, 3, heads, d)`` as Swin's qkv projection writes it.
        bias: ``(heads, N, N)`` additive position bias (Swin V1's float32 table entries; Swin V2's
            ``16 * sigmoid`` of its Log-CPB MLP).
        mask: boolean ``(nW, N, N)`` shift/padding mask (True = blocked) or ``None``.
        scale: the factor of ``q @ k^T`` (``d ** -0.5``; 1 for Swin V2).
        heads: the number of heads.
        logit_scale: Swin V2's ``(heads, 1, 1)`` logit scale: then the scores are scaled cosines,
            ``q / |q| . k / |k| * exp(min(logit_scale, logit_max))`` (norms clamped at 1e-12).
        logit_max: the clamp of ``logit_scale`` (Swin V2: ``log(100)``).

    Returns:
        ``(B, nW, N, C)`` in ``qkv``'s dtype, heads side by side in the channels (as the output
        projection reads them). Differentiable in ``qkv``, ``bias`` and ``logit_scale`` (first
        order). ``None`` where
        the forward kernel failed to build or launch on this machine: the first failure is said
        once, in a warning, and from then on :func:`triton_window_attention_applies` is ``False``
        (the caller's other path runs).
    """
    global _failed
    if torch.compiler.is_compiling():  # (only where _applies_in_graph said so: the ops, opaque to the compiler)
        rows = qkv.reshape(-1, qkv.shape[-1])
        return torch.ops.vtdense.triton_window_attention(rows, list(qkv.shape[:3]), bias, mask, scale, heads,
                                                         logit_scale, logit_max)[0]
    try:
        return _WindowAttention.apply(qkv, bias, mask, scale, heads, logit_scale, logit_max)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 (any failure of Triton's: fall back, once, loudly)
        _failed = fused_norm.failure_text(err)
        warnings.warn(f"vtdense: the Triton window attention failed on this machine ({_failed}); Swin's "
                      "training attention takes the SDPA path from now on", RuntimeWarning, stacklevel=2)
        return None


# In compiled graphs (``torch.compile``, ``compile_backbone``; not ``torch.export``): the kernels as two
# custom ops, opaque to the compiler, whose fake forms give the shapes for symbolic sizes. The
# autograd function above serves eager code, where a failed launch falls back to SDPA; a compiled
# graph cannot fall back, so a graph takes the ops only where a probe launch has worked on its device.
# The ops take the qkv projection as its ``(B * nW * N, 3C)`` rows and the window shape ``[B, nW, N]``
# apart: the forward saves its input for the backward, and a saved ``(B, nW, N, 3C)`` view of the
# projection's output has strides in the window count, a product of ceiling divisions of the sizes,
# which Inductor orders with sympy alone and cannot (it stopped the cells graph: "cannot determine
# truth value of Relational: 96*(((-8*s74)//7))*(((-8*s81)//7)) < ..."); the rows' strides are constants.

_probed: dict[tuple[str, int], bool] = {}


def _assume_constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result`` without importing Dynamo (about a second) when
    vtdense is imported: that decorator only sets this attribute, which Dynamo reads when it traces
    a call (``tests/test_import_time.py`` checks that it still does)."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _usable_in_graphs(device_type: str, index: int) -> bool:
    """Whether graphs for ``device_type`` (``index``: -1 for the current one) may call the kernels:
    a CUDA GPU whose Triton runs them (or Triton's CPU interpreter), shown by one small forward and
    backward launch, done once per device while the first graph is traced. A probe that fails is
    said once, in a warning, and the graphs keep the SDPA path."""
    global _failed
    key = (device_type, index)
    if key in _probed:
        return _probed[key]
    device = torch.device(device_type, index) if index >= 0 else torch.device(device_type)
    ok = False
    if device_type == "cpu":  # (Triton's CPU interpreter: the tests')
        eligible = _failed is None and os.environ.get("TRITON_INTERPRET") == "1"
    else:
        eligible = device_type == "cuda" and _failed is None and fused_norm._usable_on(device)
    if eligible:
        try:
            qkv = torch.randn(1, 1, 4, 3 * 16, device=device, dtype=torch.bfloat16)
            bias = torch.zeros(1, 4, 4, device=device)
            out, lse = _launch_forward(qkv, bias, None, 0.25, 1)
            _launch_backward(qkv, bias, None, out, torch.ones_like(out), lse, None, 0.25, 1, 0.0, True)
            if device_type == "cuda":
                torch.cuda.synchronize(device)
            ok = True
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 (any failure of Triton's: the graphs keep SDPA, said once)
            _failed = fused_norm.failure_text(err)
            warnings.warn(f"vtdense: the Triton window attention failed on this machine ({_failed}); compiled "
                          "graphs and eager code take the SDPA path", RuntimeWarning, stacklevel=2)
    _probed[key] = ok
    return ok


def _applies_in_graph(x: Tensor, tokens: int, head_width: int, dropout: float) -> bool:
    """:func:`triton_window_attention_applies` while a graph is built: ``torch.compile`` (not
    ``torch.export``, whose graphs must run without vtdense's ops), recording a gradient, with no
    attention dropout, windows and heads the kernels take, on a device where they run."""
    if not torch.compiler.is_compiling() or exporting() or not torch.is_grad_enabled() or dropout:
        return False
    if tokens > MAX_WINDOW_TOKENS or head_width not in _HEAD_WIDTHS:
        return False
    return _usable_in_graphs(x.device.type, -1 if x.device.index is None else x.device.index)


@torch.library.custom_op("vtdense::triton_window_attention", mutates_args=())
def _attention_op(qkv: Tensor, shape: list[int], bias: Tensor, mask: Optional[Tensor], scale: float, heads: int,
                  logit_scale: Optional[Tensor], logit_max: float) -> tuple[Tensor, Tensor]:
    """:func:`window_attention`'s forward as an op, on the projection's ``(B * nW * N, 3C)`` rows and
    ``shape = [B, nW, N]``: ``(out (B, nW, N, C), lse (B * nW, heads, 64) float32)`` (the log-sum-exps'
    rows :data:`MAX_WINDOW_TOKENS` long at every window size)."""
    masks, logit = _kernel_operands(mask, logit_scale, heads)
    return _launch_forward(qkv.contiguous().view(*shape, -1), bias.contiguous(), masks, scale, heads, logit,
                           logit_max, lse_row=MAX_WINDOW_TOKENS)


@_attention_op.register_fake
def _(qkv: Tensor, shape: list[int], bias: Tensor, mask: Optional[Tensor], scale: float, heads: int,
      logit_scale: Optional[Tensor], logit_max: float) -> tuple[Tensor, Tensor]:
    B, nW, N = shape
    out = qkv.new_empty((B, nW, N, qkv.shape[-1] // 3))
    return out, qkv.new_empty((B * nW, heads, MAX_WINDOW_TOKENS), dtype=torch.float32)


@torch.library.custom_op("vtdense::triton_window_attention_backward", mutates_args=())
def _attention_backward_op(grad_out: Tensor, qkv: Tensor, bias: Tensor, mask: Optional[Tensor], out: Tensor,
                           lse: Tensor, logit_scale: Optional[Tensor], scale: float, heads: int, logit_max: float,
                           need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The backward op, on the forward op's inputs (``qkv`` as its rows), output and log-sum-exps:
    ``(dqkv rows, grad_bias (heads, N, N) or empty, grad_logit (heads,) float32 or empty)``."""
    masks, logit = _kernel_operands(mask, logit_scale, heads)
    out = out.contiguous()
    dqkv, grad_bias, grad_logit = _launch_backward(qkv.contiguous().view(*out.shape[:3], -1), bias.contiguous(), masks,
                                                   out, grad_out, lse, logit, scale, heads, logit_max, need_bias)
    # (the bias gradient is a slice of the padded block sums: made contiguous, as the fake form says)
    grad_bias = grad_bias.contiguous() if grad_bias is not None else bias.new_empty((0,))
    if grad_logit is None:
        grad_logit = qkv.new_empty((0,), dtype=torch.float32)
    return dqkv.view(qkv.shape), grad_bias, grad_logit


@_attention_backward_op.register_fake
def _(grad_out: Tensor, qkv: Tensor, bias: Tensor, mask: Optional[Tensor], out: Tensor, lse: Tensor,
      logit_scale: Optional[Tensor], scale: float, heads: int, logit_max: float,
      need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    N = out.shape[2]
    grad_bias = bias.new_empty((heads, N, N) if need_bias else (0,))
    grad_logit = qkv.new_empty((heads,) if logit_scale is not None else (0,), dtype=torch.float32)
    return qkv.new_empty(qkv.shape), grad_bias, grad_logit


def _attention_op_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    qkv, _, bias, mask, scale, heads, logit_scale, logit_max = inputs
    ctx.save_for_backward(qkv, bias, mask, output[0], output[1], logit_scale)
    ctx.scale, ctx.heads, ctx.logit_max = scale, heads, logit_max


def _attention_op_backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    qkv, bias, mask, out, lse, logit_scale = ctx.saved_tensors
    need_bias = ctx.needs_input_grad[2]
    dqkv, grad_bias, grad_logit = torch.ops.vtdense.triton_window_attention_backward(
        grad_out, qkv, bias, mask, out, lse, logit_scale, ctx.scale, ctx.heads, ctx.logit_max, need_bias)
    if logit_scale is not None and ctx.needs_input_grad[6]:
        grad_logit = grad_logit.view(logit_scale.shape).to(logit_scale.dtype)
    else:
        grad_logit = None
    return (dqkv if ctx.needs_input_grad[0] else None, None, grad_bias if need_bias else None, None, None, None,
            grad_logit, None)


_attention_op.register_autograd(_attention_op_backward, setup_context=_attention_op_setup)
