"""Test-time augmentation for the detectors of :func:`vtdense.models.detection.build_detector`.

As detectron2's ``GeneralizedRCNNWithTTA`` (``TEST.AUG``): each view of an image (resized to
another short side, and horizontally flipped) is detected as usual; the boxes of every view are
brought back to one frame and merged by per-class NMS at the detector's own NMS threshold, keeping
its ``detections_per_img`` best. For Mask R-CNN the mask head then runs on the merged boxes in
every view (a second pass of the backbone per view, as detectron2 does), and the masks' probabilities,
flipped back where the view was flipped, are averaged. RetinaNet and FCOS merge their boxes the same
way (mmdetection's test-time augmentation merges theirs by NMS too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.roi_heads import maskrcnn_inference
from torchvision.ops import batched_nms, clip_boxes_to_image

from vtdense.models.detection import unpasted_masks

__all__ = ["merge_views"]

#: A view of an image: ``(float [3, h, w] in [0, 1], flipped)``.
View = tuple[Tensor, bool]


def _nms_settings(detector: nn.Module) -> tuple[float, int]:
    holder = detector.roi_heads if isinstance(detector, GeneralizedRCNN) else detector
    return float(holder.nms_thresh), int(holder.detections_per_img)


def _hflip(boxes: Tensor, width: float) -> Tensor:
    """XYXY boxes mirrored in an image ``width`` pixels wide."""
    return torch.stack((width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]), dim=1)


def _to_frame(boxes: Tensor, view_size: Sequence[int], frame_size: Sequence[int], flipped: bool) -> Tensor:
    """Boxes ``(N, 4)`` XYXY in a view's pixels -> the frame's: unflipped, then scaled per axis."""
    (vh, vw), (fh, fw) = view_size, frame_size
    boxes = _hflip(boxes, vw) if flipped else boxes
    return boxes * boxes.new_tensor([fw / vw, fh / vh, fw / vw, fh / vh])


def _to_view(boxes: Tensor, frame_size: Sequence[int], view_size: Sequence[int], flipped: bool) -> Tensor:
    """The inverse of :func:`_to_frame`: frame boxes -> a view's pixels (scaled, then flipped)."""
    (fh, fw), (vh, vw) = frame_size, view_size
    boxes = boxes * boxes.new_tensor([vw / fw, vh / fh, vw / fw, vh / fh])
    return _hflip(boxes, vw) if flipped else boxes


def _mask_probs(detector: GeneralizedRCNN, images: list[Tensor], boxes: list[Tensor], labels: list[Tensor]) -> list[Tensor]:
    """Mask R-CNN's mask probabilities ``(N, 1, M, M)`` for given boxes and labels (each image's
    own pixels), as its inference computes them for its detections."""
    image_list, _ = detector.transform(images)
    features = detector.backbone(image_list.tensors)
    heads = detector.roi_heads
    logits = heads.mask_predictor(heads.mask_head(heads.mask_roi_pool(features, boxes, image_list.image_sizes)))
    return maskrcnn_inference(logits, labels)


@torch.no_grad()
def merge_views(detector: nn.Module, views: Sequence[Sequence[View]]) -> list[dict[str, Tensor]]:
    """Detections of several views of each image, merged in the frame of its first view.

    Args:
        detector: A detector from :func:`~vtdense.models.detection.build_detector`, in eval mode.
        views: Per image, its views ``(image [3, h, w] in [0, 1], flipped)``; every image has as
            many, and view ``k`` of all images is detected in one batch. The first view of an image
            is the frame its results are given in; it must not be flipped.

    Returns:
        Per image: ``boxes`` (XYXY in the first view's pixels, clipped to it), ``scores``,
        ``labels`` (at most the detector's ``detections_per_img``, by descending score) and, for
        Mask R-CNN, ``masks``: the mask head's ``(N, 1, M, M)`` probabilities over each box,
        averaged over the views (unpasted, as :func:`~vtdense.models.detection.unpasted_masks`
        gives them).
    """
    if any(v[0][1] for v in views):
        raise ValueError("merge_views: the first view of an image is its frame and cannot be flipped")
    count = len(views[0])
    if any(len(v) != count for v in views):
        raise ValueError("merge_views: every image needs the same number of views")
    frames = [tuple(v[0][0].shape[-2:]) for v in views]
    found: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in views]
    with unpasted_masks(detector):
        for k in range(count):
            dets = detector([v[k][0] for v in views])
            for i, det in enumerate(dets):
                image, flipped = views[i][k]
                boxes = _to_frame(det["boxes"].float(), image.shape[-2:], frames[i], flipped)
                found[i].append((boxes, det["scores"].float(), det["labels"]))
    nms_thresh, keep_top = _nms_settings(detector)
    merged = []
    for (fh, fw), parts in zip(frames, found):
        boxes = clip_boxes_to_image(torch.cat([p[0] for p in parts]), (fh, fw))
        scores, labels = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        keep = batched_nms(boxes, scores, labels, nms_thresh)[:keep_top]
        merged.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
    if isinstance(detector, GeneralizedRCNN) and detector.roi_heads.has_mask():
        total: list[Tensor | None] = [None] * len(views)
        for k in range(count):
            images = [v[k][0] for v in views]
            boxes = [_to_view(m["boxes"], frame, im.shape[-2:], v[k][1]) for m, frame, im, v in zip(merged, frames, images, views)]
            probs = _mask_probs(detector, images, boxes, [m["labels"] for m in merged])
            for i, p in enumerate(probs):
                p = p.float().flip(-1) if views[i][k][1] else p.float()
                total[i] = p if total[i] is None else total[i] + p
        for m, t in zip(merged, total):
            m["masks"] = t / count
    return merged
