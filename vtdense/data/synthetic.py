"""Small synthetic COCO-format detection datasets for demos and tests.

The generator draws coloured shapes (one shape and colour per class, so a detector can
really learn them) on a smooth, noisy background and writes the standard COCO layout::

    root/annotations/instances_train2017.json
    root/annotations/instances_val2017.json
    root/train2017/*.jpg
    root/val2017/*.jpg

Annotations carry polygon ``segmentation`` (clipped to the image), ``bbox`` ``[x, y, w, h]``,
``area`` and ``iscrowd``. Category ids are deliberately non-contiguous (1, 3, 7, ...), some
images are empty, some objects overlap and some are cut by the image border. Optional extras
for tests: crowd annotations with RLE masks, and grayscale, RGBA and palette images.

Everything is deterministic given ``seed`` and is written atomically: to a temporary sibling
folder first, then renamed into place, so a reader never sees a half-written dataset.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils

__all__ = [
    "SHAPE_CLASSES",
    "SYNTHETIC_COCO_VERSION",
    "default_cache_dir",
    "is_coco_root",
    "make_synthetic_coco",
    "synthetic_coco_root",
    "uncompressed_rle",
]

logger = logging.getLogger(__name__)

#: Bumped whenever the generator's output changes, so stale caches are not reused.
SYNTHETIC_COCO_VERSION: int = 1

#: ``(category_id, name, shape, rgb)`` for every class the generator can draw.
SHAPE_CLASSES: tuple[tuple[int, str, str, tuple[int, int, int]], ...] = (
    (1, "red_square", "square", (220, 30, 30)),
    (3, "green_circle", "circle", (30, 200, 40)),
    (7, "blue_triangle", "triangle", (40, 60, 230)),
    (12, "yellow_hexagon", "hexagon", (235, 215, 30)),
    (18, "magenta_ellipse", "ellipse", (215, 40, 210)),
    (25, "cyan_star", "star", (30, 215, 225)),
)

_SPLITS: tuple[str, ...] = ("train2017", "val2017")
_IMAGE_ID_BASE: dict[str, int] = {"train2017": 1, "val2017": 500_001}


def is_coco_root(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds the standard COCO 2017 detection layout.

    Args:
        root: Candidate dataset folder.

    Returns:
        True when both instance annotation files and both image folders exist.
    """
    path = Path(root)
    return all((path / "annotations" / f"instances_{split}.json").is_file() for split in _SPLITS) and all(
        (path / split).is_dir() for split in _SPLITS
    )


def uncompressed_rle(mask: np.ndarray) -> dict[str, Any]:
    """Encode a binary mask as COCO uncompressed RLE (``counts`` is a list of run lengths).

    Runs are taken in column-major order and start with a (possibly empty) run of zeros, which
    is the layout ``pycocotools.mask.frPyObjects`` expects.

    Args:
        mask: ``[H, W]`` array, non-zero where the object is.

    Returns:
        ``{"size": [H, W], "counts": [int, ...]}``.
    """
    h, w = mask.shape
    flat = (np.asarray(mask).reshape(-1, order="F") != 0).astype(np.int8)
    if flat.size == 0:
        return {"size": [int(h), int(w)], "counts": []}
    changes = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate(([0], changes, [flat.size]))
    runs = np.diff(bounds).tolist()
    if flat[0] == 1:
        runs = [0, *runs]
    return {"size": [int(h), int(w)], "counts": [int(r) for r in runs]}


def _unit_shape(shape: str) -> np.ndarray:
    """Vertices of a shape of radius 1 centred on the origin, ``[K, 2]``."""
    if shape == "square":
        return np.array([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]])
    if shape in ("circle", "ellipse"):
        t = np.linspace(0.0, 2.0 * math.pi, 32, endpoint=False)
        sy = 0.4 if shape == "ellipse" else 1.0
        return np.stack([np.cos(t), sy * np.sin(t)], axis=1)
    if shape == "triangle":
        t = np.array([-90.0, 30.0, 150.0]) * math.pi / 180.0
        return np.stack([np.cos(t), np.sin(t)], axis=1)
    if shape == "hexagon":
        t = np.arange(6) * math.pi / 3.0
        return np.stack([np.cos(t), np.sin(t)], axis=1)
    if shape == "star":
        t = np.arange(10) * math.pi / 5.0 - math.pi / 2.0
        r = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
        return np.stack([r * np.cos(t), r * np.sin(t)], axis=1)
    raise ValueError(f"unknown synthetic shape {shape!r}")


def _clip_polygon(points: np.ndarray, width: float, height: float) -> np.ndarray:
    """Clip a polygon to the rectangle ``[0, width] x [0, height]`` (Sutherland-Hodgman)."""
    poly = [tuple(p) for p in points.tolist()]
    # Each edge: (axis, limit, keep_if_less_equal)
    for axis, limit, keep_le in ((0, 0.0, False), (0, width, True), (1, 0.0, False), (1, height, True)):
        if not poly:
            break

        def inside(p: tuple[float, float]) -> bool:
            return p[axis] <= limit if keep_le else p[axis] >= limit

        def cross(p: tuple[float, float], q: tuple[float, float]) -> tuple[float, float]:
            t = (limit - p[axis]) / (q[axis] - p[axis])
            x = p[0] + t * (q[0] - p[0])
            y = p[1] + t * (q[1] - p[1])
            return (limit, y) if axis == 0 else (x, limit)

        out: list[tuple[float, float]] = []
        for i, cur in enumerate(poly):
            prev = poly[i - 1]
            if inside(cur):
                if not inside(prev):
                    out.append(cross(prev, cur))
                out.append(cur)
            elif inside(prev):
                out.append(cross(prev, cur))
        poly = out
    return np.asarray(poly, dtype=np.float64).reshape(-1, 2)


def _polygon_area(points: np.ndarray) -> float:
    """Shoelace area of a simple polygon."""
    if len(points) < 3:
        return 0.0
    x, y = points[:, 0], points[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2.0)


def _box_iou(a: list[float], b: list[float]) -> float:
    """IoU of two ``[x, y, w, h]`` boxes."""
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union > 0 else 0.0


def _background(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    """A smooth, muted colour field with pixel noise."""
    coarse = rng.uniform(60, 170, size=(4, 4, 3)).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR), dtype=np.float32)
    noisy = smooth + rng.normal(0.0, 12.0, size=smooth.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Colour with a little per-object variation."""
    r, g, b = (int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in rgb)
    return (r, g, b)


def _place_shape(
    rng: np.random.Generator, shape: str, height: int, width: int, radius_frac: tuple[float, float]
) -> np.ndarray:
    """Random polygon of ``shape`` somewhere around the image (possibly past the border)."""
    radius = rng.uniform(*radius_frac) * min(height, width)
    cx = rng.uniform(-0.4 * radius, width + 0.4 * radius)
    cy = rng.uniform(-0.4 * radius, height + 0.4 * radius)
    angle = rng.uniform(0.0, 2.0 * math.pi) if shape not in ("circle",) else 0.0
    rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    return _unit_shape(shape) @ rot.T * radius + np.array([cx, cy])


def _write_split(
    out_dir: Path,
    split: str,
    num_images: int,
    classes: tuple[tuple[int, str, str, tuple[int, int, int]], ...],
    rng: np.random.Generator,
    image_size: tuple[int, int] | None,
    size_range: tuple[int, int],
    max_objects: int,
    empty_fraction: float,
    with_crowd: bool,
    special_modes: list[str],
    ann_id_start: int,
) -> tuple[dict[str, Any], int]:
    """Draw and save one split's images; return its COCO dict and the next free annotation id."""
    image_dir = out_dir / split
    image_dir.mkdir(parents=True)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    ann_id = ann_id_start
    for index in range(num_images):
        if image_size is not None:
            height, width = image_size
        else:
            height = int(rng.integers(size_range[0], size_range[1] + 1))
            width = int(rng.integers(size_range[0], size_range[1] + 1))
        image_id = _IMAGE_ID_BASE[split] + index
        img = _background(rng, height, width)
        draw = ImageDraw.Draw(img)
        forced_empty = empty_fraction > 0 and index == num_images - 1 and num_images > 1
        empty = forced_empty or rng.random() < empty_fraction
        n_objects = 0 if empty else int(rng.integers(1, max_objects + 1))
        boxes: list[list[float]] = []
        for _ in range(n_objects):
            cat_id, _name, shape, rgb = classes[int(rng.integers(len(classes)))]
            for _attempt in range(20):
                poly = _place_shape(rng, shape, height, width, (0.08, 0.25))
                clipped = _clip_polygon(poly, float(width), float(height))
                area = _polygon_area(clipped)
                if area < 20.0:
                    continue
                x0, y0 = clipped.min(axis=0)
                x1, y1 = clipped.max(axis=0)
                box = [float(x0), float(y0), float(x1 - x0), float(y1 - y0)]
                if box[2] < 3.0 or box[3] < 3.0 or any(_box_iou(box, b) > 0.4 for b in boxes):
                    continue
                boxes.append(box)
                draw.polygon([tuple(p) for p in poly.tolist()], fill=_jitter(rng, rgb))
                annotations.append(
                    {
                        "id": ann_id,
                        "image_id": image_id,
                        "category_id": cat_id,
                        "segmentation": [[round(float(v), 2) for v in clipped.reshape(-1)]],
                        "bbox": [round(v, 2) for v in box],
                        "area": round(area, 2),
                        "iscrowd": 0,
                    }
                )
                ann_id += 1
                break
        if with_crowd and index < 2:
            # A cluster of small same-class shapes annotated as one crowd region.
            cat_id, _name, shape, rgb = classes[int(rng.integers(len(classes)))]
            crowd = Image.new("L", (width, height), 0)
            crowd_draw = ImageDraw.Draw(crowd)
            cx, cy = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
            for _ in range(int(rng.integers(5, 9))):
                radius = rng.uniform(0.03, 0.06) * min(height, width)
                centre = np.array([cx, cy]) + rng.normal(0.0, 0.08 * min(height, width), size=2)
                pts = [tuple(p) for p in (_unit_shape(shape) * radius + centre).tolist()]
                draw.polygon(pts, fill=_jitter(rng, rgb))
                crowd_draw.polygon(pts, fill=1)
            crowd_mask = np.asarray(crowd, dtype=np.uint8)
            if crowd_mask.any():
                ys, xs = np.nonzero(crowd_mask)
                if index == 0:
                    segmentation = uncompressed_rle(crowd_mask)
                else:
                    rle = mask_utils.encode(np.asfortranarray(crowd_mask))
                    segmentation = {"size": [height, width], "counts": rle["counts"].decode("ascii")}
                annotations.append(
                    {
                        "id": ann_id,
                        "image_id": image_id,
                        "category_id": cat_id,
                        "segmentation": segmentation,
                        "bbox": [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1),
                                 float(ys.max() - ys.min() + 1)],
                        "area": float(crowd_mask.sum()),
                        "iscrowd": 1,
                    }
                )
                ann_id += 1
        mode = special_modes[index - 1] if 1 <= index <= len(special_modes) else "RGB"
        if mode == "RGB":
            file_name = f"{image_id:012d}.jpg"
            img.save(image_dir / file_name, quality=90)
        elif mode == "L":
            file_name = f"{image_id:012d}.jpg"
            img.convert("L").save(image_dir / file_name, quality=90)
        else:
            file_name = f"{image_id:012d}.png"
            converted = img.convert("RGBA") if mode == "RGBA" else img.convert("P", palette=Image.ADAPTIVE)
            converted.save(image_dir / file_name)
        images.append({"id": image_id, "file_name": file_name, "height": height, "width": width})
    categories = [{"id": c[0], "name": c[1], "supercategory": "shape"} for c in classes]
    coco = {
        "info": {"description": "vtdense synthetic shapes", "version": str(SYNTHETIC_COCO_VERSION)},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }
    return coco, ann_id


def make_synthetic_coco(
    root: str | os.PathLike[str],
    *,
    num_train: int = 300,
    num_val: int = 60,
    image_size: tuple[int, int] | None = None,
    size_range: tuple[int, int] = (128, 192),
    num_classes: int = 4,
    max_objects: int = 5,
    empty_fraction: float = 0.1,
    with_crowd: bool = False,
    with_gray: bool = False,
    with_rgba: bool = False,
    with_palette: bool = False,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic COCO-format detection dataset of coloured shapes.

    Args:
        root: Destination folder. It must not exist yet (or be empty) unless ``overwrite``.
        num_train: Number of training images.
        num_val: Number of validation images.
        image_size: Fixed ``(height, width)`` for every image; ``None`` draws each side from
            ``size_range``.
        size_range: Inclusive ``(low, high)`` range for each side when ``image_size`` is None.
        num_classes: How many classes of :data:`SHAPE_CLASSES` to use (1 to 6).
        max_objects: Maximum number of (non-crowd) objects per image.
        empty_fraction: Probability that an image has no objects. When positive, the last image
            of each split is always empty.
        with_crowd: Add an ``iscrowd=1`` annotation to images 0 (uncompressed RLE, ``counts``
            a list) and 1 (compressed RLE, ``counts`` a string) of each split.
        with_gray: Save image 1 of each split as a grayscale JPEG.
        with_rgba: Save the next special image as an RGBA PNG.
        with_palette: Save the next special image as a palette (``P`` mode) PNG.
        seed: Random seed; the output is a deterministic function of all arguments.
        overwrite: Replace an existing, non-empty ``root``.

    Returns:
        The dataset root.

    Raises:
        ValueError: If an argument is out of range.
        FileExistsError: If ``root`` exists, is not empty, and ``overwrite`` is False.
    """
    if not 1 <= num_classes <= len(SHAPE_CLASSES):
        raise ValueError(f"num_classes must be in 1..{len(SHAPE_CLASSES)}, got {num_classes}")
    if num_train < 0 or num_val < 0:
        raise ValueError(f"num_train and num_val must be >= 0, got {num_train} and {num_val}")
    if max_objects < 1:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    if not 0.0 <= empty_fraction <= 1.0:
        raise ValueError(f"empty_fraction must be in [0, 1], got {empty_fraction}")
    sizes = [image_size] if image_size is not None else [size_range]
    if any(len(s) != 2 or min(s) < 16 for s in sizes) or (image_size is None and size_range[0] > size_range[1]):
        raise ValueError(f"image sides must be >= 16 and ranges ordered, got image_size={image_size}, "
                         f"size_range={size_range}")
    root = Path(root).expanduser()
    if root.exists() and any(root.iterdir()) and not overwrite:
        raise FileExistsError(f"{root} exists and is not empty; pass overwrite=True to replace it")

    classes = SHAPE_CLASSES[:num_classes]
    special_modes = [m for m, on in (("L", with_gray), ("RGBA", with_rgba), ("P", with_palette)) if on]
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "annotations").mkdir()
        ann_id = 1
        for split_index, (split, count) in enumerate(zip(_SPLITS, (num_train, num_val))):
            rng = np.random.default_rng([seed, split_index])
            coco, ann_id = _write_split(
                tmp, split, count, classes, rng, image_size, size_range, max_objects, empty_fraction,
                with_crowd, special_modes, ann_id,
            )
            with open(tmp / "annotations" / f"instances_{split}.json", "w", encoding="utf-8") as f:
                json.dump(coco, f)
        if root.exists() and any(root.iterdir()):
            old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(root, old)
            os.rename(tmp, root)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, root)  # atomic; replaces an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def default_cache_dir() -> Path:
    """The vtdense cache folder.

    ``$VTDENSE_CACHE`` if set, else ``$XDG_CACHE_HOME/vtdense``, else ``~/.cache/vtdense``.

    Returns:
        The cache folder (not created).
    """
    if os.environ.get("VTDENSE_CACHE"):
        return Path(os.environ["VTDENSE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vtdense"


def synthetic_coco_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached default synthetic COCO dataset, generating it on first use.

    The dataset (300 train / 60 val images, 128-192 px, 4 classes, seed 0) lives in
    ``<cache_dir>/synthetic_coco_v1``. Generation is atomic, so concurrent callers (several
    ranks, several test processes) either reuse a finished copy or race harmlessly.

    Args:
        cache_dir: Cache folder; defaults to :func:`default_cache_dir`.

    Returns:
        The dataset root.
    """
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = base / f"synthetic_coco_v{SYNTHETIC_COCO_VERSION}"
    if is_coco_root(root):
        return root
    logger.info("Generating the synthetic COCO dataset in %s", root)
    try:
        make_synthetic_coco(root, overwrite=root.exists())
    except OSError:
        # Another process may have finished first; its copy is as good as ours.
        if not is_coco_root(root):
            raise
    return root
