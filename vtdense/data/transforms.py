"""Detection transforms built on ``torchvision.transforms.v2`` and ``tv_tensors``.

A transform takes and returns ``(image, target)`` where ``image`` is a
:class:`~torchvision.tv_tensors.Image` and ``target`` a dict whose ``boxes`` are
:class:`~torchvision.tv_tensors.BoundingBoxes` (XYXY) and ``masks`` a
:class:`~torchvision.tv_tensors.Mask`, so both move with the image. Plain tensors in the target
(labels, areas, original-coordinate ground truth) pass through untouched.

The recipes follow detectron2's ``ResizeShortestEdge``: training picks the short side at random
from a list (480..800 step 32 for COCO) with the long side capped (1333); evaluation uses one
short side (800) with the same cap.
"""

from __future__ import annotations

from typing import Any, Sequence

import PIL.Image
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

__all__ = [
    "DEFAULT_MAX_SIZE",
    "DEFAULT_TEST_SCALE",
    "DEFAULT_TRAIN_SCALES",
    "INSTANCE_KEYS",
    "ResizeShortestEdge",
    "detection_eval_transforms",
    "detection_train_transforms",
    "drop_degenerate_instances",
    "shortest_edge_size",
]

#: Short sides sampled during COCO training (detectron2 / Swin recipe).
DEFAULT_TRAIN_SCALES: tuple[int, ...] = tuple(range(480, 801, 32))
#: Short side used for evaluation.
DEFAULT_TEST_SCALE: int = 800
#: Cap on the long side, train and eval.
DEFAULT_MAX_SIZE: int = 1333

#: Target keys that hold one entry per instance (first dimension ``N``); filtered together.
INSTANCE_KEYS: tuple[str, ...] = ("boxes", "labels", "masks", "iscrowd", "area", "orig_boxes", "orig_masks")


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
        for inpt in flat_inputs:
            if isinstance(inpt, (tv_tensors.Image, tv_tensors.Video, tv_tensors.Mask, PIL.Image.Image)):
                height, width = F.get_size(inpt)
                break
            if isinstance(inpt, tv_tensors.BoundingBoxes):
                height, width = inpt.canvas_size
                break
        else:
            raise TypeError("ResizeShortestEdge needs an image, mask or bounding boxes in the sample")
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
