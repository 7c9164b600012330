"""Object detection and instance segmentation task (LightningModule).

:class:`DetectionTask` builds a detector with :func:`vtdense.models.detection.build_detector`
(backbone name + options, head name), trains it with AdamW (no weight decay on norms, biases,
position tables, logit scales) under a per-iteration warmup + step / cosine schedule, and
evaluates COCO mAP with torchmetrics' :class:`~torchmetrics.detection.MeanAveragePrecision`
(bbox, plus segm for Mask R-CNN) in ORIGINAL image coordinates.

Each validation epoch also writes to the run directory (the trainer's ``log_dir``):
``bbox.json`` / ``segm.json`` in COCO results format (COCO image and category ids, so
``COCO.loadRes`` + ``COCOeval`` re-score them) and PNGs of predictions drawn over a few
validation images under ``predictions/``.

Batches follow vtdense's detection data contract: ``(images, targets)`` where images are
``[3, h, w]`` floats in 0..1 already resized by the data pipeline, and targets carry
``boxes`` (XYXY, resized coordinates), ``labels`` (1..K), ``masks``, ``image_id``,
``orig_size`` and, on evaluation splits, ``orig_boxes`` / ``orig_masks`` / ``iscrowd`` / ``area``
in original coordinates.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from pycocotools import mask as mask_utils
from torch import Tensor, nn
from torchmetrics.detection import MeanAveragePrecision
from torchvision.ops import box_convert
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

from vtdense.models.compile import check_compile_option
from vtdense.models.detection import (HEADS, build_detector, list_heads, set_roi_alignment, set_size_divisibility,
                                     unpasted_masks)
from vtdense.models.paste_masks import paste_masks
from vtdense.models.mask_rois import check_mask_rois_multiple
from vtdense.options import check_int, check_number
from vtdense.tasks.base import BaseTask, format_class_table
from vtdense.tasks.optim import (
    StepLambdaLR,
    apply_layer_decay,
    check_no_decay,
    check_optimizer,
    check_schedule_numbers,
    make_optimizer,
    param_groups,
    warmup_schedule,
)

__all__ = ["DetectionTask", "LR_SCHEDULES", "METRIC_BACKENDS", "IOU_TYPES", "METRIC_NAMES", "keep_targets_exact"]

#: ``lr_schedule`` choice -> ``warmup_schedule`` kind.
LR_SCHEDULES: dict[str, str] = {"step": "step", "cosine": "cosine", "poly": "poly", "constant": "constant"}
#: ``metric_backend`` choice -> torchmetrics backend.
METRIC_BACKENDS: dict[str, str] = {"pycocotools": "pycocotools", "faster_coco_eval": "faster_coco_eval"}
#: head -> IoU types evaluated.
IOU_TYPES: dict[str, tuple[str, ...]] = {
    "mask_rcnn": ("bbox", "segm"),
    "faster_rcnn": ("bbox",),
    "retinanet": ("bbox",),
    "fcos": ("bbox",),
}
#: torchmetrics key -> logged name suffix (``val/bbox_mAP``, ``val/segm_mAP50``, ...).
METRIC_NAMES: dict[str, str] = {
    "map": "mAP",
    "map_50": "mAP50",
    "map_75": "mAP75",
    "map_small": "mAP_s",
    "map_medium": "mAP_m",
    "map_large": "mAP_l",
    "mar_100": "mAR100",
}

#: pycocotools' default IoU (0.50:0.05:0.95) and recall (0:0.01:1) thresholds, in float64.
COCO_IOU_THRESHOLDS: list[float] = np.linspace(0.5, 0.95, 10).tolist()
COCO_REC_THRESHOLDS: list[float] = np.linspace(0.0, 1.0, 101).tolist()

_MASK_CHUNK = 16
#: Box / mask colour of predicted class ``label`` (indexed by ``label % 10``) in drawings of ``predict``.
_DRAW_COLOURS: tuple[str, ...] = (
    "#ff3838", "#ffd21f", "#2cd4ff", "#4dff4d", "#ff8c1a", "#c77dff", "#ff5cbe", "#00e6b8", "#ffffff", "#a6ff00",
)
_VIS_MIN_SIDE = 384  # drawn predictions are upscaled to at least this long side
#: target keys the detector needs on the accelerator; the rest stays on the CPU for the metric.
_DEVICE_TARGET_KEYS: frozenset[str] = frozenset({"boxes", "labels", "masks"})  # detections whose masks are upsampled together
#: marks a training target whose boxes / labels / masks transfer_batch_to_device already prepared
_TRAIN_READY = "_vtdense_train_ready"


def _as_label_map(value: Any) -> dict[int, int]:
    """``label -> COCO category id`` from a mapping or a sequence indexed by ``label - 1``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {int(k): int(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return {i + 1: int(v) for i, v in enumerate(value)}
    raise TypeError(f"label_to_category_id must be a mapping or a sequence, got {type(value).__name__}")


def _as_name_map(value: Any, label_map: dict[int, int]) -> dict[int, str]:
    """``label -> class name`` from a mapping keyed by category id, or a sequence indexed by label
    (when entry 0 is ``"__background__"``) or by ``label - 1``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        inverse = {c: lab for lab, c in label_map.items()}
        return {inverse.get(int(k), int(k)): str(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        names = [str(v) for v in value]
        if names and names[0] == "__background__":  # indexed by label
            return {i: n for i, n in enumerate(names) if i > 0}
        return {i + 1: n for i, n in enumerate(names)}
    raise TypeError(f"category_names must be a mapping or a sequence, got {type(value).__name__}")


def _size_tuple(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, Tensor):
        value = value.tolist()
    try:
        h, w = (int(v) for v in value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"target {name!r} must be (height, width), got {value!r}") from err
    return h, w


def _rle_encode(masks: Tensor) -> list[dict[str, Any]]:
    """Bool ``[N, H, W]`` -> COCO compressed RLEs with ``counts`` as str (JSON-ready)."""
    if masks.shape[0] == 0:
        return []
    arr = np.asfortranarray(masks.permute(1, 2, 0).cpu().numpy().astype(np.uint8))
    rles = mask_utils.encode(arr)
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii")
    return rles


def _is_detection_batch(data: Any) -> bool:
    """``(images, targets)`` with one mapping per image: what the COCO datamodule's loaders give."""
    return (isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], (list, tuple))
            and all(isinstance(t, Mapping) for t in data[1]))


def _narrowed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether a floating tensor of ``before`` came out of a conversion with fewer bytes per element."""
    for key, old in before.items():
        new = after.get(key)
        if isinstance(old, Tensor) and isinstance(new, Tensor) and new.is_floating_point():
            if new.element_size() < old.element_size():
                return True
    return False


def keep_targets_exact(plugin: Any) -> None:
    """Make Lightning's precision ``plugin`` leave a detection batch's targets in their own dtypes
    when it would convert them to half precision.

    ``--trainer.precision bf16-true`` (or ``16-true``) converts every floating tensor of a batch to
    that dtype before the task sees it, the ground truth included: box coordinates rounded to 4 px
    between 512 and 1024 in bfloat16, and the boxes and areas the validation scores against with
    them, so mAP is measured against moved boxes. The images are still converted (the model runs
    in that dtype); the targets keep float32 (the heads take float32 boxes with half-precision
    maps, see :mod:`vtdense.models.roi_pool`). A lossless conversion (``64-true``) is kept whole.
    Installed once per plugin (the task calls it at ``setup``)."""
    convert = getattr(plugin, "convert_input", None)
    if convert is None or getattr(convert, "_vtdense_keeps_targets", False):
        return

    def convert_input(data: Any) -> Any:
        out = convert(data)
        if _is_detection_batch(data) and _is_detection_batch(out) and any(
                _narrowed(before, after) for before, after in zip(data[1], out[1])):
            return type(out)((out[0], data[1]))  # the images converted, the targets as the loader made them
        return out

    convert_input._vtdense_keeps_targets = True  # type: ignore[attr-defined]
    plugin.convert_input = convert_input


class DetectionTask(BaseTask):
    """Train and evaluate a vtdense-backbone detector (Mask R-CNN, Faster R-CNN, RetinaNet, FCOS).

    Example:
        >>> task = DetectionTask(backbone="swin_tiny", head="mask_rcnn", num_classes=80)  # doctest: +SKIP
    """

    monitor = "val/bbox_mAP"
    monitor_mode = "max"
    checkpoint_filename = "best-epoch{epoch:03d}"

    def __init__(
        self,
        backbone: str = "swin_tiny",
        backbone_kwargs: dict[str, Any] | None = None,
        backbone_weights: str | None = None,
        head: str = "mask_rcnn",
        num_classes: int | None = None,
        fpn_channels: int = 256,
        slim_heads: bool = False,
        mask_head_channels: int | None = None,
        mask_head_layers: int = 4,
        box_head_width: int | None = None,
        rois_per_image: int | None = None,
        anchor_sizes: list[float] | None = None,
        detections_per_img: int = 100,
        score_thresh: float = 0.05,
        head_kwargs: dict[str, Any] | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.05,
        no_decay: str = "names",
        optimizer: str = "adamw",
        momentum: float = 0.9,
        backbone_lr_mult: float = 1.0,
        layer_decay: float | None = None,
        lr_schedule: str = "step",
        lr_milestones: list[float] | None = None,
        lr_gamma: float = 0.1,
        warmup_steps: int = 500,
        warmup_factor: float = 0.001,
        metric_backend: str = "pycocotools",
        num_vis_images: int = 4,
        vis_score_thresh: float = 0.5,
        nonfinite_loss: str = "error",
        checkpoint_every_n_steps: int | None = None,
        size_divisibility: int | None = None,
        fused_optimizer: bool | None = None,
        compile_backbone: bool | str = False,
        mask_rois_multiple: int | None = 32,
        activation_recompute: bool = True,
        activation_recompute_min_bytes: int | None = None,
        triton_attention: bool | str = "auto",
        roi_aligned: bool = True,
        binary_mask_targets: bool = True,
        rpn_min_pos_iou: float | None = None,
    ) -> None:
        """Initialise the task.

        Args:
            backbone: registered backbone name (``vtdense.list_backbones()``), e.g. ``swin_tiny``.
            backbone_kwargs: ``create_backbone`` overrides (``embed_dim``, ``depths``,
                ``drop_path_rate``, ``window_size``, ...).
            backbone_weights: backbone checkpoint, a path (any format ``vtdense.load_pretrained`` reads:
                timm, official, torchvision, detectron2, mmdet, safetensors, ...) or a Hugging Face Hub id
                (``timm/swin_tiny_patch4_window7_224.ms_in1k``, through ``huggingface_hub``'s cache and
                offline mode); loaded when fitting starts.
            head: ``mask_rcnn``, ``faster_rcnn``, ``retinanet`` or ``fcos``.
            num_classes: object classes (background excluded); ``None`` takes the datamodule's
                ``num_classes`` in ``setup``.
            fpn_channels: FPN channels.
            slim_heads: small R-CNN heads for CPU demos (see ``build_detector``).
            mask_head_channels: Mask R-CNN mask head channels (``None``: 256, or 64 when slim).
            mask_head_layers: Mask R-CNN mask head convs (4 published).
            box_head_width: R-CNN box head width (``None``: 1024, or 256 when slim).
            rois_per_image: RoIs sampled per image for the R-CNN heads (``None``: 512, or 64 when slim).
            anchor_sizes: base anchor size per pyramid level (``None``: the head's default).
            detections_per_img: detections kept per image.
            score_thresh: minimum detection score.
            head_kwargs: extra keyword arguments for the torchvision detector class.
            lr: learning rate.
            weight_decay: weight decay (by ``no_decay``, not applied to position tables, logit
                scales, and norms or every 1-D tensor and bias).
            no_decay: ``"names"`` (norms and position tables get no decay, biases do: the mmdet Swin and
                detectron2 MViTv2 recipes), ``"1d"`` (every 1-D tensor and bias too: timm's rule) or
                ``"none"`` (everything decays: mmdet's SGD recipes);
                :data:`vtdense.tasks.optim.NO_DECAY_RULES`.
            optimizer: ``"adamw"`` (betas 0.9, 0.999) or ``"sgd"`` (with ``momentum``: mmdet's
                RetinaNet recipe); :data:`vtdense.tasks.optim.OPTIMIZERS`.
            momentum: SGD momentum.
            backbone_lr_mult: learning-rate multiplier of the backbone parameters.
            layer_decay: layer-wise lr decay of the backbone (``None``: off); backbone layer ``i``
                of ``N`` gets ``layer_decay ** (N - i)`` times its lr, the neck and heads ``1``.
            lr_schedule: ``step``, ``cosine``, ``poly`` or ``constant``, after the warmup.
            lr_milestones: epochs (may be fractional) at which ``step`` multiplies the lr by ``lr_gamma``.
            lr_gamma: step decay factor.
            warmup_steps: linear warmup iterations.
            warmup_factor: lr multiplier at the first warmup iteration.
            metric_backend: ``pycocotools`` (default, the reference) or ``faster_coco_eval``.
            num_vis_images: validation images drawn with their predictions each epoch.
            vis_score_thresh: minimum score of drawn predictions.
            nonfinite_loss: a NaN/inf loss ``"error"``s (naming the term and the batch's image ids)
                or ``"skip"``s the optimiser step (counted in ``train/nonfinite_skipped``).
            checkpoint_every_n_steps: also write ``last.ckpt`` every this many optimiser steps
                (mid-epoch; ``--ckpt_path last`` resumes there exactly).
            size_divisibility: pad each batch to a multiple of this (``None``: the backbone's, 32).
                A coarser grid (e.g. 128) bounds the distinct batch shapes of multi-scale training
                and of prediction on images of any size, so per-shape set-up (cuDNN plans,
                compiled graphs) is paid a few dozen times instead of hundreds, for more padded
                pixels; ``benchmarks/padding.py`` measures both. Must be a multiple of the backbone's.
            fused_optimizer: torch's fused AdamW or SGD step (one kernel per chunk of parameters): ``None``
                (auto) uses it on CPUs and GPUs unless gradient clipping under mixed precision or
                fp16 loss scaling rule it out; ``True`` requires it; ``False`` keeps torch's default.
            compile_backbone: ``torch.compile`` the backbone and its FPN for all input sizes
                (``dynamic=True``; parameter names and checkpoints unchanged) when the trainer starts:
                ``false`` (default), ``true`` (Inductor) or a backend name (``aot_eager``, ...). On a GPU
                it fuses the backbone's many small kernels; the first size compiles for minutes on a CPU.
            mask_rois_multiple: Mask R-CNN on CUDA: pad the mask head's RoI batch to a multiple of
                this, so cuDNN sets up plans for a few batch sizes instead of one per RoI count (same
                losses and masks; ``null``: off). See ``build_detector``.
            activation_recompute: the backbone's pre-norms and MLP GELUs are recomputed in the backward
                pass instead of kept (``true``, less memory) or kept as plain autograd keeps them
                (``false``: faster where the GPU step waits on the host; Swin-T at 512x768 on an
                H200: 1.47x the step's peak memory, 0.84x its time). Process-wide (:func:`vtdense.layers.mlp.set_activation_recompute`), set when
                the trainer builds the model.
            activation_recompute_min_bytes: off the CPU, only layers whose recomputable activation has
                at least this many bytes recompute (``null``: vtdense's default, 8 MiB; ``0``: every
                layer). See :func:`vtdense.layers.mlp.set_activation_recompute`.
            triton_attention: Swin's training attention on a GPU in vtdense's Triton kernels: ``auto``
                (default; bf16 and fp16), ``true`` (float32 too) or ``false`` (SDPA's memory-efficient
                kernel). Process-wide
                (:func:`vtdense.layers.triton_window_attention.set_triton_window_attention`), set when
                the trainer builds the model.
            roi_aligned: R-CNN heads: RoIAlign with the half-pixel offset for the box and mask
                features and the mask targets, as mmdet 2.x and detectron2 (``false``: torchvision's
                ``aligned=False``). A checkpoint saved before this option existed loads with ``false``,
                as it was trained. See ``build_detector``.
            binary_mask_targets: Mask R-CNN: mask targets thresholded at 0.5, as mmdet and detectron2
                (``false``: torchvision's soft targets); ``false`` for checkpoints saved before it.
            rpn_min_pos_iou: R-CNN heads: ``null`` (default) matches anchors as torchvision and
                detectron2; a number as mmdet's RPN assigner with that ``min_pos_iou`` (0.3 in the
                published Swin configs). See ``build_detector``.

        Raises:
            ValueError: an unknown choice (the message names the option and lists the choices).
        """
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r} (option 'head'); choose one of {', '.join(list_heads())}")
        check_no_decay(no_decay)
        check_optimizer(optimizer, momentum)
        check_schedule_numbers(lr=lr, weight_decay=weight_decay, backbone_lr_mult=backbone_lr_mult, lr_gamma=lr_gamma,
                               warmup_steps=warmup_steps, warmup_factor=warmup_factor)
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"unknown lr_schedule {lr_schedule!r} (option 'lr_schedule'); choose one of {', '.join(LR_SCHEDULES)}"
            )
        if metric_backend not in METRIC_BACKENDS:
            raise ValueError(
                f"unknown metric_backend {metric_backend!r} (option 'metric_backend'); "
                f"choose one of {', '.join(METRIC_BACKENDS)}"
            )
        if metric_backend == "faster_coco_eval" and importlib.util.find_spec("faster_coco_eval") is None:
            raise ValueError(
                "metric_backend='faster_coco_eval' needs the faster-coco-eval package "
                "(pip install 'vtdense[fast-eval]'); or use metric_backend='pycocotools'"
            )
        from vtdense.backbones import list_backbones

        if backbone not in list_backbones():
            raise ValueError(
                f"unknown backbone {backbone!r} (option 'backbone'); choose one of {', '.join(list_backbones())}"
            )
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 (background excluded), got {num_classes}")
        if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1] (option 'layer_decay'), got {layer_decay}")
        if size_divisibility is not None and (
            isinstance(size_divisibility, bool) or not isinstance(size_divisibility, int) or size_divisibility < 1
        ):
            raise ValueError(f"size_divisibility must be a positive int (option 'size_divisibility'), got {size_divisibility!r}")
        check_mask_rois_multiple(mask_rois_multiple)
        check_int("num_vis_images", num_vis_images, low=0)
        check_number("vis_score_thresh", vis_score_thresh, low=0.0, high=1.0)
        self.check_fault_options(nonfinite_loss, checkpoint_every_n_steps)
        self.check_recompute_option(activation_recompute_min_bytes)
        self.check_triton_attention_option(triton_attention)
        check_compile_option(compile_backbone)
        self.save_hyperparameters()
        self.label_to_category_id: dict[int, int] = {}
        self.category_names: dict[int, str] = {}
        self.val_metrics: MeanAveragePrecision | None = None
        self.test_metrics: MeanAveragePrecision | None = None
        # image id -> {"pred": ..., "gt": ...} for this rank's evaluation images (masks as RLE)
        self._records: dict[int, dict[str, Any]] = {}
        self._vis: list[tuple[int, Tensor]] = []
        self._backbone_loaded = False
        if num_classes is not None:
            self.build()
        else:
            self.check_architecture()  # the network itself is built in setup, from the datamodule's class count

    # ------------------------------------------------------------------ building
    @property
    def iou_types(self) -> tuple[str, ...]:
        """IoU types evaluated for this head."""
        return IOU_TYPES[self.hparams["head"]]

    def configure_models(self) -> None:
        """Build the detector from the hyperparameters."""
        hp = self.hparams
        self.model = build_detector(
            hp["backbone"],
            hp["head"],
            int(hp["num_classes"]),
            fpn_channels=hp["fpn_channels"],
            backbone_kwargs=hp["backbone_kwargs"],
            slim_heads=hp["slim_heads"],
            mask_head_channels=hp["mask_head_channels"],
            mask_head_layers=hp["mask_head_layers"],
            box_head_width=hp["box_head_width"],
            rois_per_image=hp["rois_per_image"],
            anchor_sizes=hp["anchor_sizes"],
            detections_per_img=hp["detections_per_img"],
            score_thresh=hp["score_thresh"],
            head_kwargs=hp["head_kwargs"],
            size_divisibility=hp.get("size_divisibility"),
            mask_rois_multiple=hp.get("mask_rois_multiple", 32),
            roi_aligned=hp.get("roi_aligned", True),
            binary_mask_targets=hp.get("binary_mask_targets", True),
            rpn_min_pos_iou=hp.get("rpn_min_pos_iou"),
        )

    def configure_metrics(self) -> None:
        """COCO mAP metrics for validation and test.

        They never synchronise across processes themselves: the task gathers every rank's
        per-image predictions, drops the repeats of the distributed sampler, and feeds the
        metric in image-id order, so each image counts once and the result equals one process.
        """
        iou = self.iou_types
        kwargs = dict(
            sync_on_compute=False,
            iou_type=iou if len(iou) > 1 else iou[0],
            backend=METRIC_BACKENDS[self.hparams["metric_backend"]],
            # pycocotools' float64 thresholds: torchmetrics' defaults come from a float32 linspace
            # (0.30000001 instead of 0.3), which shifts recall cut-offs and changes mAP slightly.
            iou_thresholds=COCO_IOU_THRESHOLDS,
            rec_thresholds=COCO_REC_THRESHOLDS,
            extended_summary=True,  # COCOeval's precision array: the per-category AP, as detectron2 derives it
        )
        self.val_metrics = MeanAveragePrecision(**kwargs)
        self.test_metrics = MeanAveragePrecision(**kwargs)

    def setup(self, stage: str) -> None:
        """Take ``num_classes`` and the category id / name tables from the datamodule."""
        super().setup(stage)
        if self._trainer is not None:
            keep_targets_exact(self._trainer.precision_plugin)
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if self.model is None:
            self.build_from_datamodule(dm)
        if dm is not None:
            dm_classes = getattr(dm, "num_classes", None)
            if dm_classes is not None and int(dm_classes) != int(self.hparams["num_classes"]):
                raise ValueError(
                    f"model num_classes={self.hparams['num_classes']} but the datamodule has {dm_classes} classes"
                )
            if hasattr(dm, "label_to_category_id"):
                self.label_to_category_id = _as_label_map(dm.label_to_category_id)
            if hasattr(dm, "category_names"):
                self.category_names = _as_name_map(dm.category_names, self.label_to_category_id)
        weights = self.hparams["backbone_weights"]
        if stage == "fit" and weights is not None and not self._backbone_loaded:
            from vtdense.checkpoints.convert import load_pretrained

            load_pretrained(self._detector.backbone.body, weights)
            self._backbone_loaded = True

    def build_from_datamodule(self, datamodule: Any) -> None:
        """Take ``num_classes`` from ``datamodule`` unless given, and build the detector."""
        if self.hparams["num_classes"] is None:
            n = getattr(datamodule, "num_classes", None)
            if n is None:
                raise ValueError("num_classes is None and the datamodule has no num_classes; pass --model.num_classes")
            self.hparams["num_classes"] = int(n)
        self.build()

    def check_data_fits(self, datamodule: Any, source: str | None = None) -> None:
        """Also refuse data whose COCO category ids or names are not the checkpoint's: the labels
        the model predicts would be scored as other categories."""
        super().check_data_fits(datamodule, source)
        if not self.label_to_category_id or not hasattr(datamodule, "label_to_category_id"):
            return
        ids = _as_label_map(datamodule.label_to_category_id)
        names = _as_name_map(getattr(datamodule, "category_names", None), ids)
        where = f"checkpoint {source}" if source else "the model"
        mine = [(self.label_to_category_id[k], self.category_names.get(k)) for k in sorted(self.label_to_category_id)]
        theirs = [(ids[k], names.get(k)) for k in sorted(ids)]
        if [c for c, _ in mine] != [c for c, _ in theirs] or any(
            a is not None and b is not None and a != b for (_, a), (_, b) in zip(mine, theirs)
        ):
            raise ValueError(
                f"{where} was trained on the categories (id, name) {mine} but the data has {theirs}: "
                "evaluate on data with the category list it was trained on"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the category tables so predictions from a checkpoint carry COCO ids."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["label_to_category_id"] = self.label_to_category_id
        checkpoint["category_names"] = self.category_names

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the category tables (and build the model if ``num_classes`` was deferred)."""
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("hyper_parameters", {})
        for name in ("roi_aligned", "binary_mask_targets"):  # options added later: as the model was trained
            if name not in saved:
                self.hparams[name] = False
        if self.model is not None:
            set_roi_alignment(self._detector, self.hparams["roi_aligned"], self.hparams["binary_mask_targets"])
        self.label_to_category_id = dict(checkpoint.get("label_to_category_id", {}))
        self.category_names = dict(checkpoint.get("category_names", {}))
        if self.model is None:
            n = checkpoint.get("hyper_parameters", {}).get("num_classes")
            if n is not None:
                self.hparams["num_classes"] = int(n)
                self.build()

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW or SGD (``optimizer``) with decay / no-decay groups and a per-iteration warmup + decay LambdaLR."""
        hp = self.hparams
        groups = param_groups(
            self._detector, hp["weight_decay"], backbone_prefix="backbone.body.", backbone_lr_mult=hp["backbone_lr_mult"],
            rule=hp["no_decay"],
        )
        if hp.get("layer_decay") is not None:
            groups = apply_layer_decay(groups, self._detector.backbone.body, "backbone.body.", hp["layer_decay"])
        for group in groups:
            group["lr"] = hp["lr"] * group["lr_mult"]
            group.pop("param_names", None)
        optimizer = make_optimizer(
            hp.get("optimizer", "adamw"), groups, lr=hp["lr"], weight_decay=hp["weight_decay"],
            momentum=hp.get("momentum", 0.9), fused=hp.get("fused_optimizer"), trainer=self._trainer,
        )

        total = self.trainer.estimated_stepping_batches
        kind = LR_SCHEDULES[hp["lr_schedule"]]
        milestones: list[int] = []
        if kind == "step" and hp["lr_milestones"]:
            nb = self.trainer.num_training_batches
            if not math.isfinite(nb):
                raise ValueError("lr_milestones are in epochs but the train dataloader has no length")
            per_epoch = max(1, math.ceil(nb / self.trainer.accumulate_grad_batches))
            milestones = [int(round(float(m) * per_epoch)) for m in hp["lr_milestones"]]
        if kind in ("cosine", "poly") and not math.isfinite(total):
            raise ValueError(f"lr_schedule={kind!r} needs a finite run: set trainer.max_epochs or trainer.max_steps")
        fn = functools.partial(
            warmup_schedule,
            total_steps=int(total) if math.isfinite(total) else 1,
            warmup_steps=hp["warmup_steps"],
            warmup_factor=hp["warmup_factor"],
            kind=kind,
            milestones=milestones,
            gamma=hp["lr_gamma"],
        )
        scheduler = StepLambdaLR(optimizer, fn)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def backbone_part(self) -> nn.Module:
        """The vtdense backbone: ``model.backbone.body`` (the FPN is ``model.backbone.fpn``)."""
        return self._detector.backbone.body

    @property
    def _detector(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the detector is not built yet: pass num_classes or attach a datamodule (setup)")
        return self.model

    # ------------------------------------------------------------------ forward / train
    def forward(self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None) -> Any:
        """The torchvision detector: losses in train mode with targets, detections in eval mode."""
        return self._detector(images, targets)

    def _train_target(self, target: dict[str, Any]) -> dict[str, Tensor]:
        if target.get(_TRAIN_READY):  # prepared on the CPU by transfer_batch_to_device
            return {k: target[k] for k in _DEVICE_TARGET_KEYS if k in target}
        boxes = target["boxes"].float()
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        out = {"boxes": boxes[keep], "labels": target["labels"][keep].long()}
        if "segm" in self.iou_types:
            if "masks" not in target:
                raise KeyError(f"head {self.hparams['head']!r} needs target 'masks' (image_id {target.get('image_id')})")
            out["masks"] = target["masks"][keep]
        return out

    def training_step(self, batch: tuple[list[Tensor], list[dict[str, Any]]], batch_idx: int) -> Tensor | None:
        """One optimisation step: sum of the detector's losses, each term logged (``None``: step skipped)."""
        images, targets = batch
        losses = self(list(images), [self._train_target(t) for t in targets])
        if self.nonfinite_step(losses, [int(t["image_id"]) for t in targets if "image_id" in t]):
            return None
        loss = sum(losses.values())
        bs = len(images)
        self.log_dict({f"train/{k}": v.detach() for k, v in losses.items()}, batch_size=bs)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=bs)
        return loss

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move images and training targets; keep evaluation-only ground truth (``orig_*``) on the CPU.

        Copies to a GPU do not make the host wait (``non_blocking``, as Lightning's own transfer), and
        in training the targets' degenerate boxes are dropped here, on the CPU, where doing it on the
        device would wait for it three times per image (a boolean index sizes its output from the data)."""
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], (list, tuple)):
            images, targets = batch
            kw = {"non_blocking": True} if torch.device(device).type == "cuda" else {}
            images = [img.to(device, **kw) for img in images]
            training = self._trainer is not None and self.trainer.training
            moved = []
            for t in targets:
                if isinstance(t, Mapping):
                    if training and isinstance(t.get("boxes"), Tensor) and t["boxes"].device.type == "cpu":
                        rest = {k: v for k, v in t.items() if k not in _DEVICE_TARGET_KEYS}
                        t = {**rest, **self._train_target(t), _TRAIN_READY: True}
                    t = {
                        k: (v.to(device, **kw) if isinstance(v, Tensor) and k in _DEVICE_TARGET_KEYS else v)
                        for k, v in t.items()
                    }
                moved.append(t)
            return images, moved
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ evaluation
    def _category_ids(self, labels: Tensor) -> Tensor:
        if not self.label_to_category_id:
            return labels.long()
        table = self.label_to_category_id
        return torch.tensor([table.get(int(lab), int(lab)) for lab in labels.tolist()], dtype=torch.long)

    def _to_original(self, image: Tensor, det: dict[str, Tensor], target: dict[str, Any] | None,
                     unpasted: bool = False) -> dict[str, Tensor]:
        """Rescale one image's detections to its original size; masks -> bool ``[N, H0, W0]``.

        ``unpasted``: ``det["masks"]`` are the mask head's ``(N, 1, M, M)`` probabilities
        (:func:`~vtdense.models.detection.unpasted_masks`), pasted here once into the original image
        with the rescaled boxes, as mmdet and detectron2 paste (and torchvision, whose model resizes
        the images itself); otherwise masks pasted into the model's input are resized to it."""
        h, w = int(image.shape[-2]), int(image.shape[-1])
        if target is not None and "orig_size" in target:
            h0, w0 = _size_tuple(target["orig_size"], "orig_size")
        else:
            h0, w0 = h, w
        scale = torch.tensor([w0 / w, h0 / h, w0 / w, h0 / h])
        on_device = det["boxes"].detach().float() * scale.to(det["boxes"].device)
        boxes = on_device.cpu()
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w0)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h0)
        out = {
            "boxes": boxes,
            "scores": det["scores"].float().detach().cpu(),
            "labels": det["labels"].long().detach().cpu(),
        }
        out["category_ids"] = self._category_ids(out["labels"])
        if "masks" in det:
            probs = det["masks"].detach()
            chunks = []
            for i in range(0, probs.shape[0], _MASK_CHUNK):
                part = probs[i : i + _MASK_CHUNK].float()
                if unpasted:
                    part = paste_masks(part, on_device[i : i + _MASK_CHUNK], (h0, w0))
                else:
                    part = F.interpolate(part, size=(h0, w0), mode="bilinear", align_corners=False)
                chunks.append(part[:, 0].gt(0.5).cpu())
            out["masks"] = torch.cat(chunks) if chunks else torch.zeros(0, h0, w0, dtype=torch.bool)
        return out

    def _ground_truth(self, image: Tensor, target: dict[str, Any]) -> dict[str, Tensor]:
        """Ground truth in original coordinates with COCO category ids, for the metric."""
        labels = target["labels"].long().cpu()
        if "orig_boxes" in target:
            boxes = target["orig_boxes"].float().cpu()
        else:  # scale the resized boxes back
            h0, w0 = _size_tuple(target["orig_size"], "orig_size")
            h, w = int(image.shape[-2]), int(image.shape[-1])
            boxes = target["boxes"].float().cpu() * torch.tensor([w0 / w, h0 / h, w0 / w, h0 / h])
        gt: dict[str, Tensor] = {"boxes": boxes, "labels": self._category_ids(labels)}
        if "iscrowd" in target:
            gt["iscrowd"] = target["iscrowd"].long().cpu()
        if "area" in target:
            # pycocotools ranks a ground truth by its ``area`` field as it is: 0 is "small", a
            # negative one is outside every range (ignored). torchmetrics replaces an area <= 0 by
            # the box or mask area, so hand it values that fall in the same ranges: the smallest
            # positive float for 0, infinity (above "all"'s 1e10) for a negative area.
            area = target["area"].float().cpu()
            tiny = torch.finfo(torch.float32).tiny
            gt["area"] = torch.where(area < 0, torch.inf, torch.where(area == 0, tiny, area))
        if "segm" in self.iou_types:
            if "orig_masks" not in target:
                raise KeyError(
                    f"segm evaluation needs target 'orig_masks' in original coordinates (image_id {target.get('image_id')})"
                )
            gt["masks"] = target["orig_masks"].bool().cpu()
        return gt

    def _results_json(self, records: dict[int, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """COCO results records per IoU type from per-image predictions, in image-id order."""
        out: dict[str, list[dict[str, Any]]] = {iou: [] for iou in self.iou_types}
        for image_id in sorted(records):
            pred = records[image_id]["pred"]
            xywh = box_convert(pred["boxes"], "xyxy", "xywh").tolist()
            cats, scores = pred["labels"].tolist(), pred["scores"].tolist()
            for b, c, s in zip(xywh, cats, scores):
                out["bbox"].append(
                    {"image_id": image_id, "category_id": int(c), "bbox": [float(v) for v in b], "score": float(s)}
                )
            if "segm" in out:
                for rle, c, s in zip(pred.get("masks", []), cats, scores):
                    out["segm"].append({"image_id": image_id, "category_id": int(c), "segmentation": rle, "score": float(s)})
        return out

    def _draw(self, image: Tensor, det: dict[str, Tensor], unpasted: bool = False) -> Tensor:
        """Draw detections (resized coordinates) over the model input; uint8 ``[3, s*h, s*w]``.

        Small images are upscaled by an integer factor ``s`` so labels stay legible. ``unpasted``: as
        for :meth:`_to_original` (the masks are pasted into the model input first).
        """
        keep = (det["scores"] >= self.hparams["vis_score_thresh"]).cpu()
        h, w = image.shape[-2:]
        scale = max(1, math.ceil(_VIS_MIN_SIDE / max(h, w)))
        canvas = image.detach().float().clamp(0, 1).cpu()
        if scale > 1:
            canvas = F.interpolate(canvas[None], scale_factor=scale, mode="nearest")[0]
        canvas = (canvas * 255).to(torch.uint8)
        if "masks" in det and keep.any():
            masks = det["masks"].detach().float().cpu()[keep]
            if unpasted:
                masks = paste_masks(masks, det["boxes"].detach().float().cpu()[keep], (int(h), int(w)))
            if scale > 1:
                masks = F.interpolate(masks, scale_factor=scale, mode="bilinear", align_corners=False)
            canvas = draw_segmentation_masks(canvas, masks[:, 0].gt(0.5), alpha=0.45)
        if keep.any():
            labels = det["labels"].cpu()[keep].tolist()
            scores = det["scores"].cpu()[keep].tolist()
            text = [f"{self.category_names.get(int(lab), str(int(lab)))} {s:.2f}" for lab, s in zip(labels, scores)]
            boxes = det["boxes"].detach().float().cpu()[keep] * scale
            canvas = draw_bounding_boxes(canvas, boxes, labels=text, colors="yellow", width=2)
        return canvas

    def _eval_step(self, batch: tuple[list[Tensor], list[dict[str, Any]]], metric: MeanAveragePrecision | None) -> None:
        if metric is None:
            raise RuntimeError("metrics are not configured: the detector was never set up")
        images, targets = batch
        keep = self.eval_keep(len(images))
        dets, unpasted = self._detect(list(images), list(targets))
        for image, det, target, real in zip(images, dets, targets, keep):
            if not real:  # a repeat added by the distributed sampler
                continue
            image_id = int(target["image_id"])
            pred = self._to_original(image, det, target, unpasted)
            record = {k: pred[k] for k in ("boxes", "scores")} | {"labels": pred["category_ids"]}
            if "masks" in pred and "segm" in self.iou_types:
                record["masks"] = _rle_encode(pred["masks"])
            gt = self._ground_truth(image, target)
            if "masks" in gt:
                gt["masks"] = _rle_encode(gt["masks"])
            self._records[image_id] = {"pred": record, "gt": gt}
            if len(self._vis) < self.hparams["num_vis_images"]:
                self._vis.append((image_id, self._draw(image, det, unpasted)))

    @staticmethod
    def _decoded(record: dict[str, Any], size: tuple[int, int]) -> dict[str, Tensor]:
        """A metric input from a record: RLE masks decoded to bool ``[N, H, W]`` (``size`` when N is 0)."""
        out = {k: v for k, v in record.items() if k != "masks"}
        if "masks" in record:
            rles = record["masks"]
            if rles:
                arr = mask_utils.decode([{"size": r["size"], "counts": r["counts"].encode("ascii")} for r in rles])
                out["masks"] = torch.from_numpy(arr).permute(2, 0, 1).bool()
            else:
                out["masks"] = torch.zeros(0, *size, dtype=torch.bool)
        return out

    def _eval_epoch_end(self, prefix: str, metric: MeanAveragePrecision | None) -> dict[str, float]:
        """Gather every rank's per-image records (a collective), score them once, log, write outputs."""
        if metric is None:
            return {}
        parts = self.gather((self._records, self._vis))
        self._records, self._vis = {}, []
        records: dict[int, dict[str, Any]] = {}
        vis: list[tuple[int, Tensor]] = []
        for part_records, part_vis in parts:
            records.update(part_records)
            vis.extend(part_vis)
        metric.reset()
        if not records:
            return {}
        for image_id in sorted(records):
            rec = records[image_id]
            rles = rec["gt"].get("masks") or rec["pred"].get("masks") or [{"size": (0, 0)}]
            size = tuple(rles[0]["size"])
            metric.update([self._decoded(rec["pred"], size)], [self._decoded(rec["gt"], size)])
        res = metric.compute()
        metric.reset()
        logs: dict[str, float] = {}
        for iou in self.iou_types:
            for key, name in METRIC_NAMES.items():
                value = res.get(f"{iou}_{key}", res.get(key) if len(self.iou_types) == 1 else None)
                if value is not None:
                    logs[f"{prefix}/{iou}_{name}"] = float(value)
        per_category = self._per_category_ap(res)
        for iou, table in per_category.items():  # categories without ground truth have no AP: not logged
            logs.update({f"{prefix}/{iou}_AP.{name}": ap for name, ap in table.items() if not math.isnan(ap)})
        # every rank computed the same numbers from the same gathered records
        self.log_dict(logs, batch_size=len(records), sync_dist=True)
        if self.writes_outputs:
            vis = sorted(vis, key=lambda v: v[0])[: self.hparams["num_vis_images"]]
            self._write_outputs(prefix, self._results_json(records), vis)
            if self.trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING):
                for iou, table in per_category.items():
                    title = f"per-category {iou} AP: mAP {logs.get(f'{prefix}/{iou}_mAP', float('nan')):.4f}"
                    print(format_class_table(list(table), list(table.values()), title, column="AP"))
        return logs

    def _per_category_ap(self, res: dict[str, Any]) -> dict[str, dict[str, float]]:
        """Per IoU type, each category's AP (IoU 0.50:0.95, all areas, 100 detections) from
        COCOeval's precision array, as detectron2 derives it: the mean of the precisions defined
        (``nan`` for a category without ground truth). Keyed by category name (its COCO id where
        it has none), in category id order."""
        classes = [int(c) for c in res.get("classes", torch.zeros(0)).tolist()]
        names = {self.label_to_category_id.get(k, k): self.category_names.get(k, str(self.label_to_category_id.get(k, k)))
                 for k in set(self.label_to_category_id) | set(self.category_names)}
        out: dict[str, dict[str, float]] = {}
        for iou in self.iou_types:
            precision = res.get(f"{iou}_precision", res.get("precision") if len(self.iou_types) == 1 else None)
            if precision is None or precision.ndim != 5 or precision.shape[2] != len(classes):
                continue
            table = {}
            for k, cat in enumerate(classes):
                p = precision[:, :, k, 0, -1]
                p = p[p > -1]
                table[names.get(cat, str(cat))] = float(p.float().mean()) if p.numel() else float("nan")
            out[iou] = table
        return out

    def _write_outputs(self, prefix: str, results: dict[str, list[dict[str, Any]]], vis: list[tuple[int, Tensor]]) -> None:
        """Results JSON and prediction PNGs (rank 0 only; no collective)."""
        stem = "" if prefix == "val" else f"{prefix}_"
        for iou in self.iou_types:
            self.write_text(f"{stem}{iou}.json", json.dumps(results.get(iou, [])))
        fn = self.trainer.state.fn.value if self.trainer.state.fn is not None else prefix
        for image_id, canvas in vis:
            self.write_image(f"predictions/{fn}_{prefix}_epoch{self.current_epoch:03d}_img{image_id}.png", canvas)
            self.log_image(f"{prefix}/pred_{image_id}", canvas)

    def validation_step(self, batch: tuple[list[Tensor], list[dict[str, Any]]], batch_idx: int) -> None:
        """Predict, rescale to original coordinates and update the COCO metric."""
        self._eval_step(batch, self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        """Compute COCO mAP once, log ``val/bbox_mAP`` etc., write results files and PNGs."""
        self._eval_epoch_end("val", self.val_metrics)

    def test_step(self, batch: tuple[list[Tensor], list[dict[str, Any]]], batch_idx: int) -> None:
        """Like ``validation_step`` on the test split."""
        self._eval_step(batch, self.test_metrics)

    def on_test_epoch_end(self) -> None:
        """Compute and log ``test/bbox_mAP`` etc., write ``test_bbox.json`` ..."""
        self._eval_epoch_end("test", self.test_metrics)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> list[dict[str, Tensor]]:
        """Per image: ``boxes`` (XYXY), ``labels``, ``category_ids``, ``scores``, ``masks`` (bool) in original coordinates.

        ``batch`` is ``(images, targets)`` (targets give ``orig_size``) or a list of images.
        """
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], (list, tuple)) and (
            len(batch[1]) == 0 or isinstance(batch[1][0], Mapping)
        ):
            images, targets = list(batch[0]), list(batch[1])
        else:
            images, targets = list(batch), [None] * len(batch)
        if not images:  # every image of the batch was skipped (undecodable files)
            return []
        dets, unpasted = self._detect(images, targets)
        return [self._to_original(img, det, tgt, unpasted) for img, det, tgt in zip(images, dets, targets)]

    def _detect(self, images: list[Tensor], targets: list[dict[str, Any] | None]) -> tuple[list[dict[str, Tensor]], bool]:
        """The detections of a batch in its images' pixels, and whether Mask R-CNN's masks are the
        mask head's unpasted ``(N, 1, M, M)`` probabilities (they are pasted once, into the original
        image). With test-time views in the targets (``views``, from the datamodule's or the predict
        transform's ``test_scales`` / ``test_flip``), the views' detections merged
        (:func:`vtdense.models.detection_tta.merge_views`)."""
        if targets and targets[0] is not None and targets[0].get("views"):
            from vtdense.models.detection_tta import merge_views

            views = [[(im, False)] + [(v["image"].to(im.device), bool(v["flip"])) for v in t["views"]]
                     for im, t in zip(images, targets)]
            return merge_views(self._detector, views), True
        with unpasted_masks(self._detector) as unpasted:  # pasted once, into the original image
            return self(images), unpasted

    # ============================================================================================
    # Prediction on new images (issue 11): preprocessing from the checkpoint, a score threshold,
    # class names, and the files of the ``predict`` recipe subcommand.
    # ============================================================================================
    def predict_transform(self, test_scale: int | None = None, max_size: int | None = None,
                          test_scales: Sequence[int] | None = None, test_flip: bool | None = None,
                          test_max_size: int | None = None) -> Any:
        """Validation's resize and test-time views: ``test_scale`` / ``max_size`` / ``test_scales`` /
        ``test_flip`` / ``test_max_size`` from the checkpoint's datamodule unless given.

        Raises:
            ValueError: ``test_scales`` is not a list of positive ints, ``test_flip`` not a bool, or
                ``test_max_size`` not a positive int.
        """
        from vtdense.data.predict import detection_predict_transform
        from vtdense.data.transforms import DEFAULT_MAX_SIZE, DEFAULT_TEST_SCALE, check_test_scales

        dm = self.datamodule_hparams or {}
        scale = test_scale if test_scale is not None else dm.get("test_scale", DEFAULT_TEST_SCALE)
        size = max_size if max_size is not None else dm.get("max_size", DEFAULT_MAX_SIZE)
        scales = check_test_scales(test_scales if test_scales is not None else dm.get("test_scales"), "test_scales")
        flip = bool(dm.get("test_flip", False)) if test_flip is None else test_flip
        if not isinstance(flip, bool):
            raise ValueError(f"test_flip must be true or false, got {flip!r}")
        views_max = test_max_size if test_max_size is not None else dm.get("test_max_size")
        check_int("test_max_size", views_max, optional=True)
        return detection_predict_transform(int(scale), None if size is None else int(size), scales, flip, views_max)

    def set_size_divisibility(self, value: int | None) -> int:
        """Pad batches to multiples of ``value`` from now on (``None``: the backbone's own, 32), e.g.
        a coarser grid for prediction on images of many sizes. Also recorded in the hyperparameters,
        so a checkpoint saved afterwards keeps it. Returns the multiple in use.

        Raises:
            ValueError: not a positive multiple of the backbone's ``size_divisibility``.
        """
        pad = set_size_divisibility(self._detector, value)
        self.hparams["size_divisibility"] = value
        return pad

    @contextlib.contextmanager
    def score_threshold(self, score_thresh: float | None) -> Iterator[None]:
        """Within the block the detector keeps only detections scoring above ``score_thresh``
        (``None``: the model's own ``score_thresh``). Set on the head, so masks are computed only
        for the detections kept."""
        holder = getattr(self._detector, "roi_heads", self._detector)
        old = holder.score_thresh
        if score_thresh is not None:
            if not 0.0 <= float(score_thresh) <= 1.0:
                raise ValueError(f"score_thresh must be in [0, 1], got {score_thresh}")
            holder.score_thresh = float(score_thresh)
        try:
            yield
        finally:
            holder.score_thresh = old

    def predict_images(  # type: ignore[override]
        self,
        images: Any,
        score_thresh: float | None = None,
        *,
        batch_size: int = 1,
        bf16: bool = False,
        num_workers: int = 0,
        test_scale: int | None = None,
        max_size: int | None = None,
        test_scales: Sequence[int] | None = None,
        test_flip: bool | None = None,
        test_max_size: int | None = None,
    ) -> list[dict[str, Any]]:
        """Detect objects in image files, folders, globs or ``[3, H, W]`` tensors.

        Args:
            images: A path (image, folder or glob), a tensor (uint8 0..255 or float 0..1), or a list of them.
            score_thresh: Keep detections scoring above this (``None``: the checkpoint's ``score_thresh``).
            batch_size: Images per forward pass (sizes may differ).
            bf16: Run the model under bfloat16 autocast (boxes and scores come back float32).
            num_workers: DataLoader workers decoding the files.
            test_scale, max_size, test_scales, test_flip, test_max_size: the resize and the test-time views
                (:meth:`predict_transform`); by default the checkpoint's validation settings.

        Returns:
            Per image: ``boxes`` float32 ``[N, 4]`` (XYXY, original pixels), ``scores`` ``[N]``,
            ``labels`` int64 ``[N]`` (1..K), ``category_ids`` ``[N]`` (the dataset's ids),
            ``masks`` bool ``[N, H0, W0]`` (Mask R-CNN), ``label_names`` (``N`` class names) and
            ``path``; all on the CPU.
        """
        with self.score_threshold(score_thresh):
            return super().predict_images(images, batch_size=batch_size, bf16=bf16, num_workers=num_workers,
                                          test_scale=test_scale, max_size=max_size, test_scales=test_scales,
                                          test_flip=test_flip, test_max_size=test_max_size)

    def _label_name(self, label: int) -> str:
        return self.category_names.get(int(label), str(int(label)))

    def name_prediction(self, pred: dict[str, Any]) -> dict[str, Any]:
        """``pred`` with ``label_names``, one class name per detection."""
        return pred | {"label_names": [self._label_name(lab) for lab in pred["labels"].tolist()]}

    def write_prediction_files(
        self, out_dir: Path, target: dict[str, Any], pred: dict[str, Any], image: Tensor
    ) -> dict[str, Any]:
        """Draw boxes, class names, scores and masks over the original image to ``vis/<name>.png``;
        return the image's record with its detections in COCO results form (XYWH, RLE masks)."""
        from vtdense.tasks.predict import png_bytes, read_display_image, write_file

        pic, (sy, sx) = read_display_image(target, image)  # per axis: each side is rounded on its own
        up = max(1, math.ceil(_VIS_MIN_SIDE / max(pic.shape[-2:])))  # small images: legible labels
        if up > 1:
            pic = F.interpolate(pic[None].float(), scale_factor=up, mode="nearest")[0].to(torch.uint8)
        names = [self._label_name(lab) for lab in pred["labels"].tolist()]
        colours = [_DRAW_COLOURS[int(lab) % len(_DRAW_COLOURS)] for lab in pred["labels"].tolist()]
        scores = pred["scores"].tolist()
        if "masks" in pred and len(scores):
            masks = pred["masks"]
            if tuple(masks.shape[-2:]) != tuple(pic.shape[-2:]):
                masks = F.interpolate(masks[:, None].float(), size=tuple(pic.shape[-2:]), mode="nearest")[:, 0].bool()
            pic = draw_segmentation_masks(pic, masks, alpha=0.45, colors=colours)
        if len(scores):
            text = [f"{n} {sc:.2f}" for n, sc in zip(names, scores)]
            scale = torch.tensor([sx, sy, sx, sy], dtype=pred["boxes"].dtype, device=pred["boxes"].device) * up
            pic = draw_bounding_boxes(pic, pred["boxes"] * scale, labels=text, colors=colours, width=2)
        vis = f"vis/{target['name']}.png"
        write_file(out_dir / vis, png_bytes(pic))
        xywh = box_convert(pred["boxes"], "xyxy", "xywh").tolist()
        rles = _rle_encode(pred["masks"]) if "masks" in pred else [None] * len(scores)
        dets = []
        for box, cid, name, score, rle in zip(xywh, pred["category_ids"].tolist(), names, scores, rles):
            det = {"category_id": int(cid), "category_name": name, "bbox": [float(v) for v in box], "score": float(score)}
            if rle is not None:
                det["segmentation"] = rle
            dets.append(det)
        h0, w0 = (int(v) for v in target["orig_size"])
        return {"index": int(target["index"]), "image_id": target.get("image_id"), "file_name": target["file_name"],
                "path": target["path"], "height": h0, "width": w0, "vis": vis, "detections": dets}

    def write_prediction_index(self, out_dir: Path, records: list[dict[str, Any]], info: dict[str, Any]) -> list[Path]:
        """``results.json`` (COCO results: one record per detection, with ``file_name``; loads with
        ``COCO.loadRes``) and ``images.json`` (``images`` with ids, file names, sizes and drawings,
        ``categories``, the options used). Image ids are the ones a COCO file listing the images
        gave (``--data.predict_path image_info.json``), else 1, 2, ... in input order."""
        from vtdense.tasks.predict import write_file

        results, images = [], []
        for rec in records:
            image_id = rec["image_id"] if rec.get("image_id") is not None else rec["index"] + 1
            for det in rec["detections"]:
                results.append({"image_id": image_id, "file_name": rec["file_name"], **det})
            images.append({"id": image_id, "file_name": rec["file_name"], "path": rec["path"], "height": rec["height"],
                           "width": rec["width"], "vis": rec["vis"], "num_detections": len(rec["detections"])})
        n = int(self.hparams["num_classes"])
        categories = [{"id": self.label_to_category_id.get(lab, lab), "name": self._label_name(lab)} for lab in range(1, n + 1)]
        index = {**info, "results": "results.json", "categories": categories, "images": images}
        return [
            write_file(out_dir / "results.json", json.dumps(results).encode()),
            write_file(out_dir / "images.json", (json.dumps(index, indent=1) + "\n").encode()),
        ]
