"""Tests for the COCO detection dataset, transforms and datamodule."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors

from vtdense.data import COCODataModule, COCODatasetError, COCODetection, collate_detection
from vtdense.data.transforms import (
    ResizeShortestEdge,
    detection_eval_transforms,
    detection_train_transforms,
    drop_degenerate_instances,
    shortest_edge_size,
)

CATEGORY_IDS = [1, 3, 7]
#: Small resize settings so CPU tests stay fast.
SMALL_SIZES: dict[str, Any] = {"train_scales": [96, 112, 128], "max_size": 160, "test_scale": 112}


def _dataset(root: Path, split: str, train: bool, transforms: Any = None, **kwargs: Any) -> COCODetection:
    return COCODetection(root / split, root / "annotations" / f"instances_{split}.json", transforms, train, **kwargs)


def _mask_box(mask: torch.Tensor) -> list[float]:
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return [float(xs.min()), float(ys.min()), float(xs.max()) + 1.0, float(ys.max()) + 1.0]


# ----------------------------------------------------------------------------- batch contract
def test_train_batches_follow_the_contract(coco_root: Path) -> None:
    dm = COCODataModule(root=str(coco_root), batch_size=4, **SMALL_SIZES)
    dm.setup("fit")
    seen = 0
    for images, targets in dm.train_dataloader():
        assert isinstance(images, list) and isinstance(targets, list) and len(images) == len(targets)
        for image, t in zip(images, targets):
            assert type(image) is torch.Tensor and image.dtype == torch.float32 and image.shape[0] == 3
            assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
            h, w = image.shape[1:]
            assert min(h, w) in SMALL_SIZES["train_scales"] or max(h, w) == SMALL_SIZES["max_size"]
            assert max(h, w) <= SMALL_SIZES["max_size"]
            assert set(t) == {"boxes", "labels", "masks", "iscrowd", "area", "image_id", "orig_size"}
            n = t["boxes"].shape[0]
            assert type(t["boxes"]) is torch.Tensor and t["boxes"].dtype == torch.float32
            assert t["boxes"].shape == (n, 4)
            assert t["labels"].dtype == torch.int64 and t["labels"].shape == (n,)
            assert t["masks"].dtype == torch.uint8 and t["masks"].shape == (n, h, w)
            assert t["iscrowd"].dtype == torch.int64 and not t["iscrowd"].any()  # crowds removed in train
            assert t["area"].dtype == torch.float32 and t["area"].shape == (n,)
            assert isinstance(t["image_id"], int) and isinstance(t["orig_size"], tuple)
            if n:
                assert set(t["labels"].tolist()) <= {1, 2, 3}
                assert (t["boxes"][:, 2:] > t["boxes"][:, :2]).all()
                assert (t["boxes"][:, [0, 2]] <= w + 1e-3).all() and (t["boxes"][:, [1, 3]] <= h + 1e-3).all()
                assert (t["boxes"] >= 0).all()
            seen += 1
    assert seen == 12


def test_eval_targets_carry_original_ground_truth(coco_root: Path, load_ann: Callable[..., dict]) -> None:
    ann = load_ann("val2017")
    ds = _dataset(coco_root, "val2017", False, detection_eval_transforms(112, 160))
    by_image = {img["id"]: img for img in ann["images"]}
    crowds = 0
    for index in range(len(ds)):
        image, t = ds[index]
        info = by_image[t["image_id"]]
        assert t["orig_size"] == (info["height"], info["width"])
        anns = [a for a in ann["annotations"] if a["image_id"] == t["image_id"]]
        n = len(anns)
        assert t["orig_boxes"].dtype == torch.float32 and t["orig_boxes"].shape == (n, 4)
        assert t["orig_masks"].dtype == torch.bool and t["orig_masks"].shape == (n, info["height"], info["width"])
        assert t["masks"].shape == (n, *image.shape[1:])
        expected = torch.tensor([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]]
                                 for a in anns], dtype=torch.float32).reshape(-1, 4)
        torch.testing.assert_close(t["orig_boxes"], expected)
        torch.testing.assert_close(t["area"], torch.tensor([a["area"] for a in anns], dtype=torch.float32))
        assert t["iscrowd"].tolist() == [a["iscrowd"] for a in anns]
        assert [ds.label_to_category_id[int(lb)] for lb in t["labels"]] == [a["category_id"] for a in anns]
        for a, mask in zip(anns, t["orig_masks"]):
            if a["iscrowd"]:  # RLE area is exactly the pixel count
                crowds += 1
                assert int(mask.sum()) == a["area"]
            else:  # polygon area vs rasterised area: close
                assert abs(int(mask.sum()) - a["area"]) <= 0.25 * a["area"] + 10
    assert crowds == 2  # one uncompressed, one compressed RLE


def test_mask_from_box_covers_every_pixel_the_box_touches(tmp_path: Path, write_ann: Callable[..., Path]) -> None:
    """An annotation without a segmentation gets its box as mask: pixel ``[i, i + 1)`` is in when it
    overlaps the box, so from ``floor(x0)`` up to ``ceil(x1)`` exclusive (a fractional far edge still
    takes its pixel; a whole one does not take the next)."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (30, 20)).save(tmp_path / "images" / "a.png")
    boxes = {1: [2.3, 3.6, 4.0, 1.6], 2: [10.0, 8.0, 5.0, 4.0]}  # far edges (6.3, 5.2) and (15, 12)
    data = {
        "images": [{"id": 1, "file_name": "a.png", "height": 20, "width": 30}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": boxes[1], "iscrowd": 0},
                        {"id": 2, "image_id": 1, "category_id": 1, "bbox": boxes[2], "iscrowd": 0, "segmentation": []}],
        "categories": [{"id": 1, "name": "thing"}],
    }
    expected = torch.zeros(2, 20, 30, dtype=torch.bool)
    expected[0, 3:6, 2:7] = True  # rows 3, 4, 5 (y 3.6 to 5.2), columns 2 to 6 (x 2.3 to 6.3)
    expected[1, 8:12, 10:15] = True
    for train in (False, True):
        _, t = COCODetection(tmp_path / "images", write_ann(data), train=train)[0]
        assert torch.equal(t["masks"].bool(), expected), train
        if not train:
            assert torch.equal(t["orig_masks"], expected)


def test_crowds_are_dropped_from_train_only(coco_root: Path, load_ann: Callable[..., dict]) -> None:
    ann = load_ann("train2017")
    train = _dataset(coco_root, "train2017", True)
    evaluation = _dataset(coco_root, "train2017", False)
    n_train = sum(len(train[i][1]["labels"]) for i in range(len(train)))
    n_eval = sum(len(evaluation[i][1]["labels"]) for i in range(len(evaluation)))
    crowd = sum(a["iscrowd"] for a in ann["annotations"])
    assert crowd == 2
    assert n_eval == len(ann["annotations"]) and n_train == n_eval - crowd


def test_labels_categories_and_names(coco_root: Path) -> None:
    dm = COCODataModule(root=str(coco_root), **SMALL_SIZES)
    assert dm.num_classes == 3 and dm.val_dataset is None  # known before setup
    dm.setup("fit")
    assert dm.label_to_category_id == {1: 1, 2: 3, 3: 7}
    assert dm.category_names == ["__background__", "red_square", "green_circle", "blue_triangle"]
    ds = dm.train_dataset
    assert ds is not None and ds.num_classes == 3 and ds.category_id_to_label == {1: 1, 3: 2, 7: 3}
    assert ds.ann_file == coco_root / "annotations" / "instances_train2017.json"
    assert set(ds.coco.getCatIds()) == set(CATEGORY_IDS)


def test_empty_images_are_kept(coco_root: Path, load_ann: Callable[..., dict]) -> None:
    for split, train in (("train2017", True), ("val2017", False)):
        ann = load_ann(split)
        ds = _dataset(coco_root, split, train, detection_train_transforms([96], 128) if train else None)
        assert len(ds) == len(ann["images"])
        annotated = {a["image_id"] for a in ann["annotations"]}
        empty_ids = [img["id"] for img in ann["images"] if img["id"] not in annotated]
        assert empty_ids, "fixture should contain empty images"
        image, t = ds[ds.ids.index(empty_ids[0])]
        assert t["boxes"].shape == (0, 4) and t["labels"].shape == (0,)
        assert t["masks"].shape == (0, *image.shape[1:]) and t["masks"].dtype == torch.uint8


def test_gray_rgba_and_palette_images_become_rgb(coco_root: Path) -> None:
    ds = _dataset(coco_root, "train2017", True)
    modes = []
    for index in (1, 2, 3):
        info = ds.coco.imgs[ds.ids[index]]
        with Image.open(coco_root / "train2017" / info["file_name"]) as img:
            modes.append(img.mode)
        image, _ = ds[index]
        assert image.shape == (3, info["height"], info["width"]) and image.dtype == torch.float32
    assert modes == ["L", "RGBA", "P"]
    gray, _ = ds[1]
    torch.testing.assert_close(gray[0], gray[1])  # grey stays grey


# --------------------------------------------------------------------------------- transforms
@pytest.mark.parametrize("flip", [0.0, 1.0])
def test_boxes_follow_masks_through_resize_and_flip(coco_root: Path, flip: float) -> None:
    ds = _dataset(coco_root, "train2017", True, detection_train_transforms([160], 200, flip_prob=flip))
    checked = 0
    for index in range(len(ds)):
        _, t = ds[index]
        for box, mask in zip(t["boxes"], t["masks"]):
            assert mask.any()
            assert np.allclose(_mask_box(mask), box.tolist(), atol=2.5), (index, box, _mask_box(mask))
            checked += 1
    assert checked >= 10


def test_flip_mirrors_boxes(coco_root: Path) -> None:
    plain = _dataset(coco_root, "val2017", False, detection_train_transforms([112], 160, flip_prob=0.0))
    flipped = _dataset(coco_root, "val2017", False, detection_train_transforms([112], 160, flip_prob=1.0))
    for index in range(len(plain)):
        image, a = plain[index]
        image_f, b = flipped[index]
        w = image.shape[-1]
        torch.testing.assert_close(image_f, image.flip(-1))
        torch.testing.assert_close(b["boxes"][:, [2, 0]], w - a["boxes"][:, [0, 2]])
        torch.testing.assert_close(b["masks"], a["masks"].flip(-1))
        torch.testing.assert_close(b["orig_boxes"], a["orig_boxes"])  # original coordinates never move


def test_train_resize_samples_scales_and_caps_long_side() -> None:
    torch.manual_seed(0)
    t = detection_train_transforms([50, 60, 70], max_size=100, flip_prob=0.0)
    seen = set()
    for _ in range(30):
        image = tv_tensors.Image(torch.zeros(3, 40, 60, dtype=torch.uint8))
        out, _ = t(image, {})
        assert out.dtype == torch.float32
        seen.add(tuple(out.shape[1:]))
    assert seen == {(50, 75), (60, 90), (67, 100)}  # 70 would make the long side 105 > 100: capped
    out, _ = detection_eval_transforms(50, 100)(tv_tensors.Image(torch.zeros(3, 40, 60, dtype=torch.uint8)), {})
    assert tuple(out.shape[1:]) == (50, 75)


def _expected_size(height: int, width: int, short: int, max_size: int) -> tuple[int, int]:
    """The rule of the reference recipe's shortest-edge resize (detectron2's), stated directly: one
    factor brings the short side to ``short``, or the long side to ``max_size`` where the first
    would take it past that; each side is then rounded half up."""
    factor = short / min(height, width)
    if max(height, width) * factor > max_size:
        factor = max_size / max(height, width)
    return math.floor(height * factor + 0.5), math.floor(width * factor + 0.5)


def test_shortest_edge_size_rounds_and_caps_like_detectron2() -> None:
    """Output sizes equal detectron2's on a grid of shapes, including the cap's edge (a long side
    of 100.5 is over a cap of 100) and sides landing on .5 (rounded half up, not to even)."""
    assert shortest_edge_size(40, 60, 67, 100) == (67, 100)  # uncapped: 67 x 100.5
    assert shortest_edge_size(40, 60, 66, 100) == (66, 99)
    assert shortest_edge_size(20, 33, 10, None) == (10, 17)  # 16.5 -> 17
    assert shortest_edge_size(37, 70, 64, None) == (64, 121)  # 121.08
    for height in range(9, 130, 11):
        for width in range(7, 130, 13):
            for short in (16, 33, 50, 67):
                assert shortest_edge_size(height, width, short, 100) == _expected_size(height, width, short, 100)
    # the canvas of boxes alone sets the size when the sample has no image
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[8.0, 4.0, 60.0, 40.0]]), format="XYXY", canvas_size=(40, 60))
    out = ResizeShortestEdge([50], max_size=None)(boxes)
    assert tuple(out.canvas_size) == (50, 75) and out.tolist() == [[10.0, 5.0, 75.0, 50.0]]


def test_transform_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="scales"):
        detection_train_transforms([])
    with pytest.raises(ValueError, match="flip_prob"):
        detection_train_transforms([64], flip_prob=2.0)
    with pytest.raises(ValueError, match="max_size"):
        detection_eval_transforms(64, max_size=0)


def test_drop_degenerate_instances_filters_every_instance_key() -> None:
    target = {
        "boxes": tv_tensors.BoundingBoxes(torch.tensor([[0, 0, 5, 5], [2, 2, 2.5, 9], [1, 1, 9, 1]]),
                                          format="XYXY", canvas_size=(10, 10)),
        "labels": torch.tensor([1, 2, 3]),
        "masks": tv_tensors.Mask(torch.zeros(3, 10, 10, dtype=torch.uint8)),
        "area": torch.tensor([25.0, 3.0, 0.0]),
        "orig_masks": torch.zeros(3, 20, 20, dtype=torch.bool),
        "image_id": 7,
    }
    out, removed = drop_degenerate_instances(target, min_size=1.0)
    assert removed == 2
    assert out["labels"].tolist() == [1] and out["area"].tolist() == [25.0]
    assert out["masks"].shape == (1, 10, 10) and out["orig_masks"].shape == (1, 20, 20)
    assert isinstance(out["boxes"], tv_tensors.BoundingBoxes) and out["image_id"] == 7


def test_drop_degenerate_instances_with_min_size_zero_still_drops_empty_boxes() -> None:
    """``min_size=0`` keeps any box of positive width and height; zero-width boxes (instances a
    crop cut away) and inverted ones still go, as the docstring promises."""
    boxes = torch.tensor([[0, 0, 0.2, 0.2], [3, 1, 3, 9], [1, 2, 4, 2], [5, 5, 4, 8]], dtype=torch.float32)
    target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(10, 10)), "labels": torch.arange(4)}
    out, removed = drop_degenerate_instances(target, min_size=0.0)
    assert removed == 3 and out["labels"].tolist() == [0]


def test_boxes_degenerate_after_transform_are_dropped(coco_root: Path, load_ann: Callable[..., dict],
                                                      write_ann: Callable[..., Path]) -> None:
    ann = load_ann("train2017")
    image = next(img for img in ann["images"] if img["width"] >= 100)
    ann["annotations"].append({"id": 10_000, "image_id": image["id"], "category_id": 3, "bbox": [10, 10, 3, 40],
                               "area": 120.0, "iscrowd": 0, "segmentation": [[10, 10, 13, 10, 13, 50, 10, 50]]})
    path = write_ann(ann)
    # Scale by ~0.1: the 3-px-wide box becomes ~0.3 px wide and must go, masks and all.
    ds = COCODetection(coco_root / "train2017", path, detection_train_transforms([10], 20, 0.0), train=True)
    _, t = ds[ds.ids.index(image["id"])]
    wh = t["boxes"][:, 2:] - t["boxes"][:, :2]
    assert (wh >= 1).all() and t["masks"].shape[0] == t["labels"].shape[0] == t["area"].shape[0]
    assert ds.num_dropped == 0  # not degenerate at load time


# ---------------------------------------------------------------------------- bad input
def test_degenerate_annotations_dropped_with_one_log_line(
    coco_root: Path, load_ann: Callable[..., dict], write_ann: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    ann = load_ann("val2017")
    image_id = ann["images"][0]["id"]
    bad = [([5, 5, 0.5, 20], 10.0), ([5, 5, 20, 1.0], 20.0), ([5, 5, 20, 20], 0.0), ([-30, 5, 20, 20], 400.0)]
    for k, (bbox, area) in enumerate(bad):
        ann["annotations"].append({"id": 20_000 + k, "image_id": image_id, "category_id": 1, "bbox": bbox,
                                   "area": area, "iscrowd": 0, "segmentation": []})
    path = write_ann(ann)
    with caplog.at_level(logging.WARNING, logger="vtdense.data.coco"):
        ds = COCODetection(coco_root / "val2017", path, train=True)
    records = [r for r in caplog.records if r.name == "vtdense.data.coco"]
    assert len(records) == 1 and "dropped 4 degenerate" in records[0].getMessage()
    assert str(path) in records[0].getMessage()
    assert ds.num_dropped == 4
    _, t = ds[0]
    anns = [a for a in ann["annotations"] if a["image_id"] == image_id]
    n = len(anns) - len(bad)
    n_crowd = sum(a.get("iscrowd", 0) for a in anns)  # training splits drop crowds too
    assert t["boxes"].shape == (n - n_crowd, 4)
    # evaluation keeps every ground-truth annotation, as pycocotools does on the JSON file
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vtdense.data.coco"):
        ev = COCODetection(coco_root / "val2017", path, train=False)
    assert ev.num_dropped == 0 and not [r for r in caplog.records if r.name == "vtdense.data.coco"]
    _, t = ev[0]
    assert t["orig_boxes"].shape == (n + len(bad), 4) and t["area"].shape == (n + len(bad),)


def test_corrupt_json_names_the_file(write_ann: Callable[..., Path], coco_root: Path) -> None:
    path = write_ann('{"images": [1, 2', "broken.json")
    with pytest.raises(COCODatasetError, match="broken.json.*not a valid COCO JSON"):
        COCODetection(coco_root / "val2017", path)
    path = write_ann("[1, 2, 3]", "list.json")
    with pytest.raises(COCODatasetError, match="list.json"):
        COCODetection(coco_root / "val2017", path)
    path = write_ann({"images": []}, "nocats.json")
    with pytest.raises(COCODatasetError, match="nocats.json.*categories"):
        COCODetection(coco_root / "val2017", path)


def test_corrupt_json_in_datamodule_names_the_file(coco_copy: Path) -> None:
    (coco_copy / "annotations" / "instances_val2017.json").write_text("not json", encoding="utf-8")
    dm = COCODataModule(root=str(coco_copy), **SMALL_SIZES)
    with pytest.raises(COCODatasetError, match="instances_val2017.json"):
        dm.setup("fit")


def test_missing_image_names_path_and_id(coco_root: Path, load_ann: Callable[..., dict],
                                         write_ann: Callable[..., Path]) -> None:
    ann = load_ann("val2017")
    ann["images"].append({"id": 424242, "file_name": "gone.jpg", "height": 100, "width": 100})
    path = write_ann(ann)
    with pytest.raises(FileNotFoundError) as info:
        COCODetection(coco_root / "val2017", path)
    message = str(info.value)
    assert str(coco_root / "val2017" / "gone.jpg") in message and "424242" in message


def test_unknown_category_names_annotation_and_category(coco_root: Path, load_ann: Callable[..., dict],
                                                        write_ann: Callable[..., Path]) -> None:
    ann = load_ann("val2017")
    victim = ann["annotations"][0]
    victim["category_id"] = 99
    path = write_ann(ann)
    with pytest.raises(COCODatasetError, match=rf"annotation {victim['id']} has category_id 99"):
        COCODetection(coco_root / "val2017", path)


def test_invalid_bbox_and_unknown_image_are_reported(coco_root: Path, load_ann: Callable[..., dict],
                                                     write_ann: Callable[..., Path]) -> None:
    ann = load_ann("val2017")
    ann["annotations"][1]["bbox"] = [1, 2, 3]
    with pytest.raises(COCODatasetError, match=rf"annotation {ann['annotations'][1]['id']} has an invalid bbox"):
        COCODetection(coco_root / "val2017", write_ann(ann))
    ann = load_ann("val2017")
    ann["annotations"][1]["image_id"] = 31337
    with pytest.raises(COCODatasetError, match="unknown image id 31337"):
        COCODetection(coco_root / "val2017", write_ann(ann))


def test_image_size_mismatch_names_the_file(coco_root: Path, load_ann: Callable[..., dict],
                                            write_ann: Callable[..., Path]) -> None:
    ann = load_ann("val2017")
    ann["images"][0]["height"] += 7
    ds = COCODetection(coco_root / "val2017", write_ann(ann), on_bad_sample="error")
    with pytest.raises(COCODatasetError, match=rf"{ann['images'][0]['file_name']} \(image id {ann['images'][0]['id']}\)"):
        ds[0]


def test_splits_with_different_categories_are_rejected(coco_copy: Path) -> None:
    path = coco_copy / "annotations" / "instances_train2017.json"
    ann = json.loads(path.read_text(encoding="utf-8"))
    ann["categories"].append({"id": 50, "name": "extra"})
    path.write_text(json.dumps(ann), encoding="utf-8")
    dm = COCODataModule(root=str(coco_copy), **SMALL_SIZES)
    with pytest.raises(COCODatasetError, match="share one category list"):
        dm.setup("fit")


# ---------------------------------------------------------------------------- root resolution
def test_explicit_missing_root_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        COCODataModule(root=str(missing))
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "half" / "annotations" / "instances_train2017.json")):
        COCODataModule(root=str(tmp_path / "half"))


def test_for_evaluation_needs_only_the_validation_split(coco_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``for_evaluation`` (the recipes' ``validate``): a root without the training split, or the
    validation files alone without a root; the plain constructor still wants every split."""
    root = tmp_path / "val_only"
    (root / "annotations").mkdir(parents=True)
    shutil.copy(coco_root / "annotations" / "instances_val2017.json", root / "annotations")
    shutil.copytree(coco_root / "val2017", root / "val2017")
    with pytest.raises(FileNotFoundError, match="instances_train2017.json"):
        COCODataModule(root=str(root))
    val = (str(root / "annotations" / "instances_val2017.json"), str(root / "val2017"))
    with pytest.raises(ValueError, match=r"missing: \['train_ann', 'train_images'\]"):
        COCODataModule(val_ann=val[0], val_images=val[1])
    for dm in (COCODataModule.for_evaluation(root=str(root), **SMALL_SIZES),
               COCODataModule.for_evaluation(val_ann=val[0], val_images=val[1], **SMALL_SIZES)):
        dm.setup("validate")
        assert dm.num_classes == 3 and len(dm.val_dataset) == 6
        images, targets = next(iter(dm.val_dataloader()))
        assert images[0].ndim == 3 and "image_id" in targets[0]
    # the default location ($VTDENSE_DATA/coco) holding only the validation split: used, not synthetic data
    monkeypatch.setenv("VTDENSE_DATA", str(tmp_path))
    root.rename(tmp_path / "coco")
    dm = COCODataModule.for_evaluation(**SMALL_SIZES)
    assert dm.paths["val"][0] == tmp_path / "coco" / "annotations" / "instances_val2017.json"
    root = tmp_path / "coco"
    val = (str(root / "annotations" / "instances_val2017.json"), str(root / "val2017"))
    with pytest.raises(FileNotFoundError, match="val2017"):  # what evaluation reads must still be there
        COCODataModule.for_evaluation(val_ann=val[0], val_images=str(tmp_path / "val2017"))


def test_default_root_falls_back_to_synthetic(coco_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # no ./data/coco here
    monkeypatch.delenv("VTDENSE_DATA", raising=False)
    cache = tmp_path / "cache"
    shutil.copytree(coco_root, cache / "synthetic_coco_v1")  # pre-seeded cache: no generation cost
    monkeypatch.setenv("VTDENSE_CACHE", str(cache))
    with caplog.at_level(logging.INFO):
        dm = COCODataModule(**SMALL_SIZES)
        assert dm.num_classes == 3
        dm.prepare_data()
        dm.setup("fit")
    lines = [r.getMessage() for r in caplog.records if "synthetic" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "data" / "coco") in lines[0]
    assert dm.paths["train"][0] == cache / "synthetic_coco_v1" / "annotations" / "instances_train2017.json"
    images, targets = next(iter(dm.val_dataloader()))
    assert len(images) == 2 and "orig_masks" in targets[0]


def test_default_root_uses_vtdense_data(coco_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "coco").symlink_to(coco_root, target_is_directory=True)
    monkeypatch.setenv("VTDENSE_DATA", str(tmp_path))
    monkeypatch.setenv("VTDENSE_CACHE", str(tmp_path / "must_not_be_used"))
    with caplog.at_level(logging.INFO):
        dm = COCODataModule(**SMALL_SIZES)
        assert dm.paths["val"] == (tmp_path / "coco" / "annotations" / "instances_val2017.json",
                                   tmp_path / "coco" / "val2017")
    assert not [r for r in caplog.records if "synthetic" in r.getMessage()]
    assert not (tmp_path / "must_not_be_used").exists()


def test_no_synthetic_fallback_when_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VTDENSE_DATA", raising=False)
    dm = COCODataModule(synthetic_if_missing=False)
    with pytest.raises(FileNotFoundError, match="no COCO dataset at"):
        dm.prepare_data()


def test_explicit_annotation_and_image_pairs(coco_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ann = coco_root / "annotations"
    dm = COCODataModule(train_ann=str(ann / "instances_train2017.json"), train_images=str(coco_root / "train2017"),
                        val_ann=str(ann / "instances_val2017.json"), val_images=str(coco_root / "val2017"),
                        batch_size=3, **SMALL_SIZES)
    dm.setup("test")
    images, _ = next(iter(dm.test_dataloader()))
    assert len(images) == 3
    with pytest.raises(ValueError, match="missing: .*'val_images'"):
        COCODataModule(train_ann=str(ann / "instances_train2017.json"), train_images=str(coco_root / "train2017"),
                       val_ann=str(ann / "instances_val2017.json"))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        COCODataModule(root=str(coco_root), val_ann=str(tmp_path / "nope.json"))


# ---------------------------------------------------------------------------- loaders
def test_collate_keeps_different_sizes_as_lists(coco_root: Path) -> None:
    ds = _dataset(coco_root, "val2017", False)  # no resize: original, differing sizes
    batch = [ds[i] for i in range(len(ds))]
    images, targets = collate_detection(batch)
    assert len({tuple(im.shape) for im in images}) > 1
    assert [t["image_id"] for t in targets] == ds.ids


def test_all_dataloaders_with_num_workers_zero(coco_root: Path) -> None:
    dm = COCODataModule(root=str(coco_root), batch_size=4, num_workers=0, **SMALL_SIZES)
    for stage in ("fit", "validate", "test", "predict"):
        dm.setup(stage)
    counts = {name: sum(len(b[0]) for b in getattr(dm, f"{name}_dataloader")())
              for name in ("train", "val", "test", "predict")}
    assert counts == {"train": 12, "val": 6, "test": 6, "predict": 6}
    val_ids = [t["image_id"] for _, targets in dm.val_dataloader() for t in targets]
    assert val_ids == dm.val_dataset.ids  # deterministic order for evaluation


def test_dataloader_before_setup_is_a_clear_error(coco_root: Path) -> None:
    with pytest.raises(RuntimeError, match="setup"):
        COCODataModule(root=str(coco_root)).train_dataloader()


def test_trainer_moves_the_batch(coco_root: Path) -> None:
    import lightning as L

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.batches: list[tuple[int, int]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, targets = batch
            self.batches.append((len(images), len(targets)))
            return self.w * sum(im.mean() for im in images) + sum(t["boxes"].sum() * 0 for t in targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    probe = Probe()
    trainer = L.Trainer(fast_dev_run=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(probe, datamodule=COCODataModule(root=str(coco_root), batch_size=2, **SMALL_SIZES))
    assert probe.batches == [(2, 2), (2, 2)]


def test_constructor_arguments_are_cli_options(coco_root: Path) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(COCODataModule, "data")
    cfg = parser.parse_args([f"--data.root={coco_root}", "--data.train_scales=[96, 128]", "--data.batch_size=3",
                             "--data.synthetic_if_missing=false"])
    dm = COCODataModule(**cfg.data.as_dict())
    assert dm.train_scales == (96, 128) and dm.batch_size == 3 and dm.num_classes == 3
    assert dm.hparams["root"] == str(coco_root)


def test_training_leaves_out_images_with_nothing_to_train_on(coco_root: Path, load_ann: Callable[..., dict],
                                                             write_ann: Callable[..., Path],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """As detectron2's ``filter_empty`` and mmdetection's ``filter_empty_gt``: the datamodule's
    training split drops images with no annotation left to train on (none, or only crowds);
    validation keeps every image; the default (``filter_empty=False``) keeps them; one log line counts them."""
    ann = load_ann("train2017")
    usable = {a["image_id"] for a in ann["annotations"] if not a.get("iscrowd")}
    empty = {img["id"] for img in ann["images"]} - usable  # no annotation, or only crowds
    with caplog.at_level(logging.INFO, logger="vtdense.data.coco"):
        dm = COCODataModule(root=str(coco_root), batch_size=2, train_scales=(96,), max_size=128, test_scale=96,
                            filter_empty=True)
        dm.setup("fit")
    assert sorted(dm.train_dataset.ids) == sorted(usable) and len(empty) > 0
    assert dm.train_dataset.num_empty_filtered == len(empty)
    assert len(dm.val_dataset) == len(load_ann("val2017")["images"])
    assert any(f"training on {len(usable)} of {len(ann['images'])} images" in r.getMessage() for r in caplog.records)
    keep = COCODataModule(root=str(coco_root), batch_size=2, train_scales=(96,), max_size=128)  # the default keeps them
    keep.setup("fit")
    assert len(keep.train_dataset) == len(ann["images"])
    ann["annotations"] = [dict(a, iscrowd=1) for a in ann["annotations"]]  # nothing left to train on
    path = write_ann(ann, "all_crowd.json")
    with pytest.raises(COCODatasetError, match=r"all_crowd.json: no training image has an annotation to train on"):
        COCODetection(coco_root / "train2017", path, None, True, filter_empty=True)
