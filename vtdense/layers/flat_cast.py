"""One cast for all of a block's linear weights in a training forward under autocast.

Autocast casts every float32 weight and bias of a linear layer to its lower precision in every
forward, one kernel each, and autograd casts each of their gradients back to float32, one kernel
each again. In a bf16 Swin-T training step that is about 160 kernels forward and as many backward,
a third of the step's kernel launches; on a GPU the step runs at the pace of its host, for which a
launch costs the same whatever its size (``benchmarks/RESULTS.md``: about 1,060 launches a step).

:func:`cast_once` casts the float32 linear parameters of a module (a transformer block) in one
kernel, into one buffer, and hands the layers views of it (through
:func:`vtdense.layers.autocast.autocast_params`, which every linear layer of the blocks takes its
weights from); autocast leaves a tensor already in its dtype alone. Two kernels: one
concatenation, one cast. The backward gathers the views' gradients the same way into one float32
buffer, and gives each parameter its slice.
The values are the ones autocast and autograd give, bit for bit: a cast is a cast. The parameters'
gradients are then views into that buffer (the optimizer and ``zero_grad`` treat them as any other).
The backward holds a block's low-precision weight gradients until the block's last one is
computed (at most 14 MB for a Swin-T block of the last stage), where autograd would cast each
as it comes: per block rather than per stage, so that this stays small.

It runs where the launches matter: CUDA, under autocast to a lower precision, with gradients
recorded, eagerly (not while a graph is traced or a CUDA graph records). :func:`set_flat_casts`
switches it off, or on for every device (the CPU tests).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from vtdense.layers.scoped import scoped_setting
from vtdense.layers.tracing import cuda_graph_capturing, tracing

__all__ = ["cast_once", "flat_cast_of", "flat_casts", "set_flat_casts"]

_mode: bool | str = "auto"
_local = threading.local()


def set_flat_casts(enabled: bool | str) -> None:
    """``"auto"`` (the default: on CUDA), ``True`` (on every device, autocast permitting) or
    ``False`` (autocast casts each weight, as without vtdense)."""
    global _mode
    if enabled not in (True, False, "auto"):
        raise ValueError(f"set_flat_casts takes True, False or 'auto'; got {enabled!r}")
    _mode = enabled


def flat_casts(enabled: bool | str) -> contextlib.AbstractContextManager[None]:
    """Context-manager form of :func:`set_flat_casts`."""
    return scoped_setting(lambda: _mode, set_flat_casts, enabled)


def flat_cast_of(p: Tensor) -> Tensor | None:
    """The cast view of parameter ``p`` while :func:`cast_once` is in force for it, else ``None``."""
    views = getattr(_local, "views", None)
    return None if views is None else views.get(id(p))


class _FlatCast(torch.autograd.Function):
    """``(dtype, *params)`` -> each parameter cast to ``dtype``, as views of one buffer."""

    @staticmethod
    def forward(ctx: Any, dtype: torch.dtype, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused view's gradient stays None (its parameter gets none)
        ctx.shapes = [p.shape for p in params]
        ctx.param_dtype = params[0].dtype
        # Two kernels: CUDA's cat copies many inputs in one launch only when they and its output
        # share a dtype (it copies them one by one otherwise), then one cast.
        flat = torch.cat([p.reshape(-1) for p in params]).to(dtype)
        return tuple(_shaped(part, shape) for part, shape in zip(flat.split([p.numel() for p in params]), ctx.shapes))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        want = [i for i, g in enumerate(grads) if g is not None and ctx.needs_input_grad[i + 1]]
        out: list[Tensor | None] = [None] * len(grads)
        if want:
            sizes = [grads[i].numel() for i in want]  # type: ignore[union-attr]
            flat = torch.cat([grads[i].reshape(-1) for i in want]).to(ctx.param_dtype)  # type: ignore[union-attr]
            for i, part in zip(want, flat.split(sizes)):
                out[i] = _shaped(part, ctx.shapes[i])
        return (None, *out)


def _shaped(part: Tensor, shape: torch.Size) -> Tensor:
    return part if len(shape) == 1 else part.view(shape)  # (a bias is its slice already: one view less)


def _applies(params: list[Tensor]) -> torch.dtype | None:
    """The dtype to cast ``params`` to, or ``None`` where :func:`cast_once` stands aside (after
    :func:`_may_apply`)."""
    if not params:
        return None
    dev = params[0].device
    if dev.type not in ("cpu", "cuda") or (_mode == "auto" and dev.type != "cuda"):
        return None
    if not torch.is_autocast_enabled(dev.type) or cuda_graph_capturing(dev) or any(p.device != dev for p in params):
        return None  # (a block split over devices keeps autocast's casts)
    return torch.get_autocast_dtype(dev.type)


def _may_apply() -> bool:
    """The checks that need no parameter, first: a graph being built must not even look at the
    parameters' storage."""
    if _mode is False or not torch.is_grad_enabled():
        return False
    if not (torch.is_autocast_enabled("cuda") or (_mode is True and torch.is_autocast_enabled("cpu"))):
        return False  # (before looking at a module: the CPU's training forwards pay nothing)
    return not tracing() and getattr(_local, "views", None) is None  # nested: the outer scope's views serve


def _castable(module: nn.Module) -> Iterator[Tensor]:
    """The float32 parameters of ``module``'s linear layers: plain ``nn.Parameter`` s with storage
    of their own (not views into another's flat buffer, nor subclasses such as ``DTensor``; fake
    tensors stand for them in the counts of ``benchmarks/launches.py``)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            for p in (m.weight, m.bias):
                if (p is not None and type(p) in (nn.Parameter, FakeTensor) and p.dtype == torch.float32 and p.requires_grad
                        and p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * 4):
                    yield p


@contextlib.contextmanager
def cast_once(module: nn.Module) -> Iterator[None]:
    """Within the ``with`` block: the linear layers of ``module`` read their weights and biases
    cast once for all (see the module's docstring), where that applies; elsewhere, nothing changes."""
    params = list(dict.fromkeys(_castable(module))) if _may_apply() else []  # a shared parameter once
    dtype = _applies(params)
    if dtype is None or dtype == torch.float32:
        yield
        return
    views = _FlatCast.apply(dtype, *params)
    _local.views = {id(p): v for p, v in zip(params, views)}
    try:
        yield
    finally:
        _local.views = None
