"""Multi-scale RoIAlign with one host synchronisation per call.

torchvision's :class:`~torchvision.ops.MultiScaleRoIAlign` assigns each RoI a pyramid level (FPN
paper, eq. 1) and then, for every level, finds its RoIs with ``torch.where(levels == level)``,
pools them and scatters the result back: on a GPU each ``where`` waits for the device to finish
everything queued before it (the output's size is data-dependent), four waits per call on a
P2-P5 pyramid, and two calls per Mask R-CNN training step (box and mask branches).

:class:`LevelSortedRoIAlign` sorts the RoIs by level instead, reads the four level counts in one
transfer, pools each level's contiguous run and writes the runs back in the RoIs' order with one
``index_copy``. Each RoI is pooled from the same feature map with the same kernel, so the output
is the same, bit for bit; only the order in which RoIAlign's backward accumulates into a feature
map's gradient changes (float rounding; on CUDA that order is not fixed anyway). Scales are
inferred as torchvision infers them, on the first call. While a graph is built (``torch.compile``,
``torch.export``, ONNX, TorchScript) it runs torchvision's own code.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.ops import MultiScaleRoIAlign, roi_align

try:  # torchvision's helpers (private names): where a release renames them, its own code runs
    from torchvision.ops.poolers import _convert_to_roi_format, _setup_scales
except ImportError:  # pragma: no cover - depends on the installed torchvision
    _convert_to_roi_format = _setup_scales = None

from vtdense.layers.tracing import tracing
from vtdense.models.nms import sort_by_group

__all__ = ["LevelSortedRoIAlign"]


class LevelSortedRoIAlign(MultiScaleRoIAlign):
    """:class:`~torchvision.ops.MultiScaleRoIAlign` (same arguments, no parameters or buffers)
    that pools its RoIs level by level after sorting them, with one device-to-host read per call.

    ``forward(x, boxes, image_shapes)``: ``x`` the pyramid (``{name: (B, C, H_l, W_l)}``),
    ``boxes`` one ``(N_i, 4)`` XYXY tensor per image in input-image coordinates, ``image_shapes``
    the images' ``(H, W)``. Returns ``(sum_i N_i, C, *output_size)``, the RoIs in the order given,
    in the dtype of the first pooled map (as torchvision's).
    """

    def forward(self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]) -> Tensor:
        maps = [v for k, v in x.items() if k in self.featmap_names]
        if tracing() or len(maps) < 2 or _setup_scales is None:
            return super().forward(x, boxes, image_shapes)
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = _setup_scales(maps, image_shapes, self.canonical_scale, self.canonical_level)
        rois = _convert_to_roi_format(boxes)
        # The one wait on the device: how many RoIs each level pools.
        order, counts = sort_by_group(self.map_levels(boxes), len(maps))
        rois = rois[order]
        first = maps[0]
        pooled, start = [], 0
        for level, n in enumerate(counts):
            if n:
                out = roi_align(maps[level], rois[start:start + n], output_size=self.output_size,
                                spatial_scale=self.scales[level], sampling_ratio=self.sampling_ratio)
                pooled.append(out.to(first.dtype))
            start += n
        result = first.new_zeros((rois.shape[0], first.shape[1], *self.output_size))
        if pooled:
            result = result.index_copy(0, order, torch.cat(pooled) if len(pooled) > 1 else pooled[0])
        return result
