"""ADE20K (ADEChallengeData2016) semantic segmentation data, and any images + PNG label-map folder.

Training follows mmseg's ADE20K pipeline: random rescale (ratio 0.5-2.0 of a 2048x512 scale,
keeping the aspect ratio), random crop with a category-ratio cap (``cat_max_ratio``: retry
up to 10 crops while one class covers more than 75% of the labelled pixels), horizontal flip,
mmseg's photometric distortion (:class:`~vtdense.data.photometric.PhotoMetricDistortion`), padding
to the crop size. Evaluation resizes the image to the scale
(keeping the ratio) and keeps the label map at its original size; the task resizes its
prediction back. Images come out as float tensors in ``[0, 1]`` (the task normalises, and
gives everything beyond a sample's ``image_size`` the mean colour, 0 after normalisation, as
mmseg pads its normalised crops), masks as int64 with ``ignore_index`` (255) for unlabelled and
padded pixels.

With ``root=None`` the datamodule reads ``$VTDENSE_DATA/ade20k`` (or ``data/ade20k``); when that
is empty it generates a small synthetic set in the same layout into
``$VTDENSE_CACHE`` / ``$XDG_CACHE_HOME/vtdense`` / ``~/.cache/vtdense`` (``synthetic_ade20k_v1``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from vtdense.data.errors import BadSampleError, SkipOnBadSample
from vtdense.data.images import decode_image
from vtdense.data.photometric import PhotoMetricDistortion
from vtdense.data.samplers import make_train_loader
from vtdense.data.synthetic_seg import generate_synthetic_segmentation
from vtdense.distributed import destroy_process_group_at_exit
from vtdense.options import positive_list

__all__ = [
    "IGNORE_INDEX",
    "ADE20K_NUM_CLASSES",
    "SegmentationFolder",
    "SegTrainTransform",
    "SegEvalTransform",
    "check_eval_ratios",
    "view_size",
    "seg_collate",
    "default_ade20k_root",
    "synthetic_cache_dir",
    "ADE20KDataModule",
]

log = logging.getLogger(__name__)

#: Label value of unlabelled / padded pixels.
IGNORE_INDEX = 255
#: Classes of ADE20K (SceneParsing, after ``reduce_zero_label``).
ADE20K_NUM_CLASSES = 150
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
SYNTHETIC_NAME = "synthetic_ade20k_v1"
#: Images with a longer side are decoded at a reduced size (long side still at least this).
DEFAULT_MAX_DECODE_SIDE = 4096
_LABEL_MODES = ("L", "P", "I", "I;16")


class SegmentationFolder(SkipOnBadSample, Dataset):
    """Images and same-named PNG label maps in two folders.

    Checked at construction: the folders exist, hold images, and every image has its label map.
    Checked at load time (skipped with a counted warning, see :mod:`vtdense.data.errors`): the
    image decodes (:func:`vtdense.data.images.decode_image`: EXIF applied, any mode to RGB), the
    label map decodes, is single-channel, has the image's size and holds no class above the count.
    Images whose long side exceeds ``max_decode_side`` are decoded reduced and their label maps
    reduced to match (nearest neighbour), so such an image is also evaluated at the reduced size.

    Args:
        root: dataset root.
        split: split name substituted into ``img_dir`` / ``ann_dir``.
        num_classes: number of classes after ``reduce_zero_label``.
        reduce_zero_label: map label 0 to ignore and ``k`` to ``k - 1`` (ADE20K convention).
        img_dir: image folder relative to ``root``, ``{split}`` is substituted.
        ann_dir: label-map folder relative to ``root``, ``{split}`` is substituted.
        transform: callable ``(image uint8 CHW, mask int64 HW) -> dict``.
        ignore_index: label of ignored pixels.
        max_decode_side: see above (``None``: always full size).
        on_bad_sample: ``"skip"`` (substitute the next loadable sample, warn and record in
            ``skipped`` / ``skip_file``) or ``"error"`` (raise :class:`~vtdense.data.errors.BadSampleError`).

    Raises:
        FileNotFoundError: a missing folder, an empty image folder, or an image without its label map.
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        num_classes: int,
        reduce_zero_label: bool = True,
        img_dir: str = "images/{split}",
        ann_dir: str = "annotations/{split}",
        transform: Callable[[Tensor, Tensor], dict[str, Any]] | None = None,
        ignore_index: int = IGNORE_INDEX,
        max_decode_side: int | None = DEFAULT_MAX_DECODE_SIDE,
        on_bad_sample: str = "skip",
    ) -> None:
        self._init_skipping(on_bad_sample)
        self.max_decode_side = max_decode_side
        self.root = Path(root)
        self.num_classes = num_classes
        self.reduce_zero_label = reduce_zero_label
        self.transform = transform
        self.ignore_index = ignore_index
        self.img_dir = self.root / img_dir.format(split=split)
        self.ann_dir = self.root / ann_dir.format(split=split)
        for d in (self.img_dir, self.ann_dir):
            if not d.is_dir():
                raise FileNotFoundError(f"segmentation data: folder {d} does not exist (split {split!r})")
        images = sorted(p for p in self.img_dir.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
        if not images:
            raise FileNotFoundError(f"segmentation data: no images ({', '.join(_IMAGE_SUFFIXES)}) in {self.img_dir}")
        missing = [p for p in images if not (self.ann_dir / f"{p.stem}.png").is_file()]
        if missing:
            raise FileNotFoundError(
                f"segmentation data: {len(missing)} image(s) in {self.img_dir} have no label map in {self.ann_dir}; "
                f"first: {missing[0].name} (expected {self.ann_dir / (missing[0].stem + '.png')})"
            )
        self.images = images
        self.labels = [self.ann_dir / f"{p.stem}.png" for p in images]

    def __len__(self) -> int:
        return len(self.images)

    def load(self, index: int) -> tuple[Tensor, Tensor]:
        """Image (uint8 3xHxW) and checked label map (int64 HxW, reduced if configured).

        Raises:
            BadSampleError: the image or label map cannot be decoded, the label map is not
                single-channel, differs in size from its image or holds a class above the count.
        """
        img_path, ann_path = self.images[index], self.labels[index]
        decoded = decode_image(img_path, max_side=self.max_decode_side)
        image = np.asarray(decoded.image)
        try:
            with Image.open(ann_path) as im:
                if im.mode not in _LABEL_MODES:
                    raise BadSampleError(
                        f"label map {ann_path} has mode {im.mode!r}; expected a single-channel PNG (L or P)", file=ann_path
                    )
                lw, lh = im.size
                if (lh, lw) != decoded.full_size:
                    fh, fw = decoded.full_size
                    exif = f" after its EXIF orientation {decoded.orientation}" if decoded.orientation != 1 else ""
                    raise BadSampleError(
                        f"label map {ann_path} is {lw}x{lh} (WxH) but its image {img_path} is {fw}x{fh}{exif}",
                        file=ann_path,
                    )
                if image.shape[:2] != (lh, lw):  # the image was decoded reduced: reduce the labels alike
                    im = im.resize((image.shape[1], image.shape[0]), Image.Resampling.NEAREST)
                label = np.asarray(im).astype(np.int64)
        except BadSampleError:
            raise
        except MemoryError:
            raise
        except Exception as e:  # missing, truncated or undecodable PNG
            raise BadSampleError(f"label map {ann_path} cannot be decoded: {type(e).__name__}: {e}", file=ann_path) from None
        if self.reduce_zero_label:
            label = np.where((label == 0) | (label == self.ignore_index), self.ignore_index + 1, label) - 1
        valid = label != self.ignore_index
        if valid.any():
            top = int(label[valid].max())
            if top >= self.num_classes or int(label[valid].min()) < 0:
                shown = top + 1 if self.reduce_zero_label else top
                raise BadSampleError(
                    f"label map {ann_path} holds class value {shown}, above the class count "
                    f"(num_classes={self.num_classes}, reduce_zero_label={self.reduce_zero_label}, "
                    f"ignore_index={self.ignore_index})",
                    file=ann_path,
                )
        return torch.from_numpy(image.copy()).permute(2, 0, 1).contiguous(), torch.from_numpy(label)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """A transformed sample; a bad one is replaced by the next loadable index (see :meth:`load`)."""
        sample = self._load_or_substitute(index, self._sample, len(self.images))
        # a substitute repeats another index's sample: evaluation must not count it twice
        sample["substitute"] = sample["file"] != Path(self.images[index]).name
        return sample

    def _sample(self, index: int) -> dict[str, Any]:
        image, mask = self.load(index)
        if self.transform is None:
            sample = {"image": image.float() / 255, "mask": mask, "image_size": tuple(image.shape[-2:])}
        else:
            sample = self.transform(image, mask)
        sample["file"] = Path(self.images[index]).name
        return sample


def _rescale_size(h: int, w: int, scale: Sequence[int]) -> tuple[int, int]:
    """mmseg keep-ratio rescale: fit (long, short) = (max(scale), min(scale))."""
    long_s, short_s = max(scale), min(scale)
    f = min(long_s / max(h, w), short_s / min(h, w))
    return max(1, int(h * f + 0.5)), max(1, int(w * f + 0.5))


def _resize(image: Tensor, mask: Tensor | None, size: tuple[int, int]) -> tuple[Tensor, Tensor | None]:
    """Bilinear image (no antialiasing: mmcv's ``imrescale``, OpenCV's ``INTER_LINEAR``), nearest mask."""
    image = v2.functional.resize(image, list(size), antialias=False)
    if mask is not None:
        mask = v2.functional.resize(mask[None], list(size), interpolation=v2.InterpolationMode.NEAREST)[0]
    return image, mask


class SegTrainTransform:
    """mmseg-style training augmentation on ``(uint8 image CHW, int64 mask HW)``.

    Args:
        scale: (long, short) target of the keep-ratio rescale, e.g. ``(2048, 512)``.
        ratio_range: random multiplier range of ``scale``.
        crop_size: (h, w) of the random crop; smaller images are padded to it.
        cat_max_ratio: retry the crop (up to 10 times) while one class covers more than this
            fraction of the labelled pixels; ``1.0`` disables.
        flip_prob: horizontal flip probability.
        photometric: apply mmseg's ``PhotoMetricDistortion`` with its defaults
            (:class:`~vtdense.data.photometric.PhotoMetricDistortion`: brightness, contrast,
            saturation and hue steps, each with probability 1/2, drawn from ``np.random``).
        ignore_index: label of padded pixels.
    """

    def __init__(
        self,
        scale: Sequence[int] = (2048, 512),
        ratio_range: Sequence[float] = (0.5, 2.0),
        crop_size: Sequence[int] = (512, 512),
        cat_max_ratio: float = 0.75,
        flip_prob: float = 0.5,
        photometric: bool = True,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.scale = tuple(scale)
        self.ratio_range = tuple(ratio_range)
        self.crop_size = (int(crop_size[0]), int(crop_size[1]))
        self.cat_max_ratio = cat_max_ratio
        self.flip_prob = flip_prob
        self.ignore_index = ignore_index
        self.jitter = PhotoMetricDistortion() if photometric else None

    def crop_box(self, mask: Tensor) -> tuple[int, int, int, int]:
        """Top, left, height, width of a random crop honouring ``cat_max_ratio``."""
        h, w = mask.shape
        ch, cw = min(self.crop_size[0], h), min(self.crop_size[1], w)

        def draw() -> tuple[int, int, int, int]:
            return random.randint(0, h - ch), random.randint(0, w - cw), ch, cw

        box = draw()
        if self.cat_max_ratio < 1.0:
            for _ in range(10):
                t, l, bh, bw = box
                crop = mask[t : t + bh, l : l + bw]
                counts = torch.bincount(crop[crop != self.ignore_index].flatten())
                counts = counts[counts > 0]
                if len(counts) > 1 and counts.max().item() / counts.sum().item() < self.cat_max_ratio:
                    break
                box = draw()
        return box

    def __call__(self, image: Tensor, mask: Tensor) -> dict[str, Any]:
        """Augment one sample; returns ``{"image": float CHW in [0, 1], "mask": int64 HW}`` at ``crop_size``."""
        ratio = random.uniform(*self.ratio_range)
        target = [int(s * ratio) for s in self.scale]  # mmseg truncates the scaled (long, short) first
        image, mask = _resize(image, mask, _rescale_size(image.shape[1], image.shape[2], target))
        t, l, bh, bw = self.crop_box(mask)
        image, mask = image[:, t : t + bh, l : l + bw], mask[t : t + bh, l : l + bw]
        if random.random() < self.flip_prob:
            image, mask = image.flip(-1), mask.flip(-1)
        if self.jitter is not None:
            image = self.jitter(image)
        ph, pw = self.crop_size[0] - bh, self.crop_size[1] - bw
        image = F.pad(image.float() / 255, (0, pw, 0, ph), value=0.0)
        mask = F.pad(mask, (0, pw, 0, ph), value=self.ignore_index)
        return {"image": image, "mask": mask, "image_size": (bh, bw)}


def check_eval_ratios(ratios: Any, option: str = "eval_ratios") -> tuple[float, ...] | None:
    """``ratios`` as a tuple of positive finite floats, or ``None`` (one scale).

    Raises:
        ValueError: ``ratios`` is not a non-empty list of positive numbers; one message naming
            ``option`` and the value.
    """
    return positive_list(ratios, option, integers=False, example="[0.5, 0.75, 1.0, 1.25, 1.5, 1.75]")


def view_size(h: int, w: int, scale: Sequence[int] | None, ratio: float = 1.0) -> tuple[int, int]:
    """Size of an ``h x w`` image resized for evaluation at ``ratio`` of ``scale``, as mmseg's
    ``MultiScaleFlipAug`` + ``Resize(keep_ratio=True)``: the scale is multiplied and truncated,
    ``(int(long * ratio), int(short * ratio))``, then the image fitted into it; with ``scale=None``
    the image itself is rescaled by ``ratio`` (``int(side * ratio + 0.5)``)."""
    if scale is None:
        return max(1, int(h * ratio + 0.5)), max(1, int(w * ratio + 0.5))
    return _rescale_size(h, w, [int(s * ratio) for s in scale])


class SegEvalTransform:
    """Evaluation transform: keep-ratio resize of the image to ``scale``, label map untouched;
    with ``ratios`` or ``flip``, also the multi-scale and flipped views of test-time augmentation.

    Args:
        scale: (long, short) target of the rescale; ``None`` keeps the image size.
        ratios: test-time scales, multiples of ``scale`` (mmseg's ``img_ratios``, e.g.
            ``(0.5, 0.75, 1.0, 1.25, 1.5, 1.75)``); ``None``: one scale.
        flip: also a horizontally flipped view of each scale.

    With one scale and no flip the sample is one image. Otherwise ``image`` is the unflipped view
    nearest ratio 1 and ``views`` lists the others in mmseg's order (by ratio; unflipped, then
    flipped), each ``{"image", "image_size", "flip"}``; the task averages the softmax of all views
    at the label's size, flipped views flipped back (:func:`vtdense.tasks.segmentation.merge_views`).
    """

    def __init__(self, scale: Sequence[int] | None = (2048, 512), ratios: Sequence[float] | None = None,
                 flip: bool = False) -> None:
        self.scale = tuple(scale) if scale is not None else None
        self.ratios = check_eval_ratios(ratios, "ratios") or (1.0,)
        self.flip = bool(flip)
        specs = [(r, f) for r in self.ratios for f in ((False, True) if self.flip else (False,))]
        base = min(range(len(specs)), key=lambda i: (abs(math.log(specs[i][0])), i))
        #: (ratio, flip) of every view, the one given as ``image`` first
        self.specs: list[tuple[float, bool]] = [specs[base]] + specs[:base] + specs[base + 1 :]

    @property
    def long_side(self) -> int | None:
        """Longest model input side over the views (``None`` without a scale)."""
        return None if self.scale is None else int(max(self.scale) * max(self.ratios))

    def resize(self, image: Tensor, ratio: float = 1.0) -> Tensor:
        """uint8 ``[3, H, W]`` -> float ``[3, h, w]`` in ``[0, 1]`` at ``ratio`` of the scale."""
        if self.scale is not None or ratio != 1.0:
            image, _ = _resize(image, None, view_size(image.shape[1], image.shape[2], self.scale, ratio))
        return image.float() / 255

    def __call__(self, image: Tensor, mask: Tensor) -> dict[str, Any]:
        """Returns ``{"image", "mask" (original size), "image_size" (resized image h, w)}`` and,
        with several views, ``views``."""
        resized: dict[float, Tensor] = {}
        views = []
        for ratio, flip in self.specs:
            if ratio not in resized:
                resized[ratio] = self.resize(image, ratio)
            view = resized[ratio].flip(-1) if flip else resized[ratio]
            views.append({"image": view, "image_size": tuple(view.shape[-2:]), "flip": flip})
        out = {"image": views[0]["image"], "mask": mask, "image_size": views[0]["image_size"]}
        return out | ({"views": views[1:]} if len(views) > 1 else {})


def seg_collate(samples: list[dict[str, Any]], ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """Batch samples of different sizes by padding bottom/right (image 0, mask ``ignore_index``).

    Returns:
        ``{"image": N3HW float, "mask": NHW int64, "image_size": N2 int64, "mask_size": N2 int64,
        "files": [N file names]}`` (``files`` only when the samples name their file), and with
        test-time views (:class:`SegEvalTransform`) ``views``: per view ``{"image": N3HW,
        "image_size": N2, "flip": bool}``, each padded on its own.
    """
    ih = max(s["image"].shape[-2] for s in samples)
    iw = max(s["image"].shape[-1] for s in samples)
    mh = max(s["mask"].shape[-2] for s in samples)
    mw = max(s["mask"].shape[-1] for s in samples)
    images = torch.stack(
        [F.pad(s["image"], (0, iw - s["image"].shape[-1], 0, ih - s["image"].shape[-2])) for s in samples]
    )
    masks = torch.stack(
        [
            F.pad(s["mask"], (0, mw - s["mask"].shape[-1], 0, mh - s["mask"].shape[-2]), value=ignore_index)
            for s in samples
        ]
    )
    views = []
    for k in range(len(samples[0].get("views", ()))):  # each test-time view padded on its own
        ims = [s["views"][k]["image"] for s in samples]
        vh, vw = max(im.shape[-2] for im in ims), max(im.shape[-1] for im in ims)
        views.append({
            "image": torch.stack([F.pad(im, (0, vw - im.shape[-1], 0, vh - im.shape[-2])) for im in ims]),
            "image_size": torch.tensor([list(s["views"][k]["image_size"]) for s in samples], dtype=torch.long),
            "flip": bool(samples[0]["views"][k]["flip"]),
        })
    return {
        "image": images,
        "mask": masks,
        "image_size": torch.tensor([list(s["image_size"]) for s in samples], dtype=torch.long),
        "mask_size": torch.tensor([list(s["mask"].shape[-2:]) for s in samples], dtype=torch.long),
    } | ({"views": views} if views else {}) | (
        {"files": [s["file"] for s in samples]} if all("file" in s for s in samples) else {}
    ) | (
        {"substitute": [bool(s.get("substitute")) for s in samples]} if any("substitute" in s for s in samples) else {}
    )


def default_ade20k_root() -> Path:
    """``$VTDENSE_DATA/ade20k`` if ``VTDENSE_DATA`` is set, else ``data/ade20k`` (relative to the cwd)."""
    base = os.environ.get("VTDENSE_DATA")
    return Path(base) / "ade20k" if base else Path("data") / "ade20k"


def synthetic_cache_dir() -> Path:
    """Where the synthetic set lives: ``$VTDENSE_CACHE``, else ``$XDG_CACHE_HOME/vtdense``, else ``~/.cache/vtdense``."""
    if os.environ.get("VTDENSE_CACHE"):
        base = Path(os.environ["VTDENSE_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]) / "vtdense"
    else:
        base = Path.home() / ".cache" / "vtdense"
    return base / SYNTHETIC_NAME


def _is_empty(path: Path) -> bool:
    return not path.is_dir() or not any(path.iterdir())


class ADE20KDataModule(L.LightningDataModule):
    """ADE20K (or any images + PNG label-map folder) for semantic segmentation.

    Args:
        root: dataset root holding ``images/{split}`` and ``annotations/{split}``. ``None`` uses
            :func:`default_ade20k_root`, falling back to a generated synthetic set when that is empty.
            An explicit root that does not exist is an error.
        num_classes: classes after ``reduce_zero_label``; ``None``: the line count of ``classes.txt`` in
            the root when there is one (the synthetic set has one), else 150 (ADE20K).
        reduce_zero_label: label 0 -> ignore, ``k`` -> ``k - 1``.
        batch_size: training batch size per device.
        val_batch_size: validation batch size per device.
        num_workers: dataloader workers.
        persistent_workers: keep the workers alive between epochs (with ``num_workers > 0``).
        scale: (long, short) rescale target (training base scale and evaluation size).
        ratio_range: training rescale ratio range.
        crop_size: training crop (h, w).
        cat_max_ratio: crop category-ratio cap (``1.0`` disables).
        flip_prob: horizontal flip probability.
        photometric: mmseg's photometric distortion on/off (see :class:`SegTrainTransform`).
        eval_scale: evaluation rescale target (long, short); ``None`` means ``scale``.
        eval_ratios: multi-scale test-time augmentation in validation and test: the image is
            also evaluated at these multiples of ``eval_scale`` and the class probabilities are
            averaged, as mmseg's ``MultiScaleFlipAug`` (the published "ms" results use
            ``[0.5, 0.75, 1.0, 1.25, 1.5, 1.75]``); ``None``: one scale.
        eval_flip: test-time augmentation with horizontally flipped views too ("flip").
        train_split / val_split: split folder names.
        img_dir / ann_dir: folder templates relative to ``root`` (``{split}`` substituted).
        ignore_index: label of ignored pixels.
        synthetic_num_train / synthetic_num_val: sizes of the generated set (only when it is generated).
    """

    def __init__(
        self,
        root: str | None = None,
        num_classes: int | None = None,
        reduce_zero_label: bool = True,
        batch_size: int = 2,
        val_batch_size: int = 1,
        num_workers: int = 4,
        persistent_workers: bool = True,
        scale: tuple[int, int] = (2048, 512),
        ratio_range: tuple[float, float] = (0.5, 2.0),
        crop_size: tuple[int, int] = (512, 512),
        cat_max_ratio: float = 0.75,
        flip_prob: float = 0.5,
        photometric: bool = True,
        eval_scale: tuple[int, int] | None = None,
        eval_ratios: list[float] | None = None,
        eval_flip: bool = False,
        train_split: str = "training",
        val_split: str = "validation",
        img_dir: str = "images/{split}",
        ann_dir: str = "annotations/{split}",
        ignore_index: int = IGNORE_INDEX,
        synthetic_num_train: int = 96,
        synthetic_num_val: int = 24,
    ) -> None:
        super().__init__()
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"ADE20KDataModule: num_classes must be >= 1, got {num_classes}")
        if len(crop_size) != 2 or min(crop_size) < 1:
            raise ValueError(f"ADE20KDataModule: crop_size must be (h, w) with positive sizes, got {crop_size}")
        check_eval_ratios(eval_ratios, "ADE20KDataModule: eval_ratios")
        if not isinstance(eval_flip, bool):
            raise ValueError(f"ADE20KDataModule: eval_flip must be true or false, got {eval_flip!r}")
        self.save_hyperparameters()
        self.root_arg = root
        self._num_classes = num_classes
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.num_workers = num_workers
        self.ignore_index = ignore_index
        self.train_transform = SegTrainTransform(
            scale, ratio_range, crop_size, cat_max_ratio, flip_prob, photometric, ignore_index
        )
        self.eval_transform = SegEvalTransform(eval_scale if eval_scale is not None else scale, eval_ratios, eval_flip)
        self._root: Path | None = None
        self.train_dataset: SegmentationFolder | None = None
        self.val_dataset: SegmentationFolder | None = None

    @property
    def root(self) -> Path:
        """The resolved dataset root (generating the synthetic set if needed)."""
        if self._root is None:
            self._root = self._resolve_root()
        return self._root

    @staticmethod
    def default_data_found() -> bool:
        """Whether the default root holds a dataset (used by recipes to pick their config)."""
        return not _is_empty(default_ade20k_root())

    def _resolve_root(self) -> Path:
        if self.root_arg is not None:
            root = Path(self.root_arg).expanduser()
            if not root.is_dir():
                raise FileNotFoundError(f"ADE20KDataModule: data.root {str(root)!r} does not exist or is not a folder")
            return root
        default = default_ade20k_root()
        if not _is_empty(default):
            return default
        cache = synthetic_cache_dir()
        if not cache.exists():
            log.warning(
                "ADE20K not found at %s: generating a synthetic ADE20K-layout set in %s (pass data.root to use real data)",
                default,
                cache,
            )
        else:
            log.warning("ADE20K not found at %s: using the synthetic set in %s", default, cache)
        return generate_synthetic_segmentation(
            cache, num_train=self.hparams.synthetic_num_train, num_val=self.hparams.synthetic_num_val
        )

    def _listed_classes(self) -> list[str] | None:
        path = self.root / "classes.txt"
        if not path.is_file():
            return None
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]

    @property
    def num_classes(self) -> int:
        """Class count: the ``num_classes`` argument, else ``classes.txt`` in the root, else 150."""
        if self._num_classes is not None:
            return self._num_classes
        listed = self._listed_classes()
        return len(listed) if listed else ADE20K_NUM_CLASSES

    @property
    def class_names(self) -> list[str]:
        """Class names from ``classes.txt`` in the root when it matches the count, else ``class_<i>``."""
        listed = self._listed_classes()
        if listed is not None and len(listed) == self.num_classes:
            return listed
        return [f"class_{i}" for i in range(self.num_classes)]

    def prepare_data(self) -> None:
        """Resolve the root (generates the synthetic set once, on rank 0)."""
        _ = self.root

    def _dataset(self, split: str, transform: Callable[[Tensor, Tensor], dict[str, Any]]) -> SegmentationFolder:
        h = self.hparams
        return SegmentationFolder(
            self.root,
            split,
            self.num_classes,
            reduce_zero_label=h.reduce_zero_label,
            img_dir=h.img_dir,
            ann_dir=h.ann_dir,
            transform=transform,
            ignore_index=self.ignore_index,
        )

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets (checks every image has its label map)."""
        destroy_process_group_at_exit()  # a clean exit under gloo (see vtdense.distributed)
        if stage in ("fit", None) and self.train_dataset is None:
            self.train_dataset = self._dataset(self.hparams.train_split, self.train_transform)
        if stage in ("fit", "validate", "test", "predict", None) and self.val_dataset is None:
            self.val_dataset = self._dataset(self.hparams.val_split, self.eval_transform)

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=shuffle and len(dataset) >= batch_size,
            num_workers=self.num_workers,
            collate_fn=functools.partial(seg_collate, ignore_index=self.ignore_index),
            persistent_workers=self.hparams.persistent_workers and self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of fixed crop size, resumable mid-epoch.

        A :class:`~torchdata.stateful_dataloader.StatefulDataLoader` whose order and per-sample
        augmentation depend only on the run seed, the epoch and the sample index (see
        :func:`vtdense.data.samplers.make_train_loader`).
        """
        assert self.train_dataset is not None, "call setup('fit') first"
        dataset = self.train_dataset
        return make_train_loader(
            dataset,
            self.batch_size,
            collate_fn=functools.partial(seg_collate, ignore_index=self.ignore_index),
            drop_last=len(dataset) >= self.batch_size,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.hparams.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches (padded to the largest image in the batch)."""
        assert self.val_dataset is not None, "call setup('validate') first"
        return self._loader(self.val_dataset, self.val_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The validation split (ADE20K's test labels are not public)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The validation split, as evaluation batches: ``trainer.predict`` gives each image's label
        map at its label's size (:meth:`~vtdense.tasks.segmentation.SegmentationTask.predict_step`)."""
        return self.val_dataloader()
