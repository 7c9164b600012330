"""A bounded number of RoI batch sizes for Mask R-CNN's mask branch on CUDA.

The mask head's convolutions see one sample per RoI: the positive proposals in training (0 to
``rois_per_image / 4`` per image, different at every step) and the detections in inference (0 to
``detections_per_img`` per image). cuDNN sets up and caches an execution plan for each input shape
it meets, forward and both backward passes, and that set-up is host time (the performance notes,
``shared/perf``, measured it for new image shapes). Left alone, the branch meets up to
``batch * rois_per_image / 4 + 1`` batch sizes in training and as many again in prediction.

:class:`MaskRoIPadding` zero-pads the RoI features entering the mask head to a multiple of
``multiple`` rows and drops the padded rows from the predictor's logits, so the branch meets at
most ``max_rois / multiple + 1`` shapes. Every RoI's logits come from the same convolutions of its
own features (convolutions never mix samples), and the padded rows get no gradient, so losses and
masks are unchanged up to the kernels' rounding. It applies to CUDA tensors only: on the CPU there
is no plan to set up and the padded rows would only add work. Nothing is padded while a graph is
traced (``torch.compile``, ``torch.export``, ONNX).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor, nn

from vtdense.layers.tracing import tracing

__all__ = ["MaskRoIPadding", "check_mask_rois_multiple", "pad_mask_rois"]


def check_mask_rois_multiple(value: Any) -> int | None:
    """``value`` as the ``mask_rois_multiple`` option: a positive int, or ``None`` (off).

    Raises:
        ValueError: anything else, naming the option.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"mask_rois_multiple must be a positive int or null (option 'mask_rois_multiple'), got {value!r}")
    return value


class MaskRoIPadding:
    """Pads the mask head's ``(R, C, 14, 14)`` input to ``(ceil(R / multiple) * multiple, C, 14, 14)``
    with zeros and cuts the predictor's ``(R', classes, 28, 28)`` logits back to ``R`` rows.

    Installed as a forward pre-hook on the mask head and a forward hook on the mask predictor (see
    :func:`pad_mask_rois`); module classes and state-dict keys stay torchvision's.

    Args:
        multiple: the RoI batch is padded to a multiple of this (``>= 1``).
        cuda_only: pad only CUDA tensors (the default; tests switch it off to check the CPU path).
    """

    def __init__(self, multiple: int, cuda_only: bool = True) -> None:
        if check_mask_rois_multiple(multiple) is None:
            raise ValueError("MaskRoIPadding needs a multiple; pad_mask_rois(..., None) installs none")
        self.multiple = multiple
        self.cuda_only = cuda_only
        # RoIs of the call in flight, between the head and the predictor, per thread (the replicas of
        # nn.DataParallel run the same hooks in one thread per GPU); a dict, so models still copy and pickle
        self._rows: dict[int, int] = {}

    def _applies(self, x: Tensor) -> bool:
        return (x.is_cuda or not self.cuda_only) and not tracing()

    def pad(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook of the mask head: ``(R, ...)`` -> ``(R + pad, ...)``, ``pad`` zero rows."""
        thread = threading.get_ident()
        self._rows.pop(thread, None)
        x = args[0]
        if not isinstance(x, Tensor) or not self._applies(x):
            return None
        rows = x.shape[0]
        extra = -rows % self.multiple
        if not extra:
            return None
        self._rows[thread] = rows
        return (torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]), *args[1:])

    def cut(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook of the mask predictor: drops the padded rows of its logits."""
        rows = self._rows.pop(threading.get_ident(), None)
        if rows is None or not isinstance(output, Tensor):
            return None
        return output[:rows]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(multiple={self.multiple}, cuda_only={self.cuda_only})"


def pad_mask_rois(roi_heads: nn.Module, multiple: int | None, cuda_only: bool = True) -> MaskRoIPadding | None:
    """Install :class:`MaskRoIPadding` on a torchvision ``RoIHeads`` with a mask branch.

    Args:
        roi_heads: ``model.roi_heads`` of a torchvision Mask R-CNN (``mask_head`` and
            ``mask_predictor`` set).
        multiple: pad the mask head's RoI batch to a multiple of this; ``None``: do nothing.
        cuda_only: see :class:`MaskRoIPadding`.

    Returns:
        The installed padding (``roi_heads.mask_roi_padding``), or ``None``.
    """
    if multiple is None:
        return None
    padding = MaskRoIPadding(multiple, cuda_only)
    roi_heads.mask_head.register_forward_pre_hook(padding.pad)
    roi_heads.mask_predictor.register_forward_hook(padding.cut)
    roi_heads.mask_roi_padding = padding
    return padding
