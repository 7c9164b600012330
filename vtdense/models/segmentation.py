"""vtdense backbones as segmentation-models-pytorch (SMP) encoders.

Every name in :func:`vtdense.list_backbones` is registered in SMP's own encoder table
(``segmentation_models_pytorch.encoders.encoders``) as ``vtdense-<name>``, so that

.. code-block:: python

    import segmentation_models_pytorch as smp
    import vtdense.models.segmentation  # noqa: F401  (``import vtdense`` does it too)

    model = smp.UPerNet(encoder_name="vtdense-swinv2_tiny", encoder_weights=None, classes=150)

works like any other SMP model. The encoder follows SMP's convention for transformer
encoders (as ``TimmUniversalEncoder`` does for timm's Swin): ``forward`` returns the input,
a zero-channel placeholder at stride 2, then one map per backbone stage at strides 4/8/16/32,
and ``out_channels`` includes the input channels and the ``0`` placeholder.

SMP's ``get_encoder`` passes only ``depth`` and ``output_stride`` to non-timm encoders, so
backbone options (window size, drop path, ...) and local weights reach the encoder through
:func:`encoder_options` (a context manager) or :func:`build_segmentor`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import segmentation_models_pytorch as smp
from segmentation_models_pytorch.encoders import encoders as _SMP_ENCODERS
from segmentation_models_pytorch.encoders._base import EncoderMixin
import torch.nn.functional as F
from torch import Tensor, nn

from vtdense.backbones.registry import create_backbone, list_backbones
from vtdense.checkpoints.adapt import adapt_input_conv

__all__ = [
    "ENCODER_PREFIX",
    "ARCHITECTURES",
    "VtdenseEncoder",
    "FCNHead",
    "encoder_options",
    "register_smp_encoders",
    "build_segmentor",
    "HEAD_LAYOUTS",
    "DropoutConv2d",
    "apply_mmseg_layout",
    "input_multiple",
    "logits_at",
]

#: Prefix of the SMP encoder names of vtdense backbones.
ENCODER_PREFIX = "vtdense-"

#: Segmentation architectures accepted by :func:`build_segmentor` (lower-case name -> SMP class).
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "upernet": smp.UPerNet,
    "fpn": smp.FPN,
    "unet": smp.Unet,
    "segformer": smp.Segformer,
    "linknet": smp.Linknet,
}

_EXPECTED_STRIDES = [4, 8, 16, 32]

# encoder_depth range each architecture accepts with a stride-4-first (transformer) encoder:
# FPN and the U-shaped decoders read the stride-2 level once depth < 5 and meet the empty placeholder.
_DEPTH_RANGE: dict[str, tuple[int, int]] = {"upernet": (3, 5)}

_PENDING_OPTIONS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "vtdense_encoder_options", default={}
)


@contextlib.contextmanager
def encoder_options(**options: Any) -> Iterator[None]:
    """Pass backbone options to every ``vtdense-*`` SMP encoder built inside the block.

    SMP's ``get_encoder`` drops keyword arguments for registered (non-``tu-``) encoders, so
    this is how ``window_size``, ``drop_path_rate`` and the like reach a vtdense encoder that
    an SMP model builds. ``weights`` (a local checkpoint path or state dict) is loaded with
    :func:`vtdense.load_pretrained` after the backbone is built (a path, Hub id or state dict).

    Example:
        >>> with encoder_options(window_size=8, drop_path_rate=0.3):  # doctest: +SKIP
        ...     model = smp.UPerNet(encoder_name="vtdense-swinv2_tiny", encoder_weights=None)
    """
    token = _PENDING_OPTIONS.set({**_PENDING_OPTIONS.get(), **options})
    try:
        yield
    finally:
        _PENDING_OPTIONS.reset(token)


class _HubWeights(Mapping):
    """``pretrained_settings`` of a vtdense encoder: any Hugging Face Hub id is a valid
    ``encoder_weights``.

    SMP checks ``encoder_weights in pretrained_settings``, downloads ``config.json`` and
    ``model.safetensors`` of ``settings["repo_id"]`` with ``hf_hub_download`` (so the Hub cache,
    ``HF_HUB_OFFLINE`` and the token apply) and calls ``encoder.load_state_dict``, which
    :class:`VtdenseEncoder` routes through :func:`vtdense.load_pretrained` (any layout: timm,
    official, torchvision, ...). Anything that is not a Hub id gets one clear error.
    """

    def __init__(self, encoder_name: str) -> None:
        self.encoder_name = encoder_name

    def _settings(self, key: object) -> dict[str, Any]:
        from vtdense.checkpoints.hub import _split, is_hub_id

        hint = "build_segmentor(..., backbone_weights=...) or encoder_options(weights=...)"
        if not isinstance(key, str) or not is_hub_id(key) or Path(key).is_file():
            raise ValueError(
                f"encoder {self.encoder_name!r}: encoder_weights={key!r} is not a Hugging Face Hub id (org/repo); "
                f"local files and state dicts go through {hint}"
            )
        repo_id, revision, filename = _split(key)
        if filename is not None:
            raise ValueError(
                f"encoder {self.encoder_name!r}: SMP reads only model.safetensors from a Hub repo, not {filename!r}; "
                f"give other files through {hint}"
            )
        return {"repo_id": repo_id, "revision": revision}

    def __contains__(self, key: object) -> bool:
        self._settings(key)
        return True

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self._settings(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __deepcopy__(self, memo: dict) -> "_HubWeights":
        return self


class VtdenseEncoder(nn.Module, EncoderMixin):
    """A vtdense backbone behind SMP's encoder interface.

    In SMP's terms (``_is_torch_*``, read by SMP's encoder tests): not TorchScript-able
    (``torch.jit.script`` raises one ``RuntimeError`` saying so: the backbones use Python-level
    caches, keyword-only arguments and dict outputs that TorchScript cannot compile); exportable
    (``torch.export.export(strict=True)`` gives the eager result, measured for Swin V1, V2 and
    MViTv2); compilable in SMP's sense (``torch.compile(fullgraph=True, dynamic=True)``: one graph,
    no break, the eager result at every size) for all three families.

    Args:
        backbone_name: a name from :func:`vtdense.list_backbones` (without the ``vtdense-`` prefix).
        depth: SMP encoder depth (1-5); depth ``d`` returns the input, the stride-2 placeholder and
            the first ``d - 1`` backbone stages.
        output_stride: must be 32 (window / pooling transformers cannot be dilated).
        weights: optional checkpoint (local path, Hugging Face Hub id or state dict) loaded with
            ``vtdense.load_pretrained``.
        **backbone_kwargs: overrides for :func:`vtdense.create_backbone`. Options set with
            :func:`encoder_options` apply first; these take precedence.

    Raises:
        ValueError: bad depth / output stride, or a backbone whose strides are not 4/8/16/32.
    """

    _is_torch_scriptable = False
    _is_torch_exportable = True
    _is_torch_compilable = True

    def __init__(
        self,
        backbone_name: str,
        depth: int = 5,
        output_stride: int = 32,
        weights: str | Path | Mapping[str, Tensor] | None = None,
        **backbone_kwargs: Any,
    ) -> None:
        nn.Module.__init__(self)
        EncoderMixin.__init__(self)
        if not 1 <= depth <= 5:
            raise ValueError(f"encoder '{ENCODER_PREFIX}{backbone_name}': encoder_depth must be in 1..5, got {depth}")
        options = {**_PENDING_OPTIONS.get(), **backbone_kwargs}
        if weights is None:
            weights = options.pop("weights", None)
        else:
            options.pop("weights", None)
        self.backbone_name = backbone_name
        self._backbone_options = options
        self._weights = weights
        self._depth = depth
        self._output_stride = output_stride
        self._trimmed = False
        if 2 <= depth < 5 and "out_indices" not in options:
            # do not build stages SMP will not read: with or without weights, so that a checkpoint
            # of the model reloads into the model rebuilt from its options alone
            options["out_indices"] = tuple(range(depth - 1))
            self._trimmed = True
        self.backbone = self._build_backbone(options)
        self._in_channels = int(getattr(self.backbone, "in_chans", 3))
        self._out_channels = [self._in_channels, 0, *[int(c) for c in self.backbone.out_channels]][: depth + 1]

    def _build_backbone(self, options: dict[str, Any]) -> nn.Module:
        backbone = create_backbone(self.backbone_name, **options)
        strides = [int(s) for s in backbone.out_strides]
        needed = max(self._depth - 1, 0)
        if strides != _EXPECTED_STRIDES[: len(strides)] or len(strides) < needed:
            raise ValueError(
                f"encoder '{ENCODER_PREFIX}{self.backbone_name}' with encoder_depth={self._depth} needs backbone "
                f"outputs at strides {_EXPECTED_STRIDES[:needed]}, got {strides} (check out_indices in the backbone options)"
            )
        if self._weights is not None:
            from vtdense import load_pretrained

            if self._trimmed:
                # check the weights strictly against the whole backbone, then keep the built stages'
                whole = create_backbone(self.backbone_name, **{k: v for k, v in options.items() if k != "out_indices"})
                load_pretrained(whole, self._weights)
                kept = whole.state_dict()
                backbone.load_state_dict({k: kept[k] for k in backbone.state_dict()}, strict=True)
                del whole, kept
            else:
                load_pretrained(backbone, self._weights)
        return backbone

    def __prepare_scriptable__(self) -> "VtdenseEncoder":
        """``torch.jit.script`` calls this first: refuse with one clear ``RuntimeError``, the error
        SMP's encoder tests expect when ``_is_torch_scriptable`` is False."""
        raise RuntimeError(
            f"encoder '{ENCODER_PREFIX}{self.backbone_name}' is not TorchScript-able (_is_torch_scriptable=False); "
            "use torch.export.export or torch.compile instead"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load the encoder's own state dict, or any backbone checkpoint ``vtdense.load_pretrained``
        reads (SMP calls this with the Hub file of ``encoder_weights``); the load's report is
        ``self.load_report``."""
        own = set(self.state_dict())
        if set(state_dict) <= own and any(k in own for k in state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        from torch.nn.modules.module import _IncompatibleKeys

        from vtdense import load_pretrained

        # stages SMP does not read may not be built (encoder_depth < 5): their weights are dropped
        self.load_report = load_pretrained(self.backbone, state_dict, strict=strict and not self._trimmed)
        return _IncompatibleKeys(list(self.load_report.missing), list(self.load_report.unexpected))

    @property
    def size_divisibility(self) -> int:
        """Padding multiple the backbone prefers."""
        return int(getattr(self.backbone, "size_divisibility", 32))

    def set_in_channels(self, in_channels: int, pretrained: bool = True) -> None:
        """Rebuild the backbone for ``in_channels`` input channels (SMP calls this after ``__init__``
        and after loading ``encoder_weights``). Weights already loaded (SMP's ``encoder_weights``,
        or ``weights``) are kept, the patch embedding's adapted as SMP and timm adapt a first conv:
        summed over the RGB channels for 1 channel, else repeated cyclically and scaled by
        ``3 / in_channels``."""
        if in_channels == self._in_channels:
            return
        keep = (pretrained or self._weights is not None) and self._in_channels == 3
        old = self.backbone.state_dict() if keep else None
        weights, self._weights = self._weights, None  # the file holds the 3-channel form: adapted below
        try:
            self.backbone = self._build_backbone({**self._backbone_options, "in_chans": in_channels})
        finally:
            self._weights = weights
        if old is not None:
            new = self.backbone.state_dict()
            state = {k: adapt_input_conv(k, v, new[k].shape, in_channels) if v.shape != new[k].shape else v
                     for k, v in old.items()}
            self.backbone.load_state_dict(state, strict=True)
        self._in_channels = in_channels
        self._out_channels[0] = in_channels

    def make_dilated(self, output_stride: int) -> None:
        """Dilation is not available; raise one clear error."""
        raise ValueError(
            f"encoder '{ENCODER_PREFIX}{self.backbone_name}' has fixed output strides 4/8/16/32; "
            f"encoder_output_stride={output_stride} is not supported (use 32)"
        )

    def get_stages(self) -> dict[int, list[nn.Module]]:
        """Not used: vtdense encoders cannot be dilated."""
        return {}

    def forward(self, x: Tensor) -> list[Tensor]:
        """Return ``[x, placeholder (B, 0, H/2, W/2), stage1, ...]`` with ``depth + 1`` entries."""
        n_stages = self._depth - 1
        feats: list[Tensor] = [x]
        if self._depth >= 1:
            feats.append(x.new_empty((x.shape[0], 0, x.shape[2] // 2, x.shape[3] // 2)))
        if n_stages > 0:
            maps = self.backbone(x)
            feats.extend(list(maps.values())[:n_stages])
        return feats


def register_smp_encoders() -> list[str]:
    """Register every current vtdense backbone as SMP encoder ``vtdense-<name>``.

    Idempotent; call it again after registering new backbones. ``import vtdense.models.segmentation``
    calls it once.

    Returns:
        The SMP encoder names of all vtdense backbones.
    """
    names = []
    for name in list_backbones():
        key = ENCODER_PREFIX + name
        names.append(key)
        if key in _SMP_ENCODERS:
            continue
        _SMP_ENCODERS[key] = {
            "encoder": VtdenseEncoder,
            "params": {"backbone_name": name},
            "pretrained_settings": _HubWeights(key),
        }
    return names


class FCNHead(nn.Module):
    """Auxiliary FCN head (conv3x3-BN-ReLU, dropout, conv1x1), as in mmseg's UPerNet configs.

    Args:
        in_channels: channels of the feature map it reads (backbone stage 3 by convention).
        num_classes: output classes.
        channels: hidden channels.
        dropout: dropout before the classifier.
    """

    def __init__(self, in_channels: int, num_classes: int, channels: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Dropout2d(dropout),
            nn.Conv2d(channels, num_classes, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits at the resolution of ``x``."""
        return self.block(x)


def build_segmentor(
    arch: str,
    backbone: str,
    num_classes: int,
    *,
    backbone_kwargs: dict[str, Any] | None = None,
    backbone_weights: str | Path | Mapping[str, Tensor] | None = None,
    in_channels: int = 3,
    encoder_depth: int = 5,
    **arch_kwargs: Any,
) -> nn.Module:
    """Build an SMP segmentation model on a vtdense backbone.

    Args:
        arch: one of :data:`ARCHITECTURES` (case-insensitive).
        backbone: a vtdense backbone name (``"swinv2_tiny"``; the ``vtdense-`` prefix is optional).
        num_classes: output classes.
        backbone_kwargs: overrides for :func:`vtdense.create_backbone` (``window_size``, ``drop_path_rate``, ...).
        backbone_weights: backbone checkpoint for ``vtdense.load_pretrained``: a local file of any
            supported format, a Hugging Face Hub id or a state dict.
        in_channels: image channels.
        encoder_depth: SMP encoder depth (UPerNet and FPN need 3..5; 5 uses all four stages).
        **arch_kwargs: passed to the SMP model (``decoder_channels``, ...).

    Raises:
        ValueError: unknown architecture or backbone (the message lists the known ones).
    """
    key = arch.lower()
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown segmentation arch {arch!r}; choose one of {', '.join(sorted(ARCHITECTURES))}")
    lo, hi = _DEPTH_RANGE.get(key, (5, 5))
    if not lo <= encoder_depth <= hi:
        allowed = str(lo) if lo == hi else f"{lo}..{hi}"
        raise ValueError(f"arch {arch!r} on a vtdense backbone needs encoder_depth in {allowed}, got {encoder_depth}")
    name = backbone[len(ENCODER_PREFIX):] if backbone.startswith(ENCODER_PREFIX) else backbone
    if name not in list_backbones():
        raise ValueError(f"unknown backbone {backbone!r}; known backbones: {', '.join(list_backbones())}")
    register_smp_encoders()
    options = dict(backbone_kwargs or {})
    if backbone_weights is not None:
        options["weights"] = backbone_weights
    with encoder_options(**options):
        model = ARCHITECTURES[key](
            encoder_name=ENCODER_PREFIX + name,
            encoder_weights=None,
            encoder_depth=encoder_depth,
            in_channels=in_channels,
            classes=num_classes,
            **arch_kwargs,
        )
    return model


#: Layouts of an SMP model's head (:func:`apply_mmseg_layout`): ``"mmseg"`` (the references') or
#: ``"smp"`` (SMP's model as it builds it).
HEAD_LAYOUTS: tuple[str, ...] = ("mmseg", "smp")


class DropoutConv2d(nn.Conv2d):
    """A ``Conv2d`` that applies ``Dropout2d(p)`` to its input first: mmseg's dropout before
    ``conv_seg``, kept under the conv's own parameter names. ``(N, C_in, H, W) -> (N, C_out, H, W)``."""

    def __init__(self, conv: nn.Conv2d, p: float = 0.1) -> None:
        super().__init__(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                         padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
                         device=conv.weight.device, dtype=conv.weight.dtype)
        self.load_state_dict(conv.state_dict())
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.dropout2d(x, self.p, self.training))


def _mmcv_init(module: nn.Module, classifiers: tuple[nn.Module, ...]) -> None:
    """mmcv's initialisation of mmseg's decode heads: each conv kaiming-normal (fan-out, ReLU) with
    zero bias, each norm 1 / 0, and the classifiers (``conv_seg``) normal with std 0.01, zero bias."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            if any(m is c for c in classifiers):
                nn.init.normal_(m.weight, 0.0, 0.01)
            else:
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)) and m.weight is not None:
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def apply_mmseg_layout(model: nn.Module, aux_head: nn.Module | None = None, dropout: float = 0.1) -> nn.Module:
    """Make an SMP model built by :func:`build_segmentor` (and its auxiliary head) what mmseg builds.

    - The decoder reads the backbone's outputs as they are: SMP's UPerNet puts a second LayerNorm
      on every encoder feature (``decoder.feature_norms``), after the backbone's own output norm;
      those become identities when the backbone has output norms (mmseg's Swin has one norm per
      output, which feeds the head).
    - ``Dropout2d(dropout)`` before the classifier (mmseg's ``dropout_ratio=0.1``).
    - The head leaves the logits at the decoder's resolution (1/4 of the input; SMP's head
      upsamples them x4 with ``align_corners=True``), for :func:`logits_at` to resize them to
      the input's size in one bilinear step with ``align_corners=False``, as mmseg does.
    - The input is not padded to a multiple of 32 (``model.input_multiple = 1``, see
      :func:`input_multiple`): the backbone pads inside, as mmseg's Swin does, so the decoder's
      pooling sees the image and not a padded border.
    - mmcv's initialisation of the decoder, the classifier and ``aux_head``'s layers.

    The model's own ``forward`` then returns logits at 1/4 of the input; ``SegmentationTask`` and
    :func:`vtdense.export` resize them with :func:`logits_at`.

    Args:
        model: an SMP model with ``encoder``, ``decoder`` and ``segmentation_head``; changed in place.
        aux_head: the auxiliary head (:class:`FCNHead`), initialised the same way; ``None``: none.
        dropout: dropout before the classifier.

    Returns:
        ``model``.
    """
    norms = getattr(model.decoder, "feature_norms", None)
    backbone = getattr(model.encoder, "backbone", None)
    if norms is not None and getattr(backbone, "out_norms", None) is not None:
        for i in range(len(norms)):
            norms[i] = nn.Identity()
    head = model.segmentation_head
    head[0] = DropoutConv2d(head[0], dropout)
    if isinstance(head[1], nn.Upsample):
        head[1] = nn.Identity()
    model.input_multiple = 1
    _mmcv_init(model.decoder, ())
    _mmcv_init(head, (head[0],))
    if aux_head is not None:
        convs = [m for m in aux_head.modules() if isinstance(m, nn.Conv2d)]
        _mmcv_init(aux_head, (convs[-1],))
    return model


def input_multiple(model: nn.Module) -> int:
    """The multiple an SMP model built by :func:`build_segmentor` wants its input's sides padded to:
    1 after :func:`apply_mmseg_layout` (its backbone pads inside), else at least 32 (SMP's check)."""
    multiple = getattr(model, "input_multiple", None)
    if multiple is not None:
        return int(multiple)
    return max(32, int(getattr(model.encoder, "size_divisibility", 32)))


def logits_at(logits: Tensor, height: int, width: int) -> Tensor:
    """Head logits ``(N, C, h, w)`` as logits ``(N, C, height, width)`` of the unpadded input: cropped
    when the head gave the (padded) input's size, resized bilinearly with ``align_corners=False``
    (mmseg's ``resize``) when it gave less (:func:`apply_mmseg_layout`'s 1/4)."""
    if logits.shape[-2] >= height and logits.shape[-1] >= width:
        return logits[..., :height, :width]
    return F.interpolate(logits, size=(int(height), int(width)), mode="bilinear", align_corners=False)


register_smp_encoders()
