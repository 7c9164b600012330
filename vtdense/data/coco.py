"""COCO-format instance detection: the :class:`COCODetection` dataset and :class:`COCODataModule`.

Batch contract (after :func:`collate_detection`): ``(images, targets)`` where ``images`` is a
list of ``float32`` ``[3, h, w]`` tensors in ``[0, 1]`` (sizes differ) and each target dict has

- ``boxes``: ``float32 [N, 4]`` XYXY in the transformed image's pixels;
- ``labels``: ``int64 [N]`` in ``1..num_classes`` (0 is background);
- ``masks``: ``uint8 [N, h, w]`` in transformed coordinates (``[0, h, w]`` without instances);
- ``iscrowd``: ``int64 [N]``; ``area``: ``float32 [N]`` (COCO ``area``, original coordinates);
- ``image_id``: the COCO image id (``int``); ``orig_size``: ``(H0, W0)``;
- evaluation splits only: ``orig_boxes`` ``float32 [N, 4]`` XYXY and ``orig_masks``
  ``bool [N, H0, W0]`` in original coordinates, for ``MeanAveragePrecision`` ground truth.

Training splits drop crowd instances; evaluation splits keep them (``iscrowd=1``). An instance
whose box shrinks below 1 px under the resize is dropped from every per-instance key (``orig_*``
included), so all of them keep one length ``N``.

Bad input (see the README's "Bad input" table): the annotation file is checked when the dataset
is built (one :class:`COCODatasetError` naming the file, image id or annotation id); boxes are
clipped to the image as torchvision's reference ``ConvertCocoPolysToMask`` and detectron2 do, and
annotations left empty by clipping, or of negative width/height, are dropped with one counted
warning and listed in ``skipped``. Images are decoded by :func:`vtdense.data.images.decode_image`
(EXIF orientation applied, any pixel mode to RGB, huge images decoded reduced); an image that fails
to decode, or whose displayed size differs from the JSON's, is skipped at load time with a counted
warning (:class:`vtdense.data.errors.SkipOnBadSample`).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import lightning as L
import numpy as np
import torch
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from vtdense.data.errors import BadSampleError, SkipOnBadSample, skip_record
from vtdense.data.images import decode_image
from vtdense.data.samplers import aspect_ratio_group_ids, make_train_loader
from vtdense.data.synthetic import synthetic_coco_root
from vtdense.data.transforms import (
    DEFAULT_MAX_SIZE,
    DEFAULT_TEST_SCALE,
    DEFAULT_TRAIN_SCALES,
    DetectionEvalViews,
    check_test_scales,
    detection_crop_transforms,
    detection_eval_transforms,
    detection_lsj_transforms,
    detection_train_transforms,
    drop_degenerate_instances,
)
from vtdense.distributed import destroy_process_group_at_exit
from vtdense.options import check_int

__all__ = [
    "DEFAULT_MAX_DECODE_SIDE",
    "COCODataModule",
    "COCODatasetError",
    "COCOImageError",
    "COCODetection",
    "collate_detection",
    "load_coco_json",
    "read_coco_categories",
]

logger = logging.getLogger(__name__)

Transform = Callable[[Any, dict[str, Any]], tuple[Any, dict[str, Any]]]


#: Images with a longer side are decoded at a reduced size (long side still at least this); above the
#: default long-side cap of the transforms (1333); :class:`COCODataModule` raises it to its ``max_size``.
DEFAULT_MAX_DECODE_SIDE = 2048


class COCODatasetError(ValueError):
    """A COCO annotation file, or one of its entries, is invalid."""


class COCOImageError(COCODatasetError, BadSampleError):
    """One image cannot be used (undecodable, or its size disagrees with the annotation file)."""


def load_coco_json(ann_file: str | os.PathLike[str], lists: Sequence[str] = ("images", "categories", "annotations")) -> dict[str, Any]:
    """Read a COCO instances JSON and check its top-level structure.

    Args:
        ann_file: Path to the JSON file.
        lists: The top-level lists it must have (an image-info file: ``("images",)``).

    Returns:
        The parsed dict.

    Raises:
        FileNotFoundError: If the file does not exist.
        COCODatasetError: If it is not valid JSON or lacks ``images``/``categories``/``annotations``
            lists (an image-info file such as ``image_info_test2017.json`` has no annotations).
    """
    path = Path(ann_file)
    if not path.is_file():
        raise FileNotFoundError(f"COCO annotation file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise COCODatasetError(f"{path} is not a valid COCO JSON file: {e}") from None
    if not isinstance(data, dict):
        raise COCODatasetError(f"{path} is not a valid COCO JSON file: top level is {type(data).__name__}, not an object")
    for key in lists:
        if key not in data:
            hint = " (an image-info file without ground truth? vtdense needs an instances file)" if key == "annotations" else ""
            raise COCODatasetError(f"{path} is not a valid COCO JSON file: missing list {key!r}{hint}")
        if not isinstance(data[key], list):
            raise COCODatasetError(
                f"{path} is not a valid COCO JSON file: {key!r} is a {type(data[key]).__name__}, not a list"
            )
    return data


def parse_coco_categories(data: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The validated ``categories`` of a loaded COCO JSON (integer ids, no id twice, not empty), sorted by id."""
    seen: set[int] = set()
    for cat in data["categories"]:
        if not isinstance(cat, dict) or not isinstance(cat.get("id"), int) or isinstance(cat.get("id"), bool):
            raise COCODatasetError(f"{path}: category entry {cat!r} has no integer 'id'")
        if cat["id"] in seen:
            raise COCODatasetError(f"{path}: duplicate category id {cat['id']}")
        seen.add(cat["id"])
    if not seen:
        raise COCODatasetError(f"{path}: 'categories' is empty")
    return sorted(data["categories"], key=lambda c: c["id"])


class CategoryTables(NamedTuple):
    """Categories as a datamodule gives them to a task: labels ``1..K`` in id order."""

    num_classes: int
    label_to_category_id: dict[int, int]
    category_names: list[str]


def category_tables(categories: Sequence[dict[str, Any]]) -> CategoryTables:
    """Labels ``1..K`` for COCO ``categories`` in id order (as :class:`COCODetection` numbers them);
    ``category_names`` is indexed by label, entry 0 ``"__background__"``."""
    ordered = sorted(categories, key=lambda c: c["id"])
    return CategoryTables(len(ordered), {i + 1: int(c["id"]) for i, c in enumerate(ordered)},
                          ["__background__"] + [str(c.get("name", c["id"])) for c in ordered])


def read_coco_categories(ann_file: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Categories of a COCO annotation file, sorted by id (label ``i + 1`` is entry ``i``).

    Args:
        ann_file: Path to the JSON file.

    Returns:
        The category dicts (``id``, ``name``, ...), sorted by id.
    """
    return parse_coco_categories(load_coco_json(ann_file), Path(ann_file))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class COCODetection(SkipOnBadSample, Dataset):
    """COCO-format instance detection / segmentation dataset.

    The annotation file is validated at construction: invalid JSON, no images, duplicate image or
    annotation ids, unknown category ids, malformed boxes and missing image files raise one clear
    error before training starts. Boxes are clipped to the image. Annotations with a negative
    width or height are dropped from every split; degenerate ones (box side ``<= min_box_size``
    after clipping, or ``area <= 0``) from training splits (evaluation keeps them, as pycocotools
    does); both with one warning giving the counts, and listed in ``skipped``. Images without
    annotations are kept. On training splits crowd annotations are dropped.

    At load time an image that cannot be decoded, or whose displayed size (after its EXIF
    orientation) differs from the JSON's ``height``/``width``, is skipped: the next loadable image
    takes its place, with a counted warning and a record (see :mod:`vtdense.data.errors`).

    Args:
        image_dir: Folder holding the images named by ``file_name``.
        ann_file: COCO instances JSON.
        transforms: Callable over ``(tv_tensors.Image, target)``; see
            :mod:`vtdense.data.transforms`. ``None`` keeps the original size.
        train: Training split (drop crowds) or evaluation split (add ``orig_*`` ground truth).
        min_box_size: Annotations whose clipped box is at most this many pixels wide or high are
            dropped from training splits.
        max_decode_side: Images with a longer side are decoded at a reduced size whose long side
            is at least this (JPEG: DCT scaling, never the full pixels); boxes and masks follow.
            ``None`` always decodes at full size.
        on_bad_sample: ``"skip"`` (substitute the next loadable image, warn and record) or
            ``"error"`` (raise :class:`COCOImageError`).
        filter_empty: Training splits only: leave out images with no annotation left to train on
            (none in the file, or only crowd or dropped ones), as detectron2's
            ``filter_empty=True`` and mmdetection's ``filter_empty_gt=True`` do.

    Attributes:
        coco: The pycocotools :class:`~pycocotools.coco.COCO` object of the (unfiltered) file.
        ann_file: Path of the annotation file.
        image_dir: Path of the image folder.
        ids: COCO image ids, in dataset order.
        categories: Category dicts sorted by id.
        label_to_category_id: ``{label: category_id}`` for labels ``1..num_classes``.
        category_id_to_label: The inverse mapping.
        category_names: Names indexed by label; entry 0 is ``"__background__"``.
        num_dropped: Number of annotations dropped at construction.
        skipped: Skip records (dicts with ``file``, ``image_id``, ``annotation_id``, ``reason``,
            ``when``): dropped annotations, and images skipped at load time in this process.
        skip_file: When set (a path from :func:`vtdense.data.errors.write_skip_report`), load-time
            skips are appended there from every process.
    """

    def __init__(
        self,
        image_dir: str | os.PathLike[str],
        ann_file: str | os.PathLike[str],
        transforms: Transform | None = None,
        train: bool = False,
        *,
        min_box_size: float = 1.0,
        max_decode_side: int | None = DEFAULT_MAX_DECODE_SIDE,
        on_bad_sample: str = "skip",
        filter_empty: bool = False,
    ) -> None:
        self._init_skipping(on_bad_sample)
        if max_decode_side is not None and max_decode_side < 1:
            raise ValueError(f"max_decode_side must be a positive int or None, got {max_decode_side}")
        self.max_decode_side = max_decode_side
        self.image_dir = Path(image_dir)
        self.ann_file = Path(ann_file)
        self.transforms = transforms
        self.train = train
        self.min_box_size = float(min_box_size)
        if not self.image_dir.is_dir():
            raise FileNotFoundError(f"COCO image folder not found: {self.image_dir}")
        data = load_coco_json(self.ann_file)
        self.categories = parse_coco_categories(data, self.ann_file)
        self.category_id_to_label: dict[int, int] = {c["id"]: i + 1 for i, c in enumerate(self.categories)}
        self.label_to_category_id: dict[int, int] = {v: k for k, v in self.category_id_to_label.items()}
        self.category_names: list[str] = ["__background__"] + [str(c.get("name", c["id"])) for c in self.categories]

        self._images: dict[int, dict[str, Any]] = {}
        for img in data["images"]:
            if not isinstance(img, dict) or any(k not in img for k in ("id", "file_name", "height", "width")):
                raise COCODatasetError(f"{self.ann_file}: image entry {img!r} needs id, file_name, height, width")
            if img["id"] in self._images:
                raise COCODatasetError(
                    f"{self.ann_file}: duplicate image id {img['id']} ({self._images[img['id']]['file_name']} "
                    f"and {img['file_name']})"
                )
            if not all(_is_number(img[k]) and img[k] >= 1 and img[k] == int(img[k]) for k in ("height", "width")):
                raise COCODatasetError(
                    f"{self.ann_file}: image id {img['id']} ({img['file_name']}) has height={img['height']!r}, "
                    f"width={img['width']!r}; both must be positive integers"
                )
            self._images[img["id"]] = img
        if not self._images:
            raise COCODatasetError(f"{self.ann_file}: the dataset is empty ('images' lists no image)")
        self.ids: list[int] = list(self._images)
        self._anns: dict[int, list[dict[str, Any]]] = {i: [] for i in self.ids}
        self.num_dropped = 0
        num_crowd = 0
        dropped: dict[str, int] = {}
        seen_ann_ids: set[Any] = set()
        for ann in data["annotations"]:
            kept, problem = self._check_annotation(ann)
            if ann["id"] in seen_ann_ids:
                raise COCODatasetError(
                    f"{self.ann_file}: duplicate annotation id {ann['id']!r} (pycocotools would keep only one of them)"
                )
            seen_ann_ids.add(ann["id"])
            if problem is not None and (train or problem.startswith("negative")):
                self.num_dropped += 1
                dropped[problem] = dropped.get(problem, 0) + 1
                self.skipped.append(
                    skip_record(
                        self.ann_file, f"annotation dropped: {problem}", image_id=ann["image_id"],
                        annotation_id=ann["id"], when="start-up",
                    )
                )
            elif train and kept["iscrowd"]:
                num_crowd += 1
            else:
                self._anns[ann["image_id"]].append(kept)
        if self.num_dropped:
            first = self.skipped[0]
            logger.warning(
                "%s: dropped %d degenerate annotations (%s; first: annotation %s of image id %s); "
                "they are listed in the dataset's skip report",
                self.ann_file, self.num_dropped, ", ".join(f"{n} {k}" for k, n in dropped.items()),
                first["annotation_id"], first["image_id"],
            )
        if num_crowd:
            logger.debug("%s: removed %d crowd annotations from the training split", self.ann_file, num_crowd)
        self.num_empty_filtered = 0
        if train and filter_empty:
            kept_ids = [i for i in self.ids if self._anns[i]]
            self.num_empty_filtered = len(self.ids) - len(kept_ids)
            if not kept_ids:
                raise COCODatasetError(
                    f"{self.ann_file}: no training image has an annotation to train on (all {len(self.ids)} are "
                    "empty, crowd-only or lost their annotations as degenerate); filter_empty=False keeps them"
                )
            if self.num_empty_filtered:
                logger.info(
                    "%s: training on %d of %d images; %d have no annotation to train on (as detectron2 and "
                    "mmdetection, filter_empty=False keeps them)",
                    self.ann_file, len(kept_ids), len(self.ids), self.num_empty_filtered,
                )
            self.ids = kept_ids
        self._check_files()
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            self.coco = COCO()
            self.coco.dataset = data
            self.coco.createIndex()

    @property
    def num_classes(self) -> int:
        """Number of object classes (background excluded)."""
        return len(self.categories)

    def _check_annotation(self, ann: Any) -> tuple[dict[str, Any], str | None]:
        """Validate one annotation; return a normalised copy and what is wrong with its box, if anything.

        Boxes are clipped to the image. The problem is ``"negative width or height"`` (dropped
        from every split: no tool can score such a box) or ``"empty after clipping to the image"``
        / ``"box side <= min_box_size"`` / ``"zero area"`` (dropped from training splits only:
        evaluation splits keep every ground-truth annotation, so metrics agree with pycocotools
        run on the JSON file).
        """
        if not isinstance(ann, dict) or "id" not in ann:
            raise COCODatasetError(f"{self.ann_file}: annotation entry {ann!r} has no 'id'")
        ann_id = ann["id"]
        if ann.get("image_id") not in self._images:
            raise COCODatasetError(
                f"{self.ann_file}: annotation {ann_id} refers to unknown image id {ann.get('image_id')!r}"
            )
        if ann.get("category_id") not in self.category_id_to_label:
            raise COCODatasetError(
                f"{self.ann_file}: annotation {ann_id} has category_id {ann.get('category_id')!r}, "
                f"which is not in 'categories' (known ids: {sorted(self.category_id_to_label)})"
            )
        bbox = ann.get("bbox")
        if (
            not isinstance(bbox, (list, tuple))
            or len(bbox) != 4
            or not all(_is_number(v) for v in bbox)
        ):
            raise COCODatasetError(
                f"{self.ann_file}: annotation {ann_id} has an invalid bbox {bbox!r} (image id {ann['image_id']}); "
                "expected [x, y, width, height] of finite numbers"
            )
        if "area" in ann and not _is_number(ann["area"]):
            raise COCODatasetError(f"{self.ann_file}: annotation {ann_id} has an invalid area {ann['area']!r}")
        img = self._images[ann["image_id"]]
        x0 = min(max(float(bbox[0]), 0.0), float(img["width"]))
        y0 = min(max(float(bbox[1]), 0.0), float(img["height"]))
        x1 = min(max(float(bbox[0] + bbox[2]), 0.0), float(img["width"]))
        y1 = min(max(float(bbox[1] + bbox[3]), 0.0), float(img["height"]))
        area = float(ann.get("area", (x1 - x0) * (y1 - y0)))
        raw = (float(bbox[0]), float(bbox[1]), float(bbox[0] + bbox[2]), float(bbox[1] + bbox[3]))
        problem: str | None = None
        if bbox[2] < 0 or bbox[3] < 0:
            problem = "negative width or height"
        elif x1 <= x0 or y1 <= y0:
            problem = "empty after clipping to the image" if bbox[2] > 0 and bbox[3] > 0 else "zero width or height"
        elif x1 - x0 <= self.min_box_size or y1 - y0 <= self.min_box_size:
            problem = f"box side <= {self.min_box_size:g} px"
        elif area <= 0:
            problem = "zero area"
        kept = {**ann, "xyxy": (x0, y0, x1, y1), "raw_xyxy": raw, "area": area, "iscrowd": int(ann.get("iscrowd", 0))}
        return kept, problem

    def _check_files(self) -> None:
        """Fail early, naming the first missing image, when image files are absent."""
        missing = [i for i in self.ids if not os.path.exists(self.image_dir / self._images[i]["file_name"])]
        if missing:
            first = self._images[missing[0]]
            raise FileNotFoundError(
                f"image file not found: {self.image_dir / first['file_name']} (image id {first['id']} in "
                f"{self.ann_file}); {len(missing)} of {len(self.ids)} images are missing"
            )

    def __len__(self) -> int:
        """Number of images."""
        return len(self.ids)

    def _decode_mask(
        self, ann: dict[str, Any], height: int, width: int, scale: tuple[float, float] = (1.0, 1.0)
    ) -> np.ndarray:
        """Binary ``uint8 [h, w]`` mask of an annotation (polygons, RLE or uncompressed RLE).

        ``height``/``width`` are the image's size in the annotation file; the mask comes out at
        ``(round(height * sy), round(width * sx))`` for ``scale = (sy, sx)`` (reduced huge images).
        """
        seg = ann.get("segmentation")
        sy, sx = scale
        out_h, out_w = (height, width) if scale == (1.0, 1.0) else (round(height * sy), round(width * sx))
        try:
            if isinstance(seg, list) and any(isinstance(p, list) and len(p) >= 6 for p in seg):
                polys = [p for p in seg if isinstance(p, list) and len(p) >= 6]
                if (out_h, out_w) != (height, width):  # scale the polygons, decode at the reduced size
                    polys = [[v * (sx if i % 2 == 0 else sy) for i, v in enumerate(p)] for p in polys]
                rle = mask_utils.merge(mask_utils.frPyObjects(polys, out_h, out_w))
            elif isinstance(seg, dict):
                if list(seg.get("size", [])) != [height, width]:
                    raise COCODatasetError(f"RLE size {seg.get('size')} differs from the image size {[height, width]}")
                rle = mask_utils.frPyObjects(seg, height, width) if isinstance(seg.get("counts"), list) else seg
                full = np.ascontiguousarray(mask_utils.decode(rle), dtype=np.uint8)
                if (out_h, out_w) == (height, width):
                    return full
                return np.asarray(Image.fromarray(full).resize((out_w, out_h), Image.Resampling.NEAREST))
            else:  # no usable segmentation: fall back to the box
                mask = np.zeros((out_h, out_w), dtype=np.uint8)
                x0, y0, x1, y1 = ann["xyxy"]
                x0, x1, y0, y1 = x0 * sx, x1 * sx, y0 * sy, y1 * sy
                mask[int(y0) : int(math.ceil(y1)), int(x0) : int(math.ceil(x1))] = 1
                return mask
            return np.ascontiguousarray(mask_utils.decode(rle), dtype=np.uint8)
        except Exception as e:  # pycocotools raises assorted errors on malformed input
            raise COCODatasetError(
                f"{self.ann_file}: cannot decode the segmentation of annotation {ann['id']} "
                f"(image id {ann['image_id']}): {e}"
            ) from None

    def _load_image(self, info: dict[str, Any]) -> tuple[Image.Image, tuple[float, float]]:
        """Decode an image as RGB (EXIF applied, reduced if huge); check its size against the JSON.

        Returns:
            The image and its scale ``(sy, sx)`` relative to the JSON's size.

        Raises:
            COCOImageError: The file cannot be decoded, or its displayed size is not the JSON's.
        """
        path = self.image_dir / info["file_name"]
        try:
            decoded = decode_image(path, max_side=self.max_decode_side, image_id=info["id"])
        except BadSampleError as e:
            raise COCOImageError(str(e), file=path, image_id=info["id"]) from None
        expected = (int(info["height"]), int(info["width"]))
        if decoded.full_size != expected:
            (h, w), (sh, sw) = decoded.full_size, decoded.stored_size
            if decoded.orientation != 1:
                detail = (
                    f"is stored as {sh}x{sw} (HxW) with EXIF orientation {decoded.orientation}, so it is displayed "
                    f"as {h}x{w}, but {self.ann_file} says {expected[0]}x{expected[1]}. COCO sizes and boxes describe "
                    "the displayed image (EXIF applied, as detectron2 and OpenCV load it)"
                )
                if (sh, sw) == expected:
                    detail += "; this file's annotations seem made on the stored pixels: rotate the image files or fix the JSON"
            else:
                detail = f"is {h}x{w} (HxW) but {self.ann_file} says {expected[0]}x{expected[1]}"
            raise COCOImageError(f"image {path} (image id {info['id']}) {detail}", file=path, image_id=info["id"])
        return decoded.image, decoded.scale

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        """Load, transform and return ``(image, target)``; see the module docstring.

        An image that cannot be used is skipped (``on_bad_sample="skip"``): the next loadable
        index is returned in its place, with a counted warning and a record in ``skipped``.
        """
        return self._load_or_substitute(index, self._load_sample, len(self.ids))

    def _load_sample(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        """Load, transform and return ``(image, target)`` of ``index``; raise on a bad image."""
        image_id = self.ids[index]
        info = self._images[image_id]
        img, scale = self._load_image(info)
        height, width = img.height, img.width  # the decoded size (below the JSON's for huge images)
        json_h, json_w = int(info["height"]), int(info["width"])
        anns = self._anns[image_id]
        boxes = torch.tensor([a["xyxy"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        orig_boxes = torch.tensor([a["raw_xyxy"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        reduced = (height, width) != (json_h, json_w)
        if reduced:
            boxes = boxes * torch.tensor([scale[1], scale[0], scale[1], scale[0]])
        if anns:
            masks = torch.from_numpy(np.stack([self._decode_mask(a, json_h, json_w, scale) for a in anns]))
        else:
            masks = torch.zeros((0, height, width), dtype=torch.uint8)
        target: dict[str, Any] = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
            "labels": torch.tensor([self.category_id_to_label[a["category_id"]] for a in anns], dtype=torch.int64),
            "masks": tv_tensors.Mask(masks),
            "iscrowd": torch.tensor([a["iscrowd"] for a in anns], dtype=torch.int64),
            "area": torch.tensor([a["area"] for a in anns], dtype=torch.float32),
        }
        if not self.train:  # ground truth as pycocotools reads it from the JSON
            target["orig_boxes"] = orig_boxes
            target["orig_masks"] = (
                masks.bool() if not reduced
                else torch.from_numpy(np.stack([self._decode_mask(a, json_h, json_w) for a in anns])).bool()
                if anns else torch.zeros((0, json_h, json_w), dtype=torch.bool)
            )
        image: Any = tv_tensors.Image(TF.pil_to_tensor(img))
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        if self.train:  # evaluation keeps all ground truth (it only feeds the metric)
            target, _ = drop_degenerate_instances(target, min_size=1.0)
        image = image.as_subclass(Tensor) if isinstance(image, Tensor) else TF.pil_to_tensor(image)
        image = TF.to_dtype(image, torch.float32, scale=True)
        out = {k: (v.as_subclass(Tensor) if isinstance(v, Tensor) else v) for k, v in target.items()}
        out["boxes"] = out["boxes"].to(torch.float32)
        out["masks"] = out["masks"].to(torch.uint8)
        out["image_id"] = int(image_id)
        out["orig_size"] = (json_h, json_w)
        return image, out


def collate_detection(batch: Sequence[tuple[Tensor, dict[str, Any]]]) -> tuple[list[Tensor], list[dict[str, Any]]]:
    """Collate ``(image, target)`` pairs of different sizes into two lists.

    Args:
        batch: Items from :class:`COCODetection`.

    Returns:
        ``(images, targets)``.
    """
    return [item[0] for item in batch], [item[1] for item in batch]


#: Training augmentation choices of :class:`COCODataModule`.
_TRAIN_AUGMENTS: tuple[str, ...] = ("multiscale", "multiscale_crop", "lsj")

#: True while :meth:`COCODataModule.for_evaluation` builds a datamodule (read by its ``__init__``).
_EVALUATION_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("vtdense_coco_evaluation_only", default=False)

_SPLIT_FILES: dict[str, tuple[str, str]] = {
    "train": ("annotations/instances_train2017.json", "train2017"),
    "val": ("annotations/instances_val2017.json", "val2017"),
}


class COCODataModule(L.LightningDataModule):
    """LightningDataModule for COCO-format detection (real COCO, synthetic shapes, or any pair).

    Paths: ``root`` with the standard layout (``annotations/instances_{train,val}2017.json``,
    ``train2017/``, ``val2017/``); the explicit ``*_ann``/``*_images`` arguments override single
    files. When neither is given, ``$VTDENSE_DATA/coco`` (or ``data/coco``) is used; if that holds
    no COCO and ``synthetic_if_missing``, a cached synthetic dataset is used instead, with one log
    line saying so. A path you type is never replaced by synthetic data.

    Test and predict use the validation split unless ``test_ann``/``test_images`` are given.

    The training loader is a resumable :class:`~torchdata.stateful_dataloader.StatefulDataLoader`
    (Lightning checkpoints its position mid-epoch) whose order and per-sample augmentation
    depend only on the run seed (``seed_everything``), the epoch and the sample index; see
    :func:`vtdense.data.samplers.make_train_loader`.

    Args:
        root: Dataset root with the standard COCO 2017 layout.
        train_ann: Training annotation JSON (overrides ``root``'s).
        train_images: Training image folder (overrides ``root``'s).
        val_ann: Validation annotation JSON.
        val_images: Validation image folder.
        test_ann: Test annotation JSON (defaults to the validation one).
        test_images: Test image folder (defaults to the validation one).
        batch_size: Images per batch, all splits.
        num_workers: DataLoader worker processes.
        pin_memory: Pin batches in page-locked memory.
        persistent_workers: Keep workers alive between epochs (only with ``num_workers > 0``).
        train_scales: Short sides sampled in training.
        max_size: Long-side cap, training and evaluation.
        test_scale: Short side in evaluation.
        test_scales: test-time augmentation in validation and test, detectron2's ``TEST.AUG``: the
            image is also detected at these short sides (``max_size`` still caps the long side)
            and the detections of all views merged by per-class NMS, Mask R-CNN's masks averaged
            (:func:`vtdense.models.detection_tta.merge_views`); ``None``: ``test_scale`` alone.
        test_flip: test-time augmentation with horizontally flipped views too.
        test_max_size: with ``test_scales``, the long-side cap of every view instead of
            ``max_size`` (detectron2's ``TEST.AUG.MAX_SIZE`` is 4000, so its large scales are not
            capped back to the evaluation size); ``None``: ``max_size``.
        flip_prob: Horizontal-flip probability in training.
        train_augment: ``"multiscale"`` (short side from ``train_scales``, long side capped at
            ``max_size``), ``"multiscale_crop"`` (the same, after the DETR-style random crop of
            the Swin and MViTv2 recipes on a ``crop_prob`` share of the images; see
            :func:`~vtdense.data.transforms.detection_crop_transforms`) or ``"lsj"`` (large-scale
            jitter: rescale to ``lsj_scale_range`` of ``lsj_size``, random crop, pad to
            ``lsj_size`` square, boxes recomputed from masks).
        crop_prob: ``multiscale_crop``: share of the images resized and cropped first.
        crop_scales: ``multiscale_crop``: short sides of the resize before the crop.
        crop_max_size: ``multiscale_crop``: long-side cap of that resize (1333 in the official
            Swin configs; ``None``, no cap, in detectron2's).
        crop_size_range: ``multiscale_crop``: ``(low, high)`` of the crop's height and width.
        lsj_size: Output side of large-scale jitter.
        lsj_scale_range: Scale range of large-scale jitter.
        filter_empty: Leave training images with no annotation to train on (none, or only crowds)
            out of the training split, as detectron2 and mmdetection do by default (on in the
            published configs); evaluation splits keep every image.
        group_by_aspect_ratio: Training batches hold only portrait or only landscape images
            (sizes read from the annotation file); under DDP each rank gets whole batches.
        min_box_size: Annotations with a box side at most this many pixels are dropped.
        synthetic_if_missing: Fall back to synthetic data when the default location is empty.
        cache_dir: Cache folder for the synthetic dataset (default: see
            :func:`vtdense.data.synthetic.default_cache_dir`).

    Raises:
        FileNotFoundError: If a path given explicitly does not exist or lacks the COCO files.
        ValueError: If only some of the explicit ``train_*``/``val_*`` paths are given without
            ``root``.
    """

    def __init__(
        self,
        root: str | None = None,
        train_ann: str | None = None,
        train_images: str | None = None,
        val_ann: str | None = None,
        val_images: str | None = None,
        test_ann: str | None = None,
        test_images: str | None = None,
        batch_size: int = 2,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        train_scales: Sequence[int] = DEFAULT_TRAIN_SCALES,
        max_size: int = DEFAULT_MAX_SIZE,
        test_scale: int = DEFAULT_TEST_SCALE,
        test_scales: list[int] | None = None,
        test_flip: bool = False,
        test_max_size: int | None = None,
        flip_prob: float = 0.5,
        train_augment: str = "multiscale",
        crop_prob: float = 0.5,
        crop_scales: Sequence[int] = (400, 500, 600),
        crop_max_size: int | None = DEFAULT_MAX_SIZE,
        crop_size_range: tuple[int, int] = (384, 600),
        lsj_size: int = 1024,
        lsj_scale_range: tuple[float, float] = (0.1, 2.0),
        group_by_aspect_ratio: bool = False,
        filter_empty: bool = False,
        min_box_size: float = 1.0,
        synthetic_if_missing: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.root = root
        self.explicit = {
            "train_ann": train_ann, "train_images": train_images, "val_ann": val_ann, "val_images": val_images,
        }
        if (test_ann is None) != (test_images is None):
            raise ValueError("give test_ann and test_images together, or neither")
        self.test_paths = (test_ann, test_images) if test_ann is not None else None
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.train_scales = tuple(int(s) for s in train_scales)
        self.max_size = max_size
        self.test_scale = test_scale
        self.test_scales = check_test_scales(test_scales, "COCODataModule: test_scales")
        if not isinstance(test_flip, bool):
            raise ValueError(f"COCODataModule: test_flip must be true or false, got {test_flip!r}")
        self.test_flip = test_flip
        check_int("test_max_size", test_max_size, optional=True)
        self.test_max_size = test_max_size
        self.flip_prob = flip_prob
        if train_augment not in _TRAIN_AUGMENTS:
            raise ValueError(f"train_augment must be one of {list(_TRAIN_AUGMENTS)}, got {train_augment!r}")
        self.train_augment = train_augment
        self.crop_prob = crop_prob
        self.crop_scales = tuple(int(s) for s in crop_scales)
        self.crop_max_size = crop_max_size
        self.crop_size_range = tuple(int(v) for v in crop_size_range)
        self.lsj_size = lsj_size
        self.lsj_scale_range = tuple(float(v) for v in lsj_scale_range)
        self.group_by_aspect_ratio = bool(group_by_aspect_ratio)
        self.filter_empty = bool(filter_empty)
        self.min_box_size = min_box_size
        self.synthetic_if_missing = synthetic_if_missing
        self.cache_dir = cache_dir
        self._paths: dict[str, tuple[Path, Path]] | None = None
        self._evaluation_only = _EVALUATION_ONLY.get()  # the training split need not exist
        self._categories: list[dict[str, Any]] | None = None
        self._categories_source: Path | None = None
        self.train_dataset: COCODetection | None = None
        self.val_dataset: COCODetection | None = None
        self.test_dataset: COCODetection | None = None
        # Validate the transform settings now, and the paths the user typed (cheap checks).
        self._train_transforms()
        detection_eval_transforms(test_scale, max_size)
        if root is not None or any(v is not None for v in self.explicit.values()):
            self._resolve_paths()

    @classmethod
    def for_evaluation(cls, **kwargs: Any) -> "COCODataModule":
        """A datamodule for ``validate`` / ``test`` only: the training annotation file and image
        folder need not exist (a machine that holds only ``val2017``), and without ``root`` only
        ``val_ann`` and ``val_images`` are needed. Takes the constructor's arguments."""
        token = _EVALUATION_ONLY.set(True)
        try:
            return cls(**kwargs)
        finally:
            _EVALUATION_ONLY.reset(token)

    # ----------------------------------------------------------------------------- paths
    @staticmethod
    def default_root() -> Path:
        """``$VTDENSE_DATA/coco`` if ``VTDENSE_DATA`` is set, else ``data/coco``."""
        env = os.environ.get("VTDENSE_DATA")
        return Path(env).expanduser() / "coco" if env else Path("data/coco")

    @classmethod
    def default_data_found(cls) -> bool:
        """Whether the default root holds a COCO dataset (used by recipes to pick their config)."""
        root = cls.default_root()
        return all((root / a).is_file() and (root / i).is_dir() for a, i in _SPLIT_FILES.values())

    def _resolve_paths(self) -> dict[str, tuple[Path, Path]]:
        """Decide the annotation file and image folder of each split (once)."""
        if self._paths is not None:
            return self._paths
        given = {k: v for k, v in self.explicit.items() if v is not None}
        if self.root is not None:
            root = Path(self.root).expanduser()
            if not root.is_dir():
                raise FileNotFoundError(f"COCO root not found: {root}")
            paths = {}
            for split, (ann_rel, img_rel) in _SPLIT_FILES.items():
                ann = Path(given.get(f"{split}_ann", root / ann_rel))
                img = Path(given.get(f"{split}_images", root / img_rel))
                paths[split] = (ann, img)
        elif given:
            needed = ["val_ann", "val_images"] if self._evaluation_only else list(self.explicit)
            absent = [k for k in needed if self.explicit[k] is None]
            if absent:
                raise ValueError(f"without root, give all of {', '.join(needed)}; missing: {absent}")
            paths = {s: (Path(given[f"{s}_ann"]), Path(given[f"{s}_images"]))
                     for s in _SPLIT_FILES if f"{s}_ann" in given and f"{s}_images" in given}
        else:
            default = self.default_root()
            paths = {s: (default / a, default / i) for s, (a, i) in _SPLIT_FILES.items()}
            val_found = (default / _SPLIT_FILES["val"][0]).is_file() and (default / _SPLIT_FILES["val"][1]).is_dir()
            if not (self.default_data_found() or self._evaluation_only and val_found):
                if not self.synthetic_if_missing:
                    raise FileNotFoundError(
                        f"no COCO dataset at {default.resolve()} (expected annotations/instances_train2017.json, "
                        "annotations/instances_val2017.json, train2017/, val2017/); set root= or $VTDENSE_DATA"
                    )
                logger.warning("No COCO dataset at %s; using synthetic shapes data instead", default.resolve())
                synth = synthetic_coco_root(self.cache_dir)
                paths = {s: (synth / a, synth / i) for s, (a, i) in _SPLIT_FILES.items()}
        if self.test_paths is not None:
            paths["test"] = (Path(self.test_paths[0]), Path(self.test_paths[1]))
        for split, (ann, img) in paths.items():
            if split == "train" and self._evaluation_only:
                continue
            if not ann.is_file():
                raise FileNotFoundError(f"COCO {split} annotation file not found: {ann}")
            if not img.is_dir():
                raise FileNotFoundError(f"COCO {split} image folder not found: {img}")
        self._paths = paths
        return paths

    @property
    def paths(self) -> dict[str, tuple[Path, Path]]:
        """``{split: (annotation_file, image_folder)}`` after resolution."""
        return self._resolve_paths()

    # ------------------------------------------------------------------------ categories
    @property
    def categories(self) -> list[dict[str, Any]]:
        """Category dicts sorted by id, read from the validation file (cheap; before setup)."""
        if self._categories is None:
            self._categories_source = self._resolve_paths()["val"][0]
            self._categories = read_coco_categories(self._categories_source)
        return self._categories

    @property
    def num_classes(self) -> int:
        """Number of object classes (background excluded)."""
        return len(self.categories)

    @property
    def label_to_category_id(self) -> dict[int, int]:
        """``{label: COCO category id}`` for labels ``1..num_classes``."""
        return category_tables(self.categories).label_to_category_id

    @property
    def category_names(self) -> list[str]:
        """Class names indexed by label; entry 0 is ``"__background__"``."""
        return category_tables(self.categories).category_names

    # ------------------------------------------------------------------------- lightning
    def prepare_data(self) -> None:
        """Resolve paths (generating the synthetic dataset if it is needed and absent)."""
        self._resolve_paths()

    def _train_transforms(self) -> Any:
        """The training transforms selected by ``train_augment`` (validates their options)."""
        if self.train_augment == "lsj":
            return detection_lsj_transforms(self.lsj_size, self.lsj_scale_range, self.flip_prob)
        if self.train_augment == "multiscale_crop":
            return detection_crop_transforms(
                self.train_scales, self.max_size, self.flip_prob, self.crop_prob, self.crop_scales,
                self.crop_max_size, self.crop_size_range,
            )
        return detection_train_transforms(self.train_scales, self.max_size, self.flip_prob)

    def _make(self, split: str, train: bool) -> COCODetection:
        """Build one split's dataset and check its categories against the others."""
        ann, img = self._resolve_paths()[split]
        if train:
            transforms = self._train_transforms()
        else:
            transforms = DetectionEvalViews(self.test_scale, self.max_size, self.test_scales, self.test_flip, self.test_max_size)
        ds = COCODetection(img, ann, transforms, train=train, min_box_size=self.min_box_size,
                           max_decode_side=max(DEFAULT_MAX_DECODE_SIDE, int(self.max_size)),
                           filter_empty=train and self.filter_empty)
        if self._categories is None:
            self._categories, self._categories_source = ds.categories, ann
        ref_ids = [c["id"] for c in self._categories]
        if [c["id"] for c in ds.categories] != ref_ids:
            raise COCODatasetError(
                f"{ann} has category ids {[c['id'] for c in ds.categories]} but {self._categories_source} "
                f"has {ref_ids}; all splits must share one category list"
            )
        return ds

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets a stage needs (``fit``, ``validate``, ``test``, ``predict``)."""
        destroy_process_group_at_exit()  # a clean exit under gloo (see vtdense.distributed)
        if stage in (None, "fit", "validate", "predict") and self.val_dataset is None:
            self.val_dataset = self._make("val", train=False)
        if stage in (None, "fit") and self.train_dataset is None:
            self.train_dataset = self._make("train", train=True)
        if stage in (None, "test") and self.test_dataset is None:
            if self.test_paths is None:
                self.test_dataset = self.val_dataset if self.val_dataset is not None else self._make("val", False)
            else:
                self.test_dataset = self._make("test", train=False)

    def _loader(self, dataset: COCODetection | None, shuffle: bool, name: str) -> DataLoader:
        """A DataLoader with the detection collate function."""
        if dataset is None:
            raise RuntimeError(f"call setup() before {name}_dataloader()")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
            collate_fn=collate_detection,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, resumable training batches (aspect-ratio grouped if ``group_by_aspect_ratio``)."""
        dataset = self.train_dataset
        if dataset is None:
            raise RuntimeError("call setup() before train_dataloader()")
        group_ids = None
        if self.group_by_aspect_ratio:
            imgs = dataset.coco.imgs  # sizes from the annotation file; no image is opened
            group_ids = aspect_ratio_group_ids([(int(imgs[i]["height"]), int(imgs[i]["width"])) for i in dataset.ids])
        return make_train_loader(
            dataset,
            self.batch_size,
            collate_fn=collate_detection,
            group_ids=group_ids,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches (with ``orig_*`` ground truth)."""
        return self._loader(self.val_dataset, False, "val")

    def test_dataloader(self) -> DataLoader:
        """Test batches (the validation split unless test paths were given)."""
        return self._loader(self.test_dataset, False, "test")

    def predict_dataloader(self) -> DataLoader:
        """Prediction batches over the validation split."""
        return self._loader(self.val_dataset, False, "predict")
