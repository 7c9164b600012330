"""MViTv2 as a dense-prediction backbone.

"MViTv2: Improved Multiscale Vision Transformers for Classification and Detection",
Li, Wu, Fan, Mangalam, Xiong, Malik and Feichtenhofer, CVPR 2022 (https://arxiv.org/abs/2112.01526).

A conv patch embedding (7x7, stride 4) feeds four stages of multiscale blocks. Each block uses
multi-head *pooling* attention: queries, keys and values are pooled after their projection by a
per-head depthwise 3x3 conv and a LayerNorm. The first block of stages 2-4 pools queries with
stride 2, which builds the stride 4/8/16/32 pyramid; keys and values are pooled with an adaptive
stride (4 at stage 1, halved at each later stage, at least 1). The pooled query is added back to
the attention output (residual pooling) and decomposed relative positions (separate height and
width tables) are added to the logits.

Layout and names follow timm's ``mvitv2_*`` models (``stages.{s}.blocks.{j}``), so timm state dicts
load as they are: the width changes in the attention of the *first* block of a stage
(``expand_attn=True``, shortcut ``shortcut_proj_attn``), except for ``mvitv2_large`` where it changes
in the MLP of the *last* block (``expand_attn=False``, shortcut ``shortcut_proj_mlp``), so that model
emits 288/576/1152/1152 channels, exactly like timm's ``features_only`` model.

**Any input size.** The patch embedding, the query pooling and the shortcut max-pool all map a side
``n`` to ``ceil(n / stride)``, so no padding is needed; maps are ``ceil(H / s) x ceil(W / s)``. The
position tables are made for a nominal ``img_size`` (224, as in timm) and linearly resampled when
the query/key grid differs from the one they were made for (as detectron2 does).

**Hybrid window attention** (``window_size > 0``; the detection setting of the paper, as in
detectron2's ``MViT``). ``window_size`` is the window side in tokens of the *stage-1 (stride-4)
grid*: every window covers the same ``4 * window_size`` pixels at every stage, so on a block's input
grid the window is ``window_size / 2**(k)`` where ``k`` is the number of query poolings before the
block (the first block of a stage still works on the previous stage's grid). It must be a multiple
of 8 (the default detection value is 56, i.e. 224 pixels, the pre-training image, so the tables
need no resampling inside windows). All blocks attend inside non-overlapping windows except the
last block of stages 2-4, which stay global; as in detectron2 those global blocks of stages 2 and 3
pool keys/values with twice the stage's stride (the conv weights have the same shape, so checkpoints
are interchangeable).

Pooling inside windows: queries, keys and values are pooled on the *whole* map first (so the 3x3
pooling convs see across window borders, as in detectron2 and as in the global model), then the
pooled maps are cut into windows of ``window / stride_q`` (queries) and ``window / stride_kv``
(keys/values) tokens; both tilings cover the same image regions. Maps that are not window
multiples are zero-padded at the bottom/right and the padded keys are masked out of the softmax
(``window_attention_mask``), which detectron2 does not do; windows are clipped to maps smaller than
them, with the relative positions of the full window. Nothing the padding contains reaches a real
token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.backbones.base import Backbone, cpu_channels_last, run_blocks
from vtdense.backbones.registry import register_config
from vtdense.layers.attention import attention
from vtdense.layers.autocast import autocast_inputs, autocast_params
from vtdense.layers import chunked
from vtdense.layers.chunked import chunking_applies, row_slices
from vtdense.layers.tracing import exporting, tracing
from vtdense.layers.depthwise_conv import depthwise_conv_nhwc
from vtdense.layers.grad_layout import param_layout
from vtdense.layers.opaque_conv import OpaqueConv2d, patch_conv
from vtdense.layers.decomposed_attention import (
    compiled_decomposed_attention,
    compiled_decomposed_attention_applies,
    decomposed_attention_chunked,
)
from vtdense.layers.drop import DropPath, residual
from vtdense.layers.fused_norm import keep_out_of_auto, norm_for_linears
from vtdense.layers.mlp import Mlp
from vtdense.layers.cpu_linear import apply_linear, linear, packed_weights
from vtdense.layers.plain import plain_linear, plain_module
from vtdense.layers.position import decomposed_rel_pos_bias, decomposed_rel_pos_fold
from vtdense.layers.windows import (
    effective_window,
    mask_value,
    pad_to_window,
    window_attention_mask,
    tokens_to_windows,
    window_partition,
    window_reverse,
    window_token_index,
    windows_to_tokens,
)

__all__ = ["MultiScaleAttention", "MultiScaleBlock", "MViTv2Stage", "MViTv2"]

_NORM_EPS = 1e-6


def _layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=_NORM_EPS)


class MultiScaleAttention(nn.Module):
    """Multi-head pooling attention (MHPA) with residual pooling and decomposed relative positions.

    Works on channels-last maps ``(B, H, W, dim) -> (B, ceil(H/sq), ceil(W/sq), dim_out)``.

    Args:
        dim: input channels.
        dim_out: output channels (also the width of q, k and v).
        num_heads: attention heads.
        stride_q: query pooling stride (2 builds the next pyramid level, else 1).
        stride_kv: key/value pooling stride.
        feat_size: side of the nominal (square) input grid the position tables are made for.
        window: window side on the input grid, 0 for global attention. Must be divisible by
            both strides.
        qkv_bias: learn q/k/v biases.
        residual_pooling: add the pooled query to the attention output.
        attn_drop: dropout on the attention weights.
        rel_pos_fold: fold the decomposed relative positions into ``q`` and ``k``
            (:func:`~vtdense.layers.position.decomposed_rel_pos_fold`, window padding as one more
            column) instead of adding a ``(Nq, Nk)`` bias. Same outputs to float rounding. Eager
            only: graphs (``torch.compile``, ``torch.export``) keep the bias.
            ``None``: fold when gradients are needed (training), add the bias otherwise.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int,
        num_heads: int,
        *,
        stride_q: int = 1,
        stride_kv: int = 1,
        feat_size: int = 56,
        window: int = 0,
        qkv_bias: bool = True,
        residual_pooling: bool = True,
        attn_drop: float = 0.0,
        rel_pos_fold: bool | None = None,
    ) -> None:
        super().__init__()
        if dim_out % num_heads:
            raise ValueError(f"dim_out {dim_out} is not divisible by num_heads {num_heads}")
        if window and (window % stride_q or window % stride_kv):
            raise ValueError(f"window {window} is not divisible by the pooling strides ({stride_q}, {stride_kv})")
        self.num_heads = num_heads
        self.head_dim = dim_out // num_heads
        self.dim_out = dim_out
        self.stride_q, self.stride_kv = stride_q, stride_kv
        self.window = window
        self.residual_pooling = residual_pooling
        self.attn_drop = attn_drop
        self.rel_pos_fold = rel_pos_fold
        hd = self.head_dim

        self.qkv = nn.Linear(dim, 3 * dim_out, bias=qkv_bias)
        self.proj = nn.Linear(dim_out, dim_out)
        # One depthwise conv over the head channels, shared by all heads (compiled, one op: see _pool).
        self.pool_q = OpaqueConv2d(hd, hd, 3, stride=stride_q, padding=1, groups=hd, bias=False)
        self.norm_q = _layer_norm(hd)
        self.pool_k = OpaqueConv2d(hd, hd, 3, stride=stride_kv, padding=1, groups=hd, bias=False)
        self.norm_k = _layer_norm(hd)
        self.pool_v = OpaqueConv2d(hd, hd, 3, stride=stride_kv, padding=1, groups=hd, bias=False)
        self.norm_v = _layer_norm(hd)
        # Table length as in the reference: offsets of the nominal query/key grids.
        span = 2 * max(feat_size // stride_q, feat_size // stride_kv) - 1
        self.rel_pos_h = nn.Parameter(torch.zeros(span, hd))
        self.rel_pos_w = nn.Parameter(torch.zeros(span, hd))
        nn.init.trunc_normal_(self.rel_pos_h, std=0.02)
        nn.init.trunc_normal_(self.rel_pos_w, std=0.02)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q``, ``k``, ``v`` of ``x`` (``(B, H, W, dim)``), each a dense ``(B, H, W, dim_out)``.

        A plain ``nn.Linear`` ``qkv`` is applied as three matmuls on row slices of its weight, so
        each projection comes out dense (the pooling conv reads a strided view into a
        ``3 * dim_out`` wide ``qkv`` several times slower than a dense input). A replaced or hooked
        ``qkv`` (LoRA, quantisation, a user's hook) is called as a module, and its output split."""
        lin = self.qkv
        if plain_linear(lin):
            c = self.dim_out
            weight, full_bias = autocast_params(lin.weight, lin.bias)  # inference under autocast: kept cast copies
            bias = full_bias.split(c) if full_bias is not None else (None, None, None)
            (x,) = autocast_inputs(x)  # under autocast: cast once, not by each of the three products
            return tuple(linear(x, w, b) for w, b in zip(weight.split(c), bias))  # type: ignore[return-value]
        return tuple(t.contiguous() for t in lin(x).chunk(3, dim=-1))  # type: ignore[return-value]

    def _pool(self, y: Tensor, pool: OpaqueConv2d, norm: nn.LayerNorm) -> Tensor:
        """Pool every head of ``y`` (``(B, H, W, heads * d)``, dense) and normalise:
        ``(B, H', W', heads, d)``, contiguous.

        One depthwise conv over all ``heads * d`` channels, its ``d`` filters repeated per head:
        the same filters as a ``(B * heads, d)`` conv, with no copy to bring the heads into the
        batch; the input is channels-last as it stands."""
        B = y.shape[0]
        h, d = self.num_heads, self.head_dim
        if not plain_module(pool, OpaqueConv2d):  # a replaced or hooked pool: one call over (B * heads, d) maps
            H, W = y.shape[1:3]
            z = pool(y.view(B, H, W, h, d).permute(0, 3, 4, 1, 2).reshape(B * h, d, H, W))
            return norm(z.view(B, h, d, *z.shape[2:]).permute(0, 3, 4, 1, 2).contiguous())
        weight, _ = autocast_params(pool.weight, None)  # inference under autocast: a kept cast copy
        # one head: the conv's own weight gradient, channels-last from oneDNN (param_layout: the weight's strides)
        filters = param_layout(weight) if h == 1 else weight.repeat(h, 1, 1, 1)
        if torch.compiler.is_compiling() and not exporting():
            # compiled: the conv as one opaque op with its own backward (see depthwise_conv_nhwc); in
            # inference too, where a traced conv on an unbacked batch states a layout it does not return
            return norm(depthwise_conv_nhwc(y, filters, pool.stride, pool.padding, heads=h))
        y = F.conv2d(y.permute(0, 3, 1, 2), filters, None, pool.stride, pool.padding, groups=h * d)
        y = y.permute(0, 2, 3, 1)  # (B, H', W', h*d), a view when the conv kept channels-last
        return norm(y.reshape(B, *y.shape[1:3], h, d))

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` (``(B, H, W, dim)``), globally or inside windows.

        Returns:
            ``(B, Hq, Wq, dim_out)`` with ``Hq = ceil(H / stride_q)``.
        """
        B = x.shape[0]
        h, d = self.num_heads, self.head_dim
        q, k, v = self._project(x)
        q = self._pool(q, self.pool_q, self.norm_q)  # (B, Hq, Wq, h, d)
        k = self._pool(k, self.pool_k, self.norm_k)
        v = self._pool(v, self.pool_v, self.norm_v)
        q_res = q  # the residual pooling's addend keeps the norm's dtype
        fold = self.rel_pos_fold
        if fold is None:
            fold = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or self.rel_pos_h.requires_grad)
        # Graphs keep the bias: AOTAutograd's backward of the fold fails at dynamic sizes (torch 2.14).
        fold = fold and not tracing()
        if not fold:
            # the bias path's consumers of q, k, v (the term's two products, SDPA) all cast them
            q, k, v = autocast_inputs(q, k, v)
        Hq, Wq = q.shape[1:3]
        Hk, Wk = k.shape[1:3]

        mask = None
        grid = None
        gathered = torch.compiler.is_compiling() and not exporting()
        if self.window:
            qw, kw = self.window // self.stride_q, self.window // self.stride_kv
            # Clipping a window to a smaller map leaves one window along that axis and needs no
            # padding; the map covers the window's top-left block either way.
            # (effective_window, not min: under torch.compile the window of a map larger than it stays a constant)
            q_win = effective_window((Hq, Wq), (qw, qw), (0, 0))[0]
            k_win = effective_window((Hk, Wk), (kw, kw), (0, 0))[0]
            grid = ((qw, qw), (kw, kw))
            if gathered:
                # Under torch.compile: padding and partition as one gather with a cached index table (padded
                # slots hold token 0: masked as keys, dropped as queries), as Swin's blocks do. Inductor then
                # indexes the windows through the table instead of through floor divisions and remainders
                # of the padded sizes, which were much of its code generation's sympy work.
                q_index = window_token_index(Hq, Wq, q_win, (0, 0), x.device)
                k_index = window_token_index(Hk, Wk, k_win, (0, 0), x.device)
                qs = tokens_to_windows(q.reshape(B, Hq * Wq, h * d), *q_index, q_win[0] * q_win[1])
                ks, vs = (tokens_to_windows(t.reshape(B, Hk * Wk, h * d), *k_index, k_win[0] * k_win[1]) for t in (k, v))
            else:
                qp = pad_to_window(q.flatten(3), q_win)
                Hqp, Wqp = qp.shape[1:3]
                qs = window_partition(qp, q_win)
                ks = window_partition(pad_to_window(k.flatten(3), k_win), k_win)
                vs = window_partition(pad_to_window(v.flatten(3), k_win), k_win)
            # Key-validity part of the cached window mask: every row of a window's (N, N)
            # mask is the same when there is no shift, so one row serves all queries.
            full = window_attention_mask(Hk, Wk, k_win, (0, 0), x.device)
            mask = full[:, :1] if full is not None else None  # nW, 1, Nk
        else:
            q_win, k_win = (Hq, Wq), (Hk, Wk)
            Hqp, Wqp = Hq, Wq
            qs, ks, vs = (t.reshape(B, 1, -1, h * d) for t in (q, k, v))

        nW = qs.shape[1]
        # (B, nW, N, h*d) -> (B, nW, heads, N, d): windows lead, as the kernel expects (views).
        qs, ks, vs = (t.view(B, nW, t.shape[2], h, d).transpose(2, 3) for t in (qs, ks, vs))
        dropout = self.attn_drop if self.training else 0.0
        if fold:
            key_mask = mask[None] if mask is not None else None  # (1, nW, 1, Nk) over (B, nW, heads, Nk)
            qa, ka = decomposed_rel_pos_fold(qs, ks, self.rel_pos_h, self.rel_pos_w, q_win, k_win, d**-0.5, grid,
                                             key_mask)
            # v padded to the same width: fused kernels (flash on CPU and GPU) want equal head dims
            va = F.pad(vs, (0, qa.shape[-1] - d))
            out = attention(qa, ka, va, None, scale=1.0, dropout=dropout)[..., :d]
        else:
            key_terms = None
            if mask is not None:
                # A window's padded keys are whole rows or columns of its key grid: MASK_VALUE on
                # them in the two factors of the bias (a blocked key gets -1e4 or -2e4 added, zero
                # weight after the softmax either way), instead of a pass over the whole term.
                blocked = mask.view(-1, *k_win)  # nW, kh, kw
                key_terms = (mask_value() * blocked.all(2).view(-1, 1, 1, 1, k_win[0]),
                             mask_value() * blocked.all(1).view(-1, 1, 1, 1, k_win[1]))
            # (sizes read only outside graphs: under compile they would become guards)
            if chunking_applies(x, self) and qs.numel() // d * ks.shape[3] * qs.element_size() > chunked.CHUNK_BYTES:
                out = decomposed_attention_chunked(qs, ks, vs, self.rel_pos_h, self.rel_pos_w, q_win, k_win, grid, key_terms)
            elif compiled_decomposed_attention_applies(qs, ks, vs, self.rel_pos_h):
                # the eager kernel as one opaque op (see vtdense.layers.decomposed_attention)
                out = compiled_decomposed_attention(qs, ks, vs, self.rel_pos_h, self.rel_pos_w, q_win, k_win, grid,
                                                    key_terms)
            else:
                bias = decomposed_rel_pos_bias(qs, self.rel_pos_h, self.rel_pos_w, q_win, k_win, grid, key_terms)
                out = attention(qs, ks, vs, bias, dropout=dropout)
        out = out.transpose(2, 3).reshape(B, nW, -1, h * d)  # a view when the kernel wrote (.., N, h, d)
        if self.window and gathered:
            out = windows_to_tokens(out.reshape(B, -1, h * d), *q_index).view(B, Hq, Wq, h * d)
        elif self.window:
            out = window_reverse(out, q_win, Hqp, Wqp)
            if torch.compiler.is_compiling():
                # Cropped always, into a new dense tensor by a negative pad. A cropped view's
                # contiguity is a guard on the map tiling exactly (a recompile at odd sizes): the
                # next op reads it, and so does AOT autograd's metadata of every view it traces.
                out = F.pad(out, (0, 0, 0, Wq - Wqp, 0, Hq - Hqp))
            elif (Hqp, Wqp) != (Hq, Wq):
                out = out[:, :Hq, :Wq]
        else:
            out = out.view(B, Hq, Wq, h * d)
        if self.residual_pooling:
            out = out + q_res.view(B, Hq, Wq, h * d)
        return apply_linear(self.proj, out)


class MultiScaleBlock(nn.Module):
    """Pre-norm pooling-attention block on a channels-last ``(B, H, W, dim)`` map.

    The attention shortcut is max-pooled (kernel ``stride_q + 1``) when the query is pooled and
    linearly projected when the width changes; the projection sits on the attention branch
    (``expand_attn``) or on the MLP branch. As in the reference, an unprojected shortcut takes the
    block input before the norm, a projected one the normalised input.

    Args:
        dim: input channels.
        dim_out: output channels.
        num_heads: attention heads.
        stride_q: query pooling stride.
        stride_kv: key/value pooling stride.
        feat_size: nominal input grid side (position tables).
        window: window side on the input grid (0 = global).
        expand_attn: change the width in the attention (else in the MLP).
        mlp_ratio: MLP hidden width over its input width.
        qkv_bias: learn q/k/v biases.
        residual_pooling: add the pooled query to the attention output.
        drop_path: stochastic depth rate of both branches.
        rel_pos_fold: see :class:`MultiScaleAttention`.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int,
        num_heads: int,
        *,
        stride_q: int = 1,
        stride_kv: int = 1,
        feat_size: int = 56,
        window: int = 0,
        expand_attn: bool = True,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        residual_pooling: bool = True,
        drop_path: float = 0.0,
        rel_pos_fold: bool | None = None,
    ) -> None:
        super().__init__()
        att_dim = dim_out if expand_attn else dim
        project = dim != dim_out
        self.norm1 = keep_out_of_auto(_layer_norm(dim))  # the Triton LayerNorm measured slower here
        self.shortcut_proj_attn = nn.Linear(dim, dim_out) if project and expand_attn else None
        self.shortcut_pool_attn = (
            nn.MaxPool2d(stride_q + 1, stride_q, (stride_q + 1) // 2) if stride_q > 1 else None
        )
        self.attn = MultiScaleAttention(
            dim,
            att_dim,
            num_heads,
            stride_q=stride_q,
            stride_kv=stride_kv,
            feat_size=feat_size,
            window=window,
            qkv_bias=qkv_bias,
            residual_pooling=residual_pooling,
            rel_pos_fold=rel_pos_fold,
        )
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = keep_out_of_auto(_layer_norm(att_dim))
        self.shortcut_proj_mlp = nn.Linear(dim, dim_out) if project and not expand_attn else None
        self.mlp = Mlp(att_dim, int(att_dim * mlp_ratio), dim_out)
        self.drop_path2 = DropPath(drop_path)

    def _forward_chunked(self, x: Tensor) -> Tensor:
        """Inference on the CPU: attention over groups of whole images, the MLP over cache-sized
        row chunks (:mod:`vtdense.layers.chunked`); the same values as the unchunked path."""
        tokens = x[0].numel() // x.shape[-1]
        y = None
        for s in row_slices(x.shape[0], tokens * 3 * self.attn.dim_out * x.element_size(), min_rows=1):
            xs = x[s]
            x_norm = self.norm1(xs)
            shortcut = xs if self.shortcut_proj_attn is None else apply_linear(self.shortcut_proj_attn, x_norm)
            if self.shortcut_pool_attn is not None:
                shortcut = self.shortcut_pool_attn(shortcut.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
            part = self.attn(x_norm)
            if y is None:
                y = part.new_empty((x.shape[0], *part.shape[1:]))
            torch.add(shortcut, part, out=y[s])
        if self.shortcut_proj_mlp is None:
            return self.mlp.add_to_(y, norm=self.norm2)
        x_norm = self.norm2(y)
        return self.mlp.add_to_(apply_linear(self.shortcut_proj_mlp, x_norm), x=x_norm)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, dim) -> (B, ceil(H/sq), ceil(W/sq), dim_out)``."""
        if chunking_applies(x, self):
            with packed_weights():  # each weight reordered for oneDNN once for all the chunks (see cpu_linear)
                return self._forward_chunked(x)
        x_norm = norm_for_linears(x, self.norm1, self.attn.qkv, self.shortcut_proj_attn)  # (CUDA bf16 inference: Triton)
        if self.shortcut_proj_attn is not None and plain_linear(self.shortcut_proj_attn) and plain_linear(self.attn.qkv):
            (x_norm,) = autocast_inputs(x_norm)  # read by the shortcut's product and the q/k/v products
        shortcut = x if self.shortcut_proj_attn is None else apply_linear(self.shortcut_proj_attn, x_norm)
        if self.shortcut_pool_attn is not None:
            shortcut = self.shortcut_pool_attn(shortcut.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        x = residual(shortcut, self.drop_path1, self.attn(x_norm))
        if self.shortcut_proj_mlp is None:  # the MLP's pre-norm is fused with its fc1 (see Mlp)
            return residual(x, self.drop_path2, self.mlp(x, norm=self.norm2))
        x_norm = norm_for_linears(x, self.norm2, self.shortcut_proj_mlp, self.mlp.fc1)
        if plain_linear(self.shortcut_proj_mlp) and plain_linear(self.mlp.fc1):
            (x_norm,) = autocast_inputs(x_norm)  # read by the shortcut's product and fc1
        return residual(apply_linear(self.shortcut_proj_mlp, x_norm), self.drop_path2, self.mlp(x_norm))


class _PatchEmbed(nn.Module):
    """Overlapping 7x7 stride-4 conv embedding (padding 3): ``ceil(H/4) x ceil(W/4)`` tokens."""

    def __init__(self, in_chans: int, dim: int) -> None:
        super().__init__()
        self.proj = patch_conv(in_chans, dim, kernel_size=7, stride=4, padding=3)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, C, H, W)`` -> ``(B, ceil(H/4), ceil(W/4), dim)``."""
        return self.proj(cpu_channels_last(x)).permute(0, 2, 3, 1)


class MViTv2Stage(nn.Module):
    """A sequence of :class:`MultiScaleBlock` (one pyramid level), optionally checkpointed."""

    def __init__(self, blocks: Sequence[MultiScaleBlock], grad_checkpointing: bool = False) -> None:
        super().__init__()
        self.grad_checkpointing = grad_checkpointing
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        return run_blocks(self.blocks, x, self.grad_checkpointing)


class MViTv2(Backbone):
    """MViTv2 emitting a stride 4/8/16/32 pyramid (no class token).

    Args:
        embed_dim: channels of stage 1 (doubled at each later stage).
        depths: blocks per stage.
        num_heads: heads of stage 1 (doubled at each later stage).
        expand_attn: change the width in the attention of a stage's first block (timm's T/S/B)
            rather than in the MLP of the previous stage's last block (timm's L).
        img_size: nominal (square) image side the relative position tables are made for.
        window_size: hybrid window attention: window side in stage-1 (stride-4) tokens, a
            multiple of 8; 0 or ``None`` = global attention everywhere (classification layout).
        mlp_ratio: MLP hidden width over channels.
        qkv_bias: learn q/k/v biases.
        residual_pooling: add the pooled query to the attention output.
        drop_path_rate: stochastic depth, linearly increasing to this value over all blocks.
        in_chans: input channels.
        out_indices: stages (0-based) whose outputs are returned; later stages are not built.
        out_norm: LayerNorm on each emitted feature map (``out_norms``, keyed by output name).
        grad_checkpointing: recompute blocks in backward to save memory.
        frozen_stages: freeze the patch embedding (0) and the first ``k`` stages with their output
            norms (:meth:`~vtdense.backbones.base.Backbone.set_frozen_stages`); -1: none.
        rel_pos_fold: fold the decomposed relative positions into the head dimension of ``q`` and
            ``k`` (one-hot keys; :func:`~vtdense.layers.position.decomposed_rel_pos_fold`) instead of
            adding a ``(Nq, Nk)`` bias to the logits (a window's padding becomes one more column):
            no tensor of that size is made, forward or backward, and attention runs with no
            mask (SDPA's flash kernel can then take the backward pass too). Same outputs to float
            rounding; the head dimension grows by ``kh + kw`` (28 at 224 px), padded to a multiple
            of 8. Eager only: ``torch.compile`` and ``torch.export`` graphs keep the bias (the
            fold's backward does not trace at dynamic sizes with torch 2.14). ``None``
            (default): fold when gradients are needed, add the bias in inference,
            which measured faster on the CPU (``benchmarks/RESULTS.md``: a CPU training step at
            512x768 1.2x faster with 0.4x the saved activations; inference 5-14 % slower).
    """

    family = "mvitv2"

    def __init__(
        self,
        *,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 3, 16, 3),
        num_heads: int = 1,
        expand_attn: bool = True,
        img_size: int = 224,
        window_size: int | None = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        residual_pooling: bool = True,
        drop_path_rate: float = 0.1,
        in_chans: int = 3,
        out_indices: Sequence[int] = (0, 1, 2, 3),
        out_norm: bool = True,
        grad_checkpointing: bool = False,
        rel_pos_fold: bool | None = None,
        frozen_stages: int = -1,
    ) -> None:
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(
                f"MViTv2 num_heads is the head count of stage 1 (doubled at each later stage), a positive int; "
                f"got {num_heads!r}"
            )
        depths = tuple(int(d) for d in depths)
        if not depths or min(depths) < 1:
            raise ValueError(f"depths must be positive block counts, got {depths}")
        n = len(depths)
        out_indices = tuple(out_indices)
        if not out_indices or any(not 0 <= i < n for i in out_indices) or list(out_indices) != sorted(set(out_indices)):
            raise ValueError(f"out_indices must be increasing stage indices in [0, {n - 1}], got {out_indices}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
        window_size = int(window_size or 0)
        granule = 2 ** (n - 1)
        if window_size < 0 or window_size % granule:
            raise ValueError(
                f"window_size is the window side in stride-4 tokens and halves at each stage, so it "
                f"must be 0 (global) or a positive multiple of {granule}; got {window_size} (e.g. 56)"
            )
        if img_size < 4 * granule:
            raise ValueError(f"img_size must be at least {4 * granule}, got {img_size}")
        self.in_chans = in_chans
        self.depths = depths
        self.expand_attn = expand_attn
        self.window_size = window_size
        self.img_size = img_size
        self.out_indices = out_indices

        dims = [embed_dim * 2**i for i in range(n)]
        heads = [num_heads * 2**i for i in range(n)]
        strides_q = [1] + [2] * (n - 1)
        strides_kv, kv = [], 4
        for s in strides_q:
            kv = max(kv // s, 1)
            strides_kv.append(kv)
        rates = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()
        num_stages = out_indices[-1] + 1

        self.patch_embed = _PatchEmbed(in_chans, embed_dim)
        self.stages = nn.ModuleList()
        stage_out: list[int] = []
        dim, feat, scale = embed_dim, img_size // 4, 1  # scale: input grid stride / 4
        for i in range(num_stages):
            dim_out = dims[i] if expand_attn else dims[min(i + 1, n - 1)]
            block_out = [dim_out] * depths[i] if expand_attn else [dim] * (depths[i] - 1) + [dim_out]
            blocks = []
            for j in range(depths[i]):
                sq = strides_q[i] if j == 0 else 1
                skv = strides_kv[i]
                is_global = i > 0 and j == depths[i] - 1
                window = 0 if not window_size or is_global else window_size // scale
                if window_size and is_global and i < n - 1:
                    skv *= 2  # detectron2's hybrid layout: cheaper global blocks in stages 2-3
                blocks.append(
                    MultiScaleBlock(
                        dim,
                        block_out[j],
                        heads[i],
                        stride_q=sq,
                        stride_kv=skv,
                        feat_size=feat,
                        window=window,
                        expand_attn=expand_attn,
                        mlp_ratio=mlp_ratio,
                        qkv_bias=qkv_bias,
                        residual_pooling=residual_pooling,
                        drop_path=rates[sum(depths[:i]) + j],
                        rel_pos_fold=rel_pos_fold,
                    )
                )
                dim = block_out[j]
                if j == 0:
                    feat //= sq
                    scale *= sq
            self.stages.append(MViTv2Stage(blocks, grad_checkpointing))
            stage_out.append(dim)

        self.stage_channels = stage_out
        self.stage_strides = [4 * 2**i for i in range(num_stages)]
        self.out_names = [f"stage{i + 1}" for i in out_indices]
        self.out_channels = [stage_out[i] for i in out_indices]
        self.out_strides = [self.stage_strides[i] for i in out_indices]
        self.size_divisibility = 4 * 2 ** (n - 1)
        self.out_norms = (
            nn.ModuleDict({k: _layer_norm(c) for k, c in zip(self.out_names, self.out_channels)}) if out_norm else None
        )
        self.apply(self._init_weights)
        self.set_frozen_stages(frozen_stages)

    def stage_modules(self) -> list[nn.Module]:
        """The built stages (a stage's first block pools and widens)."""
        return list(self.stages)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block during backward instead of storing its activations."""
        for stage in self.stages:
            stage.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter-name fragments that should get no weight decay."""
        return {"rel_pos_h", "rel_pos_w"}

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        """``(B, C, H, W)`` of any ``H, W`` -> ordered ``{"stageK": (B, C_k, ceil(H/s_k), ceil(W/s_k))}``."""
        self.check_input(x)
        x = self.patch_embed(x)
        return self.emit_pyramid(x, self.stages)


# name -> (embed_dim, depths, num_heads, expand_attn); the published configs (timm's layout).
_SIZES = {
    "tiny": (96, (1, 2, 5, 2), 1, True),
    "small": (96, (1, 2, 11, 2), 1, True),
    "base": (96, (2, 3, 16, 3), 1, True),
    "large": (144, (2, 6, 36, 4), 2, False),
}


def _register(size: str) -> None:
    embed_dim, depths, num_heads, expand_attn = _SIZES[size]
    defaults = dict(embed_dim=embed_dim, depths=depths, num_heads=num_heads, expand_attn=expand_attn)
    doc = f"MViTv2 {size}: embed {embed_dim}, depths {depths}, heads {num_heads} at stage 1."
    register_config(f"mvitv2_{size}", MViTv2, defaults, doc=doc)


for _size in _SIZES:
    _register(_size)
