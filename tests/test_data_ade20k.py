"""ADE20K datamodule on generated data: layout, reduce_zero_label, transforms, crop cap, root resolution, errors."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vtdense.data.ade20k import (
    IGNORE_INDEX,
    ADE20KDataModule,
    SegEvalTransform,
    SegmentationFolder,
    SegTrainTransform,
    seg_collate,
    synthetic_cache_dir,
)
from vtdense.data.synthetic_seg import SYNTHETIC_CLASSES, generate_synthetic_segmentation

NUM_CLASSES = len(SYNTHETIC_CLASSES)


@pytest.fixture
def ade_root(tmp_path: Path) -> Path:
    return generate_synthetic_segmentation(tmp_path / "ade", num_train=4, num_val=2, size_range=(48, 64), seed=1)


def _raw(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(np.int64)


def test_generated_layout_and_idempotence(ade_root: Path) -> None:
    for split, n in (("training", 4), ("validation", 2)):
        images = sorted((ade_root / "images" / split).glob("*.jpg"))
        labels = sorted((ade_root / "annotations" / split).glob("*.png"))
        assert len(images) == len(labels) == n
        assert [p.stem for p in images] == [p.stem for p in labels]
    assert (ade_root / "classes.txt").read_text().split() == list(SYNTHETIC_CLASSES)
    before = {p: p.stat().st_mtime_ns for p in ade_root.rglob("*")}
    assert generate_synthetic_segmentation(ade_root, num_train=1, num_val=1) == ade_root
    assert {p: p.stat().st_mtime_ns for p in ade_root.rglob("*")} == before
    assert not [p for p in ade_root.parent.iterdir() if ".tmp-" in p.name]


def test_reduce_zero_label(ade_root: Path) -> None:
    reduced = SegmentationFolder(ade_root, "training", NUM_CLASSES, reduce_zero_label=True)
    plain = SegmentationFolder(ade_root, "training", NUM_CLASSES + 1, reduce_zero_label=False)
    saw_zero = False
    for i in range(len(reduced)):
        raw = _raw(reduced.labels[i])
        saw_zero |= bool((raw == 0).any())
        _, r = reduced.load(i)
        _, p = plain.load(i)
        assert r.dtype == torch.int64
        assert torch.equal(p, torch.from_numpy(raw))
        expected = np.where(raw == 0, IGNORE_INDEX, raw - 1)
        assert torch.equal(r, torch.from_numpy(expected))
    assert saw_zero, "the synthetic set must contain label 0 (unlabelled)"


def test_raw_ignore_value_stays_ignored(tmp_path: Path) -> None:
    root = tmp_path / "folder"
    (root / "images" / "training").mkdir(parents=True)
    (root / "annotations" / "training").mkdir(parents=True)
    Image.fromarray(np.zeros((4, 6, 3), np.uint8)).save(root / "images" / "training" / "a.png")
    Image.fromarray(np.array([[0, 1, 2, 255, 3, 3]] * 4, np.uint8)).save(root / "annotations" / "training" / "a.png")
    _, mask = SegmentationFolder(root, "training", 3).load(0)
    assert mask[0].tolist() == [255, 0, 1, 255, 2, 2]


def _corrupt(root: Path, label: np.ndarray) -> Path:
    path = sorted((root / "annotations" / "training").glob("*.png"))[1]
    Image.fromarray(label.astype(np.uint8)).save(path)
    return path


def test_label_of_wrong_size_names_the_file(ade_root: Path) -> None:
    path = _corrupt(ade_root, np.ones((5, 7)))
    ds = SegmentationFolder(ade_root, "training", NUM_CLASSES)
    ds.load(0)  # the others are fine
    with pytest.raises(ValueError, match=f"label map {path}.*7x5"):
        ds.load(1)


def test_class_above_count_names_the_file(ade_root: Path) -> None:
    img = sorted((ade_root / "images" / "training").glob("*.jpg"))[1]
    w, h = Image.open(img).size
    label = np.ones((h, w))
    label[0, 0] = NUM_CLASSES + 1  # raw value 9 -> class 8 after reduction, count is 8
    path = _corrupt(ade_root, label)
    with pytest.raises(ValueError, match=f"label map {path} holds class value 9, above the class count.*num_classes=8"):
        SegmentationFolder(ade_root, "training", NUM_CLASSES, on_bad_sample="error")[1]


def test_missing_label_file_is_reported_up_front(ade_root: Path) -> None:
    victim = sorted((ade_root / "annotations" / "validation").glob("*.png"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"no label map.*{victim.stem}"):
        SegmentationFolder(ade_root, "validation", NUM_CLASSES)


def test_explicit_missing_root_is_an_error(tmp_path: Path) -> None:
    dm = ADE20KDataModule(root=str(tmp_path / "nowhere"), num_classes=NUM_CLASSES)
    with pytest.raises(FileNotFoundError, match="data.root .*nowhere.* does not exist"):
        dm.prepare_data()
    assert not (tmp_path / "nowhere").exists()


def test_train_transform_shapes_padding_and_flip() -> None:
    random.seed(0)
    image = torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8)
    mask = torch.randint(0, 4, (20, 30))
    # scale equal to the image, ratio 1, crop larger than the image -> the whole image, padded
    t = SegTrainTransform(scale=(30, 20), ratio_range=(1.0, 1.0), crop_size=(24, 40), flip_prob=1.0, photometric=False)
    out = t(image, mask)
    assert out["image"].shape == (3, 24, 40) and out["image"].dtype == torch.float32
    assert out["mask"].shape == (24, 40) and out["mask"].dtype == torch.int64
    torch.testing.assert_close(out["image"][:, :20, :30], image.flip(-1).float() / 255)
    assert torch.equal(out["mask"][:20, :30], mask.flip(-1))
    assert (out["mask"][20:] == IGNORE_INDEX).all() and (out["mask"][:, 30:] == IGNORE_INDEX).all()
    assert (out["image"][:, 20:] == 0).all()
    # random scale: output is always the crop size, labels stay valid
    t = SegTrainTransform(scale=(60, 40), ratio_range=(0.5, 2.0), crop_size=(16, 16))
    for _ in range(5):
        o = t(image, mask)
        assert o["image"].shape == (3, 16, 16)
        assert set(o["mask"].unique().tolist()) <= {0, 1, 2, 3, IGNORE_INDEX}
        assert 0.0 <= o["image"].min() and o["image"].max() <= 1.0


def _ok(mask: torch.Tensor, box: tuple[int, int, int, int], cap: float) -> bool:
    t, l, h, w = box
    crop = mask[t : t + h, l : l + w]
    counts = torch.bincount(crop[crop != IGNORE_INDEX].flatten())
    counts = counts[counts > 0]
    return len(counts) > 1 and counts.max().item() / counts.sum().item() < cap


def test_crop_category_ratio_cap() -> None:
    mask = torch.zeros(100, 100, dtype=torch.long)
    mask[30:70, 30:70] = 1
    mask[:, :5] = IGNORE_INDEX  # ignored pixels do not count
    capped = SegTrainTransform(crop_size=(30, 30), cat_max_ratio=0.75)
    free = SegTrainTransform(crop_size=(30, 30), cat_max_ratio=1.0)
    random.seed(0)
    rate_capped = np.mean([_ok(mask, capped.crop_box(mask), 0.75) for _ in range(300)])
    random.seed(0)
    rate_free = np.mean([_ok(mask, free.crop_box(mask), 0.75) for _ in range(300)])
    assert rate_capped > 0.9
    assert rate_free < 0.6


def test_eval_transform_and_collate() -> None:
    image = torch.randint(0, 256, (3, 40, 60), dtype=torch.uint8)
    mask = torch.randint(0, 4, (40, 60))
    out = SegEvalTransform(scale=(30, 24))(image, mask)
    assert out["image"].shape == (3, 20, 30)  # keep ratio, long side 30 / short side 24 -> factor 0.5
    assert torch.equal(out["mask"], mask)
    other = SegEvalTransform(scale=None)(image[:, :30, :50], mask[:30, :50])
    batch = seg_collate([out, other])
    assert batch["image"].shape == (2, 3, 30, 50)
    assert batch["mask"].shape == (2, 40, 60)
    assert batch["image_size"].tolist() == [[20, 30], [30, 50]]
    assert batch["mask_size"].tolist() == [[40, 60], [30, 50]]
    assert (batch["mask"][1, 30:] == IGNORE_INDEX).all() and (batch["mask"][1, :, 50:] == IGNORE_INDEX).all()


def test_default_root_falls_back_to_synthetic_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VTDENSE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("VTDENSE_CACHE", str(tmp_path / "cache"))
    kw = dict(num_classes=NUM_CLASSES, num_workers=0, batch_size=2, synthetic_num_train=3, synthetic_num_val=2)
    with caplog.at_level(logging.WARNING, logger="vtdense.data.ade20k"):
        dm = ADE20KDataModule(**kw, scale=(64, 48), crop_size=(32, 32))
        dm.prepare_data()
    assert dm.root == tmp_path / "cache" / "synthetic_ade20k_v1"
    assert len([r for r in caplog.records if "synthetic" in r.getMessage()]) == 1
    assert dm.class_names == list(SYNTHETIC_CLASSES)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (2, 3, 32, 32) and batch["mask"].shape == (2, 32, 32)
    val = next(iter(dm.val_dataloader()))
    assert val["image"].shape[0] == 1 and max(val["image"].shape[-2:]) <= 64
    # XDG_CACHE_HOME when VTDENSE_CACHE is unset
    monkeypatch.delenv("VTDENSE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert synthetic_cache_dir() == tmp_path / "xdg" / "vtdense" / "synthetic_ade20k_v1"


def test_default_root_uses_real_data_when_present(
    ade_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VTDENSE_DATA", str(tmp_path))
    monkeypatch.setenv("VTDENSE_CACHE", str(tmp_path / "cache"))
    assert ade_root == tmp_path / "ade"
    (tmp_path / "ade").rename(tmp_path / "ade20k")
    dm = ADE20KDataModule(num_classes=NUM_CLASSES)
    assert dm.root == tmp_path / "ade20k"
    assert not (tmp_path / "cache").exists()
