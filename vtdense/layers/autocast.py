"""Fewer casts under autocast.

Autocast casts a float32 input of every op on its lower-precision list (matmuls, convolutions,
SDPA) on each call, and caches only the casts of leaf tensors (weights), and those only until its
context exits:

- an activation read by three products is cast three times: three kernels, three copies in memory,
  on a GPU three launches that a host-bound step pays for. Casting it once, before those consumers
  (:func:`autocast_inputs`), gives them the values their own casts would, and costs one kernel;
- every weight and bias is cast again in every forward. In inference (no gradient recorded) the
  weights do not change between forwards, so :func:`autocast_params` keeps their cast copies
  until they change: on the H200 a bf16 Swin-T forward at batch 64 runs at the pace of its host,
  and its linear layers' casts were about 100 of its 331 ATen calls.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor, nn

from vtdense.layers.tracing import cuda_graph_capturing, tracing

__all__ = ["autocast_inputs", "autocast_params", "clear_autocast_params", "set_autocast_params_kept"]


def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` in autocast's dtype when autocast is on for their device and they are float32;
    otherwise (autocast off, other dtypes) as they are.

    Use it only for tensors whose every consumer is on autocast's lower-precision list (or only
    moves data: padding, partition, concatenation with tensors of that dtype); a consumer that
    autocast runs in float32 would otherwise read rounded values."""
    if not tensors:
        return tensors
    dev = tensors[0].device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return tensors
    low = torch.get_autocast_dtype(dev)
    return tuple(t.to(low) if t.dtype == torch.float32 else t for t in tensors)


_keep = True  # set_autocast_params_kept()

# id(parameter) -> (weak reference to it, (version, data_ptr, dtype), its cast copy)
_casts: dict[int, tuple[weakref.ref, tuple[int, int, torch.dtype], Tensor]] = {}
# Reentrant: a weak reference's callback (_forget) can run inside a locked section, when an
# allocation there lets the garbage collector free a parameter.
_lock = threading.RLock()


def _forget(key: int, ref: weakref.ref) -> None:
    with _lock:
        if key in _casts and _casts[key][0] is ref:
            del _casts[key]


def clear_autocast_params() -> None:
    """Drop every cast copy :func:`autocast_params` keeps (they also go when their parameter does,
    are replaced when it changes, and all go when a forward under autocast records gradients)."""
    with _lock:
        _casts.clear()


def set_autocast_params_kept(enabled: bool) -> None:
    """Keep cast copies of the weights in inference under autocast (``True``, the default) or cast
    them in every forward as autocast does (``False``, which also drops the copies kept so far).
    The copies cost half the float32 weights' bytes (bfloat16 / float16) of the layers that use
    them: about 52 MiB for Swin-T, whose inference at batch 64 and 224 needs about 480 MiB."""
    global _keep
    _keep = bool(enabled)
    if not _keep:
        clear_autocast_params()


def autocast_params(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A layer's ``weight`` and ``bias`` as autocast would cast them for a lower-precision op (a
    linear layer), from a cache kept across forwards, where that is safe: inference (no gradient
    recorded), autocast on for their device, float32 ``nn.Parameter`` s with a version counter, and
    neither a graph being traced nor a CUDA graph recording (as :func:`~vtdense.layers.tracing.fresh_tables`).
    Otherwise they are returned as they are, and autocast casts them as usual.

    An entry is keyed by the parameter and stamped with its version counter, storage and the
    autocast dtype, so an optimizer step, ``load_state_dict`` or ``.to()`` makes a new copy; an
    in-place edit through ``.data``, which bumps no version counter, is not seen (call
    :func:`clear_autocast_params` after one). A forward under autocast that records gradients drops
    every copy, so training does not keep those that validation made."""
    dev = weight.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):
        return weight, bias
    if tracing():  # (first: a compiled graph must not read, or guard on, the cache)
        return weight, bias
    if torch.is_grad_enabled():
        if _casts:  # training (again): the copies validation kept would only take memory now
            clear_autocast_params()
        return weight, bias
    if not _keep or cuda_graph_capturing(weight.device):
        return weight, bias
    dtype = torch.get_autocast_dtype(dev)
    return _cached(weight, dtype), None if bias is None else _cached(bias, dtype)


def _owns_its_storage(p: Tensor) -> bool:
    """Whether ``p`` is all of its storage: not a view into a flat buffer, as FSDP's parameters are
    (their storage is refilled by collectives, which bump no version counter) nor freed storage."""
    return p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()


def _cached(p: Tensor, dtype: torch.dtype) -> Tensor:
    if not isinstance(p, nn.Parameter) or p.dtype != torch.float32 or p.is_inference() or not _owns_its_storage(p):
        return p
    key = id(p)
    stamp = (p._version, p.data_ptr(), dtype)
    hit = _casts.get(key)
    if hit is not None and hit[0]() is p and hit[1] == stamp:
        return hit[2]
    value = p.detach().to(dtype)
    entry = (weakref.ref(p, lambda r, key=key: _forget(key, r)), stamp, value)
    with _lock:
        _casts[key] = entry
    return value
