"""Prediction from a trained task: load a checkpoint, run it on images, write the results.

- :func:`load_task_checkpoint` rebuilds a task from a Lightning checkpoint with
  ``torch.load(weights_only=True)`` (tensors and plain containers only: a checkpoint from elsewhere
  cannot run code), from the hyperparameters saved in it, so the model config is never repeated.
  The datamodule's saved hyperparameters (``test_scale``, ``max_size``, ``scale``, ...) are kept on
  the task as ``datamodule_hparams``: prediction resizes images exactly like validation did.
- :func:`predict_images` is the Python call behind ``task.predict_images(...)``: files, folders,
  globs or tensors in, one dict per image out, in original image coordinates.
- :class:`PredictionWriter` is the callback of the ``predict`` recipe subcommand
  (``trainer.predict``). Each rank writes the per-image files of the images it predicted; at the
  end of the epoch every rank gathers the per-image records (a collective), and rank 0 writes the
  JSON index. Lightning's predict loop gives every image to exactly one rank.

What is written per image and in the index is the task's business (``write_prediction_files``,
``write_prediction_index`` on :class:`~vtdense.tasks.detection.DetectionTask` and
:class:`~vtdense.tasks.segmentation.SegmentationTask`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision.transforms.v2 import functional as TF

from vtdense.checkpoints.io import read_task_checkpoint
from vtdense.data.images import decode_image
from vtdense.data.predict import ImageFile, ImageSource, PredictImages, collate_predict, first_names, list_images
from vtdense.tasks.base import atomic_write_bytes, task_family

__all__ = [
    "PredictionWriter",
    "checkpoint_run_dir",
    "default_output_dir",
    "expand_sources",
    "load_task_checkpoint",
    "png_bytes",
    "predict_images",
    "read_display_image",
]

T = TypeVar("T", bound=LightningModule)
logger = logging.getLogger(__name__)

#: Long side of the picture predictions are drawn on (bigger originals are drawn reduced).
DRAW_MAX_SIDE = 2048


# ------------------------------------------------------------------------- checkpoints
def load_task_checkpoint(
    cls: type[T], path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu", **overrides: Any
) -> T:
    """Rebuild ``cls`` from a Lightning checkpoint of it, in eval mode, on ``map_location``.

    Args:
        cls: The task class the checkpoint was saved from.
        path: The ``.ckpt`` file.
        map_location: Device of the returned task (``"cpu"``, ``"cuda"``, ``torch.device``;
            ``None``: CPU).
        overrides: Constructor arguments replacing the saved hyperparameters (e.g.
            ``score_thresh=0.3``); ``backbone_weights`` is always ``None``, the checkpoint holds
            the trained weights.

    Returns:
        The task with the checkpoint's weights, ``datamodule_hparams`` (the saved datamodule
        hyperparameters, ``{}`` when none were saved) and ``checkpoint_path`` set.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is not a Lightning checkpoint, holds objects ``weights_only`` loading
            refuses, names an unknown override, or does not match ``cls`` (the message lists keys).
    """
    path = Path(path).expanduser()
    ckpt = read_task_checkpoint(path)  # weights_only: tensors, plain containers and pathlib paths
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"{path} is not a Lightning checkpoint of a vtdense task (no state_dict / hyper_parameters)")
    task_name = ckpt.get("vtdense_task")
    if task_name is not None and task_name != task_family(cls):
        raise ValueError(f"checkpoint {path} is a {task_name} checkpoint of another task, not a {task_family(cls)} one")
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(k for k in overrides if k not in params)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} option(s) {unknown} for {path}")
    kwargs = {k: v for k, v in dict(ckpt["hyper_parameters"]).items() if k in params}
    if "backbone_weights" in params:
        kwargs["backbone_weights"] = None  # the state dict holds the trained backbone
    kwargs.update(overrides)
    try:
        task = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path} does not rebuild a {cls.__name__}: {e}") from None
    # an override that changes the model's shapes (num_classes=5 for a 3-class checkpoint): one error
    # naming the file and the option, before the hook below sees the override as saved
    task.check_checkpoint_fits(ckpt, str(path))
    task.check_state_dict_fits(ckpt, str(path), overrides)
    # the hook fills options added after the checkpoint was saved with their legacy values; an option
    # the caller gave explicitly counts as saved, so the override wins
    task.on_load_checkpoint({**ckpt, "hyper_parameters": {**dict(ckpt["hyper_parameters"]), **overrides}})
    if getattr(task, "model", None) is None:
        raise ValueError(f"checkpoint {path} saved no num_classes, so the {cls.__name__} model cannot be built")
    result = task.load_state_dict(ckpt["state_dict"], strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {path} does not match {cls.__name__} built from its hyperparameters "
            f"(missing {len(result.missing_keys)} keys, e.g. {result.missing_keys[:3]}; unexpected "
            f"{len(result.unexpected_keys)}, e.g. {result.unexpected_keys[:3]}): is it a checkpoint of another task?"
        )
    dm = ckpt.get("datamodule_hyper_parameters") or {}
    task.datamodule_hparams = {k: v for k, v in dict(dm).items() if not str(k).startswith("_")}
    task.checkpoint_path = path
    task.eval()
    return task.to(torch.device(map_location) if map_location is not None else torch.device("cpu"))


def checkpoint_run_dir(ckpt_path: str | os.PathLike[str]) -> Path:
    """The run directory a checkpoint belongs to: the parent of ``checkpoints/``, else the file's folder."""
    parent = Path(ckpt_path).expanduser().resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent


def default_output_dir(ckpt_path: str | os.PathLike[str], prefix: str = "predict") -> Path:
    """A new ``<prefix>_<YYYYmmdd-HHMMSS>`` folder in the checkpoint's run directory (``_2``, ... if taken)."""
    base = checkpoint_run_dir(ckpt_path) / time.strftime(f"{prefix}_%Y%m%d-%H%M%S")
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}_{n}")
    return out


# ----------------------------------------------------------------------- Python API
def expand_sources(images: ImageSource | Sequence[ImageSource]) -> list[Tensor | ImageFile]:
    """Files, folders, globs and tensors -> checked items for :class:`PredictImages` (before any model runs).

    Raises:
        FileNotFoundError / BadSampleError: as :func:`vtdense.data.predict.list_images`.
    """
    if isinstance(images, (str, os.PathLike, Tensor)):
        images = [images]
    items: list[Tensor | ImageFile] = []
    for src in images:
        if isinstance(src, Tensor):
            items.append(src)
        elif isinstance(src, (str, os.PathLike)):
            items.extend(list_images(src))
        else:
            raise TypeError(f"an image must be a path, a folder, a glob or a tensor, got {type(src).__name__}")
    if not items:
        raise ValueError("no images given")
    return items


def predict_images(
    task: Any,
    images: ImageSource | Sequence[ImageSource],
    *,
    batch_size: int = 1,
    bf16: bool = False,
    num_workers: int = 0,
    transform: Any = None,
) -> list[dict[str, Any]]:
    """Run ``task.predict_step`` over images on the task's device, under ``torch.inference_mode``.

    Images are preprocessed by ``transform`` (default ``task.predict_transform()``: validation's
    resize) and batched as lists of different sizes. Each result is ``predict_step``'s dict in original image coordinates,
    completed by ``task.name_prediction`` (class names) and with ``path`` (the file, ``None`` for a
    tensor). ``bf16`` runs the model under bfloat16 autocast; outputs stay float32 / int64 / bool.
    A file that cannot be decoded (truncated, corrupt) is skipped with a warning naming it, and a
    last warning counts the skipped files; the results are those of the other images.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dataset = PredictImages(expand_sources(images), task.predict_transform() if transform is None else transform)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_predict)
    device = task.device
    was_training = task.training
    task.eval()
    results: list[dict[str, Any]] = []
    done: list[int] = []
    try:
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.inference_mode(), autocast:
            for i, (batch_images, targets) in enumerate(loader):
                batch_images = [im.to(device) for im in batch_images]
                preds = task.predict_step((batch_images, targets), i)
                for pred, target in zip(preds, targets):
                    results.append(task.name_prediction(pred) | {"path": target["path"]})
                    done.append(target["index"])
    finally:
        task.train(was_training)
    skipped = dataset.skipped(done)
    if skipped:
        logger.warning("predicted %d of %d images; skipped %d that could not be decoded: %s", len(results), len(dataset),
                       len(skipped), first_names(skipped))
    return results


# -------------------------------------------------------------------------- writing
def png_bytes(image: Tensor | np.ndarray | Image.Image) -> bytes:
    """PNG of a uint8 ``[3, H, W]`` tensor, an ``(H, W[, 3])`` array or a PIL image."""
    if isinstance(image, Tensor):
        image = image.detach().cpu().permute(1, 2, 0).numpy() if image.ndim == 3 else image.cpu().numpy()
    if isinstance(image, np.ndarray):
        image = Image.fromarray(np.ascontiguousarray(image))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def read_display_image(target: dict[str, Any], image: Tensor | None = None) -> tuple[Tensor, tuple[float, float]]:
    """The picture to draw predictions on: the original file, reduced to :data:`DRAW_MAX_SIDE`.

    Args:
        target: A :class:`PredictImages` target (``path``, ``orig_size``).
        image: The model input, used when there is no file (a tensor source).

    Returns:
        uint8 ``[3, h, w]`` and its scales relative to ``orig_size``, one per axis:
        ``(h / H0, w / W0)``. Each side is rounded on its own when the picture is reduced (a
        6000 x 5 strip becomes 3000 x 3: ``(0.6, 0.5)``), so x and y need their own scale.
    """
    h0, w0 = (int(v) for v in target["orig_size"])
    if target.get("path"):
        decoded = decode_image(target["path"], max_side=DRAW_MAX_SIDE)
        pic = TF.pil_to_tensor(decoded.image)
    else:
        assert image is not None, "a tensor source needs its image"
        pic = (image.detach().float().clamp(0, 1).cpu() * 255).round().to(torch.uint8)
    return pic, (pic.shape[-2] / h0, pic.shape[-1] / w0)


class PredictionWriter(BasePredictionWriter):
    """Writes a task's predictions as they come (``trainer.predict``), then one JSON index.

    Args:
        output_dir: Folder of the outputs (created). Under DDP rank 0's value is used by all.
        info: Extra entries for the JSON index (checkpoint, options).

    After the run, :attr:`files` lists the index files rank 0 wrote, :attr:`count` the images and
    :attr:`skipped` the files skipped as undecodable (also under ``skipped`` in the index).
    """

    def __init__(self, output_dir: str | os.PathLike[str], info: dict[str, Any] | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self.info = dict(info or {})
        self.records: list[dict[str, Any]] = []
        self.files: list[Path] = []
        self.count = 0
        self.skipped: list[str] = []  # input names of the files skipped as undecodable

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Agree on the output folder (rank 0's; a collective: every rank calls setup)."""
        self.output_dir = Path(trainer.strategy.broadcast(str(self.output_dir)))
        self.records = []

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write this rank's per-image files; keep their JSON records for the index."""
        images, targets = batch
        for image, pred, target in zip(images, prediction, targets):
            self.records.append(pl_module.write_prediction_files(self.output_dir, target, pred, image))

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather every rank's records (all ranks call this) and write the index on rank 0."""
        parts = pl_module.gather(self.records)
        self.records = []
        merged: dict[int, dict[str, Any]] = {}
        for part in parts:
            for rec in part:
                merged[int(rec["index"])] = rec
        records = [merged[i] for i in sorted(merged)]
        self.count = len(records)
        dataset = getattr(trainer.predict_dataloaders, "dataset", None)
        self.skipped = dataset.skipped(list(merged)) if isinstance(dataset, PredictImages) else []
        if trainer.is_global_zero:
            info = dict(self.info)
            if self.skipped:
                info["skipped"] = self.skipped
                logger.warning("predicted %d images; skipped %d that could not be decoded: %s", self.count, len(self.skipped),
                               first_names(self.skipped))
            self.files = pl_module.write_prediction_index(self.output_dir, records, info)


def write_file(path: Path, data: bytes) -> Path:
    """Atomic write (any rank; no collective)."""
    atomic_write_bytes(path, data)
    return path
