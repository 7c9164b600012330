"""Detectors from vtdense backbones: backbone -> torchvision FPN -> torchvision head.

Any :class:`~vtdense.backbones.base.Backbone` feeds a torchvision
:class:`~torchvision.ops.FeaturePyramidNetwork` (P2-P5 for the R-CNNs plus a max-pooled P6;
P3-P5 plus P6/P7 for RetinaNet and FCOS) and one of torchvision's detectors: Mask R-CNN,
Faster R-CNN, RetinaNet or FCOS. Everything is built from the backbone's declared
``out_channels`` / ``out_strides``; no dummy image is run.

Images reaching the model are already resized by the data pipeline, so the detector's
:class:`~torchvision.models.detection.transform.GeneralizedRCNNTransform` is replaced by
:class:`NoResizeTransform`, which normalises and pads to the backbone's ``size_divisibility``
but never resizes. Head outputs are cast to fp32 so box decoding, NMS and RoIAlign stay in fp32
under mixed precision.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection import FCOS, FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, LastLevelMaxPool, LastLevelP6P7

from vtdense.backbones.base import Backbone
from vtdense.layers.cpu_linear import apply_linear
from vtdense.layers.opaque_conv import opaque_convs
from vtdense.layers.tracing import fresh_tables, tracing
from vtdense.models.mask_rois import check_mask_rois_multiple, pad_mask_rois
from vtdense.models.paste_masks import paste_masks
from vtdense.models.rcnn_waits import LowWaitRoIHeads, device_constant, reduce_host_waits
from vtdense.models.roi_pool import LevelSortedRoIAlign
from vtdense.models.retinanet_waits import LOSS_NORMALIZATIONS
from vtdense.options import check_int, check_number

__all__ = [
    "HEADS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NoResizeTransform",
    "P6P7",
    "BackboneWithFPN",
    "BoxHead",
    "BoxPredictor",
    "Float32AnchorGenerator",
    "build_detector",
    "check_size_divisibility",
    "list_heads",
    "set_roi_alignment",
    "set_size_divisibility",
    "unpasted_masks",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: Head options used by ``slim_heads=True`` (the CPU demo), for options left at ``None``.
SLIM_DEFAULTS: dict[str, int] = {"mask_head_channels": 64, "box_head_width": 256, "rois_per_image": 64}
#: Published torchvision (and Swin / mmdet) head sizes.
FULL_DEFAULTS: dict[str, int] = {"mask_head_channels": 256, "box_head_width": 1024, "rois_per_image": 512}


class NoResizeTransform(GeneralizedRCNNTransform):
    """``GeneralizedRCNNTransform`` that normalises and pads but never resizes.

    The data pipeline resizes images (and their targets); resizing again inside the model would
    change the scale the head sees. ``postprocess`` is then an identity rescale, so detections
    come back in the coordinates of the images given to the model.
    """

    #: Paste each detection's mask into its image (torchvision's output). ``False`` (see
    #: :func:`unpasted_masks`): in prediction the masks stay the mask head's ``(N, 1, M, M)``
    #: probabilities, for a caller that pastes them into another frame once, such as the original
    #: image before the data pipeline resized it.
    paste: bool = True

    def __init__(
        self,
        image_mean: Sequence[float] = IMAGENET_MEAN,
        image_std: Sequence[float] = IMAGENET_STD,
        size_divisible: int = 32,
    ) -> None:
        # min_size / max_size are unused because resize is the identity.
        super().__init__(
            min_size=1, max_size=1, image_mean=list(image_mean), image_std=list(image_std), size_divisible=size_divisible
        )

    def normalize(self, image: Tensor) -> Tensor:
        """``(C, H, W)`` float image in 0..1 -> ``(image - mean) / std``, torchvision's arithmetic with
        the mean and std kept on the image's device (torchvision copies them there for every image: two
        blocking copies per image on a GPU)."""
        if not image.is_floating_point() or fresh_tables(image.device):
            return super().normalize(image)
        mean = device_constant(self, "image_mean", image.dtype, image.device)
        std = device_constant(self, "image_std", image.dtype, image.device)
        return (image - mean[:, None, None]) / std[:, None, None]

    def resize(
        self, image: Tensor, target: dict[str, Tensor] | None = None
    ) -> tuple[Tensor, dict[str, Tensor] | None]:
        """Identity: images arrive already resized."""
        return image, target

    def postprocess(
        self, result: list[dict[str, Tensor]], image_shapes: list[tuple[int, int]],
        original_image_sizes: list[tuple[int, int]],
    ) -> list[dict[str, Tensor]]:
        """Detections in the coordinates of the images given, masks pasted into them.

        The images were not resized, so the boxes stay as they are, where torchvision multiplies
        them by ratios of 1 (made from Python numbers copied to the device: waits on a GPU), and
        the masks are pasted by :func:`vtdense.models.paste_masks.paste_masks` (the same values
        as torchvision's, with one wait per image instead of about a dozen per detection)."""
        if self.training or tracing() or any(tuple(a) != tuple(b) for a, b in zip(image_shapes, original_image_sizes)):
            return super().postprocess(result, image_shapes, original_image_sizes)
        if not self.paste:
            return result
        for pred, shape in zip(result, original_image_sizes):
            if "keypoints" in pred:  # no vtdense head predicts them: torchvision's own path
                return super().postprocess(result, image_shapes, original_image_sizes)
            if "masks" in pred:
                pred["masks"] = paste_masks(pred["masks"], pred["boxes"], shape)
        return result

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(normalize(mean={self.image_mean}, std={self.image_std}), "
            f"size_divisible={self.size_divisible}, no resize)"
        )


class P6P7(LastLevelP6P7):
    """torchvision's ``LastLevelP6P7`` (same convs and state-dict keys) whose ReLU between P6 and P7
    can be left out: ``relu_before_p7=False`` is mmdet's RetinaNet FPN (``relu_before_extra_convs
    =False``: ``P7 = conv(P6)``), ``True`` torchvision's and detectron2's (``P7 = conv(relu(P6))``)."""

    relu_before_p7: bool = True

    def forward(self, p: list[Tensor], c: list[Tensor], names: list[str]) -> tuple[list[Tensor], list[str]]:
        source = p[-1] if self.use_P5 else c[-1]
        p6 = self.p6(source)
        p7 = self.p7(F.relu(p6) if self.relu_before_p7 else p6)
        return [*p, p6, p7], [*names, "p6", "p7"]


class BackboneWithFPN(nn.Module):
    """A vtdense backbone followed by a torchvision FPN.

    Output keys are ``p{log2(stride)}`` (``p2`` ... ``p5``) plus the extra block's levels
    (``pool`` for :class:`LastLevelMaxPool`, ``p6``/``p7`` for :class:`LastLevelP6P7`).

    Attributes:
        body: the backbone.
        fpn: the feature pyramid.
        out_channels: channels of every pyramid level (what torchvision heads read).
        in_names: backbone outputs fed to the FPN.
        level_names: pyramid level names in order, extra levels included.
        level_strides: stride of each pyramid level.
    """

    def __init__(
        self,
        backbone: Backbone,
        out_channels: int = 256,
        *,
        min_stride: int = 4,
        extra: str | None = "maxpool",
        p6p7_from: str = "p5",
        p7_relu: bool = True,
    ) -> None:
        """Build the FPN from ``backbone.out_channels`` / ``out_strides``.

        Args:
            backbone: a vtdense backbone.
            out_channels: FPN channels.
            min_stride: backbone outputs with a smaller stride are not used (8 for RetinaNet/FCOS).
            extra: ``"maxpool"`` (P6 by max-pooling P5), ``"p6p7"`` (two stride-2 convs) or ``None``.
            p6p7_from: ``"p5"`` or ``"c5"``: the input of P6 when ``extra="p6p7"``.
            p7_relu: ``extra="p6p7"``: a ReLU between P6 and P7 (torchvision, detectron2); mmdet's
                RetinaNet has none.

        Raises:
            ValueError: the backbone lacks the contract attributes, has non power-of-two strides,
                or an option is not one of its choices.
        """
        super().__init__()
        for attr in ("out_names", "out_channels", "out_strides"):
            if not hasattr(backbone, attr):
                raise ValueError(f"backbone {type(backbone).__name__} has no {attr!r}; it must follow vtdense's Backbone contract")
        names, channels, strides = list(backbone.out_names), list(backbone.out_channels), list(backbone.out_strides)
        if not (len(names) == len(channels) == len(strides)) or not names:
            raise ValueError(
                f"backbone {type(backbone).__name__} declares {len(names)} out_names, {len(channels)} out_channels "
                f"and {len(strides)} out_strides; they must be non-empty and the same length"
            )
        keep = [i for i, s in enumerate(strides) if s >= min_stride]
        if not keep:
            raise ValueError(f"backbone out_strides {strides} has no level with stride >= {min_stride}")
        for s in strides:
            if s <= 0 or s & (s - 1):
                raise ValueError(f"backbone out_strides must be powers of two, got {strides}")
        if any(b <= a for a, b in zip(strides, strides[1:])):
            raise ValueError(f"backbone out_strides must be increasing, got {strides}")

        self.body = backbone
        self.in_names = [names[i] for i in keep]
        in_channels = [channels[i] for i in keep]
        in_strides = [strides[i] for i in keep]
        self._rename = {n: f"p{int(math.log2(s))}" for n, s in zip(self.in_names, in_strides)}

        extra_block: ExtraFPNBlock | None
        extra_names: list[str]
        if extra == "maxpool":
            extra_block, extra_names, extra_strides = LastLevelMaxPool(), ["pool"], [in_strides[-1] * 2]
        elif extra == "p6p7":
            if p6p7_from not in ("p5", "c5"):
                raise ValueError(f"unknown p6p7_from {p6p7_from!r}; choose 'p5' or 'c5'")
            src_channels = out_channels if p6p7_from == "p5" else in_channels[-1]
            extra_block = P6P7(src_channels, out_channels)
            extra_block.relu_before_p7 = bool(p7_relu)
            # torchvision picks the source from the channel counts; make the choice explicit.
            extra_block.use_P5 = p6p7_from == "p5"
            last = int(math.log2(in_strides[-1]))
            extra_names = [f"p{last + 1}", f"p{last + 2}"]
            extra_strides = [in_strides[-1] * 2, in_strides[-1] * 4]
        elif extra is None:
            extra_block, extra_names, extra_strides = None, [], []
        else:
            raise ValueError(f"unknown FPN extra block {extra!r}; choose 'maxpool', 'p6p7' or None")

        # (its convs run as one op each in compiled graphs: one graph for every batch size)
        self.fpn = opaque_convs(FeaturePyramidNetwork(in_channels, out_channels, extra_blocks=extra_block))
        self.out_channels = out_channels
        self.level_names = [self._rename[n] for n in self.in_names] + extra_names
        self.level_strides = in_strides + extra_strides
        self.size_divisibility = int(getattr(backbone, "size_divisibility", 32))
        self._register_load_state_dict_pre_hook(_drop_unemitted_out_norms, with_module=True)

    @property
    def fpn_level_names(self) -> list[str]:
        """Pyramid levels that come from backbone features (no extra block levels)."""
        return [self._rename[n] for n in self.in_names]

    def forward(self, x: Tensor) -> "OrderedDict[str, Tensor]":
        """Backbone features -> pyramid ``{level name: NCHW}``, stride order."""
        feats = self.body(x)
        missing = [n for n in self.in_names if n not in feats]
        if missing:
            raise KeyError(f"backbone output lacks {missing}; it returned {list(feats)}")
        inputs = OrderedDict((self._rename[n], feats[n]) for n in self.in_names)
        return self.fpn(inputs)


def _drop_unemitted_out_norms(module: BackboneWithFPN, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-time hook: drop the checkpoint's output norms of backbone outputs this backbone does not
    emit. Detectors saved before their backbones were built without the outputs the FPN skips
    (RetinaNet and FCOS carried an unused stride-4 norm) then load into the current ones."""
    emitted = set(getattr(module.body, "out_names", ()))
    start = prefix + "body.out_norms."
    for key in [k for k in state_dict if k.startswith(start)]:
        if key[len(start):].split(".", 1)[0] not in emitted:
            del state_dict[key]


def _cast_float(obj: Any) -> Any:
    """Half-precision tensors in ``obj`` cast to float32; float32 and float64 ones kept."""
    if isinstance(obj, Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_float(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_float(v) for k, v in obj.items()}
    return obj


def _fp32_outputs_hook(module: nn.Module, args: Any, output: Any) -> Any:
    return _cast_float(output)


def _keep_fp32(*modules: nn.Module | None) -> None:
    """Cast these modules' half-precision outputs to fp32 so box decoding / losses never run in bf16/fp16."""
    for m in modules:
        if m is not None:
            m.register_forward_hook(_fp32_outputs_hook)


class Float32AnchorGenerator(AnchorGenerator):
    """torchvision's ``AnchorGenerator`` that builds float32 anchors (float64 for float64 maps), places them at fixed
    level strides, and keeps the anchors of its last few sizes.

    ``strides`` (one per level, as mmdet's and detectron2's anchor generators take them): the anchors
    of level ``l`` are centred at ``(k * strides[l], j * strides[l])`` for every cell ``(j, k)`` of its
    map. torchvision derives each stride as ``padded size // map size``, which is not the level's
    stride where the map's size was rounded up: a 1088-wide batch has a 17-cell P6 map (stride 64),
    and ``1088 // 17`` is 64, but an 800-high one has a 13-cell P6 map and ``800 // 13 = 61``, so its
    last row of anchors sits at 732 instead of 768 (P7 of RetinaNet: ``800 // 7 = 114``, 684 instead
    of 768). ``None``: torchvision's derived strides.

    torchvision takes the anchors' dtype from the feature maps, so under bf16 autocast the anchors
    (and every box decoded from them) would be bfloat16: 8 bits of mantissa, a box edge near 800 px
    off by up to 4 px. Only the maps' sizes and device are used, so empty float32 stand-ins replace them;
    float64 maps (``--trainer.precision 64``) get float64 anchors, as RoIAlign takes boxes of its maps' dtype.

    The anchors depend only on the padded batch size and the maps' sizes, and torchvision builds them
    again in every forward (about ten small kernels per pyramid level, plus one concatenation per
    image). The last :attr:`cache_size` results are kept, keyed by those sizes, the device and
    whether inference mode is on; every image of a batch gets the same tensor, which the heads only
    read. Nothing is kept while a graph is built or a CUDA graph records.
    """

    #: how many sizes' anchors are kept (about 4 MB each for an 800x1333 batch on P2-P6)
    cache_size: int = 8

    def __init__(self, sizes: Any = ((128, 256, 512),), aspect_ratios: Any = ((0.5, 1.0, 2.0),),
                 strides: Sequence[int] | None = None) -> None:
        super().__init__(sizes, aspect_ratios)
        if strides is not None:
            strides = tuple(int(s) for s in strides)
            if len(strides) != len(self.sizes) or any(s < 1 for s in strides):
                raise ValueError(f"strides {list(strides)}: give one positive stride per level ({len(self.sizes)} levels)")
        self.strides = strides

    def _build_anchors(self, image_list: Any, maps: list[Tensor]) -> list[Tensor]:
        """torchvision's anchors, at :attr:`strides` where they are set."""
        if self.strides is None:
            return super().forward(image_list, maps)
        if len(maps) != len(self.strides):
            raise ValueError(f"{len(maps)} feature maps but {len(self.strides)} anchor strides")
        device = maps[0].device
        self.set_cell_anchors(maps[0].dtype, device)
        per_level = []
        for m, stride, cell in zip(maps, self.strides, self.cell_anchors):
            h, w = m.shape[-2:]
            # cell centres at multiples of the stride (Python numbers: no host-to-device copy), row-major
            ys = torch.arange(h, dtype=torch.int32, device=device) * stride
            xs = torch.arange(w, dtype=torch.int32, device=device) * stride
            y, x = torch.meshgrid(ys, xs, indexing="ij")
            x, y = x.reshape(-1), y.reshape(-1)
            shifts = torch.stack((x, y, x, y), dim=1)
            per_level.append((shifts[:, None, :] + cell[None, :, :]).reshape(-1, 4))
        anchors = torch.cat(per_level)
        return [anchors for _ in image_list.image_sizes]

    def forward(self, image_list: Any, feature_maps: list[Tensor]) -> list[Tensor]:
        """Anchors per image, ``[sum_l(A * H_l * W_l), 4]`` float32 XYXY in input-image coordinates
        (float64 where the maps are)."""
        device = feature_maps[0].device
        dtype = torch.float64 if feature_maps[0].dtype == torch.float64 else torch.float32
        key = (tuple(image_list.tensors.shape[-2:]), tuple(tuple(f.shape[-2:]) for f in feature_maps), device,
               dtype, torch.is_inference_mode_enabled())
        cache: OrderedDict = self.__dict__.setdefault("_anchors", OrderedDict())
        cached = not fresh_tables(device)
        if cached and key in cache:
            cache.move_to_end(key)
            return [cache[key]] * len(image_list.image_sizes)
        shapes = [f.new_empty((0, 0, *f.shape[-2:]), dtype=dtype) for f in feature_maps]
        anchors = self._build_anchors(image_list, shapes)
        if cached and anchors:
            cache[key] = anchors[0]
            while len(cache) > self.cache_size:
                cache.popitem(last=False)
        return anchors


def _anchor_sizes(
    strides: Sequence[int], anchor_sizes: Sequence[float] | None, factor: float
) -> list[float]:
    if anchor_sizes is None:
        return [factor * s for s in strides]
    if len(anchor_sizes) != len(strides):
        raise ValueError(
            f"anchor_sizes has {len(anchor_sizes)} entries but the pyramid has {len(strides)} levels "
            f"(strides {list(strides)}); give one base size per level"
        )
    return [float(a) for a in anchor_sizes]


def _pick(value: int | None, key: str, slim: bool) -> int:
    if value is not None:
        return int(value)
    return (SLIM_DEFAULTS if slim else FULL_DEFAULTS)[key]


class BoxHead(TwoMLPHead):
    """torchvision's ``TwoMLPHead`` (the same layers and state-dict keys, ``fc6`` / ``fc7``) with
    its linear layers through :func:`vtdense.layers.cpu_linear.linear`: oneDNN on the CPU where
    that is faster, ``F.linear`` otherwise. ``(R, C, 7, 7)`` RoI features -> ``(R, width)``."""

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(apply_linear(self.fc6, x.flatten(start_dim=1)))
        return F.relu(apply_linear(self.fc7, x))


class BoxPredictor(FastRCNNPredictor):
    """torchvision's ``FastRCNNPredictor`` (same layers and keys) with its linear layers through
    :func:`vtdense.layers.cpu_linear.linear`. ``(R, width)`` (or ``(R, width, 1, 1)``) ->
    class logits ``(R, classes)`` and box deltas ``(R, 4 * classes)``."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.dim() == 4:
            torch._assert(list(x.shape[2:]) == [1, 1], f"box features must be (R, C) or (R, C, 1, 1), got {list(x.shape)}")
        x = x.flatten(1)
        return apply_linear(self.cls_score, x), apply_linear(self.bbox_pred, x)


def _init_box_head(head: BoxHead, predictor: BoxPredictor) -> None:
    """mmdet 2.x's initialisation of the two-FC box head (``Shared2FCBBoxHead``): the shared FCs
    Xavier-uniform, the class scores normal with std 0.01, the box deltas normal with std 0.001,
    all biases zero (detectron2's FastRCNNOutputLayers draws the same two normals; torchvision keeps
    ``nn.Linear``'s default)."""
    for fc in (head.fc6, head.fc7):
        nn.init.xavier_uniform_(fc.weight)
        nn.init.zeros_(fc.bias)
    nn.init.normal_(predictor.cls_score.weight, std=0.01)
    nn.init.normal_(predictor.bbox_pred.weight, std=0.001)
    nn.init.zeros_(predictor.cls_score.bias)
    nn.init.zeros_(predictor.bbox_pred.bias)


def _rcnn(
    neck: BackboneWithFPN, num_classes: int, masks: bool, opts: dict[str, Any], head_kwargs: dict[str, Any]
) -> nn.Module:
    sizes = _anchor_sizes(neck.level_strides, opts["anchor_sizes"], 8.0)
    anchor_gen = Float32AnchorGenerator(
        sizes=tuple((s,) for s in sizes), aspect_ratios=(tuple(opts["aspect_ratios"]),) * len(sizes),
        strides=neck.level_strides,
    )
    roi_names = neck.fpn_level_names
    # sampling_ratio 0: adaptive (ceil(RoI size / output size) samples per bin), as mmdet 2.x and detectron2
    box_pool = MultiScaleRoIAlign(featmap_names=roi_names, output_size=7, sampling_ratio=0)
    width = _pick(opts["box_head_width"], "box_head_width", opts["slim"])
    c = neck.out_channels
    box_head, box_predictor = BoxHead(c * 7 * 7, width), BoxPredictor(width, num_classes + 1)
    _init_box_head(box_head, box_predictor)
    kwargs: dict[str, Any] = dict(
        rpn_anchor_generator=anchor_gen,
        box_roi_pool=box_pool,
        box_head=box_head,
        box_predictor=box_predictor,
        box_batch_size_per_image=_pick(opts["rois_per_image"], "rois_per_image", opts["slim"]),
        box_detections_per_img=opts["detections_per_img"],
        box_score_thresh=opts["score_thresh"],
        # proposals kept per image after the RPN's NMS in training: 1000 as mmdet and detectron2
        # (torchvision's default 2000); 1000 in evaluation as all three
        rpn_post_nms_top_n_train=1000,
    )
    if masks:
        mc = _pick(opts["mask_head_channels"], "mask_head_channels", opts["slim"])
        kwargs["mask_roi_pool"] = MultiScaleRoIAlign(featmap_names=roi_names, output_size=14, sampling_ratio=0)
        kwargs["mask_head"] = MaskRCNNHeads(c, [mc] * opts["mask_head_layers"], 1)
        kwargs["mask_predictor"] = MaskRCNNPredictor(mc, mc, num_classes + 1)
    kwargs.update(head_kwargs)
    cls = MaskRCNN if masks else FasterRCNN
    # min/max size are placeholders: the transform is replaced below.
    model = cls(neck, num_classes=None, min_size=1, max_size=1, **kwargs)
    _keep_fp32(model.rpn.head, model.roi_heads.box_predictor, getattr(model.roi_heads, "mask_predictor", None))
    reduce_host_waits(model)
    # the RPN's and the RoI box head's regression loss: L1 (beta 0) as mmdet and detectron2; torchvision 1/9
    model.rpn.box_loss_beta = model.roi_heads.box_loss_beta = float(opts["box_loss_beta"])
    if opts["rpn_min_pos_iou"] is not None:  # mmdet's RPN assigner (torchvision's matcher otherwise)
        model.rpn.proposal_matcher.min_low_quality = float(opts["rpn_min_pos_iou"])
    if masks:
        pad_mask_rois(model.roi_heads, opts["mask_rois_multiple"])
    return model


def _dense(
    cls: type[nn.Module],
    anchor_gen: AnchorGenerator,
    neck: BackboneWithFPN,
    num_classes: int,
    opts: dict[str, Any],
    head_kwargs: dict[str, Any],
) -> nn.Module:
    """A one-stage torchvision detector (RetinaNet / FCOS) on ``neck`` with fp32 head outputs."""
    kwargs: dict[str, Any] = dict(
        anchor_generator=anchor_gen,
        detections_per_img=opts["detections_per_img"],
        score_thresh=opts["score_thresh"],
    )
    kwargs.update(head_kwargs)
    model = cls(neck, num_classes + 1, min_size=1, max_size=1, **kwargs)
    _keep_fp32(model.head)
    return model


def _retinanet(
    neck: BackboneWithFPN, num_classes: int, opts: dict[str, Any], head_kwargs: dict[str, Any]
) -> nn.Module:
    sizes = _anchor_sizes(neck.level_strides, opts["anchor_sizes"], 4.0)
    anchor_gen = Float32AnchorGenerator(
        sizes=tuple((s, s * 2 ** (1 / 3), s * 2 ** (2 / 3)) for s in sizes),
        aspect_ratios=(tuple(opts["aspect_ratios"]),) * len(sizes),
        strides=neck.level_strides,
    )
    model = reduce_host_waits(_dense(RetinaNet, anchor_gen, neck, num_classes, opts, head_kwargs))
    # focal and box losses over the batch's foreground anchors (mmdet), not per image (torchvision)
    model.head.classification_head.loss_normalization = opts["retinanet_loss_norm"]
    model.head.regression_head.loss_normalization = opts["retinanet_loss_norm"]
    return model


def _fcos(neck: BackboneWithFPN, num_classes: int, opts: dict[str, Any], head_kwargs: dict[str, Any]) -> nn.Module:
    # FCOS derives its per-level regression ranges from the anchor size, which must be the stride.
    sizes = _anchor_sizes(neck.level_strides, opts["anchor_sizes"], 1.0)
    anchor_gen = Float32AnchorGenerator(sizes=tuple((s,) for s in sizes), aspect_ratios=((1.0,),) * len(sizes),
                                        strides=neck.level_strides)
    model = _dense(FCOS, anchor_gen, neck, num_classes, opts, head_kwargs)
    # torchvision's FCOS head norms with GroupNorm(32). At 32 FPN channels that is one channel per
    # group, which normalises P7's 1x1 map (images up to 128 px) to a constant, and fails in training
    # at batch 1; two channels per group keep it defined. The parameters are the same either way.
    for m in model.head.modules():
        if isinstance(m, nn.GroupNorm) and m.num_channels // m.num_groups < 2:
            m.num_groups = max(1, m.num_channels // 2)
    return model


#: head name -> (FPN extra block, smallest backbone stride used, builder)
HEADS: dict[str, tuple[str, int, Callable[..., nn.Module]]] = {
    "mask_rcnn": ("maxpool", 4, lambda n, k, o, h: _rcnn(n, k, True, o, h)),
    "faster_rcnn": ("maxpool", 4, lambda n, k, o, h: _rcnn(n, k, False, o, h)),
    "retinanet": ("p6p7", 8, _retinanet),
    "fcos": ("p6p7", 8, _fcos),
}

#: default P6/P7 source per head: mmdet's Swin RetinaNet builds P6 from C5, torchvision's FCOS from P5.
_P6P7_FROM: dict[str, str] = {"retinanet": "c5", "fcos": "p5"}


def list_heads() -> list[str]:
    """Head names accepted by :func:`build_detector`."""
    return sorted(HEADS)


def build_detector(
    backbone: Backbone | str,
    head: str = "mask_rcnn",
    num_classes: int = 80,
    *,
    fpn_channels: int = 256,
    backbone_kwargs: dict[str, Any] | None = None,
    backbone_weights: Any = None,
    slim_heads: bool = False,
    mask_head_channels: int | None = None,
    mask_head_layers: int = 4,
    box_head_width: int | None = None,
    rois_per_image: int | None = None,
    anchor_sizes: Sequence[float] | None = None,
    aspect_ratios: Sequence[float] = (0.5, 1.0, 2.0),
    p6p7_from: str | None = None,
    detections_per_img: int = 100,
    score_thresh: float = 0.05,
    image_mean: Sequence[float] = IMAGENET_MEAN,
    image_std: Sequence[float] = IMAGENET_STD,
    head_kwargs: dict[str, Any] | None = None,
    size_divisibility: int | None = None,
    mask_rois_multiple: int | None = 32,
    box_loss_beta: float = 0.0,
    rpn_min_pos_iou: float | None = None,
    retinanet_loss_norm: str = "batch",
    roi_aligned: bool = True,
    binary_mask_targets: bool = True,
) -> nn.Module:
    """Build a torchvision detector on a vtdense backbone with an FPN.

    Args:
        backbone: a :class:`Backbone` or a registered backbone name (see ``vtdense.list_backbones``).
            A backbone built by name emits only the outputs the FPN reads (for RetinaNet and FCOS
            ``out_indices`` from stride 8 on, as mmdet's ``out_indices=(1, 2, 3)``) unless
            ``backbone_kwargs`` sets ``out_indices``: an output norm of an unread output would get
            no gradient, which fails distributed training (DDP without ``find_unused_parameters``).
        head: one of :func:`list_heads`: ``mask_rcnn``, ``faster_rcnn``, ``retinanet``, ``fcos``.
        num_classes: number of object classes, background excluded; labels are ``1..num_classes``
            and torchvision heads get ``num_classes + 1`` outputs.
        fpn_channels: FPN channels.
        backbone_kwargs: overrides for ``create_backbone`` when ``backbone`` is a name.
        backbone_weights: backbone checkpoint loaded with ``vtdense.load_pretrained``: a Hugging Face
            Hub id (``"timm/swin_tiny_patch4_window7_224.ms_in1k"``), a local file of any supported
            format, or a state dict. Its report is ``model.backbone.body.load_report``.
        slim_heads: use small R-CNN heads (64-channel mask head, 256-wide box head, 64 RoIs per
            image) for options left at ``None``; the published sizes are 256 / 1024 / 512.
        mask_head_channels: Mask R-CNN mask head conv channels.
        mask_head_layers: number of mask head convs (4 published).
        box_head_width: width of the R-CNN two-FC box head.
        rois_per_image: RoIs sampled per image to train the R-CNN box/mask heads.
        anchor_sizes: base anchor size per pyramid level (extra levels included). Defaults:
            ``8 * stride`` (R-CNN RPN), ``4 * stride`` with 3 octave scales (RetinaNet),
            ``stride`` (FCOS, where it sets the regression ranges).
        aspect_ratios: anchor aspect ratios (R-CNN RPN and RetinaNet).
        p6p7_from: ``"p5"`` or ``"c5"``: P6 input for RetinaNet / FCOS (defaults ``c5`` / ``p5``).
        detections_per_img: detections kept per image.
        score_thresh: minimum detection score.
        image_mean: normalisation mean (images arrive in 0..1).
        image_std: normalisation std.
        head_kwargs: extra keyword arguments for the torchvision detector class
            (e.g. ``rpn_post_nms_top_n_test``, ``nms_thresh``).
        size_divisibility: batches are zero-padded to a multiple of this (height and width);
            ``None``: the backbone's own ``size_divisibility`` (32 for Swin and MViTv2). A coarser
            grid (64, 128) bounds the number of distinct batch shapes, so per-shape set-up (cuDNN
            plans, ``torch.compile`` graphs) is paid fewer times, at the cost of more padded pixels.
            It must be a multiple of the backbone's.
        mask_rois_multiple: Mask R-CNN on CUDA: the mask head's RoI batch (positive proposals in
            training, detections in inference) is zero-padded to a multiple of this and the padded
            rows dropped from its logits, so cuDNN sets up plans for a few batch sizes instead of
            one per count (:mod:`vtdense.models.mask_rois`). Same losses and masks. ``None``: off.
        box_loss_beta: R-CNN heads: the smooth L1 beta of the RPN's and the RoI box head's
            regression losses; 0 (the default) is L1, as mmdet and detectron2; torchvision uses 1/9.
        rpn_min_pos_iou: R-CNN heads: ``None`` (the default) matches anchors to gt boxes as
            torchvision and detectron2 do: each gt's best anchors are positives whatever their IoU. A
            number matches as mmdet's RPN assigner (``MaxIoUAssigner``, ``min_pos_iou``; 0.3 in the
            mmdet configs behind the official Swin results): a gt's best anchors become positives
            only where that IoU is at least this, so a gt smaller than every anchor gets none; and
            an anchor that is the best of several gts is assigned the last of them, as mmdet does.
        retinanet_loss_norm: RetinaNet: ``"batch"`` (mmdet) divides the batch's summed focal and
            box losses by its number of foreground anchors (each image counting at least 1);
            ``"image"`` (torchvision) divides each image's by its own and averages over the images.
        roi_aligned: R-CNN heads: RoIAlign with the half-pixel offset (``aligned=True``) for the
            box and mask heads' features and the mask targets, as mmdet 2.x (``RoIAlign``) and
            detectron2 (``ROIAlignV2``); ``False``: torchvision's ``aligned=False``, which samples
            half a pixel right of and below each bin's centre.
        binary_mask_targets: Mask R-CNN: mask targets thresholded at 0.5, as mmdet and detectron2;
            ``False``: torchvision's soft targets (:mod:`vtdense.models.mask_targets`).

    Returns:
        The torchvision detector; ``model.backbone`` is a :class:`BackboneWithFPN` and
        ``model.transform`` a :class:`NoResizeTransform`.

    Raises:
        ValueError: unknown head (the message lists the choices), bad option or backbone.
    """
    if head not in HEADS:
        raise ValueError(f"unknown detection head {head!r}; choose one of {', '.join(list_heads())}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int (background excluded), got {num_classes!r}")
    if retinanet_loss_norm not in LOSS_NORMALIZATIONS:
        raise ValueError(f"retinanet_loss_norm={retinanet_loss_norm!r}: choose one of {', '.join(LOSS_NORMALIZATIONS)}")
    if isinstance(box_loss_beta, bool) or not isinstance(box_loss_beta, (int, float)) or not box_loss_beta >= 0:
        raise ValueError(f"box_loss_beta must be a number >= 0 (0: L1), got {box_loss_beta!r}")
    check_number("rpn_min_pos_iou", rpn_min_pos_iou, low=0.0, high=1.0, optional=True)
    if rpn_min_pos_iou is not None and head not in ("mask_rcnn", "faster_rcnn"):
        raise ValueError(f"rpn_min_pos_iou applies to the R-CNN heads (mask_rcnn, faster_rcnn); head {head!r} has no RPN")
    for name, value in (("roi_aligned", roi_aligned), ("binary_mask_targets", binary_mask_targets)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    extra, min_stride, builder = HEADS[head]
    if isinstance(backbone, str):
        backbone = _backbone_for_neck(backbone, dict(backbone_kwargs or {}), min_stride)
    elif backbone_kwargs:
        raise ValueError("backbone_kwargs only apply when backbone is given by name")
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"backbone must be a vtdense Backbone or a backbone name, got {type(backbone).__name__}")
    if mask_head_layers < 1:
        raise ValueError(f"mask_head_layers must be >= 1, got {mask_head_layers}")
    check_int("fpn_channels", fpn_channels)
    check_int("detections_per_img", detections_per_img)
    for name, value in (("mask_head_channels", mask_head_channels), ("box_head_width", box_head_width),
                        ("rois_per_image", rois_per_image)):
        check_int(name, value, optional=True)
    check_number("score_thresh", score_thresh, low=0.0, high=1.0)
    check_mask_rois_multiple(mask_rois_multiple)
    if backbone_weights is not None:
        from vtdense.checkpoints.convert import load_pretrained

        backbone.load_report = load_pretrained(backbone, backbone_weights)

    if head == "fcos" and fpn_channels % 32:
        raise ValueError(f"fpn_channels={fpn_channels}: the fcos head uses GroupNorm(32), so it must be a multiple of 32")
    source = p6p7_from if p6p7_from is not None else _P6P7_FROM.get(head, "p5")
    # RetinaNet follows mmdet (P7 = conv(P6)), FCOS torchvision (P7 = conv(relu(P6)))
    neck = BackboneWithFPN(backbone, fpn_channels, min_stride=min_stride, extra=extra, p6p7_from=source,
                           p7_relu=head != "retinanet")
    opts = dict(
        slim=slim_heads,
        mask_head_channels=mask_head_channels,
        mask_head_layers=mask_head_layers,
        box_head_width=box_head_width,
        rois_per_image=rois_per_image,
        anchor_sizes=anchor_sizes,
        aspect_ratios=aspect_ratios,
        detections_per_img=detections_per_img,
        score_thresh=score_thresh,
        mask_rois_multiple=mask_rois_multiple,
        box_loss_beta=box_loss_beta,
        rpn_min_pos_iou=rpn_min_pos_iou,
        retinanet_loss_norm=retinanet_loss_norm,
    )
    model = builder(neck, num_classes, opts, dict(head_kwargs or {}))
    set_roi_alignment(model, roi_aligned, binary_mask_targets)
    pad = check_size_divisibility(size_divisibility, neck.size_divisibility)
    model.transform = NoResizeTransform(image_mean, image_std, size_divisible=pad)
    return model


@contextlib.contextmanager
def unpasted_masks(model: nn.Module) -> Iterator[bool]:
    """Within this block a detector from :func:`build_detector` returns Mask R-CNN's masks in
    prediction unpasted, ``(N, 1, M, M)`` probabilities over each detection's box (its
    :class:`NoResizeTransform` leaves them as the mask head made them). Yields whether it does: ``False``
    for a model with another transform, whose masks come pasted as usual."""
    transform = getattr(model, "transform", None)
    if not isinstance(transform, NoResizeTransform):
        yield False
        return
    before = transform.__dict__.get("paste")
    transform.paste = False
    try:
        yield True
    finally:
        if before is None:
            del transform.paste
        else:
            transform.paste = before


def set_roi_alignment(model: nn.Module, aligned: bool, binary_mask_targets: bool) -> None:
    """Set how an R-CNN from :func:`build_detector` pools its RoIs and makes its mask targets
    (``roi_aligned``, ``binary_mask_targets`` there), in place; a detector without RoI heads is
    left as it is. No parameter changes, so a model's weights stay valid either way."""
    heads = getattr(model, "roi_heads", None)
    if heads is None:
        return
    for pool in (getattr(heads, "box_roi_pool", None), getattr(heads, "mask_roi_pool", None)):
        if isinstance(pool, LevelSortedRoIAlign):
            pool.aligned = bool(aligned)
        elif pool is not None and aligned:
            raise ValueError(f"aligned RoIAlign needs vtdense's RoI pooler, not {type(pool).__name__}")
    if isinstance(heads, LowWaitRoIHeads):
        heads.aligned_mask_targets = bool(aligned)
        heads.binary_mask_targets = bool(binary_mask_targets)
    elif aligned or binary_mask_targets:
        raise ValueError(f"aligned or binary mask targets need vtdense's RoI heads, not {type(heads).__name__}")


def _backbone_for_neck(name: str, kwargs: dict[str, Any], min_stride: int) -> nn.Module:
    """``create_backbone(name, **kwargs)`` emitting only the outputs of stride ``>= min_stride`` (the
    ones the FPN reads), unless ``kwargs`` chooses ``out_indices``."""
    from vtdense.backbones.registry import create_backbone

    _import_backbones()
    if "out_indices" in kwargs:
        return create_backbone(name, **kwargs)
    # the outputs' strides, from a weightless copy on the meta device (no weights loaded twice)
    with torch.device("meta"):
        probe = create_backbone(name, **{k: v for k, v in kwargs.items() if k != "pretrained"})
    if hasattr(probe, "out_indices"):
        indices, strides = tuple(probe.out_indices), list(probe.out_strides)
        used = tuple(i for i, s in zip(indices, strides) if s >= min_stride)
        if used and used != indices:  # (the neck reports a backbone without any usable level)
            kwargs["out_indices"] = used
    return create_backbone(name, **kwargs)


def check_size_divisibility(value: Any, base: int) -> int:
    """``value`` as the padding multiple of a detector whose backbone needs multiples of ``base``.

    Returns:
        ``base`` when ``value`` is ``None``, else ``value``.

    Raises:
        ValueError: ``value`` is not a positive multiple of ``base`` (names the option).
    """
    if value is None:
        return int(base)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % base:
        raise ValueError(
            f"size_divisibility={value!r}: must be a positive multiple of the backbone's size_divisibility ({base}), "
            f"e.g. {base}, {2 * base} or {4 * base}"
        )
    return int(value)


def set_size_divisibility(model: nn.Module, value: int | None) -> int:
    """Pad the batches of a detector from :func:`build_detector` to multiples of ``value``
    (``None``: the backbone's own); returns the multiple now in use."""
    pad = check_size_divisibility(value, model.backbone.size_divisibility)
    model.transform.size_divisible = pad
    return pad


def _import_backbones() -> None:
    """Import the backbone modules so their ``@register_backbone`` entries exist."""
    import importlib

    for mod in ("vtdense.backbones.swin", "vtdense.backbones.mvitv2"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as err:  # a family not written yet
            if err.name != mod:
                raise
