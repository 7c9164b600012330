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

:attr:`LevelSortedRoIAlign.aligned` (``False`` unless set; ``build_detector`` sets it, see its
``roi_aligned``) samples with the half-pixel offset of ``roi_align(..., aligned=True)``, as mmdet
2.x's ``RoIAlign`` and detectron2's ``ROIAlignV2`` do; torchvision's pooler has no such option. While
a graph is built the aligned pooler runs torchvision's per-level code with that offset.
"""

from __future__ import annotations

import torch
import torchvision
from torch import Tensor
from torchvision.ops import MultiScaleRoIAlign, roi_align

try:  # torchvision's helpers (private names): where a release renames them, its own code runs
    from torchvision.ops.poolers import _convert_to_roi_format, _onnx_merge_levels, _setup_scales
except ImportError:  # pragma: no cover - depends on the installed torchvision
    _convert_to_roi_format = _onnx_merge_levels = _setup_scales = None

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

    #: Sample with ``roi_align``'s half-pixel offset (``aligned=True``). A class default, so that a
    #: pooler given this class in place of torchvision's (``reduce_host_waits``) pools as before.
    aligned: bool = False

    def forward(self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]) -> Tensor:
        maps = [v for k, v in x.items() if k in self.featmap_names]
        if maps and boxes and maps[0].dtype != boxes[0].dtype and not torch.is_autocast_enabled(maps[0].device.type):
            # A model wholly in half precision (``--trainer.precision bf16-true``) with float32 boxes:
            # ``roi_align`` takes one dtype, so pool in the wider one, as its autocast kernel does,
            # and return the maps' dtype.
            wide = torch.promote_types(maps[0].dtype, boxes[0].dtype)
            x = {k: v.to(wide) if k in self.featmap_names else v for k, v in x.items()}
            return self.forward(x, [b.to(wide) for b in boxes], image_shapes).to(maps[0].dtype)
        if not self.aligned and (_setup_scales is None or tracing() or len(maps) < 2):
            return super().forward(x, boxes, image_shapes)
        if _setup_scales is None:  # pragma: no cover - depends on the installed torchvision
            raise RuntimeError("aligned RoIAlign needs torchvision.ops.poolers' helpers, which this torchvision lacks: "
                               "build the detector with roi_aligned=False")
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = _setup_scales(maps, image_shapes, self.canonical_scale, self.canonical_level)
        if tracing() or len(maps) < 2:
            return self._per_level(maps, boxes)
        rois = _convert_to_roi_format(boxes)
        # The one wait on the device: how many RoIs each level pools.
        order, counts = sort_by_group(self.map_levels(boxes), len(maps))
        rois = rois[order]
        first = maps[0]
        pooled, start = [], 0
        for level, n in enumerate(counts):
            if n:
                out = roi_align(maps[level], rois[start:start + n], output_size=self.output_size,
                                spatial_scale=self.scales[level], sampling_ratio=self.sampling_ratio, aligned=self.aligned)
                pooled.append(out.to(first.dtype))
            start += n
        result = first.new_zeros((rois.shape[0], first.shape[1], *self.output_size))
        if pooled:
            result = result.index_copy(0, order, torch.cat(pooled) if len(pooled) > 1 else pooled[0])
        return result

    def _per_level(self, maps: list[Tensor], boxes: list[Tensor]) -> Tensor:
        """torchvision's multi-scale pooling (a ``torch.where`` per level; ONNX: its scatter merge)
        with this pooler's ``aligned``: the form graphs trace."""
        rois = _convert_to_roi_format(boxes)
        kw = dict(output_size=self.output_size, sampling_ratio=self.sampling_ratio, aligned=self.aligned)
        if len(maps) == 1:
            return roi_align(maps[0], rois, spatial_scale=self.scales[0], **kw)
        levels = self.map_levels(boxes)
        first = maps[0]
        result = first.new_zeros((rois.shape[0], first.shape[1], *self.output_size))
        onnx = torchvision._is_tracing()
        parts = []
        for level, (feature, scale) in enumerate(zip(maps, self.scales)):
            idx = torch.where(levels == level)[0]
            out = roi_align(feature, rois[idx], spatial_scale=scale, **kw).to(result.dtype)
            if onnx:
                parts.append(out)
            else:
                result[idx] = out
        return _onnx_merge_levels(levels, parts) if onnx else result
