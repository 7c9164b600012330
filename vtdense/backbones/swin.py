"""Swin Transformer V1 and V2 as dense-prediction backbones.

- V1: "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows",
  Liu et al., ICCV 2021 (https://arxiv.org/abs/2103.14030).
- V2: "Swin Transformer V2: Scaling Up Capacity and Resolution", Liu et al., CVPR 2022
  (https://arxiv.org/abs/2111.09883).

One family: V2 is V1 with residual post-norm, scaled cosine attention, a log-spaced continuous
position bias (Log-CPB), q/v biases without a k bias, and patch merging that reduces then norms.

Any input size works: the image is padded to the patch size, odd maps are padded before patch
merging, windows shrink to maps smaller than them (and drop the shift), and maps that are not
window multiples are padded with the padded tokens masked out as keys. Parameter names follow
timm's, so timm checkpoints load without renaming.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.backbones.base import Backbone, cpu_channels_last, run_blocks
from vtdense.backbones.registry import register_config
from vtdense.layers.autocast import autocast_params
from vtdense.layers.attention import TERM_ALIGN, aligned_term, attention, folds_windows, gpu_layout, pads_term_rows
from vtdense.layers.chunked import chunking_applies, functorch_transform, window_slices
from vtdense.layers.opaque_conv import patch_conv
from vtdense.layers.tracing import fresh_tables, tracing
from vtdense.layers.cpu_window_attention import (
    norm_qkv_window_attention,
    qkv_window_attention,
    qkv_window_attention_applies,
)
from vtdense.layers.drop import DropPath, residual
from vtdense.layers.fused_norm import float_layer_norm
from vtdense.layers.cpu_linear import apply_linear, linear, packed_weights
from vtdense.layers.mlp import Mlp, norm_linear
from vtdense.layers.plain import plain_layer_norm, plain_linear
from vtdense.layers.position import log_cpb_coords, log_spaced_coords, relative_position_index
from vtdense.layers import triton_window_attention as triton_attention
from vtdense.layers.windows import (
    ceil_div,
    effective_window,
    mask_value,
    pad_to_window,
    padded_length,
    select_tokens,
    slot_major,
    slot_major_scatter,
    tokens_to_windows,
    to_2tuple,
    window_attention_mask,
    window_token_index,
    windows_to_tokens,
)

__all__ = ["WindowAttention", "SwinBlock", "PatchMerging", "SwinTransformer", "log_cpb_windows"]


def _logit_scale_max() -> float:
    # a literal inside graphs: a module-level float becomes a graph input under
    # torch.compile(dynamic=True), which breaks checkpointed blocks (see windows.mask_value)
    return math.log(100.0)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside (shifted) windows with a relative position bias.

    Args:
        dim: channels.
        num_heads: attention heads.
        window_size: nominal window ``(h, w)``; the position table is made for it.
        cosine: Swin V2 scaled cosine attention with Log-CPB (otherwise V1's bias table).
        pretrained_window_size: V2 only; window the Log-CPB coordinates are normalised by
            (0 = the window in use), to fine-tune at a larger window than pre-training.
        qkv_bias: learn q/k/v biases (V2: q and v only).
        attn_drop: dropout on attention weights.
        proj_drop: dropout after the output projection.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: tuple[int, int],
        *,
        cosine: bool = False,
        pretrained_window_size: tuple[int, int] = (0, 0),
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim, self.num_heads, self.window_size, self.cosine = dim, num_heads, window_size, cosine
        self.attn_drop = attn_drop
        table_rows = (2 * window_size[0] - 1) * (2 * window_size[1] - 1)
        if cosine:
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.q_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
            self.v_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
            self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), math.log(10.0)))
            self.cpb_mlp = nn.Sequential(
                nn.Linear(2, 512, bias=True), nn.ReLU(inplace=True), nn.Linear(512, num_heads, bias=False)
            )
            self.pretrained_window_size = tuple(pretrained_window_size)
            self.register_buffer(
                "relative_coords_table",
                log_spaced_coords(window_size, self.pretrained_window_size if self.pretrained_window_size[0] > 0 else window_size),
                persistent=False,
            )
        else:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
            self.relative_position_bias_table = nn.Parameter(torch.zeros(table_rows, num_heads))
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self._bias_cache: dict[tuple, tuple[tuple, Tensor, tuple[Tensor, ...] | None]] = {}

    def position_bias(self, window: tuple[int, int]) -> Tensor:
        """``(heads, N, N)`` bias for a window no larger than the nominal one.

        V1 reads the sub-block of its table. V2 follows timm and the official code exactly: the
        Log-CPB coordinates are those of the window in use (shrunk to a small map), normalised by
        ``pretrained_window_size`` if given, else by that window, per axis.
        """
        window = tuple(window)
        if self.cosine:
            coords = self.relative_coords_table
            if window != tuple(self.window_size):
                # the cached coordinates are float32: follow the buffer's dtype (.double(), .half())
                coords = log_cpb_coords(window, self.pretrained_window_size, coords.device).to(coords.dtype)
            table = 16 * torch.sigmoid(self.cpb_mlp(coords))
            table_window = window
        else:
            table = self.relative_position_bias_table
            table_window = self.window_size
        idx = relative_position_index(window, table_window, table.device)
        n = window[0] * window[1]
        # gathered head-major, so the bias and the terms built from it are contiguous (h, N, N) and the
        # attention's reshapes of them are views, not copies. One head: a view, not a transpose, so the
        # table's gradient has the table's strides (DDP warns of a transposed (rows, 1) gradient).
        heads_first = table.view(1, -1) if table.shape[1] == 1 else table.t()
        return heads_first.index_select(1, idx.view(-1)).view(-1, n, n)

    def _bias_params(self) -> list[Tensor]:
        return list(self.cpb_mlp.parameters()) if self.cosine else [self.relative_position_bias_table]

    def cached_position_bias(self, window: tuple[int, int], dtype: torch.dtype, padded: bool = True) -> Tensor:
        """:meth:`position_bias` in ``dtype``; when no gradient can flow to it (eval, frozen
        weights) it is cached per (window, dtype) until the weights change, so Swin V2's
        Log-CPB MLP runs once, not in every forward. On a GPU its rows are padded to 16 entries,
        the alignment SDPA's memory-efficient kernel reads without a copy (``padded=False``: not
        for a bias made for this call, which the caller pads itself)."""
        params = self._bias_params()
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        # never cache traced or functorch-wrapped tensors, nor read the cache while a CUDA graph records;
        # nor for weights made under torch.inference_mode: they have no version counter to stamp
        if grad or fresh_tables(params[0].device) or any(p.is_inference() for p in params):
            bias = self.position_bias(window).to(dtype)
            return _pad_rows(bias) if padded else bias
        key = (window, dtype)
        stamp = tuple((p._version, p.data_ptr()) for p in params)
        hit = self._bias_cache.get(key)
        if hit is not None and hit[0] == stamp and _same_values(hit[2], params):
            return hit[1]
        with torch.no_grad():
            value = _pad_rows(self.position_bias(window).to(dtype))
            # On the CPU also a copy of the (small) parameters: an edit through ``.data`` bumps no
            # version counter. (On a GPU comparing would wait for the device in every block.)
            copies = tuple(p.detach().clone() for p in params) if all(p.device.type == "cpu" for p in params) else None
        if len(self._bias_cache) >= 8:
            self._bias_cache.clear()
        self._bias_cache[key] = (stamp, value, copies)
        return value

    def attn_term(self, window: tuple[int, int], mask: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The additive attention term: ``(heads, N, N)`` bias, or ``(nW, heads, N, N)`` with the
        shift/padding ``mask`` (True = blocked) folded in as :data:`MASK_VALUE`."""
        bias = self.cached_position_bias(window, dtype, padded=mask is None)
        if mask is None:
            return bias
        n = bias.shape[-1]
        if not pads_term_rows(device) or not n % TERM_ALIGN or functorch_transform():
            return torch.where(mask[:, None], mask_value(), bias)
        # On a GPU, written straight into a row-padded term (see aligned_term), with or without
        # autograd: no padded copies of the mask and the bias. (Not where(out=): it takes no Python
        # scalar, would copy a CPU one to the GPU in every call, and has no autograd.)
        term = aligned_term((mask.shape[0], *bias.shape), bias)
        return term.copy_(bias).masked_fill_(mask[:, None], mask_value())

    def forward(
        self, x: Tensor, window: tuple[int, int], mask: Tensor | None = None, norm: nn.Module | None = None,
        term: Tensor | None = None,
    ) -> Tensor:
        """Attend within windows.

        Args:
            x: ``(B, nW, N, C)`` tokens grouped by window.
            window: the window ``(h, w)`` in use (``N = h * w``).
            mask: boolean ``(nW, N, N)`` shift/padding mask (True = blocked) or ``None``.
            norm: V1's pre-norm, applied to ``x`` first (fused with the qkv projection).
            term: the additive term of these windows, from :meth:`attn_term` (then ``mask`` is
                not used): ``(heads, N, N)`` or ``(nW, heads, N, N)``.

        Returns:
            ``(B, nW, N, C)``. Where SDPA's fused kernels wrote the attention slot-major (on a GPU,
            with the windows folded into the heads), a view of a contiguous ``(B, N, nW, C)``
            tensor (:func:`~vtdense.layers.windows.slot_major`), the projection having run on
            those rows where they lay.
        """
        B, nW, N, C = x.shape
        h = self.num_heads
        dropout = self.attn_drop if self.training else 0.0
        # CUDA training, when switched on: the attention in Triton kernels (see the module)
        triton_attn = (term is None and (mask is None or mask.dtype == torch.bool)
                       and triton_attention.triton_window_attention_applies(x, N, C // h, dropout))
        if (not triton_attn and norm is not None and not self.cosine and plain_layer_norm(norm) and plain_linear(self.qkv)
                and qkv_window_attention_applies(x, dropout, 3 * x.numel() * x.element_size())):
            # CPU training: norm, qkv and attention over chunks of windows (see its module)
            if term is None:
                term = self.attn_term(window, mask, x.dtype, x.device)
            out = norm_qkv_window_attention(x, norm, self.qkv, term, (C // h) ** -0.5, h)
            return self.proj_drop(apply_linear(self.proj, out.transpose(2, 3).reshape(B, nW, N, C)))
        if self.cosine and self.q_bias is not None:
            bias = torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
            xn = norm(x) if norm is not None else x
            if plain_linear(self.qkv):  # (inference under autocast: the weight's cast copy is kept across forwards)
                qkv = linear(xn, autocast_params(self.qkv.weight, None)[0], bias)
            else:
                qkv = self.qkv(xn) + bias
        elif norm is not None:
            qkv = norm_linear(x, norm, self.qkv)
        else:
            qkv = apply_linear(self.qkv, x)
        if triton_attn and qkv.requires_grad and triton_attention.takes_dtype(qkv.dtype):
            scale, logit = (1.0, self.logit_scale) if self.cosine else ((C // h) ** -0.5, None)
            out = triton_attention.window_attention(qkv, self.position_bias(window), mask, scale, h, logit,
                                                    _logit_scale_max())
            if out is not None:  # (None: the kernel failed here, and said so once)
                return self.proj_drop(apply_linear(self.proj, out))
        qkv = qkv.view(B, nW, N, 3, h, C // h)
        if term is None:
            term = self.attn_term(window, mask, qkv.dtype, x.device)
        own_backward = qkv_window_attention_applies(qkv, dropout)  # CPU training (see its module)
        if self.cosine:
            # Scaled cosine attention, fused: one pass scales q by logit_scale / |q| and k by 1 / |k|.
            qk = qkv[:, :, :, :2]
            inv = torch.linalg.vector_norm(qk, dim=-1, keepdim=True).clamp_min(1e-12).reciprocal()
            scale = torch.clamp(self.logit_scale, max=_logit_scale_max()).exp().view(1, h, 1)
            factor = inv * torch.cat((scale, torch.ones_like(scale))).to(inv.dtype)
            if own_backward:
                out = qkv_window_attention(qk * factor, term, 1.0, v=qkv[:, :, :, 2])
            else:
                q, k = _scaled_heads_first(qk, factor, term).unbind(0)
                v = _heads_first(qkv[:, :, :, 2:], term)[0]  # copied now, as attention would, when windows fold
                qkv = qk = None  # then nothing holds the projection any more
                out = attention(q, k, v, term, scale=1.0, dropout=dropout)
        elif own_backward:
            out = qkv_window_attention(qkv, term, (C // h) ** -0.5)
        else:
            q, k, v = _heads_first(qkv, term).unbind(0)
            qkv = None  # a copy was made when the windows fold into the heads: free the projection first
            out = attention(q, k, v, term, dropout=dropout)
        # q, k, v and the projection go before the next projection (in inference nothing else holds them)
        qkv = qk = q = k = v = None  # noqa: F841
        out = out.transpose(2, 3).reshape(B, nW, N, C)
        if slot_major(out) and self._project_in_place():
            # SDPA's fused GPU kernels wrote the windows folded into the heads slot-major, (B, N, nW, C)
            # in memory: project those rows where they lie (no copy into window order first; the
            # gradient then reaches SDPA in the layout it wrote, no copy there either) and return
            # the (B, nW, N, C) view (SwinBlock gathers its tokens from the slot-major rows).
            return self.proj_drop(apply_linear(self.proj, out.transpose(1, 2))).transpose(1, 2)
        return self.proj_drop(apply_linear(self.proj, out))

    def _project_in_place(self) -> bool:
        """Whether the output projection may run on the attention's rows in another order: a plain,
        unhooked ``nn.Linear`` (a hook sees the tensor it would see otherwise), no dropout drawn
        after it (its random mask would fall on other elements), eager code."""
        return plain_linear(self.proj) and not (self.training and self.proj_drop.p) and not tracing()


def _heads_first(t: Tensor, term: Tensor) -> Tensor:
    """``(B, nW, N, n, heads, d)`` -> ``(n, B, nW, heads, N, d)`` (``n``: 3 for q, k, v, 2 for q, k).

    With a per-window term, :func:`~vtdense.layers.attention.attention` folds the windows into the
    heads, ``(B, nW * heads, N, d)``, which copies each of q, k, v from this layout; off the CPU
    the result is then made contiguous here instead, one copy for all of them (one kernel, not
    three). The CPU's inference path reads the strided layout in place, and its training path
    does not come here."""
    t = t.permute(3, 0, 1, 4, 2, 5)
    if gpu_layout(t.device) and folds_windows(term, t.dim() - 1):
        return t.contiguous()
    return t


def _scaled_heads_first(qk: Tensor, factor: Tensor, term: Tensor) -> Tensor:
    """Swin V2's ``q`` and ``k`` times their cosine factor, ``(B, nW, N, 2, heads, d)`` times
    ``(B, nW, N, 2, heads, 1)`` -> ``(2, B, nW, heads, N, d)`` as :func:`_heads_first` lays it out.

    Off the CPU (:func:`~vtdense.layers.attention.gpu_layout`) the product is written straight
    into a contiguous heads-first buffer of ``qk``'s dtype: one kernel without gradients (where
    multiplying, copying to that layout and casting q and k for SDPA took up to four, two of them
    through float32 tensors of twice the size), and two under autocast with gradients (the
    product, then one cast into the buffer). The factor is float32 under autocast (a norm), so the
    product is computed in float32 and rounded once to bf16 on writing, which is the value
    autocast's cast for SDPA gave before: the same bits."""
    grad = torch.is_grad_enabled() and (qk.requires_grad or factor.requires_grad)
    if not gpu_layout(qk.device) or tracing() or (grad and factor.dtype == qk.dtype):
        return _heads_first(qk * factor, term)  # (graphs fuse this themselves)
    B, nW, N, n, h, d = qk.shape
    out = qk.new_empty((n, B, nW, h, N, d))
    into = out.permute(1, 2, 4, 0, 3, 5)  # the buffer seen in qk's layout
    if grad:  # out= records no gradient
        into.copy_(qk * factor)
    else:
        torch.mul(qk, factor, out=into)
    return out


def _same_values(copies: tuple[Tensor, ...] | None, params: list[Tensor]) -> bool:
    """Whether ``params`` still hold the values ``copies`` took (``True`` when no copies were kept)."""
    return copies is None or all(torch.equal(c, p) for c, p in zip(copies, params))


def _pad_rows(t: Tensor) -> Tensor:
    """On a GPU, ``t`` as a view into a buffer whose last-dim rows are padded to multiples of
    :data:`~vtdense.layers.attention.TERM_ALIGN` elements: SDPA's memory-efficient kernel reads
    such a bias in place instead of copying it."""
    if not pads_term_rows(t.device) or not t.shape[-1] % TERM_ALIGN or functorch_transform():
        return t
    return aligned_term(t.shape, t).copy_(t)


class SwinBlock(nn.Module):
    """One W-MSA or SW-MSA block on a channels-last ``(B, H, W, C)`` map.

    V1 is pre-norm ``x + F(LN(x))``; V2 (``post_norm=True``) is ``x + LN(F(x))``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: tuple[int, int],
        *,
        shifted: bool,
        post_norm: bool = False,
        pretrained_window_size: tuple[int, int] = (0, 0),
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        extra_norm: bool = False,
    ) -> None:
        super().__init__()
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shifted else (0, 0)
        self.post_norm = post_norm
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(
            dim,
            num_heads,
            window_size,
            cosine=post_norm,
            pretrained_window_size=pretrained_window_size,
            qkv_bias=qkv_bias,
            attn_drop=attn_drop,
            proj_drop=drop,
        )
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.drop_path2 = DropPath(drop_path)
        # Swin V2's extra main-branch norm (used every few blocks in the largest models).
        self.norm3 = nn.LayerNorm(dim) if extra_norm else None

    def _partition(self, x: Tensor) -> tuple[Tensor, tuple[int, int], Tensor | None, tuple[Tensor, Tensor]]:
        """``(B, H, W, C)`` -> ``(windows (B, nW, N, C), window, mask, (gather, scatter))``: roll,
        padding and partition in one gather; ``scatter`` undoes them (with crop) in another."""
        B, H, W, C = x.shape
        window, shift = effective_window((H, W), self.window_size, self.shift_size)
        gather, scatter = window_token_index(H, W, window, shift, x.device)
        mask = window_attention_mask(H, W, window, shift, x.device)
        windows = tokens_to_windows(x.reshape(B, H * W, C), gather, scatter, window[0] * window[1])
        return windows, window, mask, (gather, scatter)

    def _window_attention(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """Windowed attention over ``(B, H, W, C)``; ``norm`` is applied per token after the
        window gather (the same thing, fused with the qkv projection)."""
        B, H, W, C = x.shape
        windows, window, mask, index = self._partition(x)
        out = self.attn(windows, window, mask, norm=norm)
        if slot_major(out):  # the projection's rows lie (B, N, nW, C): gather the tokens from there
            shift = effective_window((H, W), self.window_size, self.shift_size)[1]
            scatter = slot_major_scatter(H, W, window, shift, x.device)
            return select_tokens(out.transpose(1, 2).reshape(B, -1, C), scatter).view(B, H, W, C)
        return windows_to_tokens(out.reshape(B, -1, C), *index).view(B, H, W, C)

    def _forward_chunked(self, x: Tensor) -> Tensor:
        """Inference on the CPU over cache-sized chunks of windows, then of tokens (see
        :mod:`vtdense.layers.chunked`); the same values as :meth:`forward`'s unchunked path."""
        B, H, W, C = x.shape
        windows, window, mask, (_, scatter) = self._partition(x)
        n = windows.shape[2]
        term = self.attn.attn_term(window, mask, x.dtype, x.device)
        pre = None if self.post_norm else self.norm1
        for images, wins in window_slices(B, windows.shape[1], n, 3 * C * x.element_size()):
            part = windows[images, wins]
            out = self.attn(part, window, norm=pre, term=term[wins] if term.dim() == 4 else term)
            part.copy_(self.norm1(out) if self.post_norm else out)  # each chunk is read before it is overwritten
        y = select_tokens(windows.view(B, -1, C), scatter).add_(x.reshape(B, H * W, C)).view(B, H, W, C)
        y = self.mlp.add_to_(y, post_norm=self.norm2) if self.post_norm else self.mlp.add_to_(y, norm=self.norm2)
        return self.norm3(y) if self.norm3 is not None else y

    def forward(self, x: Tensor) -> Tensor:
        if chunking_applies(x, self):
            with packed_weights():  # each weight reordered for oneDNN once for all the chunks (see cpu_linear)
                return self._forward_chunked(x)
        if self.post_norm:
            x = residual(x, self.drop_path1, self.norm1(self._window_attention(x)))
            x = residual(x, self.drop_path2, self.norm2(self.mlp(x)))
        else:
            x = residual(x, self.drop_path1, self._window_attention(x, norm=self.norm1))
            x = residual(x, self.drop_path2, self.mlp(x, norm=self.norm2))  # pre-norm fused with fc1 (see Mlp)
        if self.norm3 is not None:
            x = self.norm3(x)
        return x


class PatchMerging(nn.Module):
    """2x2 neighbourhood concat to ``4C`` then a linear reduction to ``out_dim``.

    V1 norms the ``4C`` vector before the reduction; V2 (``post_norm``) norms after it.
    Odd maps are zero-padded at the bottom/right first.
    """

    def __init__(self, dim: int, out_dim: int, post_norm: bool = False) -> None:
        super().__init__()
        self.post_norm = post_norm
        self.reduction = nn.Linear(4 * dim, out_dim, bias=False)
        self.norm = nn.LayerNorm(out_dim if post_norm else 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = pad_to_window(x, (2, 2))  # (under compile always, by 0 or 1: no guard on the parity)
        B, H, W, C = x.shape
        # order of the four neighbours: (0,0), (1,0), (0,1), (1,1) -- the original Swin order
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        if self.post_norm:
            return self.norm(apply_linear(self.reduction, x))
        return norm_linear(x, self.norm, self.reduction)  # training keeps x alone: the norm is recomputed


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch x patch`` conv embedding (input zero-padded to a multiple)."""

    def __init__(self, in_chans: int, dim: int, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = patch_conv(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        p = self.patch_size
        H, W = x.shape[2:]
        pad_h, pad_w = padded_length(H, p) - H, padded_length(W, p) - W
        if torch.compiler.is_compiling() or pad_h or pad_w:  # (no guard on the size under compile)
            x = F.pad(x, (0, pad_w, 0, pad_h))
        # (cpu_channels_last: 10.7 -> 7.5 ms for 8 images at 224, conversion included)
        return float_layer_norm(self.proj(cpu_channels_last(x)).permute(0, 2, 3, 1), self.norm)  # (CUDA bf16 inference: Triton)


class SwinStage(nn.Module):
    """Optional patch merging followed by ``depth`` alternating W-MSA / SW-MSA blocks."""

    def __init__(
        self, dim: int, out_dim: int, depth: int, *, downsample: bool, post_norm: bool, extra_norm_every: int, grad_checkpointing: bool, **block_kwargs: Any
    ) -> None:
        super().__init__()
        self.grad_checkpointing = grad_checkpointing
        self.downsample = PatchMerging(dim, out_dim, post_norm) if downsample else nn.Identity()
        drop_path = block_kwargs.pop("drop_path")
        self.blocks = nn.Sequential(
            *[
                SwinBlock(
                    out_dim,
                    shifted=bool(i % 2),
                    post_norm=post_norm,
                    drop_path=drop_path[i],
                    extra_norm=bool(extra_norm_every) and (i + 1) % extra_norm_every == 0,
                    **block_kwargs,
                )
                for i in range(depth)
            ]
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.downsample(x)
        return run_blocks(self.blocks, x, self.grad_checkpointing)


class SwinTransformer(Backbone):
    """Swin Transformer (V1, or V2 with ``version=2``) emitting a stride 4/8/16/32 pyramid.

    Args:
        embed_dim: channels of stage 1 (doubled at each later stage).
        depths: blocks per stage.
        num_heads: attention heads per stage.
        window_size: attention window, int or ``(h, w)``.
        version: 1 or 2.
        pretrained_window_size: V2 only: window the checkpoint was pre-trained with, which
            normalises the Log-CPB coordinates (0 = the window in use, as timm and the official
            code do). An int, ``(h, w)``, or one entry per stage (e.g. ``(12, 12, 12, 6)`` like
            timm's ``swinv2_*_window12to24_192to384``); a pair of ints is always ``(h, w)``.
        mlp_ratio: MLP hidden width over channels.
        qkv_bias: learn q/k/v (V2: q/v) biases.
        drop_rate: dropout after projections.
        attn_drop_rate: dropout on attention weights.
        drop_path_rate: stochastic depth, linearly increasing to this value over all blocks.
        patch_size: patch embedding stride.
        in_chans: input channels.
        out_indices: stages (0-based) whose outputs are returned.
        out_norm: LayerNorm on each emitted feature map.
        grad_checkpointing: recompute blocks in backward to save memory.
        extra_norm_every: V2 large-model option: an extra LayerNorm on the main branch every N
            blocks (0 = off).
        frozen_stages: freeze the patch embedding (0) and the first ``k`` stages with their output
            norms (:meth:`~vtdense.backbones.base.Backbone.set_frozen_stages`); -1: none.
    """

    def __init__(
        self,
        *,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int | Sequence[int] = 7,
        version: int = 1,
        pretrained_window_size: int | Sequence[int] = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        patch_size: int = 4,
        in_chans: int = 3,
        out_indices: Sequence[int] = (0, 1, 2, 3),
        out_norm: bool = True,
        grad_checkpointing: bool = False,
        extra_norm_every: int = 0,
        frozen_stages: int = -1,
    ) -> None:
        super().__init__()
        if version not in (1, 2):
            raise ValueError(f"version must be 1 or 2, got {version!r}")
        depths, num_heads = tuple(depths), tuple(num_heads)
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {depths} and num_heads {num_heads} must have the same length")
        out_indices = tuple(out_indices)
        if not out_indices or any(not 0 <= i < len(depths) for i in out_indices) or list(out_indices) != sorted(set(out_indices)):
            raise ValueError(f"out_indices must be increasing stage indices in [0, {len(depths) - 1}], got {out_indices}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
        window = to_2tuple(window_size, "window_size")
        pretrained_windows = _per_stage_windows(pretrained_window_size, len(depths))
        if version == 1 and any(w != (0, 0) for w in pretrained_windows):
            raise ValueError("pretrained_window_size only applies to Swin V2 (version=2)")
        self.version = version
        self.in_chans = in_chans
        self.window_size = window
        self.depths = depths
        self.out_indices = out_indices
        post_norm = version == 2
        num_stages = out_indices[-1] + 1
        dims = [embed_dim * 2**i for i in range(len(depths))]

        self.patch_embed = PatchEmbed(in_chans, embed_dim, patch_size)
        n_blocks = sum(depths)
        rates = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]
        self.layers = nn.Sequential()
        for i in range(num_stages):
            self.layers.append(
                SwinStage(
                    dims[max(i - 1, 0)],
                    dims[i],
                    depths[i],
                    downsample=i > 0,
                    post_norm=post_norm,
                    extra_norm_every=extra_norm_every,
                    grad_checkpointing=grad_checkpointing,
                    num_heads=num_heads[i],
                    window_size=window,
                    pretrained_window_size=pretrained_windows[i],
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    drop=drop_rate,
                    attn_drop=attn_drop_rate,
                    drop_path=rates[sum(depths[:i]) : sum(depths[: i + 1])],
                )
            )
        self.stage_channels = dims[:num_stages]
        self.stage_strides = [patch_size * 2**i for i in range(num_stages)]
        self.out_names = [f"stage{i + 1}" for i in out_indices]
        self.out_channels = [self.stage_channels[i] for i in out_indices]
        self.out_strides = [self.stage_strides[i] for i in out_indices]
        self.size_divisibility = patch_size * 2 ** (len(depths) - 1)
        self.out_norms = (
            nn.ModuleDict({n: nn.LayerNorm(c) for n, c in zip(self.out_names, self.out_channels)}) if out_norm else None
        )
        self.apply(self._init_weights)
        if version == 2:
            self._init_v2()
        self.set_frozen_stages(frozen_stages)

    def stage_modules(self) -> list[nn.Module]:
        """The built stages (:class:`SwinStage`: patch merging, then the blocks)."""
        return list(self.layers)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def _init_v2(self) -> None:
        for m in self.modules():
            if isinstance(m, WindowAttention) and m.cosine:
                nn.init.constant_(m.logit_scale, math.log(10.0))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block during backward instead of storing its activations."""
        for stage in self.layers:
            stage.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter-name fragments that should get no weight decay."""
        return {"relative_position_bias_table", "cpb_mlp", "logit_scale"}

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        """``(B, C, H, W)`` of any ``H, W`` -> ordered ``{"stageK": (B, C_k, ceil(H/s_k), ceil(W/s_k))}``."""
        self.check_input(x)
        x = self.patch_embed(x)
        return self.emit_pyramid(x, self.layers)


def log_cpb_windows(
    window_size: int | Sequence[int],
    image_size: int | Sequence[int],
    pretrained_window_size: int | Sequence[Any] = 0,
    num_stages: int = 4,
    patch_size: int = 4,
) -> list[tuple[int, int]]:
    """Per stage, the ``(h, w)`` window a Swin V2 normalises its Log-CPB coordinates by when it
    runs on ``image_size`` images: its ``pretrained_window_size`` where given, else the window in
    use, which shrinks to a stage map smaller than ``window_size`` (maps: ``ceil(H / patch_size)``,
    then halved, rounding up, at each later stage).

    The value to pass as ``pretrained_window_size`` when fine-tuning such a model at a larger
    window: window 12 at 192 px gives ``[(12, 12), (12, 12), (12, 12), (6, 6)]``, the
    ``(12, 12, 12, 6)`` that timm builds its ``swinv2_*_window12to16_192to256`` models with.
    """
    window = to_2tuple(window_size, "window_size")
    size = to_2tuple(image_size, "image_size")
    fixed = _per_stage_windows(pretrained_window_size, num_stages)
    maps = [ceil_div(s, patch_size) for s in size]
    out = []
    for i in range(num_stages):
        if i:
            maps = [ceil_div(m, 2) for m in maps]
        out.append(fixed[i] if fixed[i] != (0, 0) else effective_window(tuple(maps), window, (0, 0))[0])
    return out


def _per_stage_windows(value: int | Sequence[Any], num_stages: int) -> list[tuple[int, int]]:
    """``pretrained_window_size`` as one ``(h, w)`` per stage (``(0, 0)`` = not given)."""
    def one(v: int | Sequence[int]) -> tuple[int, int]:
        return (0, 0) if v == 0 or (not isinstance(v, int) and tuple(v) == (0, 0)) else to_2tuple(v, "pretrained_window_size")

    if not isinstance(value, int) and len(value) == num_stages and (num_stages != 2 or not all(isinstance(v, int) for v in value)):
        return [one(v) for v in value]
    if isinstance(value, int) or len(value) == 2:
        return [one(value)] * num_stages
    raise ValueError(f"pretrained_window_size must be an int, (h, w) or one entry per stage ({num_stages}), got {value!r}")


# name -> (embed_dim, depths, num_heads); the papers' configs.
_SIZES = {
    "tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": (128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "large": (192, (2, 2, 18, 2), (6, 12, 24, 48)),
}


def _register(name: str, version: int, size: str) -> None:
    embed_dim, depths, num_heads = _SIZES[size]
    defaults = dict(embed_dim=embed_dim, depths=depths, num_heads=num_heads, window_size=7 if version == 1 else 8, version=version)
    doc = f"Swin{' V2' if version == 2 else ''} {size}: embed {embed_dim}, depths {depths}, heads {num_heads}."
    register_config(name, SwinTransformer, defaults, fixed=("version",), doc=doc)


for _size in _SIZES:
    _register(f"swin_{_size}", 1, _size)
    _register(f"swinv2_{_size}", 2, _size)
