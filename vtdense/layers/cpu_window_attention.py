"""Windowed attention for CPU training steps, a chunk of windows at a time, with its own backward.

On the CPU, SDPA cannot take the gradient of an additive term, so a Swin block's training step
falls back to the math path: it copies ``q``, ``k`` and ``v`` to fold windows into heads, adds
the term over the whole batch, keeps several logit-sized tensors for the backward pass, and its
backward stacks the three gradients back into the ``qkv`` layout. Here autograd functions
compute ``softmax(scale * q k^T + term) v`` one image (V2, from its ``qkv``) or one chunk of
windows (V1, norm and ``qkv`` projection included) at a time, with ``baddbmm``, ``softmax`` and
``bmm`` (as CPU inference does, :mod:`vtdense.layers.attention`) on head-major copies of the
chunk's ``q``, ``k``, ``v``. They keep only the attention probabilities (and V1 each chunk's
``qkv``) for the backward pass, which writes the gradient of ``qkv`` (V1: of the block input)
in its own layout and sums the term's gradient over the images. The output is laid out
``(B, nW, N, heads, d)``, so merging the heads into channels is a view.

The values are those of the math path to float rounding (the same operations, chunk by chunk).
Under ``create_graph`` (gradient penalties, Hessian-vector products) the backward recomputes the
attention in differentiable torch ops from the saved inputs instead, so that second derivatives
hold (``tests/test_double_backward.py``); before, such a backward at this path's sizes was refused.
Since 2026-11-28 this path serves every ``qkv`` from 1 MiB (:data:`MIN_BYTES`; 16 MiB before).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vtdense.layers.attention import _math, get_attention_backend
from vtdense.layers.chunked import CHUNK_BYTES, NormLinearGrads, training_chunking_applies, window_slices
from vtdense.layers.cpu_linear import linear

__all__ = ["qkv_window_attention", "norm_qkv_window_attention", "qkv_window_attention_applies"]


def _to_heads(t: Tensor) -> Tensor:
    """``(nW, N, heads, d)`` -> contiguous ``(nW * heads, N, d)``: ``bmm`` runs one batched
    kernel on contiguous batches, but loops matrix by matrix over strided ones (3-5x slower)."""
    nw, n, h, d = t.shape
    return t.transpose(1, 2).reshape(nw * h, n, d)


def _from_heads(t: Tensor, out: Tensor) -> None:
    """Write ``t`` ``(nW * heads, N, d)`` into ``out`` ``(nW, N, heads, d)``."""
    nw, n, h, d = out.shape
    out.copy_(t.view(nw, h, n, d).transpose(1, 2))


def _window_terms(term: Tensor, wins: slice, nw: int) -> Tensor:
    """The term of windows ``wins`` (``nw`` of them) as ``(nw * heads, N, N)``."""
    t = term[wins] if term.dim() == 4 else term.expand(nw, *term.shape)
    return t.reshape(-1, *t.shape[-2:])


def _attend(q: Tensor, k: Tensor, v: Tensor, term: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``q, k, v``: ``(n, N, d)``, ``term``: ``(n, N, N)`` -> (probabilities, output)."""
    p = torch.baddbmm(term, q, k.transpose(1, 2), alpha=scale).softmax(-1)
    return p, torch.bmm(p, v)


def _attend_backward(q: Tensor, k: Tensor, v: Tensor, p: Tensor, go: Tensor, scale: float, need_qk: bool,
                     need_v: bool, need_term: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`_attend` for the output gradient ``go``: ``(dq, dk, dv, dterm)``."""
    dv = torch.bmm(p.transpose(1, 2), go) if need_v else None
    if not (need_qk or need_term):
        return None, None, dv, None
    ds = torch._softmax_backward_data(torch.bmm(go, v.transpose(1, 2)), p, -1, p.dtype)
    dq = dk = None
    if need_qk:
        dq = torch.bmm(ds, k).mul_(scale)
        dk = torch.bmm(ds.transpose(1, 2), q).mul_(scale)
    return dq, dk, dv, ds


def _graph_grads(out: Tensor, inputs: list[Tensor | None], needs: tuple[bool, ...], grad: Tensor) -> list[Tensor | None]:
    """The gradients of ``out`` (for ``grad``) with respect to those ``inputs`` that ``needs`` asks for,
    on the graph: the backward under ``create_graph``, whose result must itself be differentiable."""
    wanted = [t for t, n in zip(inputs, needs) if n and t is not None]
    got = iter(torch.autograd.grad(out, wanted, grad, create_graph=True, allow_unused=True))
    return [next(got) if n and t is not None else None for t, n in zip(inputs, needs)]


def _add_term_grad(g_term: Tensor, ds: Tensor, wins: slice) -> None:
    """Add ``ds`` ``(nw * heads, N, N)`` of windows ``wins`` to ``g_term`` (``(nW, heads, N, N)``,
    or ``(heads, N, N)`` shared by all windows)."""
    if g_term.dim() == 4:
        g_term[wins].view_as(ds).add_(ds)
    else:
        g_term.add_(ds.view(-1, *g_term.shape).sum(0))


class _QkvWindowAttention(torch.autograd.Function):
    """Attention from a given ``qkv`` (or ``qk`` and ``v``), one image at a time."""

    @staticmethod
    def forward(ctx: Any, qk: Tensor, v_src: Tensor | None, term: Tensor, scale: float) -> Tensor:
        B, nW, N, _, h, d = qk.shape
        v_all = qk[:, :, :, 2] if v_src is None else v_src
        terms = _window_terms(term, slice(None), nW)
        out = qk.new_empty(B, nW, N, h, v_all.shape[-1])
        probs = []
        for i in range(B):
            p, o = _attend(_to_heads(qk[i, :, :, 0]), _to_heads(qk[i, :, :, 1]), _to_heads(v_all[i]), terms, scale)
            probs.append(p)
            _from_heads(o, out[i])
        ctx.save_for_backward(qk, v_src, term, *probs)
        ctx.scale, ctx.term_dim = scale, term.dim()
        return out.transpose(2, 3)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        qk, v_src, term, *probs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a differentiable recomputation (second derivatives)
            v = qk[:, :, :, 2] if v_src is None else v_src
            out = _math(qk[:, :, :, 0].transpose(2, 3), qk[:, :, :, 1].transpose(2, 3), v.transpose(2, 3), term,
                        ctx.scale, 0.0)  # (the term broadcasts over (B, nW, heads, N, N))
            return (*_graph_grads(out, [qk, v_src, term], ctx.needs_input_grad[:3], grad), None)
        need_qk, need_v, need_term, _ = ctx.needs_input_grad
        B, nW, N, _, h, d = qk.shape
        split_v = v_src is not None
        v_all = v_src if split_v else qk[:, :, :, 2]
        need_v = need_v if split_v else need_qk
        g_qk = torch.empty_like(qk) if need_qk else None  # every section is written below
        g_v = (torch.empty_like(v_all) if split_v else g_qk[:, :, :, 2]) if need_v else None
        g_term = qk.new_zeros((h, N, N) if ctx.term_dim == 3 else (nW, h, N, N)) if need_term else None
        grad = grad.transpose(2, 3)  # (B, nW, N, heads, dv), the layout of the output
        for i, p in enumerate(probs):
            dq, dk, dv, ds = _attend_backward(_to_heads(qk[i, :, :, 0]), _to_heads(qk[i, :, :, 1]), _to_heads(v_all[i]), p,
                                              _to_heads(grad[i]), ctx.scale, need_qk, need_v, need_term)
            if need_v:
                _from_heads(dv, g_v[i])
            if need_qk:
                _from_heads(dq, g_qk[i, :, :, 0])
                _from_heads(dk, g_qk[i, :, :, 1])
            if need_term:
                _add_term_grad(g_term, ds, slice(None))
        return g_qk, g_v if split_v else None, g_term, None


class _NormQkvWindowAttention(torch.autograd.Function):
    """Swin V1's attention branch up to the output projection: ``layer_norm``, the ``qkv``
    projection and attention, over chunks of windows (:func:`~vtdense.layers.chunked.window_slices`).
    Each chunk's ``qkv`` is kept head-major, ``(3, images, windows * heads, N, d)``, with the
    probabilities and the input; no ``qkv``-sized tensor of the whole batch (nor its gradient)
    is ever made."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, w: Tensor,
                b: Tensor | None, term: Tensor, scale: float, heads: int, budget: int) -> Tensor:
        B, nW, N, C = x.shape
        d = w.shape[0] // 3 // heads
        out = x.new_empty(B, nW, N, heads, d)
        chunks = window_slices(B, nW, N, w.shape[0] * x.element_size(), budget)
        qkvs: list[Tensor] = []
        probs: list[Tensor] = []
        for imgs, wins in chunks:
            xc = x[imgs, wins]
            nb, nw = xc.shape[:2]
            qkv = linear(F.layer_norm(xc, (C,), norm_w, norm_b, eps), w, b).view(nb, nw, N, 3, heads, d)
            qkv = qkv.permute(3, 0, 1, 4, 2, 5).reshape(3, nb, nw * heads, N, d)  # head-major: one copy
            qkvs.append(qkv)
            terms = _window_terms(term, wins, nw)
            oc = out[imgs, wins]
            for i in range(nb):
                p, o = _attend(qkv[0, i], qkv[1, i], qkv[2, i], terms, scale)
                probs.append(p)
                _from_heads(o, oc[i])
        ctx.save_for_backward(x, norm_w, norm_b, w, b, term, *qkvs, *probs)
        ctx.chunks, ctx.n_chunks, ctx.eps, ctx.scale, ctx.term_dim = chunks, len(qkvs), eps, scale, term.dim()
        ctx.heads, ctx.has_b = heads, b is not None
        return out.transpose(2, 3)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, norm_w, norm_b, w, b, term, *rest = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a differentiable recomputation (second derivatives)
            B, nW, N, C = x.shape
            qkv = F.linear(F.layer_norm(x, (C,), norm_w, norm_b, ctx.eps), w, b).view(B, nW, N, 3, ctx.heads, -1)
            out = _math(*qkv.permute(3, 0, 1, 4, 2, 5).unbind(0), term, ctx.scale, 0.0)
            needs = ctx.needs_input_grad
            return (*_graph_grads(out, [x, norm_w, norm_b, None, w, b, term], needs[:7], grad), None, None, None)
        qkvs, probs = rest[:ctx.n_chunks], rest[ctx.n_chunks:]
        need_x, need_nw, need_nb, _, need_w, need_b, need_term = ctx.needs_input_grad[:7]
        B, nW, N, C = x.shape
        h = ctx.heads
        proj = NormLinearGrads(norm_w, norm_b, ctx.eps, True, w, ctx.has_b, (need_x, need_nw, need_nb, need_w, need_b))
        need_qkv = proj.needed
        g_term = x.new_zeros((h, N, N) if ctx.term_dim == 3 else (nW, h, N, N)) if need_term else None
        g_x = torch.empty_like(x) if need_x else None
        grad = grad.transpose(2, 3)  # (B, nW, N, heads, d), the layout of the output
        n = 0
        for (imgs, wins), qkv in zip(ctx.chunks, qkvs):
            g_qkv = torch.empty_like(qkv) if need_qkv else None
            gc = grad[imgs, wins]
            nb, nw = gc.shape[:2]
            for i in range(nb):
                dq, dk, dv, ds = _attend_backward(qkv[0, i], qkv[1, i], qkv[2, i], probs[n], _to_heads(gc[i]), ctx.scale,
                                                  need_qkv, need_qkv, need_term)
                n += 1
                if need_qkv:
                    g_qkv[0, i], g_qkv[1, i], g_qkv[2, i] = dq, dk, dv
                if need_term:
                    _add_term_grad(g_term, ds, wins)
            if need_qkv:
                g2 = g_qkv.view(3, nb, nw, h, N, -1).permute(1, 2, 4, 0, 3, 5).reshape(nb * nw * N, 3 * C)
                proj.add(g2, x[imgs, wins].reshape(-1, C), g_x[imgs, wins].view(-1, C) if need_x else None)
        g_nw, g_nb, g_w, g_b = proj.grads
        return g_x, g_nw, g_nb, None, g_w, g_b, g_term, None, None, None


#: Smallest ``qkv`` (bytes) whose attention takes these functions in a CPU training step. SDPA's math
#: path, the alternative, also scales ``q`` and ``k`` apart, adds the term over the whole batch,
#: checks every row for being wholly masked (``_safe_softmax``: a comparison, a reduction and a
#: ``where`` over the logits) and keeps more for the backward. Swin-T's training step at batch 2
#: and 512x768 on a 2-core Zen 4 host, alternating in one process: 3482 -> 3370 ms (7 rounds) with
#: the late stages here too (their ``qkv`` of 7-14 MiB was under the 16 MiB threshold of the chunked
#: MLP, which they had shared); SwinV2-T 3528 -> 3483 ms. Under 1 MiB (toy models) the two paths
#: differ by microseconds, and SDPA's math path is what compiled graphs trace, so eager and
#: ``compile_backbone``'s ``eager`` backend keep computing the same bits there.
MIN_BYTES = 1 << 20


def qkv_window_attention_applies(qk: Tensor, dropout: float, nbytes: int | None = None) -> bool:
    """Whether :func:`qkv_window_attention` (or :func:`norm_qkv_window_attention`) serves this
    call on ``qk``, the ``qkv`` projection (or its input): a CPU step with gradients, outside
    autocast and graph capture, with a ``qkv`` of at least :data:`MIN_BYTES` (``nbytes``, default
    ``qk``'s size), without attention dropout, on the default (``"sdpa"``) backend."""
    if dropout or get_attention_backend() != "sdpa":
        return False
    return training_chunking_applies(qk, qk.numel() * qk.element_size() if nbytes is None else nbytes, MIN_BYTES)


def qkv_window_attention(qk: Tensor, term: Tensor, scale: float, v: Tensor | None = None) -> Tensor:
    """``softmax(scale * q k^T + term) v`` per window and head, for CPU training steps.

    Args:
        qk: ``(B, nW, N, 3, heads, d)``, the ``qkv`` projection (``q, k, v`` at index 0, 1, 2 of
            dim 3), or ``(B, nW, N, 2, heads, d)`` with ``v`` given apart.
        term: additive term ``(heads, N, N)`` or ``(nW, heads, N, N)``; its gradient is summed
            over the images (and the windows for a shared one).
        scale: logit scale.
        v: ``(B, nW, N, heads, dv)`` when ``qk`` holds only ``q`` and ``k``.

    Returns:
        ``(B, nW, heads, N, dv)``, laid out as ``(B, nW, N, heads, dv)``.
    """
    return _QkvWindowAttention.apply(qk, v, term, scale)


def norm_qkv_window_attention(x: Tensor, norm: torch.nn.LayerNorm, qkv: torch.nn.Linear, term: Tensor, scale: float,
                              heads: int, budget: int | None = None) -> Tensor:
    """Swin V1's ``attention(qkv(norm(x)))`` per window and head, for CPU training steps, over
    chunks of windows of about ``budget`` bytes of ``qkv`` (default
    :data:`~vtdense.layers.chunked.CHUNK_BYTES`): the ``qkv`` projection of the whole batch and its
    gradient are never made whole.

    Args:
        x: ``(B, nW, N, C)`` tokens grouped by window.
        norm: the pre-norm (a LayerNorm over ``C``).
        qkv: the ``C -> 3C`` projection.
        term: additive term ``(heads, N, N)`` or ``(nW, heads, N, N)``.
        scale: logit scale.
        heads: attention heads.

    Returns:
        ``(B, nW, heads, N, C // heads)``, laid out as ``(B, nW, N, heads, C // heads)``.
    """
    return _NormQkvWindowAttention.apply(x, norm.weight, norm.bias, norm.eps, qkv.weight, qkv.bias, term, scale, heads,
                                         CHUNK_BYTES if budget is None else budget)
