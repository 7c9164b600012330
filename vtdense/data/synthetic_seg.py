"""Synthetic semantic-segmentation data in the ADEChallengeData2016 folder layout.

Images are textured "stuff" regions (sky-, grass-, wall-like bands) with textured shapes on
top and a few unlabelled clutter blobs. Label maps follow ADE20K: ``0`` is "unlabelled"
(ignored with ``reduce_zero_label``) and ``1..num_classes`` are the classes, so the generated
set exercises the same code path as the real one. Used by the CPU demo and the tests.

Layout written under ``root``::

    images/training/*.jpg       annotations/training/*.png
    images/validation/*.jpg     annotations/validation/*.png
    classes.txt                 one class name per line (after reduce_zero_label)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["SYNTHETIC_CLASSES", "generate_synthetic_segmentation"]

#: Class names of the synthetic set, index = label after ``reduce_zero_label``.
SYNTHETIC_CLASSES: tuple[str, ...] = (
    "sky",
    "grass",
    "wall",
    "disc",
    "box",
    "triangle",
    "ring",
    "bar",
)

# (base RGB, texture kind) per class; texture kinds: 0 smooth, 1 h-stripes, 2 diagonal, 3 checker, 4 dots.
_STYLE: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((110, 160, 230), 0),
    ((60, 150, 50), 1),
    ((170, 150, 120), 3),
    ((220, 60, 50), 0),
    ((240, 200, 40), 2),
    ((150, 60, 190), 4),
    ((40, 200, 200), 0),
    ((240, 120, 30), 1),
)
_N_STUFF = 3


def _texture(kind: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    period = rng.uniform(5, 9)
    phase = rng.uniform(0, 2 * np.pi)
    if kind == 1:
        t = np.sin(yy * 2 * np.pi / period + phase)
    elif kind == 2:
        t = np.sin((xx + yy) * 2 * np.pi / period + phase)
    elif kind == 3:
        t = ((np.floor(xx / period) + np.floor(yy / period)) % 2) * 2 - 1
    elif kind == 4:
        t = (np.sin(xx * 2 * np.pi / period + phase) * np.sin(yy * 2 * np.pi / period)) > 0.5
        t = t.astype(np.float32) * 2 - 1
    else:
        t = np.zeros((h, w), np.float32)
    return t * 30.0


def _paint(img: np.ndarray, mask: np.ndarray, cls: int, rng: np.random.Generator) -> None:
    h, w = mask.shape
    color, kind = _STYLE[cls]
    base = np.array(color, np.float32) + rng.uniform(-25, 25, 3)
    tex = _texture(kind, h, w, rng)[..., None] + rng.normal(0, 12, (h, w, 1))
    layer = base[None, None, :] + tex
    img[mask] = layer[mask]


def _shape_mask(kind: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx = rng.uniform(0.15, 0.85) * h, rng.uniform(0.15, 0.85) * w
    r = rng.uniform(0.08, 0.2) * min(h, w)
    if kind == 3:  # disc
        return (yy - cy) ** 2 + (xx - cx) ** 2 <= r**2
    if kind == 4:  # box
        a, b = r * rng.uniform(0.7, 1.4), r * rng.uniform(0.7, 1.4)
        return (np.abs(yy - cy) <= a) & (np.abs(xx - cx) <= b)
    if kind == 5:  # triangle, apex up
        top = cy - r
        rel = (yy - top) / (2 * r)
        return (rel >= 0) & (rel <= 1) & (np.abs(xx - cx) <= rel * r * 1.2)
    if kind == 6:  # ring
        d2 = (yy - cy) ** 2 + (xx - cx) ** 2
        return (d2 <= r**2) & (d2 >= (0.55 * r) ** 2)
    # bar: long thin rectangle, horizontal or vertical
    long, short = r * rng.uniform(1.5, 2.5), r * rng.uniform(0.25, 0.4)
    if rng.random() < 0.5:
        long, short = short, long
    return (np.abs(yy - cy) <= long) & (np.abs(xx - cx) <= short)


def _sample(h: int, w: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One image (uint8 HxWx3) and its raw label map (uint8 HxW, 0 = unlabelled, k = class k-1)."""
    img = np.zeros((h, w, 3), np.float32)
    label = np.zeros((h, w), np.uint8)
    # stuff: 2-3 horizontal bands with wavy borders
    n_bands = int(rng.integers(2, 4))
    classes = rng.permutation(_N_STUFF)[:n_bands]
    cuts = np.sort(rng.uniform(0.2, 0.8, n_bands - 1)) * h
    xx = np.arange(w, dtype=np.float32)
    yy = np.arange(h, dtype=np.float32)[:, None]
    band = np.zeros((h, w), np.int64)
    for cut in cuts:
        wave = cut + rng.uniform(2, 0.08 * h) * np.sin(xx * 2 * np.pi / rng.uniform(30, 90) + rng.uniform(0, 6.3))
        band += yy > wave[None, :]
    for i, cls in enumerate(classes):
        m = band == i
        _paint(img, m, int(cls), rng)
        label[m] = cls + 1
    # things: 2-5 shapes
    for _ in range(int(rng.integers(2, 6))):
        cls = int(rng.integers(_N_STUFF, len(_STYLE)))
        m = _shape_mask(cls, h, w, rng)
        _paint(img, m, cls, rng)
        label[m] = cls + 1
    # unlabelled clutter: 1-2 grey noisy blobs with label 0
    for _ in range(int(rng.integers(1, 3))):
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        r = rng.uniform(0.04, 0.1) * min(h, w)
        m = (yy - cy) ** 2 + (xx[None, :] - cx) ** 2 <= r**2
        img[m] = rng.uniform(60, 200) + rng.normal(0, 40, (int(m.sum()), 1))
        label[m] = 0
    return np.clip(img, 0, 255).astype(np.uint8), label


def generate_synthetic_segmentation(
    root: str | Path,
    *,
    num_train: int = 96,
    num_val: int = 24,
    size_range: tuple[int, int] = (160, 256),
    seed: int = 0,
) -> Path:
    """Write a synthetic ADE20K-layout dataset to ``root`` atomically.

    The set is written to a temporary sibling folder and renamed into place, so a reader
    never sees half a dataset; if ``root`` already exists it is left as it is.

    Args:
        root: destination folder (created; its parent too).
        num_train: training images.
        num_val: validation images.
        size_range: min and max of image height and width in pixels (drawn per image).
        seed: random seed; the same arguments give the same files.

    Returns:
        ``root`` as a :class:`~pathlib.Path`.
    """
    root = Path(root)
    if root.exists():
        return root
    lo, hi = size_range
    if not 16 <= lo <= hi:
        raise ValueError(f"size_range must satisfy 16 <= min <= max, got {size_range}")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        rng = np.random.default_rng(seed)
        for split, n in (("training", num_train), ("validation", num_val)):
            (tmp / "images" / split).mkdir(parents=True)
            (tmp / "annotations" / split).mkdir(parents=True)
            for i in range(n):
                h, w = (int(v) for v in rng.integers(lo, hi + 1, 2))
                img, label = _sample(h, w, rng)
                stem = f"ADE_{split[:5]}_{i:08d}"
                Image.fromarray(img).save(tmp / "images" / split / f"{stem}.jpg", quality=95)
                Image.fromarray(label, mode="L").save(tmp / "annotations" / split / f"{stem}.png")
        (tmp / "classes.txt").write_text("\n".join(SYNTHETIC_CLASSES) + "\n")
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.exists():  # pragma: no cover - rename failed for another reason
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root
