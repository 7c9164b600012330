"""Float32 linear layers and matmuls on the CPU through oneDNN.

PyTorch runs a float32 ``linear`` or ``mm`` on the CPU through its BLAS, which is Intel MKL in the
official wheels. MKL picks its kernels by CPU vendor and does not use AVX-512 on AMD CPUs. oneDNN,
which every CPU wheel also carries (PyTorch runs its convolutions with it), picks them by
instruction set. On the 2-core AMD EPYC (Zen 5) these backbones were tuned on, oneDNN's float32
matmul ran the backbones' linear layers at 400-500 GFLOP/s where MKL ran them at 200-220; on CPUs
where MKL has its AVX-512 kernels the two are about even.

So on the CPU, in float32, the backbones' linear layers and the matmuls of their chunked backward
passes go through :func:`linear`, :func:`mm` and :func:`mm_tn`, which call oneDNN when
:func:`cpu_matmul` says ``"onednn"``:

- ``"auto"`` (the default, or the ``VTDENSE_CPU_MATMUL`` environment variable): the first call
  (every backbone makes it when it is built) times three mid-sized linears both ways (about
  0.15 s, once per process, no random numbers drawn) and keeps oneDNN where it is at least
  :data:`_PROBE_MARGIN` times as fast. It also times a weight gradient, ``g.T @ x`` over many rows,
  both ways, and keeps the faster for :func:`mm_tn` alone: oneDNN takes its operands contiguous, so
  there ``g.T`` or ``x.T`` is first copied, a transpose of a tall matrix that the BLAS, which reads
  a transposed operand as it is, never makes. On a 2-core AMD EPYC (Zen 4) oneDNN ran the linears
  1.06-1.11x as fast as MKL (1.11-1.14x with packed weights), while the BLAS ran the weight gradients
  1.2-1.9x as fast as oneDNN with its copy;
- ``"onednn"`` or ``"blas"`` force one for all three (:func:`set_cpu_matmul`, :func:`use_cpu_matmul`).

Inside ``torch.compile`` the same kernel runs as the custom op ``vtdense::onednn_linear`` (with
its backward), so compiled code computes what eager code does. Everything else keeps ``F.linear``:
other devices and dtypes, autocast, ``torch.export`` / ONNX graphs (which must stay portable),
TorchScript and ``torch.func`` transforms. Both libraries compute the same float32 products in a
different order, so results differ by float rounding, not more.

A weight is given to oneDNN in its own blocked layout, and reordering it costs about as much as
reading it. Within :func:`packed_weights` (the backbones open it around each chunked block call in
inference) each weight is reordered once and the copy reused by every chunk that calls it; the
copies are dropped when the scope closes, so no weight is ever read stale and no copy outlives
the call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.layers.autocast import autocast_params
from vtdense.layers.plain import plain_linear
from vtdense.layers.tracing import exporting, tracing

__all__ = ["linear", "apply_linear", "mm", "mm_tn", "linear_into", "packed_weights", "set_cpu_matmul",
           "use_cpu_matmul", "cpu_matmul", "onednn_applies", "ENV_VAR"]

#: Environment variable read at the first call: ``auto`` (default), ``onednn`` or ``blas``.
ENV_VAR = "VTDENSE_CPU_MATMUL"
_CHOICES = ("auto", "onednn", "blas")
#: oneDNN must beat the BLAS by this factor in the probe to be chosen by ``"auto"`` for linear
#: layers. On the Zen 4 host oneDNN measured 1.06-1.11x on the probe's linears and 1.08x over a whole Swin-T
#: forward (475 against 515 ms at batch 8 and 224); it was 1.15 until 2026-11-28, which kept MKL there.
_PROBE_MARGIN = 1.04

_choice: str | None = None  # None: not read from the environment yet
_use: bool | None = None  # the resolved choice, once made
_use_tn: bool = False  # whether mm_tn goes through oneDNN too (resolved with _use)
_local = threading.local()  # .cache: (data_ptr, shape, stride) -> (weight, version, packed copy) in packed_weights()


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def set_cpu_matmul(name: str) -> None:
    """Choose how float32 linear layers run on the CPU: ``"auto"`` (time both once, keep the
    faster), ``"onednn"`` or ``"blas"`` (PyTorch's own ``F.linear``)."""
    global _choice, _use
    if name not in _CHOICES:
        raise ValueError(f"cpu matmul backend must be one of {_CHOICES}, got {name!r}")
    if name == "onednn" and not _available():
        raise ValueError(f"cpu matmul backend 'onednn' needs PyTorch built with oneDNN, which torch {torch.__version__} is not")
    _choice, _use = name, None


@contextlib.contextmanager
def use_cpu_matmul(name: str) -> Iterator[None]:
    """Context-manager form of :func:`set_cpu_matmul` (for this process; the previous choice,
    and its probe result, come back on exit)."""
    old = (_choice, _use, _use_tn)
    set_cpu_matmul(name)
    try:
        yield
    finally:
        _restore(old)


def _restore(state: tuple[str | None, bool | None, bool]) -> None:
    global _choice, _use, _use_tn
    _choice, _use, _use_tn = state


def _best(fn: Any, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (seconds), after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


#: The probe's linears, ``(rows, in, out)``: the shapes of Swin-T's attention projection and of its
#: third stage's MLP (most of its FLOPs). A 96-channel one was left out: alone it measured even
#: (0.96-1.04x) on the Zen 4 host, where the whole forward ran 1.08x as fast on oneDNN.
_PROBE_LINEARS = ((2048, 256, 768), (1024, 384, 1536), (1024, 1536, 384))


def _probe() -> tuple[bool, bool]:
    """(whether oneDNN runs :data:`_PROBE_LINEARS` at least :data:`_PROBE_MARGIN` times as fast as
    ``F.linear``, in total; whether :func:`mm_tn`'s oneDNN form runs a ``(4096, 384)^T x (4096, 96)``
    weight gradient faster than ``torch.mm``), each call the best of 3 after one untimed call."""
    with torch.no_grad():
        pairs = [(torch.full((n, k), 0.01, device="cpu"), torch.full((m, k), 0.02, device="cpu"))
                 for n, k, m in _PROBE_LINEARS]
        blas = sum(_best(lambda: F.linear(x, w), 3) for x, w in pairs)
        onednn = sum(_best(lambda: _lp(x, w, None), 3) for x, w in pairs)
        g, x = torch.full((4096, 384), 0.01, device="cpu"), torch.full((4096, 96), 0.02, device="cpu")
        tn_blas = _best(lambda: torch.mm(g.t(), x), 3)
        tn_onednn = _best(lambda: _onednn_mm_tn(g, x), 3)
    return onednn * _PROBE_MARGIN <= blas, tn_onednn < tn_blas


def cpu_matmul() -> str:
    """The backend float32 CPU linear layers use now: ``"onednn"`` or ``"blas"`` (``"auto"`` is
    resolved by its probe on the first call)."""
    global _choice, _use, _use_tn
    if _use is None:
        if _choice is None:
            env = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
            if env not in _CHOICES:
                raise ValueError(f"environment variable {ENV_VAR}={env!r}: expected one of {_CHOICES}")
            if env == "onednn" and not _available():
                raise ValueError(f"environment variable {ENV_VAR}=onednn: torch {torch.__version__} has no oneDNN")
            _choice = env
        if not _available():
            _use = False
        elif _choice == "auto":
            if _len_dispatch_modes():
                # a fake-tensor, FLOP-counting or other dispatch mode would see (and falsify) the
                # probe: answer "blas" for now and decide at the first call outside such a mode
                return "blas"
            _use, _use_tn = _probe()
        else:
            _use = _use_tn = _choice == "onednn"
    return "onednn" if _use else "blas"


def _len_dispatch_modes() -> int:
    length = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return length() if length is not None else 0


def onednn_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` goes through oneDNN: plain float32 CPU tensors with rows,
    autocast off, eager (not inside a compiler, exporter, tracer or ``torch.func`` transform),
    PyTorch's oneDNN switch on, and :func:`cpu_matmul` saying ``"onednn"``."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if tracing() or type(x) not in (Tensor, nn.Parameter) or type(weight) not in (Tensor, nn.Parameter):
        return False
    if x.layout != torch.strided or weight.layout != torch.strided or torch.is_autocast_enabled("cpu"):
        return False
    return x.numel() > 0 and torch.backends.mkldnn.enabled and cpu_matmul() == "onednn"


def _lp(x2: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """oneDNN's ``x2 @ w.T + b`` for 2-D ``x2``; ``w``: ``(out, in)``, plain or packed.

    A ``w`` with a zero stride (a broadcast gradient, such as ``out.sum()``'s ones, reaching a
    weight-gradient product) is copied first: oneDNN takes such a weight, but through a path
    hundreds of times slower (18 ms instead of 40 us for a ``(96, 64) x (64, 288)`` product)."""
    if w.layout == torch.strided and 0 in w.stride() and w.numel() > 1:
        w = w.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")


@contextlib.contextmanager
def packed_weights() -> Iterator[None]:
    """Within this scope (this thread), each weight :func:`linear` meets is reordered into
    oneDNN's layout once and reused, as long as it is not modified in place; the copies go when
    the outermost scope closes. Nested scopes share the outer one."""
    if getattr(_local, "cache", None) is not None:
        yield
        return
    _local.cache = {}
    try:
        yield
    finally:
        _local.cache = None


#: Fewest rows a call must have for :func:`packed_weights` to reorder a weight it has no copy of
#: yet. oneDNN also takes a weight in its plain layout (its kernels then read it as it is), and
#: for fewer rows that is faster than reordering it first: with a (3072, 768) weight, 8 rows took
#: 0.19 ms plain against 0.46 ms to reorder plus 0.12 ms packed, 1024 rows 10.3 ms plain against
#: 10.1 ms packed (the 2-core AMD EPYC). Late stages at small inputs have the largest weights and
#: the fewest rows.
PACK_MIN_ROWS = 1024


def _weight(w: Tensor, rows: int = PACK_MIN_ROWS) -> Tensor:
    """``w`` in oneDNN's layout, from this scope's cache (keyed by where its data lives, so a view
    made again, like a row slice of ``qkv``, finds its copy; the entry holds a reference, so that
    memory cannot be reused while it stands), or ``w`` itself outside :func:`packed_weights` or
    when a call of ``rows`` rows finds no copy and is too small to pay for one."""
    cache = getattr(_local, "cache", None)
    if cache is None or w.requires_grad and torch.is_grad_enabled():
        return w
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    version = -1 if w.is_inference() else w._version  # (a weight made under inference_mode has no counter)
    hit = cache.get(key)
    if hit is not None and hit[1] == version:
        return hit[2]
    if rows < PACK_MIN_ROWS:
        return w
    packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
    cache[key] = (w, version, packed)
    return packed


def _forward(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    out = _lp(x2, _weight(w, x2.shape[0]), None if b is None else b.contiguous())
    return out.view(*x.shape[:-1], w.shape[0])


def _recorded(*ts: Tensor) -> bool:
    """Whether autograd would record an op on ``ts`` (as under ``create_graph``)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for 2-D ``a`` ``(n, k)`` and ``b`` ``(k, m)``, through oneDNN where
    :func:`onednn_applies` and autograd does not record (``torch.mm`` otherwise): for backward
    passes, whose create-graph form stays differentiable."""
    return _lp(a, b.t(), None) if onednn_applies(a, b) and not _recorded(a, b) else torch.mm(a, b)


def mm_tn(g: Tensor, x: Tensor) -> Tensor:
    """``g.T @ x`` for ``g`` ``(n, m)`` and ``x`` ``(n, k)`` (a weight gradient: the sum over
    the ``n`` rows), ``(m, k)``. Through oneDNN where :func:`onednn_applies` and the probe (or a
    forced ``"onednn"``) chose it for this product too; the smaller of the two is then transposed
    into a contiguous copy. As :func:`mm`, plain ``torch.mm`` where autograd records."""
    if not onednn_applies(g, x) or _recorded(g, x) or not _use_tn:
        return torch.mm(g.t(), x)
    return _onednn_mm_tn(g, x)


def _onednn_mm_tn(g: Tensor, x: Tensor) -> Tensor:
    if x.shape[1] < g.shape[1]:
        return _lp(x.t().contiguous(), g.t(), None).t().contiguous()
    return _lp(g.t().contiguous(), x.t(), None)


def linear_into(out: Tensor, x: Tensor, w: Tensor, b: Tensor | None) -> None:
    """``out[:] = x @ w.T + b`` for 2-D ``x``, without autograd (inference and backward
    passes): ``addmm(out=...)`` with the BLAS, a oneDNN result copied in otherwise."""
    if onednn_applies(x, w):
        out.copy_(_lp(x, _weight(w, x.shape[0]), b))
    elif b is not None:
        torch.addmm(b, x, w.t(), out=out)
    else:
        torch.mm(x, w.t(), out=out)


class _Linear(torch.autograd.Function):
    """``x @ w.T + b`` through oneDNN, forward and backward. Under ``create_graph`` the backward
    uses differentiable torch ops instead, so second derivatives work."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _forward(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = gb = None  # (mm and mm_tn keep create_graph's gradients differentiable)
        if ctx.needs_input_grad[0]:
            gx = mm(g2, w).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = mm_tn(g2, x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN on the CPU where :func:`onednn_applies`
    (with its own backward pass when autograd records), and as the ``vtdense::onednn_linear``
    op inside ``torch.compile`` graphs (:func:`_compiled_applies`), so compiled code computes
    what eager code does. ``x``: ``(..., in)``, ``weight``: ``(out, in)``, ``bias``: ``(out,)``
    -> ``(..., out)``."""
    if x.device.type == "cuda":
        return _rows_linear(x, weight, bias)
    if bias is not None and bias.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if _compiled_applies(x, weight):
        return torch.ops.vtdense.onednn_linear(x, weight, bias)
    if not onednn_applies(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _forward(x, weight, bias)


def _rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` on a GPU, an input of more than two dims flattened to rows first (eager only).

    ``F.linear`` runs a 4-D input, or a non-contiguous 3-D one, as a matmul (copying the input to
    rows when it is strided) followed by a separate bias-add kernel; on rows it is one ``addmm``
    with the bias added in the GEMM's epilogue, as timm's 3-D windows get. One launch and one pass
    over the output fewer per layer (the windows' q/k/v and output projections are 4-D)."""
    if bias is None or x.dim() <= 2 or tracing():
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def _compiled_applies(x: Tensor, weight: Tensor) -> bool:
    """Inside ``torch.compile`` (not ``torch.export``, whose graphs must stay portable, nor a
    ``torch.func`` transform): float32 CPU tensors, autocast off, and oneDNN chosen before the
    graph was captured (the backbones resolve the choice when they are built; a choice not made
    yet counts as ``"blas"``, so no probe runs while tracing)."""
    if not torch.compiler.is_compiling() or exporting():
        return False
    if not (_use if _use is not None else _choice == "onednn"):  # (a forced choice needs no probe; set_cpu_matmul checked it)
        return False
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    return not torch.is_autocast_enabled("cpu") and torch.backends.mkldnn.enabled


@torch.library.custom_op("vtdense::onednn_linear", mutates_args=())
def _op_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:  # typing's: see decomposed_attention
    if x.numel() == 0:
        return F.linear(x, weight, bias)
    return _forward(x, weight, bias)


@_op_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("vtdense::onednn_mm", mutates_args=())
def _op_mm(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b) if a.numel() == 0 or b.numel() == 0 else _lp(a, b.t(), None)


@_op_mm.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("vtdense::onednn_mm_tn", mutates_args=())
def _op_mm_tn(g: Tensor, x: Tensor) -> Tensor:
    return torch.mm(g.t(), x) if g.numel() == 0 or x.numel() == 0 else mm_tn(g, x)


@_op_mm_tn.register_fake
def _(g: Tensor, x: Tensor) -> Tensor:
    return g.new_empty(g.shape[1], x.shape[1])


def _op_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _op_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    x, weight = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        gx = torch.ops.vtdense.onednn_mm(g2, weight).view(x.shape)
    if ctx.needs_input_grad[1]:
        gw = torch.ops.vtdense.onednn_mm_tn(g2, x.reshape(-1, x.shape[-1]))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        gb = g2.sum(0)
    return gx, gw, gb


_op_linear.register_autograd(_op_backward, setup_context=_op_setup)


def _register_flop_formulas() -> None:
    """Teach ``torch.utils.flop_counter.FlopCounterMode`` the FLOPs of these matmuls (2 per
    multiply-add, as for ``mm``), so FLOP counts of a model do not depend on the backend."""
    from torch.utils.flop_counter import register_flop_formula

    def rows(shape: Any) -> int:
        n = 1
        for d in shape[:-1]:
            n *= d
        return n

    def linear_flops(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * rows(x_shape) * x_shape[-1] * out_shape[-1]

    def mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    def mm_tn_flops(g_shape: Any, x_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * g_shape[0] * g_shape[1] * x_shape[1]

    from torch.utils.flop_counter import flop_registry

    ops = [(torch.ops.vtdense.onednn_linear, linear_flops), (torch.ops.vtdense.onednn_mm, mm_flops),
           (torch.ops.vtdense.onednn_mm_tn, mm_tn_flops)]
    if _available():
        ops.append((torch.ops.mkldnn._linear_pointwise, linear_flops))
    for packet, formula in ops:
        if packet not in flop_registry:  # (a torch that has its own formula keeps it)
            register_flop_formula(packet)(formula)


_register_flop_formulas()


def apply_linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, through :func:`linear` when ``module`` is a plain, unhooked ``nn.Linear``
    (:func:`~vtdense.layers.plain.plain_linear`); any other module is called as it is. In
    inference under autocast the layer's cast weight and bias are kept across forwards
    (:func:`~vtdense.layers.autocast.autocast_params`). (Called at module level, never inside an
    autograd function's forward, where grad mode is off even in training.)"""
    if plain_linear(module):
        weight, bias = autocast_params(module.weight, module.bias)  # type: ignore[arg-type]
        return linear(x, weight, bias)
    return module(x)
