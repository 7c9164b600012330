"""One home for the "process-wide switch, and its context-manager form" pattern of the layers
(:func:`~vtdense.layers.chunked.cpu_chunking`, :func:`~vtdense.layers.attention.attention_backend`,
:func:`~vtdense.layers.mlp.activation_recompute`, :func:`~vtdense.layers.fused_norm.triton_norm`)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

__all__ = ["scoped_setting", "is_auto_switch"]

T = TypeVar("T")


def is_auto_switch(value: object) -> bool:
    """Whether ``value`` is one of a three-way switch's settings: ``True``, ``False`` or ``"auto"``
    (not ``1``, ``0`` or another string)."""
    return isinstance(value, (bool, str)) and value in (True, False, "auto")


@contextlib.contextmanager
def scoped_setting(get: Callable[[], T], set_: Callable[[T], None], value: T) -> Iterator[None]:
    """``set_(value)`` for the ``with`` block, then the value ``get()`` read before it, also when the
    block raises. ``set_`` validates ``value`` as it does when called directly."""
    old = get()
    set_(value)
    try:
        yield
    finally:
        set_(old)
