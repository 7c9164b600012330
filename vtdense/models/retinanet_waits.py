"""torchvision's RetinaNet losses without host waits.

torchvision's RetinaNet heads select each image's foreground and non-ignored anchors through
boolean masks (``logits[valid]``, ``targets[fg, labels] = 1``, ``torch.where(matched >= 0)``) and
divide by ``max(1, num_foreground)``: on a GPU each waits for the device, about seven times per
image per training step. The classes here compute the same per-anchor losses on every anchor and
sum them under the masks instead (``torch.where(mask, loss, 0)``: a masked-out anchor's value, even a
non-finite one, never reaches the sum, and its gradient is zero), dividing by the foreground count
on the device. Same values up to the order of the summation (float rounding), the same gradients;
while a graph is built torchvision's own code runs. :func:`vtdense.models.rcnn_waits.reduce_host_waits`
installs them on a RetinaNet built by :func:`~vtdense.models.detection.build_detector`.

Normalisation (a head's ``loss_normalization`` attribute; torchvision's ``"image"`` when unset):

* ``"image"`` (torchvision): each image's summed loss over ``max(1, its foreground anchors)``,
  averaged over the images;
* ``"batch"`` (mmdet 2.x ``AnchorHead``, what :func:`~vtdense.models.detection.build_detector`
  sets): the batch's summed loss over ``sum_i max(1, foreground anchors of image i)``, so an image
  with many objects weighs more than an image with one, and an image without objects adds the
  background term of its anchors over 1 instead of over its own count of 1. This one runs the
  same code while a graph is built (it has no data-dependent shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.models.detection.retinanet import RetinaNetClassificationHead, RetinaNetRegressionHead
from torchvision.ops import complete_box_iou_loss, distance_box_iou_loss, generalized_box_iou_loss, sigmoid_focal_loss

from vtdense.layers.tracing import tracing

__all__ = ["LOSS_NORMALIZATIONS", "LowWaitClassificationHead", "LowWaitRegressionHead", "loss_normalization"]

#: the choices of a head's ``loss_normalization``
LOSS_NORMALIZATIONS: tuple[str, ...] = ("image", "batch")


def loss_normalization(head: object) -> str:
    """``head.loss_normalization``: ``"image"`` (torchvision's, when unset) or ``"batch"`` (mmdet's)."""
    norm = getattr(head, "loss_normalization", "image")
    if norm not in LOSS_NORMALIZATIONS:
        raise ValueError(f"loss_normalization={norm!r}: choose one of {', '.join(LOSS_NORMALIZATIONS)}")
    return norm


def _reduce(sums: list[Tensor], foreground: list[Tensor], norm: str) -> Tensor:
    """Per-image loss sums and foreground counts (0-d tensors) -> the loss, normalised by ``norm``."""
    counts = [n.clamp(min=1) for n in foreground]
    if norm == "batch":
        return _sequential_sum(sums) / _sequential_sum(counts).to(sums[0].dtype)
    return _sequential_sum([s / n for s, n in zip(sums, counts)]) / max(1, len(sums))


def _sequential_sum(terms: list[Tensor]) -> Tensor:
    """``terms[0] + terms[1] + ...`` in that order (as torchvision adds the images' losses)."""
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


class LowWaitClassificationHead(RetinaNetClassificationHead):
    """torchvision's RetinaNet classification head (same layers and keys); its focal loss summed over
    the non-ignored anchors and normalised as ``loss_normalization`` says (module docstring), without
    a host wait."""

    def compute_loss(self, targets: list[dict[str, Tensor]], head_outputs: dict[str, Tensor],
                     matched_idxs: list[Tensor]) -> Tensor:
        norm = loss_normalization(self)
        if tracing() and norm == "image":
            return super().compute_loss(targets, head_outputs, matched_idxs)
        sums, counts = [], []
        for target, logits, matched in zip(targets, head_outputs["cls_logits"], matched_idxs):
            foreground = matched >= 0
            wanted = torch.zeros_like(logits)
            if target["labels"].numel():  # one-hot rows for the foreground anchors' classes
                classes = target["labels"][matched.clamp(min=0)]
                wanted.scatter_(1, classes.unsqueeze(1), foreground.unsqueeze(1).to(wanted.dtype))
            valid = (matched != self.BETWEEN_THRESHOLDS).unsqueeze(1)
            per_anchor = sigmoid_focal_loss(logits, wanted, reduction="none")
            sums.append(torch.where(valid, per_anchor, 0.0).sum())
            counts.append(foreground.sum())
        return _reduce(sums, counts, norm)


class LowWaitRegressionHead(RetinaNetRegressionHead):
    """torchvision's RetinaNet regression head (same layers and keys); its box loss over the
    foreground anchors (``l1``, ``smooth_l1``, ``giou``, ``diou``, ``ciou``), normalised as
    ``loss_normalization`` says (module docstring), without a host wait (torchvision's IoU
    losses, which the last three call, still wait inside; ``l1``, the default, does not)."""

    def _per_anchor(self, anchors: Tensor, gt: Tensor, regression: Tensor) -> Tensor:
        """``(A, 4)`` (l1, smooth_l1) or ``(A,)`` (IoU losses) unreduced losses, as torchvision's
        ``_box_loss`` computes them before its sum."""
        kind = self._loss_type
        if kind in ("l1", "smooth_l1"):
            wanted = self.box_coder.encode_single(gt, anchors)
            if kind == "l1":
                return F.l1_loss(regression, wanted, reduction="none")
            return F.smooth_l1_loss(regression, wanted, reduction="none", beta=1.0)
        boxes = self.box_coder.decode_single(regression, anchors)
        loss = {"ciou": complete_box_iou_loss, "diou": distance_box_iou_loss}.get(kind, generalized_box_iou_loss)
        return loss(boxes, gt, reduction="none", eps=1e-7)

    def compute_loss(self, targets: list[dict[str, Tensor]], head_outputs: dict[str, Tensor], anchors: list[Tensor],
                     matched_idxs: list[Tensor]) -> Tensor:
        norm = loss_normalization(self)
        known = self._loss_type in ("l1", "smooth_l1", "giou", "diou", "ciou")
        if not known and norm == "batch":
            raise ValueError(f"RetinaNet box loss {self._loss_type!r} has no batch normalisation here; "
                             "choose l1, smooth_l1, giou, diou or ciou")
        if (tracing() and norm == "image") or not known:
            return super().compute_loss(targets, head_outputs, anchors, matched_idxs)
        sums, counts = [], []
        for target, regression, anchors_i, matched in zip(targets, head_outputs["bbox_regression"], anchors, matched_idxs):
            foreground = matched >= 0
            counts.append(foreground.sum())
            if target["boxes"].numel() == 0:  # no foreground: zero, with the (zero) gradient torchvision's has
                sums.append(torch.where(foreground.unsqueeze(1), regression, 0.0).sum())
                continue
            per_anchor = self._per_anchor(anchors_i, target["boxes"][matched.clamp(min=0)], regression)
            mask = foreground if per_anchor.dim() == 1 else foreground.unsqueeze(1)
            sums.append(torch.where(mask, per_anchor, 0.0).sum())
        if not sums:
            return head_outputs["bbox_regression"].sum() * 0
        return _reduce(sums, counts, norm)
