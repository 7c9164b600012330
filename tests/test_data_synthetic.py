"""Tests for the synthetic COCO generator and its cache helper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as mask_utils

from vtdense.data import synthetic
from vtdense.data.synthetic import (
    SHAPE_CLASSES,
    default_cache_dir,
    is_coco_root,
    make_synthetic_coco,
    synthetic_coco_root,
    uncompressed_rle,
)


def _box_iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    return ix * iy / (a[2] * a[3] + b[2] * b[3] - ix * iy)


def test_layout_and_annotation_fields(coco_root: Path, load_ann: Callable[..., dict]) -> None:
    assert is_coco_root(coco_root)
    for split, count in (("train2017", 12), ("val2017", 6)):
        ann = load_ann(split)
        assert len(ann["images"]) == count
        assert [c["id"] for c in ann["categories"]] == [1, 3, 7]
        assert [c["name"] for c in ann["categories"]] == [c[1] for c in SHAPE_CLASSES[:3]]
        ids = [a["id"] for a in ann["annotations"]]
        assert len(set(ids)) == len(ids)
        images = {img["id"]: img for img in ann["images"]}
        for img in ann["images"]:
            with Image.open(coco_root / split / img["file_name"]) as im:
                assert (im.height, im.width) == (img["height"], img["width"])
                assert im.format == ("JPEG" if img["file_name"].endswith(".jpg") else "PNG")
                assert 96 <= im.height <= 128 and 96 <= im.width <= 128
        for a in ann["annotations"]:
            img = images[a["image_id"]]
            x, y, w, h = a["bbox"]
            assert a["category_id"] in (1, 3, 7) and w > 1 and h > 1 and a["area"] > 0
            assert 0 <= x and 0 <= y and x + w <= img["width"] + 0.01 and y + h <= img["height"] + 0.01
            if a["iscrowd"] == 0:
                (poly,) = a["segmentation"]
                pts = np.asarray(poly).reshape(-1, 2)
                assert len(pts) >= 3
                assert pts[:, 0].min() >= 0 and pts[:, 0].max() <= img["width"] + 1e-6  # clipped to the image
                assert pts[:, 1].min() >= 0 and pts[:, 1].max() <= img["height"] + 1e-6
                np.testing.assert_allclose([pts[:, 0].min(), pts[:, 1].min()], [x, y], atol=0.02)
                np.testing.assert_allclose([pts[:, 0].max(), pts[:, 1].max()], [x + w, y + h], atol=0.02)


def test_default_dataset_has_empty_cut_and_overlapping_objects(tmp_path: Path) -> None:
    root = make_synthetic_coco(tmp_path / "d", num_train=40, num_val=4, num_classes=5)
    ann = json.loads((root / "annotations" / "instances_train2017.json").read_text())
    images = {img["id"]: img for img in ann["images"]}
    assert all(128 <= img["height"] <= 192 and 128 <= img["width"] <= 192 for img in ann["images"])
    assert {a["category_id"] for a in ann["annotations"]} == {1, 3, 7, 12, 18}
    per_image: dict[int, list[dict[str, Any]]] = {i: [] for i in images}
    for a in ann["annotations"]:
        per_image[a["image_id"]].append(a)
    assert sum(1 for anns in per_image.values() if not anns) >= 1
    cut = [a for a in ann["annotations"] if a["bbox"][0] == 0 or a["bbox"][1] == 0
           or abs(a["bbox"][0] + a["bbox"][2] - images[a["image_id"]]["width"]) < 0.01]
    assert len(cut) >= 5
    overlapping = [(a, b) for anns in per_image.values() for i, a in enumerate(anns) for b in anns[i + 1:]
                   if _box_iou(a["bbox"], b["bbox"]) > 0]
    assert overlapping
    assert not any(a["iscrowd"] for a in ann["annotations"])  # extras are opt-in


def test_class_colour_is_visible_inside_its_shape(tmp_path: Path) -> None:
    root = make_synthetic_coco(tmp_path / "d", num_train=6, num_val=1, num_classes=6, max_objects=1,
                               empty_fraction=0.0, seed=3)
    ann = json.loads((root / "annotations" / "instances_train2017.json").read_text())
    colours = {c[0]: np.array(c[3]) for c in SHAPE_CLASSES}
    for a in ann["annotations"]:
        img = next(i for i in ann["images"] if i["id"] == a["image_id"])
        pixels = np.asarray(Image.open(root / "train2017" / img["file_name"]).convert("RGB"), dtype=np.float32)
        rle = mask_utils.frPyObjects(a["segmentation"], img["height"], img["width"])
        mask = mask_utils.decode(mask_utils.merge(rle)).astype(bool)
        mean = pixels[mask].mean(axis=0)
        assert np.abs(mean - colours[a["category_id"]]).max() < 45, (a["category_id"], mean)


def test_deterministic_given_seed(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"num_train": 3, "num_val": 2, "size_range": (64, 80), "with_crowd": True}
    a = make_synthetic_coco(tmp_path / "a", seed=5, **opts)
    b = make_synthetic_coco(tmp_path / "b", seed=5, **opts)
    c = make_synthetic_coco(tmp_path / "c", seed=6, **opts)
    for split in ("train2017", "val2017"):
        name = f"annotations/instances_{split}.json"
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()
        for f in sorted((a / split).iterdir()):
            assert f.read_bytes() == (b / split / f.name).read_bytes()


def test_crowd_annotations_use_rle(coco_root: Path, load_ann: Callable[..., dict]) -> None:
    for split in ("train2017", "val2017"):
        ann = load_ann(split)
        crowds = [a for a in ann["annotations"] if a["iscrowd"]]
        assert len(crowds) == 2
        kinds = []
        for a in crowds:
            img = next(i for i in ann["images"] if i["id"] == a["image_id"])
            seg = a["segmentation"]
            assert seg["size"] == [img["height"], img["width"]]
            kinds.append(type(seg["counts"]))
            rle = mask_utils.frPyObjects(seg, *seg["size"]) if isinstance(seg["counts"], list) else seg
            mask = mask_utils.decode(rle)
            assert int(mask.sum()) == a["area"] > 0
            ys, xs = np.nonzero(mask)
            assert a["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
        assert kinds == [list, str]


@pytest.mark.parametrize("first", [0, 1])
def test_uncompressed_rle_round_trips(first: int) -> None:
    rng = np.random.default_rng(first)
    mask = (rng.random((7, 5)) > 0.5).astype(np.uint8)
    mask[0, 0] = first
    rle = uncompressed_rle(mask)
    assert sum(rle["counts"]) == mask.size and rle["size"] == [7, 5]
    assert (rle["counts"][0] == 0) == bool(first)
    decoded = mask_utils.decode(mask_utils.frPyObjects(rle, 7, 5))
    np.testing.assert_array_equal(decoded, mask)
    assert mask_utils.frPyObjects(rle, 7, 5)["counts"] == mask_utils.encode(np.asfortranarray(mask))["counts"]


def test_special_image_modes(coco_root: Path, load_ann: Callable[..., dict]) -> None:
    for split in ("train2017", "val2017"):
        ann = load_ann(split)
        modes = []
        for img in ann["images"][:5]:
            with Image.open(coco_root / split / img["file_name"]) as im:
                modes.append(im.mode)
        assert modes == ["RGB", "L", "RGBA", "P", "RGB"]


def test_fixed_image_size_and_argument_checks(tmp_path: Path) -> None:
    root = make_synthetic_coco(tmp_path / "fixed", num_train=2, num_val=1, image_size=(40, 70))
    ann = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    assert [(i["height"], i["width"]) for i in ann["images"]] == [(40, 70)]
    with pytest.raises(ValueError, match="num_classes"):
        make_synthetic_coco(tmp_path / "x", num_classes=7)
    with pytest.raises(ValueError, match="image sides"):
        make_synthetic_coco(tmp_path / "x", size_range=(100, 50))
    with pytest.raises(ValueError, match="empty_fraction"):
        make_synthetic_coco(tmp_path / "x", empty_fraction=1.5)
    assert not (tmp_path / "x").exists()


def test_existing_root_is_protected_and_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opts: dict[str, Any] = {"num_train": 2, "num_val": 1, "size_range": (32, 40)}
    root = make_synthetic_coco(tmp_path / "d", **opts)
    with pytest.raises(FileExistsError, match=str(root)):
        make_synthetic_coco(root, **opts)
    make_synthetic_coco(root, overwrite=True, seed=1, **opts)
    assert is_coco_root(root)

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(synthetic, "_write_split", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        make_synthetic_coco(tmp_path / "e", **opts)
    with pytest.raises(RuntimeError, match="disk full"):
        make_synthetic_coco(root, overwrite=True, **opts)
    assert not (tmp_path / "e").exists() and is_coco_root(root)  # old copy untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary folders left


def test_cache_dir_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VTDENSE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "vtdense"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "vtdense"
    monkeypatch.setenv("VTDENSE_CACHE", str(tmp_path / "vt"))
    assert default_cache_dir() == tmp_path / "vt"


def test_synthetic_coco_root_generates_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    real = synthetic.make_synthetic_coco

    def small(root: Path, **kwargs: Any) -> Path:  # keep the test fast: shrink the default dataset
        calls.append(Path(root))
        return real(root, num_train=3, num_val=2, size_range=(48, 64), overwrite=kwargs.get("overwrite", False))

    monkeypatch.setattr(synthetic, "make_synthetic_coco", small)
    monkeypatch.setenv("VTDENSE_CACHE", str(tmp_path / "cache"))
    first = synthetic_coco_root()
    assert first == tmp_path / "cache" / "synthetic_coco_v1" and is_coco_root(first)
    stamp = (first / "annotations" / "instances_train2017.json").stat().st_mtime_ns
    assert synthetic_coco_root() == first and len(calls) == 1  # reused, not regenerated
    assert (first / "annotations" / "instances_train2017.json").stat().st_mtime_ns == stamp
    explicit = synthetic_coco_root(tmp_path / "other")
    assert explicit == tmp_path / "other" / "synthetic_coco_v1" and len(calls) == 2
