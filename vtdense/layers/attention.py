"""The one attention kernel of vtdense: softmax attention with one additive term.

Swin V1, Swin V2 and MViTv2 differ only in what they feed it (a bias table, Log-CPB with
cosine logits, or decomposed relative positions, each with the shift/padding mask folded in).

Three interchangeable paths compute it (same outputs to float rounding):

- ``"sdpa"`` (default): ``F.scaled_dot_product_attention`` with the term as ``attn_mask`` in the
  query's dtype. On a GPU that reaches the memory-efficient kernel; on the CPU its flash kernel.
- ``"flex"``: PyTorch's FlexAttention, the term read by a ``score_mod`` (nothing is expanded over
  the batch). Meant for GPUs under ``torch.compile``; without compile it runs PyTorch's reference
  implementation (slow, but exact), which the tests use.
- ``"math"``: explicit ``softmax(q k^T * scale + term) v``; the reference and CPU fallback.

Windowed callers pass ``q, k, v`` as ``(B, nW, heads, N, d)`` and a per-window term
``(nW, heads, N, N)``. The windows are then folded into the head dimension, ``(B, nW*heads, N, d)``,
so the term is one ``(1, nW*heads, N, N)`` tensor that broadcasts over the batch without a copy.
CPU inference (no gradient, not traced) instead runs such calls image by image, reading the term
and the strided ``q, k, v`` in place (``baddbmm`` + softmax + ``bmm`` without autocast).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vtdense.layers.chunked import functorch_transform, tracing, window_slices
from vtdense.layers.scoped import scoped_setting
from vtdense.layers.tracing import exporting

__all__ = [
    "attention", "set_attention_backend", "attention_backend", "get_attention_backend", "flex_available",
    "aligned_term", "folds_windows", "gpu_layout", "pads_term_rows", "TERM_ALIGN",
]

_BACKENDS = ("sdpa", "flex", "math")
_backend = "sdpa"
#: fold per-window terms into the heads (else expand the term over the batch); see attention()
_FOLD_WINDOWS = True


#: SDPA's memory-efficient CUDA kernel reads an additive term in place only when every stride but
#: the last is a multiple of this many elements; it pads (copies) any other term in every call.
TERM_ALIGN = 16


#: tests set this to lay attention's inputs out as on a GPU on the CPU too, to check those layouts' values
_GPU_LAYOUT_ON_CPU = False


def gpu_layout(device: torch.device) -> bool:
    """Whether attention's inputs on ``device`` are laid out for SDPA's fused GPU kernels: terms
    with rows padded to :data:`TERM_ALIGN` entries, Swin V2's scaled q and k written heads-first
    in the compute dtype. Off the CPU (whose kernels read any strides), or where a test forces it."""
    return device.type != "cpu" or _GPU_LAYOUT_ON_CPU


def pads_term_rows(device: torch.device) -> bool:
    """Whether additive terms on ``device`` are built with rows padded to :data:`TERM_ALIGN`
    entries (:func:`gpu_layout`)."""
    return gpu_layout(device)


def aligned_term(shape: tuple[int, ...], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised additive term of ``shape`` (``(..., Nq, Nk)``) to fill in place for
    :func:`attention`, on ``like``'s device, in ``dtype`` (default ``like``'s).

    On a GPU it is a view into a buffer whose rows are padded to :data:`TERM_ALIGN` entries, so
    SDPA's memory-efficient kernel reads it where it lies; on the CPU a contiguous tensor."""
    dtype = like.dtype if dtype is None else dtype
    nk = shape[-1]
    if not pads_term_rows(like.device) or not nk % TERM_ALIGN:
        return like.new_empty(shape, dtype=dtype)
    return like.new_empty((*shape[:-1], nk + (-nk % TERM_ALIGN)), dtype=dtype)[..., :nk]


def folds_windows(term: Tensor, q_dim: int) -> bool:
    """Whether :func:`attention` folds the windows of ``q`` (``q_dim`` dims, ``(B, nW, heads, N,
    d)``) into its heads for ``term``: a per-window term, ``(nW, heads, N, N)`` with ``nW > 1``.
    ``q``, ``k`` and ``v`` are then copied to ``(B, nW * heads, N, d)`` unless they are laid out so
    already."""
    return _FOLD_WINDOWS and term.dim() == 4 < q_dim and term.shape[0] > 1


def flex_available() -> bool:
    """Whether this torch has FlexAttention (``torch.nn.attention.flex_attention``)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def set_attention_backend(name: str) -> None:
    """Choose the attention path for every vtdense model: ``"sdpa"``, ``"flex"`` or ``"math"``."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    if name == "flex" and not flex_available():
        raise ValueError(f"attention backend 'flex' needs torch.nn.attention.flex_attention, which torch {torch.__version__} lacks")
    _backend = name


def get_attention_backend() -> str:
    """The attention path in use (see :func:`set_attention_backend`)."""
    return _backend


def attention_backend(name: str) -> contextlib.AbstractContextManager[None]:
    """Context manager form of :func:`set_attention_backend`."""
    return scoped_setting(get_attention_backend, set_attention_backend, name)


def _math(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None, scale: float, dropout: float) -> Tensor:
    attn = torch.matmul(q * scale, k.transpose(-2, -1))
    if term is not None:
        attn = attn + term
    attn = attn.softmax(dim=-1)
    if dropout:
        attn = F.dropout(attn, p=dropout)
    return torch.matmul(attn, v)


#: profiler label of the CPU inference path that runs windows as batched matmuls (not SDPA)
BMM_LABEL = "vtdense::window_attention_bmm"

_flex_compiled = None


def _flex_kernel(device: torch.device):  # noqa: ANN202
    """FlexAttention compiled into a fused kernel on GPUs (once per process); the reference
    implementation elsewhere, and inside a graph torch.compile is already tracing."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu" or torch.compiler.is_compiling():
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=True)
    return _flex_compiled


def _flex(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None, scale: float, dropout: float) -> Tensor:
    flex_attention = _flex_kernel(q.device)

    if dropout:
        raise ValueError("the 'flex' attention backend has no attention dropout; use 'sdpa' or 'math' to train with attn_drop")
    if term is None:
        return flex_attention(q, k, v, scale=scale)
    # term: (1 or B, H, Nq, Nk); a term shared by the batch is read for every image. Tensor indices
    # only: torch 2.7 and 2.9 cannot trace an int mixed with them there (a data-dependent error).
    if term.shape[0] == 1:
        shared = term[0]

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + shared[h, q_idx, kv_idx]
    else:
        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + term[b, h, q_idx, kv_idx]

    return flex_attention(q, k, v, score_mod=score_mod, scale=scale)


def _term_dtype(q: Tensor, backend: str) -> torch.dtype:
    """The dtype the additive term is built in: SDPA under autocast runs in autocast's dtype and
    would cast a ``q``-dtype (fp32) term down again, so the term goes straight to that dtype (a
    bf16 term from a bf16 matmul is then not copied at all); otherwise ``q``'s dtype."""
    dev = q.device.type
    if backend == "sdpa" and dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) and q.dtype == torch.float32:
        return torch.get_autocast_dtype(dev)
    return q.dtype


def _image_by_image(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """CPU inference on windows, ``q`` of ``(B, nW, heads, N, d)`` with a term shared by the
    images, ``(heads, N, N)`` or ``(nW, heads, N, N)``: attention runs image by image (see
    :func:`_attention_image_by_image`)."""
    if q.device.type != "cpu" or q.dim() != 5 or not (mask.dim() == 3 or (mask.dim() == 4 and mask.shape[0] == q.shape[1])):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or mask.requires_grad):
        return False
    return not tracing()


def _attention_image_by_image(q: Tensor, k: Tensor, v: Tensor, term: Tensor, scale: float) -> Tensor:
    """``q``: ``(B, nW, heads, N, d)``, ``term``: ``(heads, N, N)`` or ``(nW, heads, N, N)``.

    One image at a time, so the term is read in place for every image (no copy of it per image,
    and no copy of ``q``, ``k``, ``v`` to fold windows into heads). Without autocast, each image
    is ``softmax(baddbmm(term, q, k^T)) v`` over its ``nW * heads`` small matrices: on the CPU
    that is 25-30% faster than SDPA's flash kernel at Swin's 49- or 64-token windows. A large
    image is attended in runs of windows of about :data:`~vtdense.layers.chunked.CHUNK_BYTES`, so
    that each run's copies of ``q``, ``k``, ``v`` and its logits stay in cache (the chunked eager
    blocks pass one run already; a compiled graph passes whole images). Under autocast SDPA runs
    per image. The result is ``(B, nW, heads, N,
    dv)`` laid out as ``(B, nW, N, heads, dv)``, so merging the heads back into channels is a view.
    """
    B, nW, h, nq, d = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    if term.dim() == 3:
        term = term.expand(nW, h, nq, nk)
    plain = not torch.is_autocast_enabled("cpu") and q.dtype == k.dtype == v.dtype == term.dtype
    term3 = term.reshape(nW * h, nq, nk) if plain else None
    if not plain:
        out = None
        for i in range(B):
            o = F.scaled_dot_product_attention(q[i], k[i], v[i], attn_mask=term, scale=scale)
            if out is None:
                out = o.new_empty(B, nW, nq, h, dv)  # autocast's dtype
            out[i].copy_(o.transpose(1, 2))
        return out.transpose(2, 3)
    out = q.new_empty(B, nW, nq, h, dv)
    # runs of windows whose q, k, v copies and logits stay in cache (one run when the image fits)
    per_window = h * (nq * d + nk * (d + dv) + nq * nk) * q.element_size()
    runs = [w for _, w in window_slices(1, nW, nq, max(per_window // nq, 1))]
    with torch.profiler.record_function(BMM_LABEL):
        for i in range(B):
            for w in runs:
                n = w.stop - w.start
                logits = torch.baddbmm(term3[w.start * h:w.stop * h], q[i, w].reshape(-1, nq, d),
                                       k[i, w].reshape(-1, nk, d).transpose(1, 2), alpha=scale)
                o = torch.bmm(logits.softmax(-1), v[i, w].reshape(-1, nk, dv)).view(n, h, nq, dv)
                out[i, w].copy_(o.transpose(1, 2))
    return out.transpose(2, 3)


def _compiled_image_by_image(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """Inside ``torch.compile`` (not ``torch.export``): the case :func:`_image_by_image` serves
    eagerly, in float32 without autocast. The graph then calls that same path as the opaque op
    ``vtdense::window_attention_cpu`` rather than SDPA's CPU flash kernel, which measured slower at
    window sizes (and compiled code then computes what eager code does)."""
    if not torch.compiler.is_compiling() or exporting():
        return False
    if q.device.type != "cpu" or q.dim() != 5 or not (q.dtype == k.dtype == v.dtype == torch.float32):
        return False
    if mask.dim() != 3 and not (mask.dim() == 4 and mask.shape[0] == q.shape[1]):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or mask.requires_grad):
        return False
    return not torch.is_autocast_enabled("cpu")


@torch.library.custom_op("vtdense::window_attention_cpu", mutates_args=())
def _op_window_attention(q: Tensor, k: Tensor, v: Tensor, term: Tensor, scale: float) -> Tensor:
    return _attention_image_by_image(q, k, v, term, scale)


@_op_window_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, term: Tensor, scale: float) -> Tensor:
    B, nW, h, nq, _ = q.shape
    return q.new_empty(B, nW, nq, h, v.shape[-1]).transpose(2, 3)  # the layout the eager path returns


def _window_attention_flops(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    n = 1
    for dim in q_shape[:-1]:
        n *= dim
    return 2 * n * k_shape[-2] * (q_shape[-1] + v_shape[-1])


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if torch.ops.vtdense.window_attention_cpu not in flop_registry:
        register_flop_formula(torch.ops.vtdense.window_attention_cpu)(_window_attention_flops)


_register_flops()


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    backend: str | None = None,
) -> Tensor:
    """Multi-head attention over the last two dims.

    Args:
        q: ``(..., heads, Nq, d)``; ``k``, ``v``: ``(..., heads, Nk, d)``. For windowed attention
            the leading dims are ``(B, nW)``.
        mask: additive term, cast to ``q``'s dtype (to autocast's for SDPA under autocast):
            ``(heads, Nq, Nk)`` shared by all leading
            dims; ``(nW, heads, Nq, Nk)`` per window (the last leading dim) shared over the batch;
            or ``(..., heads, Nq, Nk)`` with q's leading dims (size-1 dims broadcast).
        scale: logit scale; ``None`` means ``d ** -0.5``.
        dropout: dropout on the attention weights (pass 0 in eval).
        backend: ``"sdpa"``, ``"flex"`` or ``"math"``; ``None``: :func:`get_attention_backend`.

    Returns:
        ``(..., heads, Nq, d)``.
    """
    backend = backend or _backend
    if backend == "sdpa" and mask is not None and functorch_transform():
        backend = "math"  # vmap's SDPA rule may pick a fused kernel that takes no gradient for the term
    lead = q.shape[:-3]
    h, nq, d = q.shape[-3:]
    nk = k.shape[-2]
    scale = d**-0.5 if scale is None else scale
    dtype = _term_dtype(q, backend)
    # (not with dropout: in training without a gradient, e.g. frozen weights, it still applies)
    if backend == "sdpa" and mask is not None and not dropout and _image_by_image(q, k, v, mask):
        return _attention_image_by_image(q, k, v, mask.to(dtype), scale)
    if backend == "sdpa" and mask is not None and not dropout and _compiled_image_by_image(q, k, v, mask):
        return torch.ops.vtdense.window_attention_cpu(q, k, v, mask.to(dtype), float(scale))
    if mask is not None and folds_windows(mask, q.dim()):
        # Per-window term: fold the windows into the heads, (B, nW*h, N, d), so the term is one
        # (1, nW*h, N, N) tensor broadcast over the batch (no copy of it per image).
        nw = mask.shape[0]
        if lead[-1] != nw:
            raise ValueError(f"a per-window mask of {nw} windows needs q of (..., {nw}, heads, N, d), got {tuple(q.shape)}")
        h_all = nw * h
        term = mask.to(dtype).reshape(1, h_all, nq, nk)
    else:
        h_all = h
        if mask is None:
            term = None
        elif mask.dim() == q.dim() or mask.dim() == 4 < q.dim():  # a term per leading index, or per window
            term = mask.to(dtype).expand(*lead, h, nq, nk).reshape(-1, h, nq, nk)
        else:
            term = mask.to(dtype).reshape(1, h, nq, nk)
    q4 = q.reshape(-1, h_all, nq, d)
    k4 = k.reshape(-1, h_all, nk, k.shape[-1])
    v4 = v.reshape(-1, h_all, nk, v.shape[-1])
    if backend == "sdpa":
        # (symbolic_shapes, imported by torch.compile, is read here and not imported with vtdense: sympy takes 0.5 s)
        if (term is not None and torch.compiler.is_compiling()
                and torch.fx.experimental.symbolic_shapes.statically_known_true(term.shape[0] == 1)):
            # A term shared by the batch, expanded to it (a view): compiled graphs trace the batch as
            # an unbacked size, and SDPA's own decomposition (traced again for a block region reused
            # by a later block, e.g. under autocast) asks whether that size is 1 to broadcast a term
            # of 1, which cannot be answered for an unbacked size. (A term per image, of a symbolic
            # first size, is left as it is.)
            term = term.expand(q4.shape[0], -1, -1, -1)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=term, dropout_p=dropout, scale=scale)
    elif backend == "math":
        out = _math(q4, k4, v4, term, scale, dropout)
    elif backend == "flex":
        out = _flex(q4, k4, v4, term, scale, dropout)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(_BACKENDS)}")
    return out.reshape(*lead, h, nq, v.shape[-1])
