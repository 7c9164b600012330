"""A LayerNorm that writes the bf16 input of the next projection (CUDA inference under bf16 autocast).

CUDA autocast runs ``layer_norm`` in float32: on a float32 residual stream it reads and writes
float32, and the projection after it casts that output to bf16 in a second kernel. On the H200
(``benchmarks/RESULTS.md``) the two took about a quarter of Swin-T's inference kernels, PyTorch's
LayerNorm kernel being slow for the few channels of early stages (one thread block per row). The
Triton kernel here normalises a block of rows per program in float32, as autocast does, and rounds
to bf16, to nearest even, as the cast does: one pass that reads the input once and writes half the
bytes. Its statistics are summed in another order than PyTorch's, so a value can differ by one
bf16 step where the float32 result sits on a rounding boundary (about 1 in 10,000 values).

Timed per call on an H200 (``benchmarks/triton_norm_check.py``, ``benchmarks/RESULTS.md``): at
Swin-T's first stage at batch 64 (200,704 rows of 96 channels) PyTorch's LayerNorm and the cast
take 334 us, the kernel here at most 31 us; at 12,544 rows of 384 channels both take about 30 us,
and the kernel's launch from Python (about 30 us of host time, against about 19 us for the two
PyTorch ops) sets its pace. A whole bf16 Swin-T forward at batch 64 is close to the host's pace:
with the kernel on every pre-norm, launched directly, it ran faster in one process of four (8.0
against 9.2 ms) and slower in the other three. So by default
(``"auto"``) it runs only where an input has at least :data:`AUTO_MIN_ELEMENTS` values (the first
two stages of a Swin at batch 64, or at detection sizes), where it saves hundreds of microseconds
of kernel time for a few microseconds of host time; :func:`set_triton_norm` sets it on for every
pre-norm, or off. It runs only in eager CUDA inference (no gradient recorded, no graph being
built) under bf16 autocast, for a plain ``nn.LayerNorm`` followed by a plain ``nn.Linear``
(:func:`vtdense.layers.mlp.norm_linear`), where Triton imports. As the op
``vtdense::layer_norm_bf16`` it has a fake implementation, so the GPU code paths' tests run it on
fake CUDA tensors; eager calls on real CUDA tensors launch the kernel directly
(:func:`eager_layer_norm_bf16`), which took the host's share per call from 50 to 30 us.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.layers.plain import plain_layer_norm, plain_linear
from vtdense.layers.scoped import is_auto_switch, scoped_setting
from vtdense.layers.tracing import tracing

__all__ = ["set_triton_norm", "triton_norm", "triton_norm_applies", "layer_norm_bf16", "eager_layer_norm_bf16",
           "norm_for_linears", "float_layer_norm", "keep_out_of_auto"]

_enabled: bool | str = "auto"
#: Widest row the kernel takes in one block.
MAX_CHANNELS = 8192
#: In ``"auto"`` mode, the fewest values (rows x channels) an input needs to take the kernel.
AUTO_MIN_ELEMENTS = 1 << 23
_kernel: Any = None
#: Why the kernel could not run on this machine (set by its first failure; PyTorch's ops run from then on).
_failed: str | None = None
_bf16_gpus: dict[int, bool] = {}


#: Marks a norm that the ``"auto"`` mode leaves to PyTorch (:func:`keep_out_of_auto`).
_AUTO_OFF = "_vtdense_triton_auto_off"


def keep_out_of_auto(norm: nn.Module) -> nn.Module:
    """Leave ``norm`` to PyTorch's LayerNorm in the ``"auto"`` mode (``True`` still takes it), and
    return it. MViTv2's block norms are so marked: with the kernel on its large pre-norms, MViTv2-T's
    bf16 inference at batch 64 measured slower on both GPUs it was timed on (H200: 14.8 against
    13.8 ms; H100: 20.1 against 15.7 ms, ``benchmarks/RESULTS.md``) although its kernels took less
    device time (24.2 against 27.5 ms per step under the profiler), a loss not yet explained; Swin's
    norms, at the same sizes, gain."""
    norm.__dict__[_AUTO_OFF] = True
    return norm


def set_triton_norm(enabled: bool | str) -> None:
    """Where CUDA bf16 inference runs a pre-norm and its cast as one Triton kernel: ``"auto"`` (the
    default: inputs of at least :data:`AUTO_MIN_ELEMENTS` values), ``True`` (every pre-norm that
    feeds a projection) or ``False`` (none)."""
    global _enabled
    if not is_auto_switch(enabled):
        raise ValueError(f"set_triton_norm takes True, False or 'auto'; got {enabled!r}")
    _enabled = "auto" if enabled == "auto" else bool(enabled)


def triton_norm(enabled: bool | str) -> contextlib.AbstractContextManager[None]:
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
    def _layer_norm_bf16(X, W, B, Y, MEAN, RSTD, M, C, stride_x, eps, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr, OUT_BF16: tl.constexpr):
        # STATS: 0 compute the rows' mean and 1/std, 1 compute and store them, 2 load them (a recomputation
        # that must give the stored pass's values bit for bit: the same float32 steps from the same numbers)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if STATS == 2:
            mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        else:
            mean = tl.sum(x, axis=1) / C
            xc = tl.where(mask, x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
            if STATS == 1:
                tl.store(MEAN + rows, mean, mask=rmask)
                tl.store(RSTD + rows, rstd, mask=rmask)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if OUT_BF16:
            # round to nearest even on the bits, so every backend (the CPU interpreter truncates) agrees
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
            tl.store(Y + rows[:, None] * C + cols[None, :], y.to(tl.bfloat16), mask=mask)
        else:
            tl.store(Y + rows[:, None] * C + cols[None, :], y, mask=mask)

    _kernel = (_layer_norm_bf16, triton.next_power_of_2, triton.cdiv)
    return _kernel


def _run(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, stats: int,
         mean: Tensor | None = None, rstd: Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Run the kernel on ``x`` ``(..., C)`` (rows made contiguous): ``(..., C)`` in ``out_dtype``
    (bf16, or float32), and the rows' float32 mean and 1/std ``(rows,)``: made here with
    ``stats=1``, given with ``stats=2``."""
    kernel, next_pow2, cdiv = _triton_kernel()
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    M = x2.shape[0]
    if stats == 1:
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        block = next_pow2(C)
        rows = max(1, min(64, 4096 // block))
        with launch_device(x2):
            kernel[(cdiv(M, rows),)](x2, weight, bias, y, mean, rstd, M, C, x2.stride(0), eps, BLOCK_C=block, ROWS=rows,
                                     HAS_W=weight is not None, HAS_B=bias is not None, STATS=stats,
                                     OUT_BF16=out_dtype == torch.bfloat16, num_warps=8 if block >= 2048 else 4)
    return y.view(x.shape), mean, rstd


def _launch(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """Run the kernel on ``x`` ``(..., C)`` (rows contiguous): ``(..., C)`` bf16."""
    return _run(x, weight, bias, eps, 0)[0]


@torch.library.custom_op("vtdense::layer_norm_bf16", mutates_args=())
def layer_norm_bf16(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:  # typing's: see decomposed_attention
    """``layer_norm(x.float(), weight, bias).to(bfloat16)`` over the last dimension, in one Triton
    kernel on CUDA (elsewhere, and without Triton, the two ops). ``x``: ``(..., C)`` float32 or
    bf16; ``weight``, ``bias``: ``(C,)`` or ``None`` -> ``(..., C)`` bf16."""
    if x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        if _triton_kernel() is not None:
            return _launch(x, weight, bias, eps)
    return _reference(x, weight, bias, eps).to(torch.bfloat16)


def _reference(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """PyTorch's float32 LayerNorm of ``x``, as CUDA autocast runs it."""
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), x.shape[-1:], w, b, eps)


def _direct(x: Tensor) -> bool:
    """Whether the kernel is launched directly on ``x``: a plain CUDA tensor (not a fake or subclass one)."""
    return type(x) is Tensor and x.device.type == "cuda"


def _usable_on(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: Triton imports, it has not failed here before, and
    the GPU has bf16 arithmetic (compute capability 8.0 or newer)."""
    if _failed is not None or _triton_kernel() is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _bf16_gpus.get(index)
    if ok is None:
        ok = _bf16_gpus[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return ok


def _guarded(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out_dtype: torch.dtype) -> Tensor | None:
    """The kernel's output in ``out_dtype``, or ``None`` where it has failed here: its first failure
    to build or launch is recorded and said once, and PyTorch's ops run from then on."""
    global _failed
    if _failed is not None:
        return None
    try:
        return _run(x, weight, bias, eps, 0, out_dtype=out_dtype)[0]
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 (any failure of Triton's: fall back, once, loudly)
        _failed = failure_text(err)
        warnings.warn(f"vtdense: the Triton LayerNorm failed on this machine ({_failed}); PyTorch's "
                      "LayerNorm runs instead from now on (vtdense.layers.fused_norm)", RuntimeWarning, stacklevel=3)
        return None


def launch_device(t: Tensor) -> contextlib.AbstractContextManager[Any]:
    """Where a Triton kernel reading ``t`` must be launched from: Triton launches on the *current*
    CUDA device and its stream, whatever device the tensors are on, so a model moved to ``cuda:1``
    in a process whose current device is 0 would have its kernels run on GPU 0 with GPU 1's
    pointers. ``torch.cuda.device(t.device)`` where the two differ, else nothing to do."""
    if t.device.type == "cuda" and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def failure_text(err: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters of it): how a Triton
    kernel's failure to build or launch is named in the one warning that says it."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


def eager_layer_norm_bf16(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """:func:`layer_norm_bf16` for eager callers: on a plain CUDA tensor the kernel is launched
    directly, without the custom op's dispatch (host time, which a GPU inference step at batch 64
    cannot spare: through the op the kernel made Swin-T slower on the H200, see
    ``benchmarks/RESULTS.md``); on anything else (fake tensors, subclasses) through the op. Where
    the kernel fails to build or launch (a Triton without a working compiler here, say), one warning
    says why and PyTorch's two ops run from then on. Shapes as :func:`layer_norm_bf16`."""
    if not _direct(x):
        return layer_norm_bf16(x, weight, bias, eps)
    y = _guarded(x, weight, bias, eps, torch.bfloat16)
    return y if y is not None else _reference(x, weight, bias, eps).to(torch.bfloat16)


@layer_norm_bf16.register_fake
def _(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)


def triton_norm_applies(x: Tensor, norm: nn.Module) -> bool:
    """Whether :func:`layer_norm_bf16` may stand in for ``norm(x)`` before a plain linear layer:
    switched on (in ``"auto"`` mode: ``x`` has at least :data:`AUTO_MIN_ELEMENTS` values and ``norm``
    is not marked by :func:`keep_out_of_auto`), CUDA
    inference under bf16 autocast (no gradient to record, no graph being built), ``norm`` a plain
    ``nn.LayerNorm`` over at most :data:`MAX_CHANNELS` channels, ``x`` float32 or bf16, Triton
    available, and the GPU one with bf16 arithmetic where the kernel has not failed before."""
    if not _enabled or x.device.type != "cuda" or x.dtype not in (torch.float32, torch.bfloat16) or tracing():
        return False  # (tracing first: a size test in a graph being built would guard on the size)
    if _enabled == "auto" and (x.numel() < AUTO_MIN_ELEMENTS or _AUTO_OFF in norm.__dict__):
        return False
    if not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in norm.parameters())):
        return False
    if not plain_layer_norm(norm) or x.shape[-1] > MAX_CHANNELS:
        return False
    return _usable_on(x.device) if _direct(x) else _triton_kernel() is not None


def norm_for_linears(x: Tensor, norm: nn.Module, *linears: nn.Module | None) -> Tensor:
    """``norm(x)`` whose every consumer is one of ``linears`` (``None`` entries are skipped): where
    :func:`triton_norm_applies` and each is a plain ``nn.Linear``, the kernel's bf16 output, which is
    what each linear's autocast cast of ``norm(x)`` would give (MViTv2's pre-norm feeds its q/k/v
    projection and, where the width changes, the shortcut's). ``x``: ``(..., C)`` -> ``(..., C)``."""
    if triton_norm_applies(x, norm) and all(lin is None or plain_linear(lin) for lin in linears):
        return eager_layer_norm_bf16(x, norm.weight, norm.bias, norm.eps)  # type: ignore[arg-type]
    return norm(x)


def float_layer_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """``norm(x)`` as CUDA autocast runs it, in float32, for a norm whose output is no projection's
    input (Swin's patch embedding, whose output starts the float32 residual stream): where
    :func:`triton_norm_applies`, by the kernel with a float32 output on a plain CUDA tensor (a conv's
    bf16 output read as it is, where autocast would cast it to float32 first). The values are
    PyTorch's but for the last bits of float32 (the statistics summed in another order).
    ``x``: ``(..., C)`` -> ``(..., C)`` float32."""
    if _direct(x) and triton_norm_applies(x, norm):
        y = _guarded(x, norm.weight, norm.bias, norm.eps, torch.float32)  # type: ignore[arg-type]
        if y is not None:
            return y
    return norm(x)
