"""The backbone contract every vtdense backbone follows.

A backbone maps an NCHW image batch of any height and width to an ordered dict of NCHW
feature maps, one per requested stage, in stride order. Heads are built from the
attributes declared here, never by running a dummy image.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vtdense.layers.cpu_linear import cpu_matmul
from vtdense.layers.plain import hooks_below
from vtdense.layers.tracing import exporting, functorch_transform, tracing
from vtdense.layers.windows import ceil_div

__all__ = ["Backbone", "FeatureInfo", "run_blocks", "cpu_channels_last", "set_compile_regions"]

#: Whether compiled graphs trace each block as a nested compile region (:func:`set_compile_regions`).
_COMPILE_REGIONS = True


def set_compile_regions(enabled: bool = True) -> None:
    """Whether ``torch.compile`` traces each backbone block as a nested compile region in graphs
    without gradients (the default), or inlines every block into one flat graph. Graphs that record
    gradients always inline them (see :func:`_as_region`: torch 2.14 trains reused regions wrongly).

    Blocks of a stage are the same computation on the same sizes, so torch compiles a block once
    and calls that code again for every later block it matches (``torch.compiler.nested_compile_region``:
    Dynamo reuses the traced block, AOT autograd and Inductor its code): Swin-T's
    12 blocks compile as 8 (its 4 stages, shifted or not), Swin-S's 24 as 8. Blocks match where
    their constants do; drop-path rates are graph inputs (:class:`vtdense.layers.drop.DropPath`),
    so stochastic depth does not tell blocks apart. Outputs are the same either way; what changes is the
    compile's time, and that the compiler fuses no kernel across a block's boundary.
    ``torch.export`` always traces the flat form.
    """
    global _COMPILE_REGIONS
    _COMPILE_REGIONS = bool(enabled)


def _call_block(block: nn.Module, x: Tensor) -> Tensor:
    """``block(x)``, traced as a region whose compiled code later matching blocks reuse."""
    return block(x)


def _region_of(call: Callable[[nn.Module, Tensor], Tensor]) -> Callable[[nn.Module, Tensor], Tensor] | None:
    """``call`` as a nested compile region, on a torch that reuses a region only where the guards of
    the first trace hold for the new call (the module's constants included), as torch 2.14 does
    (checked here: a shifted block never reuses an unshifted one's code). ``None`` on an older
    torch: blocks stay inlined there. (Torch 2.11 was tried: with three work-rounds its regions
    matched, but its first compile took as long as the flat graph's; ``benchmarks/RESULTS.md``.)"""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None or torch.__version__ < "2.14":
        return None
    return region(call, max_reuse_entries=1024)  # (a model's distinct blocks, 8 by default, raise when exceeded)


_block_region = _region_of(_call_block)


def _floats_constant() -> bool:
    """Whether Dynamo traces the Python floats it reads as constants (``specialize_float``, which
    :func:`vtdense.models.compile.compile_backbone` sets). Where they are graph inputs (plain
    ``torch.compile(dynamic=True)``), a block reused as a region takes its LayerNorm's ``eps`` as
    a symbol that no trace can guard on, so blocks stay inlined."""
    import torch._dynamo

    return bool(torch._dynamo.config.specialize_float)


def _as_region(block: nn.Module) -> bool:
    """Whether ``block`` is traced as a nested compile region: while ``torch.compile`` traces (not
    ``torch.export``) without gradients, and where no hook of the block, of a module in it, or a
    global module hook observes its calls (a hook's side effects keep the block inlined, as Dynamo
    traces them).

    Not where gradients are recorded: on torch 2.14.1 a region reused by two or more later blocks
    trains wrongly. With Inductor and dynamic sizes, Swin-T's stage-3 blocks 5 and 6 got wrong
    ``norm1.weight`` gradients (relative errors 1.0 and 0.79; 0.05 on the bias tables; 3e-6 with the
    blocks inlined), and with torch alone, three calls of one region with a LayerNorm, a linear and
    SDPA gave the first call's parameters zero gradients. Under autocast the reused region's backward
    also lost autocast's casts ("expected scalar type Float but found BFloat16"). So training graphs
    inline every block, and inference graphs keep the regions (outputs measured equal to eager's,
    Inductor included)."""
    return (_COMPILE_REGIONS and _block_region is not None and torch.compiler.is_compiling() and not exporting()
            and not torch.is_grad_enabled() and _floats_constant()
            and not block._forward_hooks and not block._forward_pre_hooks and not hooks_below(block))


def cpu_channels_last(x: Tensor) -> Tensor:
    """``x`` (``(B, C, H, W)``) channels-last on the CPU, as it is elsewhere: the input of a patch
    embedding's conv. oneDNN's channels-last conv is faster, its output permuted to ``(B, H, W, C)``
    is dense for the first norm, and compiled code needs it too: Inductor lays CPU convs out
    channels-last anyway, and an activation saved in another layout than the trace's reaches the
    backward's compile with fixed strides (a recompile at every new size). Not under a ``torch.func``
    transform, which cannot query channels-last."""
    if x.device.type == "cpu" and not functorch_transform():
        return x.contiguous(memory_format=torch.channels_last)
    return x


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, grad_checkpointing: bool = False) -> Tensor:
    """Apply ``blocks`` in order; with ``grad_checkpointing`` (and grads enabled) each block's
    activations are recomputed in backward instead of stored."""
    for block in blocks:
        if grad_checkpointing and torch.is_grad_enabled():
            x = checkpoint(block, x, use_reentrant=False)
        elif _as_region(block):
            x = _block_region(block, x)  # type: ignore[misc]
        else:
            x = block(x)
    return x


class FeatureInfo:
    """What each stage of a backbone emits, in timm's ``feature_info`` form, for code written
    against timm's ``features_only`` models (``backbone.feature_info.channels()``).

    ``info`` holds one dict per built stage: ``num_chs`` (channels), ``reduction`` (stride to the
    input), ``module`` (the stage's name in ``named_modules()``, the module whose output is that
    stage's map, channels-last) and ``index`` (the stage index). ``out_indices`` are the stages
    the backbone returns. The accessors answer for those stages, or with ``idx`` for the stage
    index (an int) or indices (a list or tuple) given, whether returned or not.
    """

    def __init__(self, info: list[dict], out_indices: Iterable[int]) -> None:
        self.info = [dict(d) for d in info]
        self.out_indices = tuple(int(i) for i in out_indices)

    def from_other(self, out_indices: Iterable[int]) -> "FeatureInfo":
        """The same stages, with other ``out_indices``."""
        return FeatureInfo(self.info, out_indices)

    def _rows(self, idx: int | Iterable[int] | None) -> list[dict] | dict:
        if idx is None:
            return [self.info[i] for i in self.out_indices]
        if isinstance(idx, int):
            return self.info[idx]
        return [self.info[i] for i in idx]

    def get(self, key: str, idx: int | Iterable[int] | None = None) -> Any:
        """``key`` of the returned stages (``idx=None``), of stage ``idx``, or of stages ``idx``."""
        rows = self._rows(idx)
        return rows[key] if isinstance(rows, dict) else [r[key] for r in rows]

    def get_dicts(self, keys: Iterable[str] | None = None, idx: int | Iterable[int] | None = None) -> Any:
        """The stages' dicts (only ``keys`` where given), selected as in :meth:`get`."""
        rows = self._rows(idx)
        pick = (lambda r: r) if keys is None else (lambda r: {k: r[k] for k in keys})  # noqa: E731
        return pick(rows) if isinstance(rows, dict) else [pick(r) for r in rows]

    def channels(self, idx: int | Iterable[int] | None = None) -> Any:
        """Channels (``num_chs``), selected as in :meth:`get`."""
        return self.get("num_chs", idx)

    def reduction(self, idx: int | Iterable[int] | None = None) -> Any:
        """Strides to the input (``reduction``), selected as in :meth:`get`."""
        return self.get("reduction", idx)

    def module_name(self, idx: int | Iterable[int] | None = None) -> Any:
        """Module names (``module``), selected as in :meth:`get`."""
        return self.get("module", idx)

    def __getitem__(self, item: int) -> dict:
        return self.info[item]

    def __len__(self) -> int:
        return len(self.info)

    def __repr__(self) -> str:
        return f"FeatureInfo({self.info}, out_indices={self.out_indices})"


class Backbone(nn.Module):
    """Abstract base of vtdense backbones.

    Subclasses set, before any forward:
        out_names: keys of the returned dict, e.g. ``["stage1", "stage2", "stage3", "stage4"]``.
        out_channels: channels of each returned map.
        out_strides: stride of each returned map relative to the input image.
        size_divisibility: padding multiple the model prefers (inputs of any size work).
        in_chans: number of input channels.
        out_indices: stage indices (0-based) whose outputs are returned.
        stage_channels, stage_strides: channels and stride of every built stage's output
            (stages up to the last of ``out_indices`` are built).
    """

    out_names: list[str]
    out_channels: list[int]
    out_strides: list[int]
    size_divisibility: int = 32
    in_chans: int = 3

    out_indices: tuple[int, ...]
    stage_channels: list[int]
    stage_strides: list[int]

    def __init__(self) -> None:
        super().__init__()
        # Settle how CPU linear layers run (a short probe, once per process; see cpu_linear) now,
        # eagerly: never first inside a compiled graph, and a bad VTDENSE_CPU_MATMUL fails here.
        cpu_matmul()

    #: leading stages whose weights are frozen (see :meth:`set_frozen_stages`); -1: none
    frozen_stages: int = -1

    def stage_modules(self) -> list[nn.Module]:
        """The built stages in order (each holds what computes that stage's output from the
        previous one's, downsampling included)."""
        raise NotImplementedError

    def frozen_modules(self) -> list[nn.Module]:
        """The modules :attr:`frozen_stages` freezes: the patch embedding, the first
        ``frozen_stages`` stages and their output norms."""
        k = self.frozen_stages
        if k < 0:
            return []
        norms = getattr(self, "out_norms", None)
        names = [f"stage{i + 1}" for i in range(k)]
        return [self.patch_embed, *self.stage_modules()[:k], *(norms[n] for n in names if norms is not None and n in norms)]

    def set_frozen_stages(self, frozen_stages: int) -> None:
        """Freeze the patch embedding (``0``) and the first ``frozen_stages`` stages with their
        output norms (``k >= 1``), as mmdet's ``frozen_stages`` and detectron2's ``freeze_at``:
        their parameters get ``requires_grad=False`` and the modules stay in eval mode, also
        under ``.train()`` (no stochastic depth or dropout there), so their outputs are those of
        inference and autograd stores nothing for them. ``-1`` unfreezes what this froze.

        A stage here begins with its downsampling (Swin's patch merging, MViTv2's pooling
        block), as in timm's layout and detectron2's: ``frozen_stages=k`` freezes exactly what the
        first ``k`` outputs depend on. mmdet's Swin also freezes the patch merging after stage ``k``.

        Raises:
            ValueError: ``frozen_stages`` is not an int from -1 to the number of built stages.
        """
        n = len(self.stage_modules())
        if isinstance(frozen_stages, bool) or not isinstance(frozen_stages, int) or not -1 <= frozen_stages <= n:
            raise ValueError(f"frozen_stages must be an int from -1 (none) to {n} (every stage), got {frozen_stages!r}")
        for m in self.frozen_modules():
            m.requires_grad_(True)
            m.train(self.training)
        self.frozen_stages = frozen_stages
        self.train(self.training)

    def train(self, mode: bool = True) -> "Backbone":
        """``nn.Module.train``, with the :attr:`frozen_stages` kept frozen and in eval mode."""
        super().train(mode)
        for m in self.frozen_modules():
            m.eval()
            m.requires_grad_(False)
        return self

    def output_shape(self) -> dict[str, dict[str, int]]:
        """Channels and stride of each output, keyed like ``forward``'s result."""
        return {
            name: {"channels": c, "stride": s}
            for name, c, s in zip(self.out_names, self.out_channels, self.out_strides)
        }

    @property
    def feature_info(self) -> FeatureInfo:
        """The stages' channels, strides and module names in timm's ``feature_info`` form
        (:class:`FeatureInfo`): ``backbone.feature_info.channels()`` equals ``out_channels`` and
        ``reduction()`` ``out_strides``, as for timm's ``features_only`` model of the same network."""
        if "stage_channels" not in self.__dict__ or "stage_strides" not in self.__dict__:
            # (not an AttributeError: nn.Module would report this property itself as missing)
            raise NotImplementedError(f"{type(self).__name__} sets no stage_channels / stage_strides, which feature_info reads")
        names = {id(m): n for n, m in self.named_modules()}
        info = [dict(num_chs=c, reduction=s, module=names[id(m)], index=i)
                for i, (m, c, s) in enumerate(zip(self.stage_modules(), self.stage_channels, self.stage_strides))]
        return FeatureInfo(info, self.out_indices)

    def check_input(self, x: Tensor) -> None:
        """Raise one clear error for inputs the backbone cannot take."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(self).__name__} expects a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{type(self).__name__} expects an NCHW batch (4-D tensor), got shape {tuple(x.shape)}; "
                "add a batch dimension with x.unsqueeze(0) for a single image"
            )
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"{type(self).__name__} was built for in_chans={self.in_chans} but the input has "
                f"{x.shape[1]} channels (shape {tuple(x.shape)}); pass in_chans={x.shape[1]} to create_backbone"
            )
        if x.shape[2] < 1 or x.shape[3] < 1:
            raise ValueError(f"{type(self).__name__} got an empty image, shape {tuple(x.shape)}")
        if not torch.is_floating_point(x):
            raise TypeError(
                f"{type(self).__name__} expects a floating point image, got dtype {x.dtype}; "
                "convert with x.float() (and normalise) first"
            )

    def emit_pyramid(self, x: Tensor, stages: Iterable[nn.Module]) -> "OrderedDict[str, Tensor]":
        """Run channels-last ``stages`` on ``x`` (B, H, W, C) and collect the requested outputs.

        Uses ``self.out_indices`` / ``self.out_names`` and, when not ``None``, the per-level
        LayerNorms in ``self.out_norms`` (a ModuleDict keyed by output name); returns NCHW maps.
        """
        if not tracing() and x.shape[0] == 0:  # (no size read, so no guard, under compile or export)
            return self._empty_pyramid(x)
        out: OrderedDict[str, Tensor] = OrderedDict()
        names = dict(zip(self.out_indices, self.out_names))
        norms = getattr(self, "out_norms", None)
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in names:
                y = norms[names[i]](x) if norms is not None else x
                out[names[i]] = y.permute(0, 3, 1, 2).contiguous()
        return out

    def _empty_pyramid(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        """The outputs for an empty batch (``x``: ``(0, H, W, C)`` after the patch embedding), as
        torchvision's backbones give them: ``(0, C_k, ceil(H / 2^k), ceil(W / 2^k))`` for stage ``k``
        (0-based), with nothing run. Where ``x`` takes part in autograd they stay on its graph, so a
        loss over them backpropagates (zero gradients)."""
        _, H, W, _ = x.shape
        anchor = x.sum() * 0 if x.requires_grad else None
        out: OrderedDict[str, Tensor] = OrderedDict()
        for i, name, channels in zip(self.out_indices, self.out_names, self.out_channels):
            y = x.new_zeros(0, channels, ceil_div(H, 2**i), ceil_div(W, 2**i))
            out[name] = y + anchor if anchor is not None else y
        return out

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":  # pragma: no cover - abstract
        raise NotImplementedError
