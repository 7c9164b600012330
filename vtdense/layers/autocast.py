"""One cast under autocast for a tensor that several lower-precision consumers read.

Autocast casts a float32 input of every op on its lower-precision list (matmuls, convolutions,
SDPA) on each call, and caches only the casts of leaf tensors (weights). An activation read by
three products is cast three times: three kernels, three copies in memory, on a GPU three
launches that a host-bound step pays for. Casting it once, before those consumers, gives them the
values their own casts would, and costs one kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["autocast_inputs"]


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
