"""Mask R-CNN's mask targets and loss, as mmdet 2.x and detectron2 make them, or as torchvision does.

The mask head predicts an ``M x M`` mask (28 x 28) per positive RoI. Its target is the RoI's region
of the matched ground-truth mask, resampled to ``M x M`` by RoIAlign on the full-image mask. The
libraries differ in two ways:

- **alignment**: mmdet's ``BitmapMasks.crop_and_resize`` and detectron2's ``BitMasks.crop_and_resize``
  call RoIAlign with ``aligned=True``: bin ``j`` of a box ``[x1, x2)`` samples the image at
  ``x1 + (j + 0.5) * w / M``, pixel ``i`` covering ``[i, i + 1)`` with its value at ``i + 0.5``.
  torchvision's ``project_masks_on_boxes`` uses ``aligned=False``, which samples half a pixel
  further right and down, so a box that exactly covers an object gets a target that fades out along
  its bottom and right edges;
- **binary targets**: both references threshold the resampled mask at 0.5, torchvision keeps the
  soft values in the binary cross-entropy.

:func:`mask_loss` makes either: ``aligned=True, binary=True`` (the references; ``build_detector``'s
default) or ``False, False`` (torchvision's values). The loss is the mean binary cross-entropy of
each positive RoI's predicted mask for its ground-truth class, as in all three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.ops import roi_align

__all__ = ["mask_targets", "mask_loss"]


def mask_targets(gt_masks: Tensor, boxes: Tensor, matched: Tensor, size: int, aligned: bool = True,
                 binary: bool = True) -> Tensor:
    """The ``(N, size, size)`` mask targets of ``N`` RoIs of one image.

    Args:
        gt_masks: ``(G, H, W)`` ground-truth masks of the image (any dtype; 0 / 1 values).
        boxes: ``(N, 4)`` XYXY RoIs in the image's pixels.
        matched: ``(N,)`` index of each RoI's ground truth in ``gt_masks``.
        size: side ``M`` of the targets.
        aligned: RoIAlign with the half-pixel offset (``aligned=True``), as mmdet and detectron2.
        binary: threshold the resampled masks at 0.5, as mmdet and detectron2.

    Returns:
        ``(N, M, M)`` in ``boxes``' dtype: 0 / 1 when ``binary``, else the resampled values.
    """
    rois = torch.cat([matched.to(boxes)[:, None], boxes], dim=1)
    # sampling_ratio 0: ceil(RoI side / M) samples per bin, as both references (torchvision's -1 is the same rule)
    out = roi_align(gt_masks[:, None].to(rois), rois, (size, size), spatial_scale=1.0, sampling_ratio=0,
                    aligned=aligned)[:, 0]
    return (out >= 0.5).to(out.dtype) if binary else out


def mask_loss(mask_logits: Tensor, proposals: list[Tensor], gt_masks: list[Tensor], gt_labels: list[Tensor],
              matched: list[Tensor], aligned: bool = True, binary: bool = True) -> Tensor:
    """Mean binary cross-entropy of each positive RoI's mask logits for its ground-truth class.

    Args:
        mask_logits: ``(N, classes, M, M)``, the positive RoIs of all images in order.
        proposals: per image ``(N_i, 4)`` positive RoIs (``sum N_i = N``).
        gt_masks: per image ``(G_i, H, W)`` ground-truth masks.
        gt_labels: per image ``(G_i,)`` ground-truth classes.
        matched: per image ``(N_i,)`` index of each RoI's ground truth.
        aligned, binary: see :func:`mask_targets`; ``False, False`` give torchvision's
            ``maskrcnn_loss``.

    Returns:
        A scalar (0 with a gradient when there is no positive RoI).
    """
    size = mask_logits.shape[-1]
    labels = torch.cat([lab[i] for lab, i in zip(gt_labels, matched)])
    targets = torch.cat([mask_targets(m, p, i, size, aligned, binary) for m, p, i in zip(gt_masks, proposals, matched)])
    if targets.numel() == 0:
        return mask_logits.sum() * 0
    picked = mask_logits[torch.arange(labels.shape[0], device=labels.device), labels]
    return F.binary_cross_entropy_with_logits(picked, targets)
