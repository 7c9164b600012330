"""Counting the calls of given ATen (or other dispatcher) ops, for tests that check how often a kernel runs."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCalls(TorchDispatchMode):
    """``with OpCalls(torch.ops.aten.baddbmm) as calls: ...`` then ``calls.count``: how many times
    the given op packets ran inside the block (every overload counts)."""

    def __init__(self, *ops: Any) -> None:
        super().__init__()
        self.ops = ops
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket in self.ops:
            self.count += 1
        return func(*args, **(kwargs or {}))
