"""Detection transforms built on ``torchvision.transforms.v2`` and ``tv_tensors``.

A transform takes and returns ``(image, target)`` where ``image`` is a
:class:`~torchvision.tv_tensors.Image` and ``target`` a dict whose ``boxes`` are
:class:`~torchvision.tv_tensors.BoundingBoxes` (XYXY) and ``masks`` a
:class:`~torchvision.tv_tensors.Mask`, so both move with the image. Plain tensors in the target
(labels, areas, original-coordinate ground truth) pass through untouched.

The recipes follow detectron2's ``ResizeShortestEdge``: training picks the short side at random
from a list (480..800 step 32 for COCO) with the long side capped (1333); evaluation uses one
short side (800) with the same cap.

Large-scale jitter (:func:`detection_lsj_transforms`, Ghiasi et al. 2021, "Simple Copy-Paste",
as used by ViTDet and MViTv2) instead resizes so the image fits a square of ``size * s`` with
``s`` drawn from ``scale_range`` (0.1..2.0 of 1024), takes a random crop of at most ``size``,
pads to ``size x size`` and recomputes each box from its cropped mask.

The DETR-style crop of the Swin and MViTv2 detection recipes (:func:`detection_crop_transforms`,
Carion et al. 2020; mmdetection's ``AutoAugment`` policy in the official Swin configs, detectron2's
``RandomApply`` in its MViTv2 configs) applies to half of the images: resize the short side to one
of 400/500/600, crop a random ``h x w`` with each side drawn from 384..600 (detectron2's and
mmdetection's ``absolute_range``), then the usual multi-scale resize.

Random draws use the global ``torch`` generator, so a sample's augmentation is reproducible
when the global state is seeded per sample (see :mod:`vtdense.data.seeding`).
"""

from __future__ import annotations

from typing import Any, Sequence

import PIL.Image
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from vtdense.options import positive_list

__all__ = [
    "DEFAULT_MAX_SIZE",
    "DEFAULT_TEST_SCALE",
    "DEFAULT_TRAIN_SCALES",
    "IMAGENET_MEAN_UINT8",
    "INSTANCE_KEYS",
    "BoxesFromMasks",
    "DetectionEvalViews",
    "FixedSizeCropPad",
    "RandomRangeCrop",
    "RandomScaleResize",
    "ResizeShortestEdge",
    "check_test_scales",
    "detection_crop_transforms",
    "detection_eval_transforms",
    "detection_lsj_transforms",
    "detection_train_transforms",
    "drop_degenerate_instances",
    "masks_to_tight_boxes",
    "shortest_edge_size",
]

#: Short sides sampled during COCO training (detectron2 / Swin recipe).
DEFAULT_TRAIN_SCALES: tuple[int, ...] = tuple(range(480, 801, 32))
#: Short side used for evaluation.
DEFAULT_TEST_SCALE: int = 800
#: Cap on the long side, train and eval.
DEFAULT_MAX_SIZE: int = 1333

#: Pad colour of large-scale jitter: the ImageNet mean in 0..255, i.e. zero after normalisation.
IMAGENET_MEAN_UINT8: tuple[int, int, int] = (124, 116, 104)

#: Target keys that hold one entry per instance (first dimension ``N``); filtered together.
INSTANCE_KEYS: tuple[str, ...] = ("boxes", "labels", "masks", "iscrowd", "area", "orig_boxes", "orig_masks")


def _sample_size(flat_inputs: list[Any], name: str) -> tuple[int, int]:
    """``(height, width)`` of the first image, mask or box canvas in a flattened sample."""
    for inpt in flat_inputs:
        if isinstance(inpt, (tv_tensors.Image, tv_tensors.Video, tv_tensors.Mask, PIL.Image.Image)):
            height, width = F.get_size(inpt)
            return int(height), int(width)
        if isinstance(inpt, tv_tensors.BoundingBoxes):
            return int(inpt.canvas_size[0]), int(inpt.canvas_size[1])
    raise TypeError(f"{name} needs an image, mask or bounding boxes in the sample")


def _check_scales(scales: Sequence[int], max_size: int | None) -> list[int]:
    """Validate short-side sizes and the long-side cap."""
    sizes = [int(s) for s in scales]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"scales must be a non-empty list of positive ints, got {list(scales)}")
    if max_size is not None and max_size <= 0:
        raise ValueError(f"max_size must be positive or None, got {max_size}")
    return sizes


def shortest_edge_size(height: int, width: int, short: int, max_size: int | None) -> tuple[int, int]:
    """Output ``(height, width)`` with the short side ``short`` and the long side capped at ``max_size``.

    Sides are rounded to the nearest pixel (as detectron2's ``ResizeShortestEdge`` does), so the
    short side is exactly ``short`` unless the cap applies.

    Args:
        height: Input height.
        width: Input width.
        short: Target short side.
        max_size: Cap on the long side, or None.

    Returns:
        The output size.
    """
    scale = short / min(height, width)
    if max_size is not None and max(height, width) * scale > max_size:
        scale = max_size / max(height, width)
    return max(1, int(height * scale + 0.5)), max(1, int(width * scale + 0.5))


class ResizeShortestEdge(v2.Transform):
    """Resize so the short side is one of ``sizes`` (drawn at random) and the long side ``<= max_size``.

    Boxes, masks and any other ``tv_tensors`` in the sample are resized with the image (masks
    with nearest-neighbour interpolation).

    Args:
        sizes: Candidate short sides; one is drawn uniformly per call.
        max_size: Cap on the long side (``None``: no cap).
        antialias: Antialias when downscaling images.
    """

    def __init__(self, sizes: Sequence[int], max_size: int | None = None, antialias: bool = True) -> None:
        super().__init__()
        self.sizes = _check_scales(sizes, max_size)
        self.max_size = max_size
        self.antialias = antialias

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        """Draw the short side and compute the output size from the sample's image."""
        height, width = _sample_size(flat_inputs, type(self).__name__)
        short = self.sizes[int(torch.randint(len(self.sizes), ()))]
        return {"size": list(shortest_edge_size(height, width, short, self.max_size))}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        """Resize one input to ``params["size"]``."""
        return self._call_kernel(F.resize, inpt, size=params["size"], antialias=self.antialias)


def detection_train_transforms(
    scales: Sequence[int] = DEFAULT_TRAIN_SCALES,
    max_size: int | None = DEFAULT_MAX_SIZE,
    flip_prob: float = 0.5,
) -> v2.Compose:
    """Training transforms: multi-scale short-side resize, horizontal flip, float in [0, 1].

    Args:
        scales: Candidate short-side lengths; one is drawn per image.
        max_size: Cap on the long side after resizing (``None``: no cap).
        flip_prob: Probability of a horizontal flip.

    Returns:
        A v2 transform over ``(image, target)``.

    Raises:
        ValueError: On empty or non-positive sizes, or ``flip_prob`` outside [0, 1].
    """
    sizes = _check_scales(scales, max_size)
    if not 0.0 <= flip_prob <= 1.0:
        raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
    return v2.Compose(
        [
            ResizeShortestEdge(sizes, max_size=max_size),
            v2.RandomHorizontalFlip(p=flip_prob),
            v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        ]
    )


def detection_crop_transforms(
    scales: Sequence[int] = DEFAULT_TRAIN_SCALES,
    max_size: int | None = DEFAULT_MAX_SIZE,
    flip_prob: float = 0.5,
    crop_prob: float = 0.5,
    crop_scales: Sequence[int] = (400, 500, 600),
    crop_max_size: int | None = DEFAULT_MAX_SIZE,
    crop_size_range: Sequence[int] = (384, 600),
) -> v2.Compose:
    """Multi-scale training transforms with the DETR-style random crop on a share of the images.

    With probability ``crop_prob`` the image is first resized to a short side from
    ``crop_scales`` (long side ``<= crop_max_size``) and cropped by :class:`RandomRangeCrop`;
    then every image gets the multi-scale resize of :func:`detection_train_transforms`, the
    flip, and float conversion. The defaults are the official Swin detection configs'
    (mmdetection's ``AutoAugment`` with two equally likely policies). detectron2's MViTv2 configs
    use the same crop with no cap on the first resize: ``crop_max_size=None``.

    Args:
        scales: Candidate short sides of the final resize.
        max_size: Cap on the long side of the final resize (``None``: no cap).
        flip_prob: Probability of a horizontal flip.
        crop_prob: Probability that an image is resized and cropped before the final resize.
        crop_scales: Candidate short sides of the resize before the crop.
        crop_max_size: Cap on the long side of the resize before the crop (``None``: no cap).
        crop_size_range: ``(low, high)`` of the crop's height and width.

    Returns:
        A v2 transform over ``(image, target)``.

    Raises:
        ValueError: On empty or non-positive sizes, an invalid crop range, or a probability
            outside [0, 1]; the message names the option.
    """
    sizes = _check_scales(scales, max_size)
    if not 0.0 <= flip_prob <= 1.0:
        raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
    if not 0.0 <= crop_prob <= 1.0:
        raise ValueError(f"crop_prob must be in [0, 1], got {crop_prob}")
    try:
        first = _check_scales(crop_scales, crop_max_size)
    except ValueError as err:
        raise ValueError(f"crop_scales / crop_max_size: {err}") from None
    crop = v2.Compose([ResizeShortestEdge(first, max_size=crop_max_size), RandomRangeCrop(crop_size_range)])
    return v2.Compose(
        [
            v2.RandomApply([crop], p=crop_prob),
            ResizeShortestEdge(sizes, max_size=max_size),
            v2.RandomHorizontalFlip(p=flip_prob),
            v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        ]
    )


def detection_eval_transforms(scale: int = DEFAULT_TEST_SCALE, max_size: int | None = DEFAULT_MAX_SIZE) -> v2.Compose:
    """Evaluation transforms: fixed short-side resize with a long-side cap, float in [0, 1].

    Args:
        scale: Short-side length.
        max_size: Cap on the long side after resizing (``None``: no cap).

    Returns:
        A v2 transform over ``(image, target)``.
    """
    sizes = _check_scales([scale], max_size)
    return v2.Compose(
        [
            ResizeShortestEdge(sizes, max_size=max_size),
            v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
        ]
    )


def check_test_scales(scales: Any, option: str = "test_scales") -> tuple[int, ...] | None:
    """``scales`` as a tuple of positive ints (short sides), or ``None`` (one scale).

    Raises:
        ValueError: not a non-empty list of positive ints; one message naming ``option`` and the value.
    """
    return positive_list(scales, option, integers=True, example="[400, 500, ..., 1200] (short sides)")


class DetectionEvalViews:
    """The evaluation resize, with the views of test-time augmentation (detectron2's ``TEST.AUG``:
    ``MIN_SIZES`` and ``FLIP``).

    Args:
        test_scale: Short side of the evaluation resize.
        max_size: Cap on the long side (``None``: no cap).
        scales: Short sides of the test-time views (``None``: ``test_scale`` alone).
        flip: Also a horizontally flipped view of each scale.
        views_max_size: With ``scales``, the long-side cap of every view instead of ``max_size``
            (detectron2's ``TEST.AUG.MAX_SIZE``, 4000; ``None``: ``max_size``).

    Called on ``(image, target)`` like :func:`detection_eval_transforms`. With one view that is
    all it is. With several, the sample's image (and its target) is the unflipped view whose short
    side is nearest ``test_scale``, and ``target["views"]`` lists the others in detectron2's order
    (by scale; unflipped, then flipped) as ``{"image": float [3, h, w] in [0, 1], "flip": bool}``;
    the task merges the detections of all views (:func:`vtdense.models.detection_tta.merge_views`).
    """

    def __init__(self, test_scale: int, max_size: int | None, scales: Sequence[int] | None = None, flip: bool = False,
                 views_max_size: int | None = None) -> None:
        if scales is not None and views_max_size is not None:
            max_size = int(views_max_size)
        scales = check_test_scales(scales) or (int(test_scale),)
        specs = [(s, f) for s in scales for f in ((False, True) if flip else (False,))]
        base = min(range(len(specs)), key=lambda i: (abs(specs[i][0] - int(test_scale)), specs[i][1], i))
        #: (short side, flipped) of every view, the sample's own first
        self.specs: list[tuple[int, bool]] = [specs[base]] + specs[:base] + specs[base + 1 :]
        self.resizes = {s: detection_eval_transforms(s, max_size) for s in scales}

    def __call__(self, image: Any, target: Any) -> tuple[Any, Any]:
        """``(image, target)`` resized as the first view, with ``target["views"]`` when there are others."""
        first = self.specs[0][0]
        out_image, out_target = self.resizes[first](image, target)
        if len(self.specs) == 1:
            return out_image, out_target
        resized = {first: out_image.as_subclass(torch.Tensor)}
        views = []
        for short, flipped in self.specs[1:]:
            if short not in resized:
                resized[short] = self.resizes[short](image).as_subclass(torch.Tensor)
            views.append({"image": resized[short].flip(-1) if flipped else resized[short], "flip": flipped})
        return out_image, dict(out_target) | {"views": views}


class RandomScaleResize(v2.Transform):
    """Resize so the image fits in ``size * s`` square, ``s`` drawn uniformly from ``scale_range``.

    The aspect ratio is kept: the factor is ``size * s / max(height, width)``, and each side is
    rounded to the nearest pixel (at least 1). Boxes and masks follow the image.

    Args:
        size: Side of the target square (1024 in the LSJ recipes).
        scale_range: ``(low, high)`` of the uniform scale draw (0.1..2.0 in the LSJ recipes).
        antialias: Antialias when downscaling images.
    """

    def __init__(self, size: int, scale_range: Sequence[float] = (0.1, 2.0), antialias: bool = True) -> None:
        super().__init__()
        self.size, self.scale_range = _check_lsj(size, scale_range)
        self.antialias = antialias

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        """Draw the scale and compute the output ``size`` from the sample's image."""
        height, width = _sample_size(flat_inputs, type(self).__name__)
        low, high = self.scale_range
        scale = low + float(torch.rand(())) * (high - low)
        factor = self.size * scale / max(height, width)
        return {"size": [max(1, int(height * factor + 0.5)), max(1, int(width * factor + 0.5))]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        """Resize one input to ``params["size"]``."""
        return self._call_kernel(F.resize, inpt, size=params["size"], antialias=self.antialias)


def _random_offset(height: int, width: int, crop_h: int, crop_w: int) -> tuple[int, int]:
    """Uniform ``(top, left)`` of a ``crop_h x crop_w`` window inside ``height x width``, last offset included."""
    return int(torch.randint(height - crop_h + 1, ())), int(torch.randint(width - crop_w + 1, ()))


def _check_crop_range(size_range: Sequence[int]) -> tuple[int, int]:
    """Validate a ``(low, high)`` range of crop sides."""
    rng = tuple(int(v) for v in size_range)
    if len(rng) != 2 or not 0 < rng[0] <= rng[1]:
        raise ValueError(f"crop_size_range must be (low, high) with 0 < low <= high, got {list(size_range)}")
    return rng[0], rng[1]


class RandomRangeCrop(v2.Transform):
    """Random crop whose height and width are each drawn from ``size_range`` (inclusive).

    Each side is drawn uniformly from ``min(side, low) .. min(side, high)``, so an image smaller
    than ``low`` keeps that side whole, then the window's position is drawn uniformly: the law of
    detectron2's and mmdetection's ``RandomCrop(crop_type="absolute_range")``. Boxes are shifted
    and clamped to the crop (an instance cropped away gets a zero-width box, which
    :func:`drop_degenerate_instances` removes; an image may be left with no instance, as the
    references allow); masks are cropped.

    Args:
        size_range: ``(low, high)`` crop side in pixels (384..600 in the DETR-style recipes).
    """

    def __init__(self, size_range: Sequence[int] = (384, 600)) -> None:
        super().__init__()
        self.size_range = _check_crop_range(size_range)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        """Draw the crop's height, width and top-left corner."""
        height, width = _sample_size(flat_inputs, type(self).__name__)
        low, high = self.size_range
        crop_h = int(torch.randint(min(height, low), min(height, high) + 1, ()))
        crop_w = int(torch.randint(min(width, low), min(width, high) + 1, ()))
        top, left = _random_offset(height, width, crop_h, crop_w)
        return {"crop": (top, left, crop_h, crop_w)}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        """Crop one input to ``params["crop"]``."""
        top, left, crop_h, crop_w = params["crop"]
        return self._call_kernel(F.crop, inpt, top=top, left=left, height=crop_h, width=crop_w)


class FixedSizeCropPad(v2.Transform):
    """Random crop of at most ``size x size``, then pad bottom/right to exactly ``size x size``.

    Boxes are shifted and clamped to the crop (an instance cropped away gets a zero-width box,
    which :func:`drop_degenerate_instances` removes); masks are cropped and padded with 0.

    Args:
        size: Output side.
        fill: Pad value of images (one per channel, 0..255 for uint8 images).
    """

    def __init__(self, size: int, fill: Sequence[float] = IMAGENET_MEAN_UINT8) -> None:
        super().__init__()
        if int(size) <= 0:
            raise ValueError(f"size must be a positive int, got {size}")
        self.size = int(size)
        self.fill = [float(v) for v in fill]

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        """Draw the crop's top-left corner; compute the crop and pad extents."""
        height, width = _sample_size(flat_inputs, type(self).__name__)
        crop_h, crop_w = min(height, self.size), min(width, self.size)
        top, left = _random_offset(height, width, crop_h, crop_w)
        return {"crop": (top, left, crop_h, crop_w), "pad": [0, 0, self.size - crop_w, self.size - crop_h]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        """Crop one input, then pad it (images with ``fill``, masks with 0)."""
        top, left, crop_h, crop_w = params["crop"]
        out = self._call_kernel(F.crop, inpt, top=top, left=left, height=crop_h, width=crop_w)
        if not any(params["pad"]):
            return out
        fill: Any = self.fill if isinstance(inpt, (tv_tensors.Image, tv_tensors.Video, PIL.Image.Image)) else 0
        return self._call_kernel(F.pad, out, padding=params["pad"], fill=fill)


class BoxesFromMasks:
    """Replace each box by the tight box of its mask (detectron2's ``recompute_boxes``).

    After a crop, a clamped box can be far larger than the visible part of its object; the
    mask's extent is exact. An instance whose mask is empty gets an all-zero box, so
    :func:`drop_degenerate_instances` removes it. Targets without ``masks`` pass unchanged.
    """

    def __call__(self, image: Any, target: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Return ``(image, target)`` with ``target["boxes"]`` (``[N, 4]`` XYXY) recomputed."""
        masks = target.get("masks")
        if masks is None or masks.shape[0] == 0:
            return image, target
        boxes = target["boxes"]
        out = dict(target)
        out["boxes"] = tv_tensors.wrap(masks_to_tight_boxes(masks).to(boxes.dtype), like=boxes)
        return image, out


def masks_to_tight_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Tight XYXY boxes (``float32 [N, 4]``, exclusive right/bottom) of ``[N, H, W]`` masks; empty: zeros."""
    m = masks.as_subclass(torch.Tensor) != 0
    n, height, width = m.shape
    rows, cols = m.any(dim=2), m.any(dim=1)
    ys = torch.arange(height, device=m.device)
    xs = torch.arange(width, device=m.device)
    y0 = torch.where(rows, ys, height).amin(dim=1)
    y1 = torch.where(rows, ys + 1, 0).amax(dim=1)
    x0 = torch.where(cols, xs, width).amin(dim=1)
    x1 = torch.where(cols, xs + 1, 0).amax(dim=1)
    boxes = torch.stack([x0, y0, x1, y1], dim=1).to(torch.float32)
    boxes[~rows.any(dim=1)] = 0.0
    return boxes


def _check_lsj(size: int, scale_range: Sequence[float]) -> tuple[int, tuple[float, float]]:
    """Validate the large-scale-jitter size and scale range."""
    if int(size) <= 0:
        raise ValueError(f"lsj_size must be a positive int, got {size}")
    rng = tuple(float(v) for v in scale_range)
    if len(rng) != 2 or not 0.0 < rng[0] <= rng[1]:
        raise ValueError(f"lsj_scale_range must be (low, high) with 0 < low <= high, got {list(scale_range)}")
    return int(size), (rng[0], rng[1])


def detection_lsj_transforms(
    size: int = 1024,
    scale_range: Sequence[float] = (0.1, 2.0),
    flip_prob: float = 0.5,
    recompute_boxes: bool = True,
    fill: Sequence[float] = IMAGENET_MEAN_UINT8,
) -> v2.Compose:
    """Large-scale-jitter training transforms: flip, random rescale, crop and pad to ``size``, float.

    Every output image is ``[3, size, size]``; the pad (bottom/right) has the ImageNet mean
    colour. Boxes and masks follow; with ``recompute_boxes`` each box becomes the tight box of
    its cropped mask, and instances cropped away are left with zero boxes for
    :func:`drop_degenerate_instances` to remove (as :class:`~vtdense.data.COCODetection` does on
    training splits).

    Args:
        size: Output side (1024 in the MViTv2 / ViTDet recipes).
        scale_range: Range of the random scale of ``size`` the image is fitted to.
        flip_prob: Probability of a horizontal flip.
        recompute_boxes: Recompute boxes from masks after the crop.
        fill: Image pad value per channel (0..255).

    Returns:
        A v2 transform over ``(image, target)``.

    Raises:
        ValueError: On a non-positive size, an invalid range, or ``flip_prob`` outside [0, 1].
    """
    size, rng = _check_lsj(size, scale_range)
    if not 0.0 <= flip_prob <= 1.0:
        raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
    steps: list[Any] = [
        v2.RandomHorizontalFlip(p=flip_prob),
        RandomScaleResize(size, rng),
        FixedSizeCropPad(size, fill=fill),
    ]
    if recompute_boxes:
        steps.append(BoxesFromMasks())
    steps.append(v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True))
    return v2.Compose(steps)


def drop_degenerate_instances(target: dict[str, Any], min_size: float = 1.0) -> tuple[dict[str, Any], int]:
    """Remove instances whose XYXY box is narrower or shorter than ``min_size`` pixels.

    Every per-instance entry of :data:`INSTANCE_KEYS` present in ``target`` is filtered with the
    same index, so all of them keep the same length ``N``.

    Args:
        target: Target dict with ``boxes`` of shape ``[N, 4]`` in XYXY.
        min_size: Minimum box width and height in pixels; a box is kept only when both sides
            are positive and at least ``min_size``.

    Returns:
        The filtered target (a new dict) and the number of instances removed.
    """
    boxes = target["boxes"]
    if boxes.numel() == 0:
        return dict(target), 0
    wh = boxes[:, 2:] - boxes[:, :2]
    keep = (wh >= min_size).all(dim=1) & (wh > 0).all(dim=1)
    removed = int((~keep).sum())
    if removed == 0:
        return dict(target), 0
    out = dict(target)
    for key in INSTANCE_KEYS:
        if key in out:
            value = out[key]
            filtered = value[keep]
            out[key] = tv_tensors.wrap(filtered, like=value) if isinstance(value, tv_tensors.TVTensor) else filtered
    return out, removed
