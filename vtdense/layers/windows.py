"""Window partition, padding, cyclic shift and the additive masks they need.

Everything about non-overlapping windows lives here so Swin (V1/V2) and the hybrid-window
MViTv2 share one implementation. Feature maps are channels-last ``(B, H, W, C)``.

Padding convention: a map whose sides are not multiples of the window is zero-padded at the
bottom/right *before* the cyclic shift (as the original Swin detection code does), and padded
tokens are masked out as keys, so they never change the result for real tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vtdense.layers.tracing import exporting, fresh_tables, tracing

__all__ = [
    "MASK_VALUE",
    "mask_value",
    "to_2tuple",
    "effective_window",
    "ceil_div",
    "padded_length",
    "pad_to_window",
    "window_partition",
    "window_reverse",
    "window_attention_mask",
    "window_token_index",
    "slot_major_scatter",
    "slot_major",
    "select_tokens",
    "tokens_to_windows",
    "windows_to_tokens",
]

#: Additive value for masked logits. Finite (a fully masked row of a padded query stays
#: finite instead of NaN) yet far below any logit, cosine logits included (<= 116).
MASK_VALUE = -1e4


def mask_value() -> float:
    """:data:`MASK_VALUE`, for code that runs inside graphs: a literal, which Dynamo keeps a
    constant. Under ``torch.compile(dynamic=True)`` a module-level float becomes a graph input,
    and Dynamo then fails on the second ``torch.utils.checkpoint`` region that reads it
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer"), which broke
    compiled training with ``grad_checkpointing=True``."""
    return -1e4


def to_2tuple(v: int | Sequence[int], name: str = "value") -> tuple[int, int]:
    """``7 -> (7, 7)``; ``(7, 9) -> (7, 9)``; anything else is an error naming ``name``."""
    if isinstance(v, int):
        out = (v, v)
    else:
        out = tuple(int(x) for x in v)
        if len(out) != 2:
            raise ValueError(f"{name} must be an int or a pair (h, w), got {v!r}")
    if min(out) < 1:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return out  # type: ignore[return-value]


def effective_window(
    size: tuple[int, int], window: tuple[int, int], shift: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per axis: a map no larger than the window gets a window of the map's size and no shift.

    Written as the same comparison the shift needs (not ``min``): under ``torch.compile`` with
    symbolic sizes, ``min`` keeps the window symbolic (``sym_min``) and every kernel built on it
    loses its static shape (a scalar loop with integer division per element); the comparison is a
    guard the shift already takes, so the window of a map larger than it stays a constant.
    """
    win = tuple(w if s > w else s for s, w in zip(size, window))
    sh = tuple(0 if s <= w else sf for s, w, sf in zip(size, window, shift))
    return win, sh  # type: ignore[return-value]


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` of a size ``n >= 0``, as ``-(-n // d)`` (the form ``torch.compile``'s symbolic
    sizes simplify, see :func:`padded_length`). Under TorchScript tracing (``torch.onnx.export(...,
    dynamo=False)``) sizes are traced tensors and ``//`` becomes ONNX's integer ``Div``, which
    truncates: ``-(-50 // 4)`` would give 12, not 13. There it is ``(n + d - 1) // d``, which only
    ever divides non-negative numbers."""
    if torch.jit.is_tracing():
        return (n + d - 1) // d
    return -(-n // d)


def padded_length(n: int, window: int) -> int:
    """``n`` rounded up to a multiple of ``window``.

    Written as ``ceil(n / window) * window``, the form the window ops' fake sizes take, and not as
    ``n + (-n % window)``: under ``torch.compile`` with a symbolic ``n``, the two are different
    expressions that the shape checks of every later view must prove equal, which cost a quarter of
    the trace of a windowed MViTv2 (``n // window`` of this form is simply ``ceil(n / window)``).
    """
    return ceil_div(n, window) * window


def pad_to_window(x: Tensor, window: tuple[int, int]) -> Tensor:
    """Zero-pad ``(B, H, W, C)`` at the bottom/right up to multiples of ``window``.

    Under ``torch.compile`` it always pads (possibly by 0), so whether a size needs padding is
    not a guard that recompiles the graph at the next size.
    """
    H, W = x.shape[1:3]
    pad_h = padded_length(H, window[0]) - H
    pad_w = padded_length(W, window[1]) - W
    if torch.compiler.is_compiling() or pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    return x


def window_partition(x: Tensor, window: tuple[int, int]) -> Tensor:
    """``(B, Hp, Wp, C) -> (B, nW, wh*ww, C)``; ``Hp, Wp`` must be multiples of the window."""
    B, H, W, C = x.shape
    wh, ww = window
    x = x.view(B, H // wh, wh, W // ww, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // wh) * (W // ww), wh * ww, C)


def window_reverse(windows: Tensor, window: tuple[int, int], H: int, W: int) -> Tensor:
    """Inverse of :func:`window_partition`: ``(B, nW, wh*ww, C) -> (B, H, W, C)``."""
    B, _, _, C = windows.shape
    wh, ww = window
    x = windows.view(B, H // wh, W // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def _region_labels(n_pad: Tensor | int, n: int | Tensor, window: int, shift: int, device: torch.device) -> Tensor:
    """Shift-region id (0, 1, 2) of each position of a rolled, padded axis of length ``n_pad``."""
    r = torch.arange(n_pad, device=device)
    if not shift:
        return torch.zeros_like(r)
    return (r >= n_pad - window).long() + (r >= n_pad - shift).long()


def _grid_to_windows(t: Tensor, window: tuple[int, int]) -> Tensor:
    """``(Hp, Wp, ...)`` -> ``(nW, wh*ww, ...)`` in :func:`window_partition`'s order."""
    Hp, Wp = t.shape[:2]
    wh, ww = window
    rest = t.shape[2:]
    t = t.reshape(Hp // wh, wh, Wp // ww, ww, *rest).transpose(1, 2)
    return t.reshape((Hp // wh) * (Wp // ww), wh * ww, *rest)


def _token_index(H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor]:
    # Pure tensor arithmetic on the sizes, so torch.compile can trace it with symbolic H, W.
    wh, ww = window
    sh, sw = shift
    Hp, Wp = padded_length(H, wh), padded_length(W, ww)
    # The rolled, padded grid holds at (r, c) the token ((r + sh) % Hp, (c + sw) % Wp).
    r = (torch.arange(Hp, device=device) + sh) % Hp
    c = (torch.arange(Wp, device=device) + sw) % Wp
    valid = (r[:, None] < H) & (c[None, :] < W)
    # Padded slots read token 0: they are masked as keys and dropped as queries, so any finite
    # value will do, and no padded copy of the map is needed.
    src = torch.where(valid, r[:, None] * W + c[None, :], 0)
    gather = _grid_to_windows(src, window).reshape(-1)
    # Where token (i, j) sits in the windowed sequence.
    ri = (torch.arange(H, device=device) - sh) % Hp
    cj = (torch.arange(W, device=device) - sw) % Wp
    n = wh * ww
    win = (ri // wh)[:, None] * (Wp // ww) + (cj // ww)[None, :]
    scatter = win * n + (ri % wh)[:, None] * ww + (cj % ww)[None, :]
    return gather, scatter.reshape(-1)


def _window_mask(H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device) -> Tensor:
    wh, ww = window
    Hp, Wp = padded_length(H, wh), padded_length(W, ww)
    rh = _region_labels(Hp, H, wh, shift[0], device)
    rw = _region_labels(Wp, W, ww, shift[1], device)
    region = rh[:, None] * 3 + rw[None, :]
    r = (torch.arange(Hp, device=device) + shift[0]) % Hp
    c = (torch.arange(Wp, device=device) + shift[1]) % Wp
    valid = (r[:, None] < H) & (c[None, :] < W)
    reg, val = _grid_to_windows(region, window), _grid_to_windows(valid, window)  # nW, N
    return (reg[:, :, None] != reg[:, None, :]) | ~val[:, None, :]


def _needs_mask(H: int, W: int, window: tuple[int, int], shift: tuple[int, int]) -> bool:
    return bool(any(shift) or H % window[0] or W % window[1])


# Bool masks (1 byte per entry) and a bounded cache: multi-scale training visits many sizes, and
# a stage-1 mask at 1333x800 holds ~1400 windows x 49 x 49 entries.
@functools.lru_cache(maxsize=64)
def _window_mask_cached(
    H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device
) -> Tensor | None:
    if not _needs_mask(H, W, window, shift):
        return None
    with torch.inference_mode(False), torch.no_grad():
        return _window_mask(H, W, window, shift, device)


@functools.lru_cache(maxsize=64)
def _token_index_cached(
    H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device
) -> tuple[Tensor, Tensor]:
    with torch.inference_mode(False), torch.no_grad():
        return _token_index(H, W, window, shift, device)


@functools.lru_cache(maxsize=16)
def _no_mask(H: int, W: int, window: tuple[int, int], device: torch.device) -> Tensor:
    n = ceil_div(H, window[0]) * ceil_div(W, window[1])
    return torch.zeros(n, window[0] * window[1], window[0] * window[1], dtype=torch.bool, device=device)


def _fetch(cached: Callable[..., Any], *args: Any, fresh: bool | None = None) -> Any:
    """``cached(*args)``, or the uncached builder behind it when ``fresh`` (default: while a graph
    is built or a CUDA graph records, :func:`~vtdense.layers.tracing.fresh_tables`)."""
    if fresh is None:
        fresh = fresh_tables(args[-1])
    return cached.__wrapped__(*args) if fresh else cached(*args)


def _op_fresh(device: torch.device) -> bool:
    """Whether the custom ops below build their table for this call instead of caching it: where
    :func:`~vtdense.layers.tracing.fresh_tables` says so, and on a CUDA stream other than the
    device's default one. ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) runs its
    warm-up on a stream of its own whose allocations come from the graphs' private memory pool; a
    table cached there would outlive the graph in that pool, which the trees refuse ("tensors in the
    cudagraph pool not tracked as outputs", seen on an H200). Built per call, it is an ordinary
    intermediate of the graph."""
    if fresh_tables(device):
        return True
    return device.type == "cuda" and torch.cuda.current_stream(device) != torch.cuda.default_stream(device)


# Under torch.compile the cached index and mask are fetched by two custom ops: opaque to Dynamo
# (which would otherwise trace the caches and specialise on the sizes) and to Inductor (which,
# fusing the index arithmetic into the gathers, fails on symbolic sizes), yet inside the graph, so
# a backbone compiles to one graph with no break (``fullgraph=True``). Their size arguments are
# symbolic: a new input size runs the same graph. Each returns a copy of a cache entry, as a graph
# may reuse the memory of an op's output once it is dead, and the cache must not see that.
@torch.library.custom_op("vtdense::window_attention_mask", mutates_args=())
def _mask_op(H: int, W: int, wh: int, ww: int, sh: int, sw: int, device: torch.device) -> Tensor:
    fresh = _op_fresh(device)
    mask = _fetch(_window_mask_cached, H, W, (wh, ww), (sh, sw), device, fresh=fresh)
    if mask is None:
        mask = _fetch(_no_mask, H, W, (wh, ww), device, fresh=fresh)
    return mask if fresh else mask.clone()  # a fresh one was built for this call


@_mask_op.register_fake
def _(H, W, wh, ww, sh, sw, device):  # type: ignore[no-untyped-def]
    n = ceil_div(H, wh) * ceil_div(W, ww)
    return torch.empty(n, wh * ww, wh * ww, dtype=torch.bool, device=device)


# (the schema spelt out: torch 2.6 cannot read a string return annotation of a tuple)
@torch.library.custom_op("vtdense::window_token_index", mutates_args=(),
                         schema="(SymInt H, SymInt W, SymInt wh, SymInt ww, SymInt sh, SymInt sw, Device device) -> (Tensor, Tensor)")
def _index_op(H: int, W: int, wh: int, ww: int, sh: int, sw: int, device: torch.device) -> tuple[Tensor, Tensor]:
    fresh = _op_fresh(device)
    gather, scatter = _fetch(_token_index_cached, H, W, (wh, ww), (sh, sw), device, fresh=fresh)
    return (gather, scatter) if fresh else (gather.clone(), scatter.clone())


@_index_op.register_fake
def _(H, W, wh, ww, sh, sw, device):  # type: ignore[no-untyped-def]
    padded = padded_length(H, wh) * padded_length(W, ww)
    return (torch.empty(padded, dtype=torch.long, device=device),
            torch.empty(H * W, dtype=torch.long, device=device))


def window_attention_mask(
    H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device | str = "cpu"
) -> Tensor | None:
    """Boolean mask ``(nW, N, N)``, True where a query may not attend to a key, for (shifted)
    window attention on an ``H x W`` map.

    Blocks attention across shift regions (SW-MSA) and to padded keys; callers turn it into the
    additive term with ``torch.where(mask, MASK_VALUE, bias)``. ``None`` when nothing needs
    masking. Cached per (H, W, window, shift, device): built once per feature-map size (but
    built anew while a CUDA graph records, so that no replay reads an evicted cache entry).

    Under ``torch.compile`` the cached mask is fetched by the custom op
    ``vtdense::window_attention_mask`` (symbolic sizes, no graph break: Dynamo neither traces the
    cache nor guards on the sizes), and is never ``None`` (an all-False mask when nothing is
    masked), so a change of size that adds or removes padding needs no new graph.
    ``torch.export`` builds it from tensor ops inside the graph.
    """
    if exporting():  # traced once, at fixed sizes: build it in the graph, never cache traced tensors
        return _window_mask_cached.__wrapped__(int(H), int(W), tuple(window), tuple(shift), torch.device(device))
    if torch.compiler.is_compiling():
        return _mask_op(H, W, *window, *shift, torch.device(device))
    return _fetch(_window_mask_cached, int(H), int(W), tuple(window), tuple(shift), torch.device(device))


def window_token_index(
    H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Index pair that does roll, padding and window partition in one gather, and undoes them.

    Returns:
        ``gather``: ``(nW * N,)`` indices into the ``H * W`` row-major tokens; ``tokens[:, gather]``
        equals ``window_partition(roll(pad_to_window(tokens), -shift))`` flattened over windows,
        except that padded slots hold a copy of token 0 instead of zeros (they must be masked as
        keys with :func:`window_attention_mask`, and their outputs are dropped).
        ``scatter``: ``(H * W,)`` position of each token in that sequence, so
        ``windows[:, scatter]`` is :func:`window_reverse`, roll back and crop in one gather.

    Cached per size like the mask, and fetched by the custom op ``vtdense::window_token_index``
    under ``torch.compile`` (built from tensor ops inside the graph under ``torch.export``).
    """
    if exporting():
        return _token_index_cached.__wrapped__(int(H), int(W), tuple(window), tuple(shift), torch.device(device))
    if torch.compiler.is_compiling():
        return _index_op(H, W, *window, *shift, torch.device(device))
    return _fetch(_token_index_cached, int(H), int(W), tuple(window), tuple(shift), torch.device(device))


@functools.lru_cache(maxsize=64)
def _slot_major_scatter_cached(H: int, W: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device) -> Tensor:
    with torch.inference_mode(False), torch.no_grad():
        _, scatter = _token_index(H, W, window, shift, device)
        n = window[0] * window[1]
        windows = ceil_div(H, window[0]) * ceil_div(W, window[1])
        return (scatter % n) * windows + scatter // n


def slot_major_scatter(H: int, W: int, window: tuple[int, int], shift: tuple[int, int],
                       device: torch.device | str = "cpu") -> Tensor:
    """``(H * W,)``: where each token of an ``H x W`` map sits in the windowed sequence laid out
    slot-major, ``(N, nW)`` (every window's first slot, then every window's second, ...), where
    :func:`window_token_index`'s ``scatter`` gives it in the window-major ``(nW, N)`` order. Rows
    of ``(B, N, nW, C)`` gathered with it along dim 1 are the tokens, rolled back and cropped.

    SDPA's fused CUDA kernels write their output as ``(B, Nq, heads, d)`` in memory; with the
    windows folded into the heads that is slot-major, so a projection of those rows where they
    lie followed by this gather skips the copy into window-major order. Eager code only (cached
    per size as the index pair; built anew where :func:`~vtdense.layers.tracing.fresh_tables`)."""
    return _fetch(_slot_major_scatter_cached, int(H), int(W), tuple(window), tuple(shift), torch.device(device))


def slot_major(t: Tensor) -> bool:
    """Whether ``t``, ``(B, nW, N, C)``, lies in memory as a contiguous ``(B, N, nW, C)`` (and is
    not also contiguous as it is: one window or one slot)."""
    return t.dim() == 4 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous()


def select_tokens(x: Tensor, index: Tensor) -> Tensor:
    """``x[:, index]`` for ``x`` of ``(B, L, C)``: ``(B, len(index), C)``, e.g. with the indices of
    :func:`window_token_index`.

    Eagerly on the CPU it gathers whole rows of one ``(B * L, C)`` matrix (index_select along
    dim 0, a row-by-row copy, about 1.7x faster there than along dim 1). GPUs, and traced graphs
    (compile, export, TorchScript), whose batch dimension stays symbolic, keep ``index_select``
    along dim 1.
    """
    if x.device.type != "cpu" or tracing() or not x.is_contiguous():
        return x.index_select(1, index)
    B, L, C = x.shape
    if B == 1:
        return x.view(L, C).index_select(0, index).unsqueeze(0)
    flat = (torch.arange(B, device=index.device) * L).unsqueeze(1) + index
    return x.view(B * L, C).index_select(0, flat.view(-1)).view(B, -1, C)


# Inside torch.compile the two gathers of a Swin block get backward passes that are gathers as well.
# Autograd's backward of index_select is a scatter-add (index_add into zeros), which Inductor emits as
# atomic adds that fuse with nothing; the two index tables of window_token_index are each other's
# inverse on the real tokens, so each backward can read the other table instead. Eager steps keep
# autograd's: on a GPU they wait on the host, where an autograd function per gather only adds Python,
# and on the CPU the eager training step measured the same either way (1.56-1.63 s against 1.61 s,
# Swin-T at 512x768).


class _TokensToWindows(torch.autograd.Function):
    """``select_tokens(x, gather)``; backward ``select_tokens(grad, scatter)``. Exact because the
    windows' padded slots (copies of token 0) get no gradient: they are masked as keys, so their
    attention weights are 0, and their outputs are dropped by :class:`_WindowsToTokens`.

    Given ``tokens`` (per window), the gather writes ``(B, nW, tokens, C)`` itself, not a view of
    ``(B, nW * tokens, C)``: the windows are saved for the backward, and Inductor lays out a saved
    view by sorting its symbolic strides with sympy alone (``get_stride_order`` without the shape
    environment), which could not order Swin's ``(nW * N * C, N * C, C, 1)`` at batch 2 ("cannot
    determine truth value of Relational"); a tensor of its own keeps its exact strides."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, gather: Tensor, scatter: Tensor, tokens: int | None = None) -> Tensor:
        ctx.save_for_backward(scatter)
        if tokens is None:
            return select_tokens(x, gather)
        return x[:, gather.view(-1, tokens)]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (scatter,) = ctx.saved_tensors
        return select_tokens(grad.flatten(1, 2) if grad.dim() == 4 else grad, scatter), None, None, None


class _WindowsToTokens(torch.autograd.Function):
    """``select_tokens(w, scatter)``; backward ``select_tokens(grad, gather)`` with the padded slots
    zeroed (slot ``s`` is real where ``scatter[gather[s]] == s``)."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, gather: Tensor, scatter: Tensor) -> Tensor:
        ctx.save_for_backward(gather, scatter)
        return select_tokens(w, scatter)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        gather, scatter = ctx.saved_tensors
        padded = scatter.index_select(0, gather) != torch.arange(gather.shape[0], device=gather.device)
        return select_tokens(grad, gather).masked_fill_(padded[:, None], 0), None, None


def _own_backward(x: Tensor) -> bool:
    return torch.compiler.is_compiling() and not exporting() and torch.is_grad_enabled() and x.requires_grad


def tokens_to_windows(x: Tensor, gather: Tensor, scatter: Tensor, tokens: int | None = None) -> Tensor:
    """``(B, H * W, C)`` tokens -> ``(B, nW * N, C)`` windowed sequence with the index pair of
    :func:`window_token_index` (:func:`select_tokens` with ``gather``); given ``tokens`` (``N``, the
    tokens per window), ``(B, nW, N, C)``. Inside ``torch.compile`` (not export) its backward is a
    gather with ``scatter`` instead of autograd's scatter-add."""
    if _own_backward(x):
        return _TokensToWindows.apply(x, gather, scatter, tokens)
    out = select_tokens(x, gather)
    return out if tokens is None else out.view(x.shape[0], -1, tokens, x.shape[2])


def windows_to_tokens(w: Tensor, gather: Tensor, scatter: Tensor) -> Tensor:
    """``(B, nW * N, C)`` windowed sequence -> ``(B, H * W, C)`` tokens: the inverse of
    :func:`tokens_to_windows` (roll back and crop; :func:`select_tokens` with ``scatter``). Inside
    ``torch.compile`` its backward is a gather with ``gather``, padded slots zeroed."""
    if _own_backward(w):
        return _WindowsToTokens.apply(w, gather, scatter)
    return select_tokens(w, scatter)
