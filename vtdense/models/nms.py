"""Non-maximum suppression by category with fewer host waits: torchvision's ``batched_nms``, the
same kept indices in the same order.

torchvision's ``batched_nms`` shifts the categories apart and runs one NMS while there are at most
4,000 coordinates on the CPU or 100,000 on CUDA, and there copies a Python ``1`` to the device (a
blocking copy: on a GPU the host waits); above that it runs one NMS per category, finding each with
a ``torch.where`` (a wait each) after a ``torch.unique`` (another). :func:`batched_nms` makes the same
choice: the shift computed on the device, or the boxes sorted by category with one read of the
counts. Every NMS still waits once (torchvision's kernel finishes on the host).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.ops import boxes as box_ops

__all__ = ["batched_nms", "sort_by_group"]


def sort_by_group(ids: Tensor, num_groups: int) -> tuple[Tensor, list[int]]:
    """``ids`` ``(N,)`` int64 in ``[0, num_groups)`` -> ``(order, counts)``: the ``(N,)`` positions
    sorted by group, each group's in their original order, and how many each group holds, read from
    the device in one transfer (not ``bincount``, which on CUDA reads its input's extremes first)."""
    order = torch.argsort(ids, stable=True)
    groups = torch.arange(num_groups, device=ids.device)
    return order, (ids.unsqueeze(0) == groups.unsqueeze(1)).sum(dim=1).tolist()


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, num_groups: int) -> Tensor:
    """``torchvision.ops.batched_nms`` (NMS within each category ``idxs`` in ``[0, num_groups)``):
    ``(N, 4)`` XYXY boxes, ``(N,)`` scores and ``(N,)`` int64 categories -> ``(K,)`` int64 indices of
    the kept boxes, by decreasing score: the same as torchvision's, with fewer waits. Where torchvision shifts the
    categories apart and runs one NMS (up to 4,000 coordinates on the CPU, 100,000 on CUDA), the
    shift is computed on the device instead of from a copied ``1``; above that, where it finds each
    category with a ``torch.where`` and a wait, the boxes are sorted by category and the counts read
    once (one NMS per category remains, each a wait)."""
    if boxes.numel() > _one_nms_limit(boxes.device):
        return _grouped_nms(boxes, scores, idxs, iou_threshold, num_groups)
    return _offset_nms(boxes, scores, idxs, iou_threshold)


def _one_nms_limit(device: torch.device) -> int:
    """The most coordinates torchvision's ``batched_nms`` handles with one NMS on ``device``."""
    return 4000 if device.type == "cpu" else 100_000


def _grouped_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, num_groups: int) -> Tensor:
    """torchvision's per-category NMS (its ``batched_nms`` for many boxes): each category's boxes in
    their order, NMS on them, the kept indices sorted by score as torchvision sorts them."""
    order, counts = sort_by_group(idxs, num_groups)
    kept, start = [], 0
    for n in counts:
        if n:
            members = order[start:start + n]
            kept.append(members[box_ops.nms(boxes[members], scores[members], iou_threshold)])
        start += n
    if not kept:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    keep = torch.cat(kept).sort().values  # ascending, as torchvision's torch.where(keep_mask)
    return keep[scores[keep].sort(descending=True)[1]]


def _offset_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float) -> Tensor:
    """torchvision's coordinate trick (each category's boxes shifted past the largest coordinate,
    then one NMS), the same arithmetic, with the ``+ 1`` added on the device."""
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    offsets = idxs.to(boxes) * (boxes.max() + 1)
    return box_ops.nms(boxes + offsets[:, None], scores, iou_threshold)
