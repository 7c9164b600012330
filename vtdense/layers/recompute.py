"""A linear layer whose saved input is recomputed in the backward pass, the rest left to autograd.

``linear(f(*args))`` keeps, under plain autograd, what ``f`` saves for its own backward (a
LayerNorm its input and row statistics, a GELU its input) *and* ``f``'s output, which the linear
saves for its weight gradient. That output is recomputable from ``args``, which ``f`` keeps anyway.
:func:`recomputed_input_linear` runs ``f`` and the linear as plain recorded operations, so the
backward runs autograd's own C++ nodes, and lets go of ``f``'s output: while the linear records,
a saved-tensor pack hook swaps that one tensor for a recipe (``f``, ``args``, the autocast state,
the view autograd saved), and the unpack hook in the backward reruns ``f`` under the same autocast
state. Only that recipe and one ``f`` call per layer run in Python.

The same saving as :class:`vtdense.layers.mlp._NormLinear` and :class:`~vtdense.layers.mlp._GeluLinear`,
whose whole backward is Python: on a GPU, where a step's pace is often the host's, these hooks cost
a few Python calls per layer instead (``vtdense.layers.mlp`` picks the form per device).

Where saved-tensor hooks of someone else are in force (activation checkpointing, offloading, a
memory probe), they must see every saved tensor, so :func:`hooks_free` is false there and the
callers take another form.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["recomputed_input_linear", "hooks_free", "plain_storage"]

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_top = torch._C._autograd._top_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled


def plain_storage(t: Tensor) -> bool:
    """Whether ``t`` is a plain tensor, whose storage is its own (or a fake one, standing for it in
    the tests of the GPU code paths), not a subclass such as ``DTensor``."""
    return type(t) is Tensor or type(t) is FakeTensor


def hooks_free() -> bool:
    """Whether saved-tensor hooks may be pushed here: none of another's in force (checkpointing's
    included), and hooks not disabled (as some transforms do)."""
    return _hooks_enabled() and _top(False) is None


class _Recipe:
    """How to remake a saved tensor: ``fn(*args)`` under ``amp``, cast to ``dtype``, then the view
    ``(size, stride, offset)`` that autograd saved."""

    __slots__ = ("fn", "args", "amp", "dtype", "size", "stride", "offset")

    def __init__(self, fn: Callable[..., Tensor], args: tuple, amp: tuple | None, dtype: torch.dtype, saved: Tensor):
        self.fn, self.args, self.amp, self.dtype = fn, args, amp, dtype
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()

    def remake(self) -> Tensor:
        if self.amp is None:
            out = self.fn(*self.args)
        else:
            out = _under_autocast(self.amp, self.fn, self.args)
        return out.to(self.dtype).as_strided(self.size, self.stride, self.offset)


def _under_autocast(amp: tuple, fn: Callable[..., Tensor], args: tuple) -> Tensor:
    """``fn(*args)`` under autocast ``amp`` (device type, dtype), as ``torch.autocast`` would run it,
    through the state setters alone: ``torch.autocast("cuda")`` asks the CUDA runtime about the
    device on every entry, which the backward would pay once per remake."""
    dev, dtype = amp
    prev = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
    torch.set_autocast_enabled(dev, True)
    torch.set_autocast_dtype(dev, dtype)
    torch.autocast_increment_nesting()
    try:
        return fn(*args)
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(dev, prev[0])
        torch.set_autocast_dtype(dev, prev[1])


def _unpack(saved: Any) -> Tensor:
    return saved.remake() if type(saved) is _Recipe else saved


def _same(x: Tensor) -> Tensor:
    return x


def _cast_of(t: Tensor, x: Tensor, x_node: Any) -> bool:
    """Whether autograd recorded ``t`` as a dtype cast of ``x`` (``x`` requires grad)."""
    node = t.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or len(node.next_functions) != 1:
        return False
    src = node.next_functions[0][0]
    if x_node is not None:
        return src is x_node
    return src is not None and getattr(src, "variable", None) is x  # x a leaf: its AccumulateGrad


def recomputed_input_linear(fn: Callable[..., Tensor], args: tuple, linear: nn.Linear, casts: bool = True) -> Tensor:
    """``linear(fn(*args))``, recorded by autograd, with ``fn``'s output recomputed in the backward
    pass instead of kept (see the module's docstring). ``fn`` must be deterministic and keep
    whatever it needs of ``args`` for its own backward; call only where :func:`hooks_free`, with
    ``args[0]`` of :func:`plain_storage`.

    Two tensors are remade instead of kept:

    - the linear's input. Under autocast it is cast to the autocast dtype here, as ``F.linear``
      would cast it, so that the tensor autograd saves is one this function made;
    - a cast copy of ``args[0]`` that ``fn`` saves: CUDA autocast runs ``layer_norm`` in float32,
      so on a bf16 input (Swin's residual stream after a patch merging) the norm would keep a
      float32 copy of it, twice the bytes of the input itself.

    ``casts``: whether ``fn`` may be one autocast casts ``args[0]`` for (a LayerNorm, which CUDA
    autocast runs in float32); ``False`` for one it leaves alone (GELU). Only then, and for an
    ``args[0]`` not already float32, does a hook watch what ``fn`` saves: elsewhere its saved tensors
    stay autograd's own, with no Python call per tensor in the forward or the backward.

    ``args[0]``: ``(..., in)`` -> ``(..., out)``."""
    x = args[0]
    dev = x.device.type
    amp = (dev, torch.get_autocast_dtype(dev)) if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) else None
    x_node = x.grad_fn

    def pack_in_fn(t: Tensor) -> Any:  # a cast copy of x (autograd's record says so): remade from x
        if plain_storage(t) and t.shape == x.shape and t.dtype != x.dtype and _cast_of(t, x, x_node):
            return _Recipe(_same, (x,), None, t.dtype, t)
        return t

    if casts and x.dtype != torch.float32:
        _push(pack_in_fn, _unpack)
        try:
            a = fn(*args)
        finally:
            _pop()
    else:
        a = fn(*args)
    if amp is not None and a.is_floating_point() and a.dtype != amp[1]:
        a = a.to(amp[1])
    key = a.untyped_storage()._cdata  # the storage itself (fake tensors' data pointers are all 0)
    dtype = a.dtype

    def pack(t: Tensor) -> Any:
        if plain_storage(t) and t.dtype == dtype and t.untyped_storage()._cdata == key:
            return _Recipe(fn, args, amp, dtype, t)
        return t

    _push(pack, _unpack)
    try:
        return F.linear(a, linear.weight, linear.bias)
    finally:
        _pop()
