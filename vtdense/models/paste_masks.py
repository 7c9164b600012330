"""Mask R-CNN's masks pasted into the image with one host read, the same values as torchvision's.

torchvision's ``paste_masks_in_image`` resizes each detection's ``28 x 28`` mask to its box and
writes it into a zeroed image-sized mask, one detection at a time, with the box's corners read as
Python numbers from the tensor (``int(box[2] - box[0] + 1)``, ``max(box[0], 0)``, slices bounded by
0-d tensors). On a GPU each such read waits for the device: about a dozen waits and twenty small
ops per detection, so a hundred detections per image cost thousands of both, and then a stack
copies every ``H x W`` mask once more.

:func:`paste_masks` reads all the boxes' corners in one transfer, then per detection resizes the
mask (the same ``F.interpolate`` call on the same padded mask, so the same values) and copies it
into its slot of one preallocated ``(N, 1, H, W)`` output: two kernels per detection and no wait.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.models.detection.roi_heads import expand_boxes, expand_masks

__all__ = ["paste_masks"]


def paste_masks(masks: Tensor, boxes: Tensor, image_shape: tuple[int, int], padding: int = 1) -> Tensor:
    """Each detection's mask resized to its box and placed in an image of ``image_shape``.

    Args:
        masks: ``(N, 1, M, M)`` mask probabilities (the mask head's output for each detection).
        boxes: ``(N, 4)`` XYXY boxes in the image's pixel coordinates.
        image_shape: ``(H, W)`` of the image.
        padding: pixels of zeros added around each mask before it is resized (torchvision's 1,
            so that a mask's edge fades out over the box's border).

    Returns:
        ``(N, 1, H, W)`` masks in ``masks``' dtype, zero outside each box: the values
        ``torchvision.models.detection.roi_heads.paste_masks_in_image`` gives.
    """
    height, width = int(image_shape[0]), int(image_shape[1])
    padded, scale = expand_masks(masks, padding=padding)
    out = masks.new_zeros((masks.shape[0], 1, height, width))
    if masks.shape[0] == 0:
        return out
    corners = expand_boxes(boxes, scale).to(torch.int64).tolist()  # the one wait on the device
    for i, (x0, y0, x1, y1) in enumerate(corners):
        w, h = max(x1 - x0 + 1, 1), max(y1 - y0 + 1, 1)
        left, right = max(x0, 0), min(x1 + 1, width)
        top, bottom = max(y0, 0), min(y1 + 1, height)
        if right <= left or bottom <= top:  # the box lies outside the image
            continue
        resized = F.interpolate(padded[i:i + 1], size=(h, w), mode="bilinear", align_corners=False)
        out[i, 0, top:bottom, left:right] = resized[0, 0, top - y0:bottom - y0, left - x0:right - x0]
    return out
