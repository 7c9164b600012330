"""CPU inference in cache-sized chunks.

A transformer block does most of its work token by token (LayerNorm, the projections, the MLP)
or window by window (windowed attention). In inference nothing ties one slice of rows to another,
so on the CPU the backbones run a block over slices whose temporaries stay a few MiB: the MLP's
hidden activation, ``qkv`` and the attention output then live in cache between the matmul that
writes them and the op that reads them, and the allocator reuses their memory instead of mapping
fresh pages. Without chunks, the stage-1 MLP hidden of Swin-T at batch 8 and 224 px is a 38 MiB
tensor, which glibc maps anew on every allocation: about 9,400 page faults (a few ms each time
on a virtual machine) before a single FLOP, twice per block.

The rows go through the same operations in the same order, so the results equal the unchunked
ones (the tests compare them exactly). The chunked path is taken only where it cannot change
anything but speed: on the CPU, with no gradient needed, outside autocast, and outside
``torch.compile``, ``torch.export`` and TorchScript tracing (ONNX export), whose graphs keep the
whole-tensor form. :func:`set_cpu_chunking` switches it off (for benchmarks and comparisons).

CPU training steps chunk their large activations too, with autograd functions of their own
(:mod:`vtdense.layers.chunked_mlp`, :mod:`vtdense.layers.cpu_window_attention`;
:func:`training_chunking_applies`); :class:`NormLinearGrads` is the backward of the
``linear(layer_norm(x))`` both of them start with.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from vtdense.layers.cpu_linear import mm, mm_tn
from vtdense.layers.plain import hooks_below
from vtdense.layers.scoped import scoped_setting
from vtdense.layers.tracing import functorch_transform, tracing

__all__ = ["CHUNK_BYTES", "set_cpu_chunking", "cpu_chunking", "chunking_applies", "training_chunking_applies",
           "TRAIN_CHUNK_MIN_BYTES", "NormLinearGrads", "row_slices", "window_slices", "tracing", "functorch_transform"]

#: Target size of the largest temporary of one chunk (bytes). A few MiB keeps it in the L2/L3
#: caches of current CPUs and well under glibc's 32 MiB ceiling for reusing freed memory.
CHUNK_BYTES = 8 << 20
#: Fewest rows a chunk is cut to: below this the matmuls lose more to their own overhead than
#: the cache gains.
MIN_ROWS = 256

#: Smallest activation (bytes) a training step computes in chunks. glibc maps blocks above
#: 32 MiB afresh on every allocation, and returns the top of its heap to the kernel once more
#: than 64 MiB of it is free (as at the end of every backward pass), so a step's large tensors are
#: faulted in page by page again on every step. Swin-T at batch 2 and 512x768 measured fastest
#: with 16 MiB (its stage-1/2 attention and stage-1 to 3 MLPs in chunks): smaller tensors run
#: as fast whole, with fewer, larger matmuls.
TRAIN_CHUNK_MIN_BYTES = 16 << 20

_enabled = True


def set_cpu_chunking(enabled: bool) -> None:
    """Switch the chunked CPU paths (inference, and the MLP of training steps) on (the default)
    or off for every vtdense backbone."""
    global _enabled
    _enabled = bool(enabled)


def cpu_chunking(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context-manager form of :func:`set_cpu_chunking`."""
    return scoped_setting(lambda: _enabled, set_cpu_chunking, enabled)


def chunking_applies(x: Tensor, module: nn.Module) -> bool:
    """Whether ``module`` may run ``x`` in chunks: eval mode (dropout and drop path are identity),
    on the CPU, no gradient to ``x`` or to any of ``module``'s parameters, autocast off, not
    inside a compiler, exporter or tracer, and no forward hook on any of ``module``'s layers
    (:func:`~vtdense.layers.plain.hooks_below`)."""
    if not _enabled or module.training or x.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    # chunks call the block's layers once per slice of rows: not where a hook would see each call
    return not tracing() and not hooks_below(module)


def training_chunking_applies(x: Tensor, nbytes: int, min_bytes: int | None = None) -> bool:
    """Whether a training-step op on ``x`` whose largest activation takes ``nbytes`` runs in
    chunks with its own backward (:mod:`vtdense.layers.chunked_mlp`,
    :mod:`vtdense.layers.cpu_window_attention`): at least ``min_bytes`` (default
    :data:`TRAIN_CHUNK_MIN_BYTES`), on the CPU with gradients enabled, autocast off, and not inside a
    compiler, exporter or tracer."""
    if not _enabled or x.device.type != "cpu" or not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    # the size test last: under export / compile it would put a guard on symbolic sizes
    return not tracing() and nbytes >= (TRAIN_CHUNK_MIN_BYTES if min_bytes is None else min_bytes)


def _add(acc: Tensor | None, t: Tensor | None) -> Tensor | None:
    """``acc + t`` in place (``t`` itself for the first chunk, ``acc`` when ``t`` is ``None``)."""
    return t if acc is None else (acc if t is None else acc.add_(t))


class NormLinearGrads:
    """The backward of ``linear(layer_norm(x), w, b)`` (or ``linear(x, w, b)`` without a norm),
    one chunk of rows at a time: :meth:`add` takes a chunk's output gradient and input rows,
    recomputes the norm, writes the input gradient, and sums the parameter gradients over the
    chunks (:attr:`grads`). ``needs``: which of ``(x, norm_w, norm_b, w, b)`` need a gradient."""

    def __init__(self, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, has_norm: bool, w: Tensor,
                 has_b: bool, needs: tuple[bool, bool, bool, bool, bool]) -> None:
        self.norm_w, self.norm_b, self.eps, self.has_norm, self.w = norm_w, norm_b, eps, has_norm, w
        nx, nnw, nnb, nw_, nb_ = needs
        self.need_x, self.need_w, self.need_b = nx, nw_, nb_ and has_b
        self.need_nw = nnw and has_norm and norm_w is not None
        self.need_nb = nnb and has_norm and norm_b is not None
        self.g_nw = self.g_nb = self.g_w = self.g_b = None

    @property
    def needed(self) -> bool:
        """Whether any gradient is wanted at all (else :meth:`add` need not be called)."""
        return self.need_x or self.need_nw or self.need_nb or self.need_w or self.need_b

    def add(self, g_out: Tensor, rows: Tensor, g_rows: Tensor | None) -> None:
        """``g_out``: ``(n, out)`` gradient of this chunk's output; ``rows``: its ``(n, in)``
        input; ``g_rows``: where its input gradient goes (``(n, in)``, when ``x`` needs one)."""
        if self.has_norm:
            xn, mean, rstd = torch.native_layer_norm(rows, rows.shape[-1:], self.norm_w, self.norm_b, self.eps)
        else:
            xn = rows
        if self.need_w:
            self.g_w = _add(self.g_w, mm_tn(g_out, xn))
        if self.need_b:
            self.g_b = _add(self.g_b, g_out.sum(0))
        if not (self.need_x or self.need_nw or self.need_nb):
            return
        if not self.has_norm:
            g_rows.copy_(mm(g_out, self.w))
            return
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            mm(g_out, self.w), rows, rows.shape[-1:], mean, rstd, self.norm_w, self.norm_b,
            [self.need_x, self.need_nw, self.need_nb])
        if self.need_x:
            g_rows.copy_(dx)
        self.g_nw, self.g_nb = _add(self.g_nw, dw), _add(self.g_nb, db)

    @property
    def grads(self) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """The summed ``(norm_w, norm_b, w, b)`` gradients (``None`` where none was wanted)."""
        return self.g_nw, self.g_nb, self.g_w, self.g_b


def _even_slices(n: int, per: int) -> list[slice]:
    """``range(n)`` in the fewest near-equal slices of at most ``per`` (>= 1) items."""
    parts = max(1, -(-n // max(per, 1)))
    size = -(-n // parts)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def row_slices(n_rows: int, bytes_per_row: int, budget: int | None = None, min_rows: int | None = None) -> list[slice]:
    """Slices covering ``range(n_rows)`` with about ``budget`` (default :data:`CHUNK_BYTES`)
    bytes of ``bytes_per_row`` each, at least ``min_rows`` (default :data:`MIN_ROWS`) rows, in
    near-equal parts."""
    budget = CHUNK_BYTES if budget is None else budget
    min_rows = MIN_ROWS if min_rows is None else min_rows
    return _even_slices(n_rows, max(min_rows, budget // max(bytes_per_row, 1)))


def window_slices(batch: int, windows: int, rows_per_window: int, bytes_per_row: int,
                  budget: int | None = None) -> list[tuple[slice, slice]]:
    """``(images, windows)`` slice pairs covering a ``(batch, windows, rows_per_window, ...)``
    tensor, each a contiguous block of about ``budget`` bytes (at least :data:`MIN_ROWS` rows):
    whole images, one or more, when an image fits, else runs of windows inside one image."""
    budget = CHUNK_BYTES if budget is None else budget
    per = max(-(-MIN_ROWS // rows_per_window), budget // max(rows_per_window * bytes_per_row, 1))
    if per >= windows:
        return [(s, slice(0, windows)) for s in _even_slices(batch, per // windows)]
    runs = _even_slices(windows, per)
    return [(slice(b, b + 1), w) for b in range(batch) for w in runs]
