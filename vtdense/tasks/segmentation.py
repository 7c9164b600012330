"""Semantic segmentation task: an SMP decoder on a vtdense backbone, trained the mmseg way.

Loss is pixel-wise cross-entropy with an ignore label, plus an optional auxiliary FCN head
on backbone stage 3 (weight 0.4, as in the Swin / UPerNet ADE20K recipes). The optimiser is
AdamW with no weight decay on norms, biases and position tables, optional layer-wise lr
decay, and a per-iteration poly schedule after a linear warmup. Validation reports mIoU
(torchmetrics ``JaccardIndex``, macro: classes absent from both prediction and ground truth
are left out, like mmseg), pixel accuracy and per-class IoU, and writes ``metrics.json``
and colourised predictions beside the ground truth into the run directory; a test run
(``trainer.test``) logs ``test/...`` and writes ``test_metrics.json``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex, MulticlassStatScores

from vtdense.models.compile import check_compile_option
from vtdense.models.segmentation import (
    ARCHITECTURES,
    HEAD_LAYOUTS,
    FCNHead,
    VtdenseEncoder,
    apply_mmseg_layout,
    build_segmentor,
    input_multiple,
    logits_at,
)
from vtdense.options import check_int, check_number
from vtdense.tasks.base import BaseTask, format_class_table
from vtdense.tasks.optim import (
    StepLambdaLR,
    adamw,
    apply_layer_decay,
    check_no_decay,
    check_schedule_numbers,
    layer_ids,
    param_groups,
    warmup_schedule,
)

_logger = logging.getLogger(__name__)

__all__ = ["SegmentationTask", "layer_ids", "color_palette", "format_class_table", "resize_logits", "merge_views", "view_probs"]

_BACKBONE_PREFIX = "model.encoder.backbone."
#: How the cross-entropy is averaged: over every pixel of the batch, ignored ones included
#: (``"all"``: mmseg's ``CrossEntropyLoss`` with its default ``avg_non_ignore=False``), or over the
#: labelled pixels only (``"valid"``: ``torch.nn.CrossEntropyLoss``'s mean).
LOSS_AVERAGES: tuple[str, ...] = ("all", "valid")

#: decoders with a global-pooling branch followed by BatchNorm: they cannot train on one image per batch.
_POOLED_BN_ARCHS = frozenset({"upernet", "pspnet", "deeplabv3", "deeplabv3plus"})


def color_palette(num_classes: int) -> np.ndarray:
    """Distinct RGB colours per class (PASCAL-VOC bit-interleaving scheme), shape ``(num_classes, 3)``."""
    palette = np.zeros((num_classes, 3), np.uint8)
    for k in range(num_classes):
        c, r, g, b = k + 1, 0, 0, 0
        for shift in range(7, -1, -1):
            r |= (c & 1) << shift
            g |= ((c >> 1) & 1) << shift
            b |= ((c >> 2) & 1) << shift
            c >>= 3
        palette[k] = (r, g, b)
    return palette


class SegmentationTask(BaseTask):
    """Semantic segmentation with an SMP decoder on a vtdense backbone.

    Args:
        arch: decoder architecture, one of ``vtdense.models.segmentation.ARCHITECTURES``.
        backbone: vtdense backbone name (``vtdense.list_backbones()``).
        backbone_kwargs: overrides for ``create_backbone`` (``window_size``, ``drop_path_rate``, ...).
        backbone_weights: backbone checkpoint for ``vtdense.load_pretrained``: a path or a Hugging Face Hub id.
        num_classes: classes (after ``reduce_zero_label``); ``None`` takes the datamodule's
            ``num_classes`` at setup (the model is then built in :meth:`setup`).
        arch_kwargs: extra arguments of the SMP model (``decoder_channels``, ...).
        encoder_depth: SMP encoder depth (5 uses all four backbone stages).
        ignore_index: label ignored by the loss and the metrics.
        aux_weight: weight of the auxiliary FCN head loss on stage 3; ``0`` builds no head.
        aux_channels: hidden channels of the auxiliary head.
        lr: peak learning rate (AdamW).
        weight_decay: AdamW weight decay (not applied to position tables, logit scales and, by
            ``no_decay``, norms or every 1-D tensor and bias).
        no_decay: ``"names"`` (parameters named as norms', and position tables, get no decay; biases
            and the heads' BatchNorms, named otherwise, do: mmseg's Swin UPerNet ``paramwise_cfg``) or
            ``"1d"`` (every 1-D tensor and bias too: timm's rule); :data:`vtdense.tasks.optim.NO_DECAY_RULES`.
        betas: AdamW betas.
        warmup_steps: linear warmup iterations.
        warmup_factor: lr multiplier at iteration 0.
        poly_power: power of the poly decay.
        min_lr_factor: floor of the poly decay, as a fraction of ``lr``.
        layer_decay: layer-wise lr decay factor (``None``: off); layer ``i`` of ``N`` gets
            ``layer_decay ** (N - i)``.
        inference: ``"whole"`` (the whole resized image at once) or ``"slide"`` (sliding window).
        slide_crop: sliding-window crop (h, w).
        slide_stride: sliding-window stride (h, w).
        mean: per-channel mean of the ``[0, 1]`` images (normalisation happens in the task).
        std: per-channel std.
        class_names: names for the per-class table; default: the datamodule's ``class_names``.
        num_vis: validation images saved as colourised predictions beside the ground truth.
        nonfinite_loss: a NaN/inf loss ``"error"``s (naming the term and the batch's files) or
            ``"skip"``s the optimiser step (counted in ``train/nonfinite_skipped``).
        checkpoint_every_n_steps: also write ``last.ckpt`` every this many optimiser steps.
        fused_optimizer: torch's fused AdamW step: ``None`` (auto) uses it on CPUs and GPUs unless
            gradient clipping under mixed precision or fp16 loss scaling rule it out; ``True``
            requires it; ``False`` keeps torch's default.
        compile_backbone: ``torch.compile`` the backbone (the SMP encoder) for all input sizes
            (``dynamic=True``; parameter names and checkpoints unchanged) when the trainer starts:
            ``false`` (default), ``true`` (Inductor) or a backend name (``aot_eager``, ...). On a GPU it
            fuses the backbone's many small kernels; the first size compiles for minutes on a CPU.
        activation_recompute: a vtdense backbone's pre-norms and MLP GELUs are recomputed in the
            backward pass (``true``, less memory) or kept as plain autograd keeps them (``false``:
            faster where the GPU step waits on the host). Process-wide
            (:func:`vtdense.layers.mlp.set_activation_recompute`), set when the trainer builds the model.
        activation_recompute_min_bytes: off the CPU, only layers whose recomputable activation has at
            least this many bytes recompute (``null``: vtdense's default, 8 MiB; ``0``: every layer).
        triton_attention: Swin's training attention on a GPU in vtdense's Triton kernels: ``auto``
            (default; bf16 and fp16), ``true`` (float32 too) or ``false`` (SDPA's memory-efficient
            kernel). Process-wide (:func:`vtdense.layers.triton_window_attention.set_triton_window_attention`),
            set when the trainer builds the model.
        head_layout: ``"mmseg"`` (default): the decoder and heads as mmseg builds them
            (:func:`vtdense.models.segmentation.apply_mmseg_layout`: no second norm on the backbone's
            outputs, dropout 0.1 before the classifier, logits resized from 1/4 to the input in one
            step with ``align_corners=False``, no padding to 32, mmcv's initialisation);
            ``"smp"``: SMP's model as it is.
            Checkpoints written before this option load as ``"smp"``.
        loss_average: ``"all"`` (default, mmseg's): the cross-entropy summed over the labelled
            pixels and divided by all the batch's pixels, padding and ignored ones included, so a
            mostly padded crop weighs by its labelled pixels; ``"valid"``: divided by the labelled
            pixels (``torch.nn.CrossEntropyLoss``). Checkpoints written before this option load as ``"valid"``.
    """

    monitor = "val/mIoU"
    monitor_mode = "max"
    checkpoint_filename = "best-epoch{epoch}-step{step}"

    def __init__(
        self,
        arch: str = "upernet",
        backbone: str = "swinv2_tiny",
        backbone_kwargs: dict[str, Any] | None = None,
        backbone_weights: str | None = None,
        num_classes: int | None = None,
        arch_kwargs: dict[str, Any] | None = None,
        encoder_depth: int = 5,
        ignore_index: int = 255,
        aux_weight: float = 0.4,
        aux_channels: int = 256,
        lr: float = 6e-5,
        weight_decay: float = 0.01,
        no_decay: str = "names",
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 1500,
        warmup_factor: float = 1e-6,
        poly_power: float = 1.0,
        min_lr_factor: float = 0.0,
        layer_decay: float | None = None,
        inference: str = "whole",
        slide_crop: tuple[int, int] = (512, 512),
        slide_stride: tuple[int, int] = (341, 341),
        mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
        std: tuple[float, float, float] = (0.229, 0.224, 0.225),
        class_names: list[str] | None = None,
        num_vis: int = 4,
        nonfinite_loss: str = "error",
        checkpoint_every_n_steps: int | None = None,
        fused_optimizer: bool | None = None,
        compile_backbone: bool | str = False,
        activation_recompute: bool = True,
        activation_recompute_min_bytes: int | None = None,
        triton_attention: bool | str = "auto",
        head_layout: str = "mmseg",
        loss_average: str = "all",
    ) -> None:
        super().__init__()
        if head_layout not in HEAD_LAYOUTS:
            raise ValueError(f"model.head_layout: unknown layout {head_layout!r}; choose one of {', '.join(HEAD_LAYOUTS)}")
        if loss_average not in LOSS_AVERAGES:
            raise ValueError(f"model.loss_average: unknown {loss_average!r}; choose one of {', '.join(LOSS_AVERAGES)}")
        self.check_fault_options(nonfinite_loss, checkpoint_every_n_steps)
        self.check_recompute_option(activation_recompute_min_bytes)
        self.check_triton_attention_option(triton_attention)
        check_compile_option(compile_backbone)
        check_no_decay(no_decay)
        check_schedule_numbers(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, warmup_factor=warmup_factor,
                               poly_power=poly_power, min_lr_factor=min_lr_factor, betas=betas)
        self.save_hyperparameters()
        if arch.lower() not in ARCHITECTURES:
            raise ValueError(f"model.arch: unknown architecture {arch!r}; choose one of {', '.join(sorted(ARCHITECTURES))}")
        if inference not in ("whole", "slide"):
            raise ValueError(f"model.inference must be 'whole' or 'slide', got {inference!r}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"model.num_classes must be >= 1, got {num_classes}")
        check_number("aux_weight", aux_weight, low=0.0)
        if aux_weight > 0 and encoder_depth < 4:
            raise ValueError(f"model.aux_weight > 0 needs backbone stage 3, i.e. encoder_depth >= 4 (got {encoder_depth})")
        if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"model.layer_decay must be in (0, 1], got {layer_decay}")
        check_int("aux_channels", aux_channels)
        check_int("num_vis", num_vis, low=0)
        for name, pair in (("slide_crop", slide_crop), ("slide_stride", slide_stride)):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair)):
                raise ValueError(f"model.{name} must be two positive ints (height, width), got {pair!r}")
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)
        self._vis: list[tuple[int, np.ndarray]] = []
        self._class_names: list[str] | None = class_names
        self.configure_losses()
        if num_classes is not None:
            self.build()
        else:
            self.check_architecture()  # the network itself is built in setup, from the datamodule's class count

    def setup(self, stage: str) -> None:
        """Build the model now if ``num_classes`` comes from the datamodule."""
        super().setup(stage)
        dm = getattr(self.trainer, "datamodule", None)
        if self.model is None:
            self.build_from_datamodule(dm)
        if stage == "fit" and getattr(dm, "batch_size", 2) == 1 and str(self.hparams.arch).lower() in _POOLED_BN_ARCHS:
            raise ValueError(
                f"data.batch_size=1 cannot train the {self.hparams.arch} decoder: its BatchNorm needs at least 2 images "
                "per batch on every process (the pooled 1x1 branch has one value per channel); use data.batch_size >= 2"
            )

    def build_from_datamodule(self, datamodule: Any) -> None:
        """Take ``num_classes`` from ``datamodule`` and build the network."""
        n = getattr(datamodule, "num_classes", None)
        if not isinstance(n, int) or n < 1:
            raise ValueError(
                "model.num_classes is None and the datamodule gives no num_classes; set model.num_classes"
            )
        self.hparams.num_classes = n  # saved in checkpoints, so load_from_checkpoint builds the same model
        self.build()

    def backbone_part(self) -> torch.nn.Module:
        """The vtdense backbone: ``model.encoder.backbone`` (SMP's encoder wraps it)."""
        return self.model.encoder.backbone

    # ------------------------------------------------------------------ build
    def configure_models(self) -> None:
        """Build the SMP model and the optional auxiliary head."""
        h = self.hparams
        self.model = build_segmentor(
            h.arch,
            h.backbone,
            h.num_classes,
            backbone_kwargs=h.backbone_kwargs,
            backbone_weights=h.backbone_weights,
            in_channels=len(h.mean),
            encoder_depth=h.encoder_depth,
            **(h.arch_kwargs or {}),
        )
        self.aux_head = (
            FCNHead(self.model.encoder.out_channels[4], h.num_classes, h.aux_channels) if h.aux_weight > 0 else None
        )
        if h.get("head_layout", "mmseg") == "mmseg":
            apply_mmseg_layout(self.model, self.aux_head)
        self.size_divisibility = input_multiple(self.model)  # 1 for mmseg's layout: the backbone pads inside

    def configure_losses(self) -> None:
        """Cross-entropy with the ignore label, averaged as ``loss_average`` says."""
        self.criterion = nn.CrossEntropyLoss(ignore_index=self.hparams.ignore_index)

    def seg_loss(self, logits: Tensor, mask: Tensor) -> Tensor:
        """Cross-entropy of logits ``(N, C, H, W)`` against labels ``(N, H, W)`` (``ignore_index``
        excluded), averaged by ``loss_average``."""
        if self.hparams.get("loss_average", "all") == "valid":
            return self.criterion(logits, mask)
        total = F.cross_entropy(logits, mask, ignore_index=self.hparams.ignore_index, reduction="sum")
        return total / max(1, mask.numel())

    def configure_metrics(self) -> None:
        """mIoU (macro JaccardIndex), per-class IoU, pixel accuracy and the per-class counts of
        mmseg's per-class accuracy (``mAcc``), all ignoring ``ignore_index``."""
        c, ig = self.hparams.num_classes, self.hparams.ignore_index
        self.val_miou = MulticlassJaccardIndex(num_classes=c, ignore_index=ig, average="macro")
        self.val_class_iou = MulticlassJaccardIndex(
            num_classes=c, ignore_index=ig, average="none", zero_division=float("nan")
        )
        self.val_acc = MulticlassAccuracy(num_classes=c, ignore_index=ig, average="micro")
        self.val_class_stats = MulticlassStatScores(num_classes=c, ignore_index=ig, average="none")

    @property
    def class_names(self) -> list[str]:
        """Names used in the per-class table."""
        if self._class_names is None:
            dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            names = getattr(dm, "class_names", None)
            n = self.hparams.num_classes
            self._class_names = list(names) if names is not None and len(names) == n else [f"class_{i}" for i in range(n)]
        return self._class_names

    # ---------------------------------------------------------------- forward
    def _pad(self, x: Tensor) -> tuple[Tensor, int, int]:
        h, w = x.shape[-2:]
        d = self.size_divisibility
        ph, pw = (-h) % d, (-w) % d
        return (F.pad(x, (0, pw, 0, ph)) if ph or pw else x), h, w

    def fsdp_units(self) -> list[nn.Module]:
        """The steps call the encoder, decoder and heads one by one (see :meth:`_logits`)."""
        m = self.model
        return [m.encoder, m.decoder, m.segmentation_head, self.aux_head] if m is not None else []

    def _logits(self, x: Tensor, with_aux: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logits (and aux logits) at the input size for normalised images of any size."""
        x, h, w = self._pad(x)
        feats = self.model.encoder(x)
        logits = logits_at(self.model.segmentation_head(self.model.decoder(list(feats))), h, w)
        aux = None
        if with_aux and self.aux_head is not None:
            aux = F.interpolate(self.aux_head(feats[4]), size=x.shape[-2:], mode="bilinear", align_corners=False)
            aux = aux[..., :h, :w]
        return logits, aux

    def normalize(self, image: Tensor) -> Tensor:
        """``[0, 1]`` images -> normalised model input."""
        return (image - self.mean) / self.std

    def fill_padding(self, image: Tensor, image_sizes: Any) -> Tensor:
        """``[0, 1]`` images ``(N, C, H, W)`` with everything beyond each image's own extent
        (``image_sizes``: ``N`` pairs ``(h, w)``) set to the mean colour, which normalises to 0:
        mmseg normalises its crops and batches and then pads them with 0, whatever the loader
        padded with. Returns a new tensor; no value is read back to the host (the sizes may lie on
        the device, where Lightning moves the batch)."""
        sizes = torch.as_tensor(image_sizes, device=image.device).reshape(-1, 2)
        rows = torch.arange(image.shape[-2], device=image.device)[None, :] >= sizes[:, :1]
        cols = torch.arange(image.shape[-1], device=image.device)[None, :] >= sizes[:, 1:]
        outside = rows[:, None, :, None] | cols[:, None, None, :]
        return torch.where(outside, self.mean.to(image.dtype), image)

    def forward(self, image: Tensor) -> Tensor:
        """Logits ``(N, num_classes, H, W)`` for ``[0, 1]`` images ``(N, C, H, W)`` of any size."""
        x = self.normalize(image)
        if self.hparams.inference == "slide" and not self.training:
            return self.slide_inference(x)
        return self._logits(x)[0]

    def slide_inference(self, x: Tensor) -> Tensor:
        """Sliding-window logits for normalised images (mmseg's ``slide_inference``)."""
        ch, cw = self.hparams.slide_crop
        sh, sw = self.hparams.slide_stride
        n, _, h, w = x.shape
        out = x.new_zeros((n, self.hparams.num_classes, h, w))
        count = x.new_zeros((n, 1, h, w))
        ny = max(h - ch + sh - 1, 0) // sh + 1
        nx = max(w - cw + sw - 1, 0) // sw + 1
        for iy in range(ny):
            for ix in range(nx):
                y2, x2 = min(iy * sh + ch, h), min(ix * sw + cw, w)
                y1, x1 = max(y2 - ch, 0), max(x2 - cw, 0)
                out[:, :, y1:y2, x1:x2] += self._logits(x[:, :, y1:y2, x1:x2])[0]
                count[:, :, y1:y2, x1:x2] += 1
        return out / count

    # --------------------------------------------------------------- training
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        """Cross-entropy (+ weighted aux loss) on one batch (``None``: step skipped, see ``nonfinite_loss``)."""
        image, mask = batch["image"], batch["mask"]
        if "image_size" in batch:
            image = self.fill_padding(image, batch["image_size"])
        logits, aux = self._logits(self.normalize(image), with_aux=True)
        loss_main = self.seg_loss(logits, mask)
        loss = loss_main
        n = image.shape[0]
        logs = {"train/loss_seg": loss_main}
        if aux is not None:
            loss_aux = self.seg_loss(aux, mask)
            loss = loss + self.hparams.aux_weight * loss_aux
            logs["train/loss_aux"] = loss_aux
        if self.nonfinite_step(logs, list(batch.get("files") or [f"batch {batch_idx}, image {i}" for i in range(n)])):
            return None
        self.log_dict(logs, batch_size=n)
        self.log("train/loss", loss, batch_size=n, prog_bar=True)
        self.log("lr", max(g["lr"] for g in self.trainer.optimizers[0].param_groups), batch_size=n, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over no-decay / layer-decay groups with a per-iteration warmup + poly schedule."""
        h = self.hparams
        groups = param_groups(self, h.weight_decay, rule=h.no_decay)
        if h.layer_decay is not None:
            groups = apply_layer_decay(groups, self.model.encoder.backbone, _BACKBONE_PREFIX, h.layer_decay)
        for g in groups:
            g["lr"] = h.lr * g.get("lr_mult", 1.0)
            g.pop("param_names", None)  # (torch then takes groups added later, e.g. by BackboneFinetuning)
        optimizer = adamw(
            groups, fused=h.get("fused_optimizer"), trainer=self._trainer, lr=h.lr, betas=tuple(h.betas),
            weight_decay=h.weight_decay,
        )
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        total = max(total, 1)

        def factor(step: int) -> float:
            return warmup_schedule(
                step,
                total_steps=total,
                warmup_steps=h.warmup_steps,
                warmup_factor=h.warmup_factor,
                kind="poly",
                power=h.poly_power,
                min_factor=h.min_lr_factor,
            )

        scheduler = StepLambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------- validation
    def view_logits(self, views: Sequence[tuple[Tensor, Any, bool]]) -> list[list[tuple[Tensor, bool]]]:
        """Logits of test-time views (see :func:`merge_views`), per image.

        Args:
            views: per view ``(images (N, C, H, W) in [0, 1], their N sizes (h, w) before the
                batch's padding, flipped)``.

        Returns:
            Per image, per view: ``(logits [num_classes, h, w] cropped to that image's extent,
            flipped)``.
        """
        per_image: list[list[tuple[Tensor, bool]]] = [[] for _ in range(views[0][0].shape[0])]
        for x, sizes, flipped in views:
            logits = self(self.fill_padding(x, sizes))
            for i, (h, w) in enumerate(sizes):
                per_image[i].append((logits[i, :, : int(h), : int(w)], bool(flipped)))
        return per_image

    @staticmethod
    def batch_views(batch: Mapping[str, Any]) -> list[tuple[Tensor, Any, bool]]:
        """An evaluation batch's views for :meth:`view_logits`: the image, then ``views``
        (test-time augmentation, :class:`~vtdense.data.ade20k.SegEvalTransform`)."""
        return [(batch["image"], batch["image_size"], False)] + [
            (v["image"], v["image_size"], bool(v["flip"])) for v in batch.get("views", ())
        ]

    def _predict_batch(self, batch: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
        """Per image: (prediction at the label size, label) with padding removed; with test-time
        views, the class of the views' mean softmax (:func:`merge_views`)."""
        if batch.get("views"):
            # as mmseg's aug_test: one view at a time, its probabilities summed at the label's size
            out_sizes = [tuple(int(v) for v in s) for s in batch["mask_size"]]
            views = self.batch_views(batch)
            total: list[Tensor | None] = [None] * len(out_sizes)
            for x, sizes, flipped in views:
                logits = self(self.fill_padding(x, sizes))
                for i, ((h, w), (mh, mw)) in enumerate(zip(sizes, out_sizes)):
                    p = view_probs(logits[i, :, : int(h), : int(w)], flipped, 0, mh, (mh, mw))
                    total[i] = p if total[i] is None else total[i].add_(p)
            return [((t / len(views)).argmax(0), batch["mask"][i, :mh, :mw])
                    for i, (t, (mh, mw)) in enumerate(zip(total, out_sizes))]
        logits = self(self.fill_padding(batch["image"], batch["image_size"]))
        pairs = []
        for i in range(logits.shape[0]):
            ih, iw = (int(v) for v in batch["image_size"][i])
            mh, mw = (int(v) for v in batch["mask_size"][i])
            li = logits[i : i + 1, :, :ih, :iw]
            if (ih, iw) != (mh, mw):
                li = F.interpolate(li, size=(mh, mw), mode="bilinear", align_corners=False)
            pairs.append((li.argmax(1)[0], batch["mask"][i, :mh, :mw]))
        return pairs

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Update the metrics (at the label's original resolution) and keep a few visualisations.

        Repeats added by the distributed sampler, and samples standing in for an unreadable image
        (see :mod:`vtdense.data.errors`), are skipped, so every image counts once.
        """
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        """Log mIoU, pixel accuracy and per-class IoU; write ``metrics.json`` and the visualisations
        (PNGs in ``predictions/``, and to the logger when it takes images: TensorBoard, W&B)."""
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Like :meth:`validation_step`, on the datamodule's test loader (for ADE20K its validation
        split: the test labels are not public)."""
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        """Log ``test/mIoU``, ``test/aAcc`` and ``test/IoU.<class>``; write ``test_metrics.json``
        and ``predictions/test_*.png`` (also sent to a logger that takes images)."""
        self._eval_epoch_end("test")

    def _eval_step(self, batch: dict[str, Tensor]) -> None:
        positions = self.eval_positions(batch["image"].shape[0])
        substitute = batch.get("substitute") or [False] * len(positions)
        pairs = self._predict_batch(batch)
        for i, ((pred, mask), pos) in enumerate(zip(pairs, positions)):
            if pos is None or substitute[i]:  # a distributed-sampler repeat, or a stand-in for an unreadable image
                continue
            self.val_miou.update(pred, mask)
            self.val_class_iou.update(pred, mask)
            self.val_acc.update(pred, mask)
            self.val_class_stats.update(pred, mask)
            if len(self._vis) < self.hparams.num_vis and not self.trainer.sanity_checking:
                self._vis.append((pos, self._visual(batch["image"][i], batch["image_size"][i], pred, mask)))

    def _eval_epoch_end(self, prefix: str) -> None:
        """Compute, log and write the metrics of the loop that ends (``prefix``: ``val`` or
        ``test``; the two loops never run at once, so they share the metric states)."""
        # compute() synchronises the metric states across ranks: every rank calls it.
        miou, acc, per_class = self.val_miou.compute(), self.val_acc.compute(), self.val_class_iou.compute()
        stats = self.val_class_stats.compute()  # per class: tp, fp, tn, fn, support
        # mmseg's per-class accuracy: correct over labelled pixels of the class; a class without any is left out
        class_acc = torch.where(stats[:, 4] > 0, stats[:, 0].double() / stats[:, 4].clamp(min=1), float("nan"))
        macc = class_acc.nanmean() if bool((stats[:, 4] > 0).any()) else torch.tensor(float("nan"))
        for metric in (self.val_miou, self.val_acc, self.val_class_iou, self.val_class_stats):
            metric.reset()
        vis = [v for part in self.gather(self._vis) for v in part]
        self._vis = []
        names = self.class_names
        logs = {f"{prefix}/aAcc": acc, f"{prefix}/mAcc": macc.float()}
        logs.update({f"{prefix}/IoU.{n}": v for n, v in zip(names, per_class)})
        self.log_dict(logs, batch_size=1, sync_dist=True)
        self.log(f"{prefix}/mIoU", miou, batch_size=1, prog_bar=True, sync_dist=True)
        self.last_metrics = {
            "epoch": int(self.current_epoch),
            "step": int(self.global_step),
            "mIoU": float(miou),
            "aAcc": float(acc),
            "mAcc": None if math.isnan(float(macc)) else float(macc),
            "per_class_iou": {n: (None if math.isnan(float(v)) else float(v)) for n, v in zip(names, per_class)},
            "per_class_acc": {n: (None if math.isnan(float(v)) else float(v)) for n, v in zip(names, class_acc)},
        }
        if self.writes_outputs:
            stem = "" if prefix == "val" else f"{prefix}_"
            self.write_text(f"{stem}metrics.json", json.dumps(self.last_metrics, indent=2) + "\n")
            for pos, panel in sorted(vis, key=lambda v: v[0])[: self.hparams.num_vis]:
                self.write_image(f"predictions/{prefix}_{pos:03d}.png", panel)
                self.log_image(f"{prefix}/pred_{pos:03d}", torch.from_numpy(panel).permute(2, 0, 1))
            if self.trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING):
                self.print_class_table()

    def on_fit_end(self) -> None:
        """Print the per-class IoU table of the last validation."""
        if self.trainer.is_global_zero and getattr(self, "last_metrics", None):
            self.print_class_table(title="per-class IoU (last epoch)")

    def print_class_table(self, title: str = "per-class IoU") -> None:
        """Print the per-class IoU (and accuracy) table of the last validation, as mmseg prints it."""
        m = self.last_metrics
        values = [float("nan") if v is None else v for v in m["per_class_iou"].values()]
        accs = m.get("per_class_acc")
        more = {"Acc": [float("nan") if v is None else v for v in accs.values()]} if accs else None
        summary = f"{title}: mIoU {m['mIoU']:.4f}, aAcc {m['aAcc']:.4f}"
        if m.get("mAcc") is not None:
            summary += f", mAcc {m['mAcc']:.4f}"
        print(format_class_table(list(m["per_class_iou"]), values, summary, more=more))

    # ---------------------------------------------------------------- outputs
    def _visual(self, image: Tensor, image_size: Tensor, pred: Tensor, mask: Tensor) -> np.ndarray:
        """``image | ground truth | prediction`` (colourised, ignore = black) as one uint8 ``(H, 3W, 3)`` array."""
        palette = color_palette(self.hparams.num_classes)
        ih, iw = (int(v) for v in image_size)
        mh, mw = mask.shape
        img = image[:, :ih, :iw].float()
        if (ih, iw) != (mh, mw):
            img = F.interpolate(img[None], size=(mh, mw), mode="bilinear", align_corners=False)[0]
        img = (img.clamp(0, 1) * 255).byte().permute(1, 2, 0).cpu().numpy()

        def colour(lbl: Tensor) -> np.ndarray:
            lbl = lbl.cpu().numpy()
            rgb = np.zeros((*lbl.shape, 3), np.uint8)
            valid = (lbl >= 0) & (lbl < len(palette))
            rgb[valid] = palette[lbl[valid]]
            return rgb

        return np.concatenate([img, colour(mask), colour(pred)], axis=1)

    # ============================================================================================
    # Prediction on new images (issue 11): class names and palette in the checkpoint, label maps
    # at the original size, and the files of the ``predict`` recipe subcommand.
    # ============================================================================================
    #: ``predict_step`` also returns per-pixel class probabilities (see :meth:`predict_images`).
    predict_probs: bool = False

    @property
    def palette(self) -> np.ndarray:
        """RGB colour per class, ``(num_classes, 3)`` uint8 (the validation pictures' palette)."""
        saved = getattr(self, "_palette", None)
        return saved if saved is not None else color_palette(int(self.hparams.num_classes))

    def check_data_fits(self, datamodule: Any, source: str | None = None) -> None:
        """Also refuse data whose class names (``classes.txt``) differ from the checkpoint's; data
        without names of its own (``class_<i>``) is taken by its class count alone."""
        super().check_data_fits(datamodule, source)
        mine, theirs = self._class_names, getattr(datamodule, "class_names", None)
        if mine is None or theirs is None or len(mine) != len(theirs):
            return
        generic = [f"class_{i}" for i in range(len(theirs))]
        if list(theirs) != generic and list(mine) != generic and list(mine) != list(theirs):
            where = f"checkpoint {source}" if source else "the model"
            differ = [f"{i}: {a!r} / {b!r}" for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
            raise ValueError(
                f"{where} names its classes differently from the data (index: checkpoint / data): "
                f"{', '.join(differ[:5])}{', ...' if len(differ) > 5 else ''}"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the class names and the palette, so a checkpoint names its classes without the dataset."""
        super().on_save_checkpoint(checkpoint)
        if self.hparams.num_classes is not None:
            checkpoint["class_names"] = [str(n) for n in self.class_names]
            checkpoint["palette"] = self.palette.tolist()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the class names and the palette saved by :meth:`on_save_checkpoint`.

        A checkpoint written before ``head_layout`` / ``loss_average`` existed holds SMP's own
        model and was trained with the valid-pixel average: the task takes those settings again
        (rebuilding its model if it was built otherwise), so the weights load and a resumed run
        goes on as it started.
        """
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("hyper_parameters", {})
        if "loss_average" not in saved:
            self.hparams["loss_average"] = "valid"
        if "head_layout" not in saved and self.hparams.get("head_layout") != "smp":
            self.hparams["head_layout"] = "smp"
            if self.model is not None:
                self.build()
                if self._trainer is not None:
                    self.configure_model()  # shard / compile the rebuilt model as the trainer's hook did
        self._drop_unbuilt_stages(checkpoint)
        n = self.hparams.num_classes
        names = checkpoint.get("class_names")
        if names is not None and n is not None and len(names) == int(n):
            self._class_names = [str(v) for v in names]
        palette = checkpoint.get("palette")
        if palette is not None and n is not None and len(palette) == int(n):
            self._palette = np.asarray(palette, dtype=np.uint8).reshape(-1, 3)

    def _drop_unbuilt_stages(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of an earlier release trained with ``backbone_weights`` and
        ``encoder_depth`` < 5 holds the backbone stages SMP never read, which this model does not
        build: their (untrained) weights are dropped for evaluation and prediction; a resume, whose
        optimiser state counts them, is refused with the option that builds them."""
        state = checkpoint.get("state_dict")
        encoder = getattr(self.model, "encoder", None)
        if not state or not isinstance(encoder, VtdenseEncoder) or not encoder._trimmed:
            return
        built = encoder._depth - 1  # stages 1..depth-1: (layers|stages).0 .. built-1, out_norms.stage1 ..
        unbuilt = []
        for k in state:
            stage = re.match(r"(?:layers|stages)\.(\d+)\.|out_norms\.stage(\d+)\.", k[len(_BACKBONE_PREFIX):])
            if k.startswith(_BACKBONE_PREFIX) and stage and (int(stage[1]) if stage[1] else int(stage[2]) - 1) >= built:
                unbuilt.append(k)
        if not unbuilt:
            return
        t = self._trainer
        if t is not None and t.state.fn == TrainerFn.FITTING:
            raise ValueError(
                f"checkpoint {getattr(t, 'ckpt_path', None) or ''} holds {len(unbuilt)} weights of backbone stages "
                f"encoder_depth={self.hparams.encoder_depth} does not read ({unbuilt[0]}, ...), written by an earlier "
                "release; to resume it, build them with model.backbone_kwargs.out_indices=[0, 1, 2, 3]"
            )
        for k in unbuilt:
            del state[k]
        _logger.info("dropped %d weights of backbone stages encoder_depth=%s does not read (%s, ...)",
                     len(unbuilt), self.hparams.encoder_depth, unbuilt[0])

    def predict_transform(
        self,
        eval_scale: Sequence[int] | None = None,
        eval_ratios: Sequence[float] | None = None,
        eval_flip: bool | None = None,
    ) -> Any:
        """Validation's resize and test-time views: ``eval_scale`` (else ``scale``), ``eval_ratios``
        and ``eval_flip`` from the checkpoint's datamodule unless given.

        Raises:
            ValueError: ``eval_scale`` is not one or two positive ints (long, short), or
                ``eval_ratios`` not a list of positive numbers; raised here, before any image is
                read or the model runs.
        """
        from vtdense.data.ade20k import check_eval_ratios
        from vtdense.data.predict import check_eval_scale, segmentation_predict_transform

        dm = self.datamodule_hparams or {}
        if eval_scale is not None:
            scale = check_eval_scale(eval_scale, "eval_scale")
        else:
            scale = tuple(int(v) for v in dm.get("eval_scale") or dm.get("scale") or (2048, 512))
        ratios = check_eval_ratios(eval_ratios if eval_ratios is not None else dm.get("eval_ratios"), "eval_ratios")
        flip = bool(dm.get("eval_flip", False)) if eval_flip is None else eval_flip
        if not isinstance(flip, bool):
            raise ValueError(f"eval_flip must be true or false, got {flip!r}")
        return segmentation_predict_transform(scale, ratios, flip)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> list[dict[str, Tensor]]:
        """Per image: ``label_map`` int64 ``[H0, W0]`` at the original size (and ``probs`` float32
        ``[C, H0, W0]`` when :attr:`predict_probs`), on the CPU.

        ``batch`` is ``(images, targets)`` (lists; targets give ``orig_size``; sizes may differ),
        a list of ``[3, h, w]`` images in 0..1, or an evaluation batch of
        :class:`~vtdense.data.ade20k.ADE20KDataModule` (predictions at the label maps' size).
        Logits are resized to the original size in row strips, never all at once. With test-time
        views (``views`` in the targets or the batch; ``eval_ratios`` / ``eval_flip``), the class
        is that of the views' mean softmax (:func:`merge_views`).
        """
        if isinstance(batch, Mapping):
            views = self.batch_views(batch)
            out_sizes = [tuple(int(v) for v in s) for s in batch["mask_size"]]
        else:
            if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], (tuple, list)) and (
                len(batch[1]) == 0 or isinstance(batch[1][0], Mapping)
            ):
                images, targets = list(batch[0]), list(batch[1])
            else:
                images, targets = list(batch), [None] * len(batch)
            if not images:  # every image of the batch was skipped (undecodable files)
                return []
            out_sizes = [
                tuple(int(v) for v in t["orig_size"]) if t is not None and "orig_size" in t else tuple(im.shape[-2:])
                for t, im in zip(targets, images)
            ]
            per_view = [[(im, False) for im in images]]  # test-time views come in the targets
            extra = [t.get("views", ()) if t is not None else () for t in targets]
            for k in range(len(extra[0])):
                per_view.append([(ex[k]["image"].to(images[0].device), bool(ex[k]["flip"])) for ex in extra])
            views = [(_pad_stack([im for im, _ in v]), [tuple(im.shape[-2:]) for im, _ in v], v[0][1]) for v in per_view]
        out = []
        if len(views) > 1:
            for crops, size in zip(self.view_logits(views), out_sizes):
                label, probs = merge_views(crops, size, with_probs=self.predict_probs)
                out.append({"label_map": label.cpu()} | ({"probs": probs.cpu()} if probs is not None else {}))
            return out
        x, in_sizes, _ = views[0]
        logits = self(self.fill_padding(x, in_sizes))
        for i, ((h, w), size) in enumerate(zip(in_sizes, out_sizes)):
            label, probs = resize_logits(logits[i, :, : int(h), : int(w)], size, with_probs=self.predict_probs)
            pred = {"label_map": label}
            if probs is not None:
                pred["probs"] = probs
            out.append(pred)
        return out

    def predict_images(  # type: ignore[override]
        self,
        images: Any,
        return_probs: bool = False,
        *,
        batch_size: int = 1,
        bf16: bool = False,
        num_workers: int = 0,
        eval_scale: Sequence[int] | None = None,
        eval_ratios: Sequence[float] | None = None,
        eval_flip: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Segment image files, folders, globs or ``[3, H, W]`` tensors.

        Args:
            images: A path (image, folder or glob), a tensor (uint8 0..255 or float 0..1), or a list of them.
            return_probs: Also return ``probs``, float32 ``[C, H0, W0]`` softmax probabilities.
            batch_size: Images per forward pass (sizes may differ; padded like validation).
            bf16: Run the model under bfloat16 autocast (outputs stay int64 / float32).
            num_workers: DataLoader workers decoding the files.
            eval_scale, eval_ratios, eval_flip: the resize and the test-time views
                (:meth:`predict_transform`); by default the checkpoint's validation settings.

        Returns:
            Per image: ``label_map`` int64 ``[H0, W0]`` (class indices, original pixels),
            ``class_names`` (index -> name), ``path``; all on the CPU.
        """
        old, self.predict_probs = self.predict_probs, bool(return_probs)
        try:
            return super().predict_images(images, batch_size=batch_size, bf16=bf16, num_workers=num_workers,
                                          eval_scale=eval_scale, eval_ratios=eval_ratios, eval_flip=eval_flip)
        finally:
            self.predict_probs = old

    def name_prediction(self, pred: dict[str, Any]) -> dict[str, Any]:
        """``pred`` with ``class_names`` (index -> name)."""
        return pred | {"class_names": list(self.class_names)}

    def write_prediction_files(
        self, out_dir: Path, target: dict[str, Any], pred: dict[str, Any], image: Tensor
    ) -> dict[str, Any]:
        """``labels/<name>.png`` (class indices as a palette PNG; 16-bit grey above 256 classes) and
        ``overlay/<name>.png`` (the palette blended over the original image); return the record."""
        from vtdense.tasks.predict import png_bytes, read_display_image, write_file

        label = pred["label_map"].cpu()
        palette = self.palette
        if len(palette) <= 256:
            lab_png = Image.fromarray(label.numpy().astype(np.uint8))  # mode L; putpalette makes it P
            lab_png.putpalette(palette.reshape(-1).tolist())
        else:
            lab_png = Image.fromarray(label.numpy().astype(np.uint16))
        name = target["name"]
        write_file(out_dir / f"labels/{name}.png", png_bytes(lab_png))
        pic, _ = read_display_image(target, image)
        small = label
        if tuple(small.shape) != tuple(pic.shape[-2:]):
            small = F.interpolate(label[None, None].float(), size=tuple(pic.shape[-2:]), mode="nearest")[0, 0].long()
        colour = torch.from_numpy(palette)[small.clamp(0, len(palette) - 1)].permute(2, 0, 1)
        overlay = (0.5 * pic.float() + 0.5 * colour.float()).round().to(torch.uint8)
        write_file(out_dir / f"overlay/{name}.png", png_bytes(overlay))
        counts = torch.bincount(label.reshape(-1), minlength=len(self.class_names)).tolist()
        total = max(1, label.numel())
        h0, w0 = (int(v) for v in target["orig_size"])
        return {
            "index": int(target["index"]), "file_name": target["file_name"], "path": target["path"],
            "height": h0, "width": w0, "label_map": f"labels/{name}.png", "overlay": f"overlay/{name}.png",
            "classes": {self.class_names[c]: round(k / total, 6) for c, k in enumerate(counts) if k},
        }

    def write_prediction_index(self, out_dir: Path, records: list[dict[str, Any]], info: dict[str, Any]) -> list[Path]:
        """``predictions.json``: class names, palette, and per image its files and class pixel fractions."""
        from vtdense.tasks.predict import write_file

        images = [{"id": r["index"] + 1, **{k: v for k, v in r.items() if k != "index"}} for r in records]
        index = {**info, "class_names": list(self.class_names), "palette": self.palette.tolist(), "images": images}
        return [write_file(out_dir / "predictions.json", (json.dumps(index, indent=1) + "\n").encode())]


def _pad_stack(images: Sequence[Tensor]) -> Tensor:
    """``[C, h, w]`` images of different sizes as one batch, padded bottom/right with 0."""
    hh, ww = max(im.shape[-2] for im in images), max(im.shape[-1] for im in images)
    return torch.stack([F.pad(im, (0, ww - im.shape[-1], 0, hh - im.shape[-2])) for im in images])


def _resized_rows(logits: Tensor, y0: int, y1: int, size: tuple[int, int]) -> Tensor:
    """Rows ``y0:y1`` of float ``[C, h, w]`` logits resized bilinearly to ``size``
    (``align_corners=False``), as ``[C, y1 - y0, W]``: ``grid_sample`` at the source
    coordinates ``F.interpolate`` uses, so a strip never needs the whole resized tensor."""
    hh, ww = size
    if tuple(logits.shape[-2:]) == (hh, ww):
        return logits[:, y0:y1]
    dev = logits.device
    gx = (2 * torch.arange(ww, device=dev, dtype=torch.float32) + 1) / ww - 1
    gy = (2 * torch.arange(y0, y1, device=dev, dtype=torch.float32) + 1) / hh - 1
    grid = torch.stack((gx.expand(y1 - y0, ww), gy[:, None].expand(y1 - y0, ww)), dim=-1)[None]
    return F.grid_sample(logits[None], grid, mode="bilinear", padding_mode="border", align_corners=False)[0]


def _strip_rows(channels: int, width: int, max_elements: int) -> int:
    return max(1, int(max_elements) // max(1, channels * width))


def resize_logits(
    logits: Tensor, size: tuple[int, int], *, with_probs: bool = False, max_elements: int = 1 << 24
) -> tuple[Tensor, Tensor | None]:
    """Bilinearly resize ``[C, h, w]`` logits to ``size`` and take the per-pixel class, in row strips.

    Equal to ``F.interpolate(logits[None], size, mode="bilinear", align_corners=False)`` followed
    by ``argmax`` (and ``softmax``), but at most ``max_elements`` resized values exist at once, so a
    12-megapixel photo with 150 classes does not need 7 GB. Each strip samples the logits with
    ``grid_sample`` at the same source coordinates ``interpolate`` uses.

    Returns:
        ``(label_map int64 [H, W], probs float32 [C, H, W] or None)``, on the CPU.
    """
    c, h, w = logits.shape
    hh, ww = int(size[0]), int(size[1])
    logits = logits.float()
    if (h, w) == (hh, ww):
        probs = logits.softmax(0).cpu() if with_probs else None
        return logits.argmax(0).cpu(), probs
    rows = _strip_rows(c, ww, max_elements)
    label = torch.empty(hh, ww, dtype=torch.long)
    probs_out = torch.empty(c, hh, ww, dtype=torch.float32) if with_probs else None
    for y0 in range(0, hh, rows):
        y1 = min(hh, y0 + rows)
        strip = _resized_rows(logits, y0, y1, (hh, ww))
        label[y0:y1] = strip.argmax(0).cpu()
        if probs_out is not None:
            probs_out[:, y0:y1] = strip.softmax(0).cpu()
    return label, probs_out


def view_probs(logits: Tensor, flipped: bool, y0: int, y1: int, size: tuple[int, int]) -> Tensor:
    """One test-time view's class probabilities for rows ``y0:y1`` of the output ``size``: its
    ``[C, h, w]`` logits resized bilinearly (``align_corners=False``), softmax over the classes,
    flipped back horizontally if the view was flipped. Float32 ``[C, y1 - y0, W]``, a new tensor."""
    p = _resized_rows(logits.float(), y0, y1, size).softmax(0)
    return p.flip(-1) if flipped else p


def merge_views(
    views: Sequence[tuple[Tensor, bool]], size: tuple[int, int], *, with_probs: bool = False,
    max_elements: int = 1 << 24,
) -> tuple[Tensor, Tensor | None]:
    """Test-time augmentation: the class of each pixel from the mean softmax of several views.

    Each view is ``(logits [C, h, w], flipped)``: the logits of one resized (and, if ``flipped``,
    horizontally flipped) copy of the image, cropped to its extent. As mmseg's ``aug_test``, each
    view's logits are resized bilinearly (``align_corners=False``) to ``size``, the original
    image's, turned into probabilities, flipped back if flipped, summed and divided by the view
    count; the class is the argmax. Done in row strips of at most ``max_elements`` values per
    view, so the output may be a large photo: all views' logits are kept, at their own sizes.
    (Validation sums one view at a time at the label's size instead, as mmseg does; the same
    values.)

    Returns:
        ``(label_map int64 [H, W], probs float32 [C, H, W] or None)``, on the logits' device.
    """
    c = views[0][0].shape[0]
    hh, ww = int(size[0]), int(size[1])
    dev = views[0][0].device
    rows = _strip_rows(c, ww, max_elements)
    label = torch.empty(hh, ww, dtype=torch.long, device=dev)
    probs_out = torch.empty(c, hh, ww, dtype=torch.float32, device=dev) if with_probs else None
    for y0 in range(0, hh, rows):
        y1 = min(hh, y0 + rows)
        acc: Tensor | None = None
        for logits, flipped in views:
            p = view_probs(logits, flipped, y0, y1, (hh, ww))
            acc = p if acc is None else acc.add_(p)
        assert acc is not None
        acc /= len(views)
        label[y0:y1] = acc.argmax(0)
        if probs_out is not None:
            probs_out[:, y0:y1] = acc
    return label, probs_out
