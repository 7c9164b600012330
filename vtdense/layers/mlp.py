"""The transformer MLP shared by the backbones."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.layers.chunked import row_slices, tracing
from vtdense.layers.chunked_mlp import chunked_mlp, chunked_mlp_applies
from vtdense.layers.compiled_mlp import compiled_cpu_mlp, compiled_cpu_mlp_applies
from vtdense.layers.cpu_linear import apply_linear, mm, mm_tn
from vtdense.layers.cpu_linear import linear as _linear
from vtdense.layers.fused_norm import norm_for_linears
from vtdense.layers.fused_norm_train import triton_norm_linear, triton_norm_training_applies
from vtdense.layers.plain import plain_gelu, plain_layer_norm, plain_linear
from vtdense.layers.recompute import hooks_free, plain_storage, recomputed_input_linear
from vtdense.layers.scoped import scoped_setting

__all__ = ["plain_linear", "Mlp", "gelu_linear", "norm_linear", "set_activation_recompute", "activation_recompute"]

_recompute = True
#: Off the CPU, layers whose recomputable activation is smaller than this keep it (see
#: :func:`set_activation_recompute`); 0 recomputes every layer.
DEFAULT_RECOMPUTE_MIN_BYTES = 8 << 20
_min_bytes = DEFAULT_RECOMPUTE_MIN_BYTES
#: How the recomputation is made: ``"auto"`` (saved-tensor hooks off the CPU, the autograd
#: functions on it, whose backward uses the CPU's oneDNN matmuls), ``"hooks"`` or ``"function"``.
_form = "auto"


def _set_recompute_form(form: str) -> None:
    """Tests and benchmarks: force one form of the recomputation (see :data:`_form`)."""
    global _form
    if form not in ("auto", "hooks", "function"):
        raise ValueError(f"unknown recompute form {form!r}")
    _form = form


def _via_hooks(x: Tensor) -> bool:
    """Whether the recomputation runs through :func:`~vtdense.layers.recompute.recomputed_input_linear`
    (autograd's C++ backward, a Python recipe per layer) rather than :class:`_NormLinear` /
    :class:`_GeluLinear` (a Python backward): off the CPU by default, for plain tensors (not
    subclasses such as ``DTensor``), never under others' saved-tensor hooks (checkpointing keeps
    the autograd functions)."""
    if _form == "function" or (_form == "auto" and x.device.type == "cpu") or not plain_storage(x):
        return False
    return hooks_free()


def _worth_recomputing(x: Tensor, width: int, dtype: torch.dtype | None = None) -> bool:
    """Whether the activation the recomputation would free, ``x``'s rows at ``width`` channels in
    ``dtype`` (default: CUDA autocast's where ``x`` is a CUDA tensor and it is on, else ``x``'s), is
    at least :data:`_min_bytes`; always on the CPU."""
    dev = x.device.type
    if dev == "cpu" or not _min_bytes:
        return True
    if dtype is None:
        amp = dev == "cuda" and torch.is_autocast_enabled(dev)
        dtype = torch.get_autocast_dtype(dev) if amp else x.dtype
    return (x.numel() // max(x.shape[-1], 1)) * width * dtype.itemsize >= _min_bytes


def set_activation_recompute(enabled: bool, *, min_bytes: int | None = None) -> None:
    """Training, every vtdense backbone: whether ``norm -> linear`` and ``GELU -> linear`` keep only
    their input for the backward pass and recompute the norm or the GELU there (``True``, the
    default), or keep what plain autograd keeps (``False``).

    Recomputing saves the activations of a normalised copy per pre-norm layer and a hidden-width
    GELU output per MLP; it costs the recomputation. On the CPU it runs as two autograd functions
    with their own backward (:class:`_NormLinear`, :class:`_GeluLinear`, whose backward uses the
    CPU's oneDNN matmuls); elsewhere through saved-tensor hooks
    (:func:`vtdense.layers.recompute.recomputed_input_linear`), so autograd's C++ backward runs,
    and under others' saved-tensor hooks (activation checkpointing) through the functions again. On
    one H200 (bf16, Swin-T, batch 8 at 512x768, ``benchmarks/RESULTS.md``): about 2.8 GB and
    37-47 ms per step with it, 4.1 GB and 31-36 ms without (timm with fused attention: 4.0 GB,
    33-39 ms); the two forms measured the same time. Turn it off where GPU memory is plentiful.
    Results are the same either way (to float rounding). Graphs (``torch.compile``, export) always take the plain form. The CPU's chunked
    training paths (:func:`vtdense.layers.chunked.set_cpu_chunking`) recompute on their own.

    ``min_bytes`` (``None``: leave as set; default 8 MiB): off the CPU, a layer recomputes only
    where the activation it would free (the normalised copy or the GELU output, in the dtype the
    linear runs in) has at least this many bytes; ``0`` recomputes every layer. A recomputed layer
    costs about the same time whatever its size (on one H100, forward and backward: 150-300 us
    more for a pre-norm, 20-120 us for a GELU, ``benchmarks/recompute_cost.py``), while the bytes
    it saves grow with the image. At 8 MiB Swin-T at batch 8 and 512x768 leaves out only its last
    stage's four pre-norms (45 MiB more kept); the published detector at batch 2 and 800x1333
    leaves out the pre-norms of its last two stages and the last merging's (17 of 39 layers, about
    200 MiB more); a small image recomputes nothing."""
    global _recompute, _min_bytes
    _recompute = bool(enabled)
    if min_bytes is not None:
        if int(min_bytes) < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        _min_bytes = int(min_bytes)


def activation_recompute(enabled: bool, *, min_bytes: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Context-manager form of :func:`set_activation_recompute` (restores both settings)."""
    return scoped_setting(lambda: (_recompute, _min_bytes), lambda v: set_activation_recompute(v[0], min_bytes=v[1]),
                          (enabled, _min_bytes if min_bytes is None else min_bytes))


def _compute_weight(weight: Tensor) -> Tensor:
    """``weight`` in the dtype autocast runs its linear in: cast once in the forward and kept for
    the backward (as plain autograd keeps autocast's cast), so the backward does not cast again."""
    dev = weight.device.type
    if dev in ("cpu", "cuda") and weight.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return weight.to(torch.get_autocast_dtype(dev))
    return weight


class _GeluLinear(torch.autograd.Function):
    """``linear(gelu(h), weight, bias)`` that keeps only ``h`` for the backward pass.

    Plain autograd keeps both ``h`` (for GELU's gradient) and ``gelu(h)`` (for the weight
    gradient): two hidden-width tensors per block, the largest activations of a transformer. The
    backward here recomputes ``gelu(h)`` from ``h`` instead (one cheap pointwise op), which saves
    a quarter to a third of a training step's activation memory at the same results.
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.weight_dtype = weight.dtype
        weight = _compute_weight(weight)
        out = _linear(F.gelu(h), weight, bias)  # autocast, if on, casts the rest as for a plain linear
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        h, weight = ctx.saved_tensors
        dtype = grad.dtype  # the dtype the forward's linear ran in
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_h = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_g = mm(g2, weight.to(dtype)).view(*grad.shape[:-1], weight.shape[1])
            grad_h = torch.ops.aten.gelu_backward(grad_g.to(h.dtype), h)
        if ctx.needs_input_grad[1]:
            act = F.gelu(h).to(dtype)
            grad_w = mm_tn(g2, act.reshape(-1, act.shape[-1])).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.weight_dtype)
        return grad_h, grad_w, grad_b


def gelu_linear(h: Tensor, linear: nn.Linear, inplace: bool = False) -> Tensor:
    """``linear(gelu(h))``; when training eagerly it stores only ``h`` for the backward pass
    (:class:`_GeluLinear`; :func:`set_activation_recompute`). ``inplace``: the caller owns ``h``,
    which may then be overwritten by its GELU where no gradient flows through it (inference: one
    hidden-width tensor less at the peak). ``h``: ``(..., in)`` -> ``(..., out)``."""
    grad = torch.is_grad_enabled() and (h.requires_grad or linear.weight.requires_grad)
    if grad and _recompute and not tracing() and plain_linear(linear) and _worth_recomputing(h, h.shape[-1], h.dtype):
        if h.requires_grad and _via_hooks(h):
            return recomputed_input_linear(F.gelu, (h,), linear, casts=False)
        return _GeluLinear.apply(h, linear.weight, linear.bias)
    if inplace and not tracing() and not (torch.is_grad_enabled() and h.requires_grad):
        return apply_linear(linear, torch.ops.aten.gelu_(h))
    return apply_linear(linear, F.gelu(h))


class _NormLinear(torch.autograd.Function):
    """``linear(layer_norm(x))`` that keeps only ``x`` (not the normalised copy) for the backward
    pass, recomputing the norm there: one channel-width tensor less per pre-norm block."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, weight: Tensor,
                bias: Tensor | None) -> Tensor:
        ctx.weight_dtype = weight.dtype
        weight = _compute_weight(weight)
        normed = F.layer_norm(x, x.shape[-1:], norm_w, norm_b, eps)
        out = _linear(normed, weight, bias)
        ctx.save_for_backward(x, norm_w, norm_b, weight)
        ctx.eps, ctx.has_bias = eps, bias is not None
        dev = x.device.type  # the backward recomputes the norm under the forward's autocast state
        amp_on = dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev)
        ctx.amp = (dev, amp_on, torch.get_autocast_dtype(dev)) if dev in ("cpu", "cuda") else None
        # The dtype the norm ran in, where autocast cast its inputs: CUDA autocast runs layer_norm
        # in float32 (its fp32 list); CPU autocast leaves it alone. None: no input was cast.
        ctx.norm_cast = normed.dtype if (amp_on and dev == "cuda") or normed.dtype != x.dtype else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_w, norm_b, weight = ctx.saved_tensors
        dtype = grad.dtype
        if not torch.is_grad_enabled():
            return _norm_linear_backward(ctx, grad, x, norm_w, norm_b, weight)
        amp = torch.autocast(ctx.amp[0], dtype=ctx.amp[2], enabled=ctx.amp[1]) if ctx.amp else contextlib.nullcontext()
        # Under create_graph (a double backward: gradient penalties, Hessian products) the gradients
        # must themselves be differentiable: the norm is recomputed from the saved tensors and
        # differentiated with create_graph. (That nested autograd call costs about half a
        # millisecond of host time per call on a GPU; the usual backward above has none.)
        with torch.enable_grad(), amp:
            y = F.layer_norm(x, x.shape[-1:], norm_w, norm_b, ctx.eps)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_y = mm(g2, weight.to(dtype)).view(*grad.shape[:-1], weight.shape[1])
        leaves = (x, norm_w, norm_b)
        wanted = [t for t, need in zip(leaves, ctx.needs_input_grad[:3]) if t is not None and need]
        found = iter(torch.autograd.grad(y, wanted, grad_y.to(y.dtype), create_graph=True)) if wanted else iter(())
        grads_in = [next(found) if t is not None and need else None for t, need in zip(leaves, ctx.needs_input_grad[:3])]
        grad_w = mm_tn(g2, y.to(dtype).reshape(-1, y.shape[-1])).to(ctx.weight_dtype) if ctx.needs_input_grad[4] else None
        grad_b = g2.sum(0).to(ctx.weight_dtype) if ctx.has_bias and ctx.needs_input_grad[5] else None
        return grads_in[0], grads_in[1], grads_in[2], None, grad_w, grad_b


def _norm_linear_backward(ctx: Any, grad: Tensor, x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None,
                          weight: Tensor) -> tuple[Tensor | None, ...]:
    """:class:`_NormLinear`'s backward without a nested autograd call: the norm is recomputed by
    ``native_layer_norm`` (which also returns the row statistics) and differentiated by
    ``native_layer_norm_backward``, the kernels autograd runs for ``layer_norm``, on the inputs
    cast as autocast cast them in the forward (``ctx.norm_cast``); each gradient is cast back to
    its input's dtype, as autograd's cast nodes do."""
    dtype = grad.dtype  # the dtype the forward's linear ran in
    cast = ctx.norm_cast

    def to_norm(t: Tensor | None) -> Tensor | None:
        if t is None or cast is None or t.dtype == cast or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(cast)

    xf, wf, bf = to_norm(x), to_norm(norm_w), to_norm(norm_b)
    shape = [x.shape[-1]]
    y, mean, rstd = torch.ops.aten.native_layer_norm(xf, shape, wf, bf, ctx.eps)
    g2 = grad.reshape(-1, grad.shape[-1])
    need = ctx.needs_input_grad
    grad_x = grad_nw = grad_nb = None
    if need[0] or need[1] or need[2]:
        grad_y = mm(g2, weight.to(dtype)).view(*grad.shape[:-1], weight.shape[1]).to(y.dtype)
        mask = [need[0], need[1] and wf is not None, need[2] and bf is not None]
        grad_x, grad_nw, grad_nb = torch.ops.aten.native_layer_norm_backward(grad_y, xf, shape, mean, rstd, wf, bf, mask)
        grad_x = grad_x.to(x.dtype) if grad_x is not None else None
        grad_nw = grad_nw.to(norm_w.dtype) if grad_nw is not None else None
        grad_nb = grad_nb.to(norm_b.dtype) if grad_nb is not None else None
    grad_w = mm_tn(g2, y.to(dtype).reshape(-1, y.shape[-1])).to(ctx.weight_dtype) if need[4] else None
    grad_b = g2.sum(0).to(ctx.weight_dtype) if ctx.has_bias and need[5] else None
    return grad_x, grad_nw, grad_nb, None, grad_w, grad_b


def norm_linear(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    """``linear(norm(x))``; when training eagerly it stores only ``x`` for the backward pass
    (the norm is recomputed there; :func:`set_activation_recompute`). ``x``: ``(..., in)`` ->
    ``(..., out)``."""
    if triton_norm_training_applies(x) and plain_layer_norm(norm) and plain_linear(linear):
        # CUDA bf16 training, when switched on: its recomputation costs one fast kernel, so it also
        # runs with the recomputation switched off
        return triton_norm_linear(x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias)
    if (_recompute and torch.is_grad_enabled() and not tracing() and plain_layer_norm(norm)
            and plain_linear(linear) and _worth_recomputing(x, x.shape[-1])):
        if x.requires_grad and _via_hooks(x):
            return recomputed_input_linear(F.layer_norm, (x, x.shape[-1:], norm.weight, norm.bias, norm.eps), linear)
        return _NormLinear.apply(x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias)
    return apply_linear(linear, norm_for_linears(x, norm, linear))  # (CUDA bf16 inference: Triton)


class Mlp(nn.Module):
    """Two-layer GELU MLP (names ``fc1``/``fc2`` as in timm), optionally changing the width.

    Training without dropout keeps only ``fc1``'s output for the backward pass and recomputes
    the GELU (see :func:`gelu_linear`); the results are the same. On the CPU outside autocast, a
    hidden activation of 16 MiB or more makes the whole MLP, forward and backward, run over
    cache-sized row chunks (:func:`~vtdense.layers.chunked_mlp.chunked_mlp`); compiled float32 CPU
    inference runs it over row chunks too, as one op (:mod:`vtdense.layers.compiled_mlp`).

    Args:
        dim: input channels.
        hidden: hidden channels.
        out_dim: output channels (``None``: ``dim``).
        drop: dropout after the activation and after ``fc2``.

    Shapes: ``(..., dim)`` -> ``(..., out_dim)``.
    """

    def __init__(self, dim: int, hidden: int, out_dim: int | None = None, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out_dim or dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """``x``: ``(..., dim)``; ``norm``: a pre-norm to apply first (fused with ``fc1``)."""
        if (self.drop.p and self.training) or not plain_gelu(self.act):
            x = norm(x) if norm is not None else x
            return self.drop(apply_linear(self.fc2, self.drop(self.act(apply_linear(self.fc1, x)))))
        if compiled_cpu_mlp_applies(x, self, norm):  # compiled CPU inference: eager's row chunks, as one op
            return self.drop(compiled_cpu_mlp(x, self, norm))
        if ((norm is None or plain_layer_norm(norm)) and plain_linear(self.fc1) and plain_linear(self.fc2)
                and chunked_mlp_applies(x, self.fc1.out_features)):
            return self.drop(chunked_mlp(x, self.fc1, self.fc2, norm))
        h = norm_linear(x, norm, self.fc1) if norm is not None else apply_linear(self.fc1, x)
        return self.drop(gelu_linear(h, self.fc2, inplace=plain_linear(self.fc1)))  # h is then ours alone

    def add_to_(self, y: Tensor, x: Tensor | None = None, norm: nn.Module | None = None,
                post_norm: nn.Module | None = None) -> Tensor:
        """Inference only: ``y += mlp(norm(x))``, or ``y += post_norm(mlp(x))``, in place and over
        cache-sized row chunks (:mod:`vtdense.layers.chunked`); ``x`` defaults to ``y`` itself
        (each chunk is read before it is updated). The values equal the unchunked residual
        ``y + mlp(...)``. ``y``: ``(..., out_dim)`` that the caller owns, made contiguous if it is
        not; ``x``: ``(..., dim)`` with the same leading shape. Returns ``y``. Callers check
        :func:`~vtdense.layers.chunked.chunking_applies` first."""
        y = y.contiguous()
        rows = y.view(-1, y.shape[-1])
        src = rows if x is None else x.reshape(-1, x.shape[-1])
        for sl in row_slices(rows.shape[0], self.fc1.out_features * y.element_size()):
            r = src[sl]
            h = apply_linear(self.fc1, norm(r) if norm is not None else r)
            t = apply_linear(self.fc2, torch.ops.aten.gelu_(h) if plain_gelu(self.act) else self.act(h))
            rows[sl].add_(post_norm(t) if post_norm is not None else t)
        return y
