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


def test_label_map_of_a_reduced_image_is_shrunk_by_nearest_neighbour(tmp_path: Path) -> None:
    """A huge image decoded reduced (a PNG 90 px wide, max side 30: 1/3) has its label map reduced to
    match by nearest neighbour, which only ever picks existing labels: the result is the PIL NEAREST
    resize, i.e. the centre pixel of every 3x3 block. Averaging modes would invent labels between
    the far-apart values used here."""
    root = tmp_path / "folder"
    (root / "images" / "training").mkdir(parents=True)
    (root / "annotations" / "training").mkdir(parents=True)
    rng = np.random.default_rng(0)
    label = rng.choice(np.array([10, 100, 190], np.uint8), size=(60, 90))
    Image.fromarray(np.zeros((60, 90, 3), np.uint8)).save(root / "images" / "training" / "a.png")
    Image.fromarray(label).save(root / "annotations" / "training" / "a.png")
    ds = SegmentationFolder(root, "training", 200, reduce_zero_label=False, max_decode_side=30, on_bad_sample="error")
    image, mask = ds.load(0)
    assert image.shape == (3, 20, 30) and mask.shape == (20, 30)
    assert torch.equal(mask, torch.from_numpy(label[1::3, 1::3].astype(np.int64)))
    nearest = np.asarray(Image.fromarray(label).resize((30, 20), Image.Resampling.NEAREST))
    assert torch.equal(mask, torch.from_numpy(nearest.astype(np.int64)))


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


@pytest.mark.parametrize(
    "first",
    [
        # one real class (4 px) and 4 ignored px: a single class, rejected (counting 255 would make it 50/50)
        [[0, 0, 0, 0], [255, 255, 255, 255]],
        # class 0 on 6 of the 7 labelled px (0.86 > 0.75), rejected (counting the 5 ignored px: 6 / 12, kept)
        [[0, 0, 0, 0], [0, 0, 1, 255], [255, 255, 255, 255]],
    ],
)
def test_crop_category_ratio_leaves_out_ignored_pixels(monkeypatch: pytest.MonkeyPatch, first: list[list[int]]) -> None:
    """``cat_max_ratio`` counts labelled pixels only (mmseg's RandomCrop drops ``ignore_index`` from
    the class counts): the first crop drawn is rejected, the second (two classes, 50/50) is kept."""
    import vtdense.data.ade20k as ade20k

    rows = len(first)
    mask = torch.full((rows, 8), IGNORE_INDEX)
    mask[:, :4] = torch.tensor(first)
    mask[:, 4:6], mask[:, 6:] = 0, 1  # the right half: two classes, evenly
    draws = iter([0, 0, 0, 4])  # (top, left) of the first crop, then of the second
    monkeypatch.setattr(ade20k, "random", type("Scripted", (), {"randint": staticmethod(lambda a, b: next(draws))}))
    box = SegTrainTransform(crop_size=(rows, 4), cat_max_ratio=0.75).crop_box(mask)
    assert box == (0, 4, rows, 4)


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


def test_num_classes_and_names_come_from_classes_txt(ade_root: Path) -> None:
    """Without ``num_classes`` the count is the number of names in ``classes.txt`` (blank lines
    aside), and the names label the classes; an explicit count wins, and names that do not match it
    are not used (``class_<i>`` instead)."""
    names = ["wall", "floor", "sky"]
    (ade_root / "classes.txt").write_text("\n".join(names) + "\n\n")
    dm = ADE20KDataModule(root=str(ade_root), num_workers=0, scale=(64, 48), crop_size=(32, 32))
    assert dm.num_classes == 3 and dm.class_names == names
    dm.setup("validate")
    assert dm.val_dataset is not None and dm.val_dataset.num_classes == 3
    other = ADE20KDataModule(root=str(ade_root), num_classes=NUM_CLASSES, num_workers=0)
    assert other.num_classes == NUM_CLASSES and other.class_names == [f"class_{i}" for i in range(NUM_CLASSES)]
    (ade_root / "classes.txt").unlink()
    assert ADE20KDataModule(root=str(ade_root), num_workers=0).num_classes == 150  # ADE20K's


def test_validation_loader_scores_every_image(tmp_path: Path) -> None:
    """The validation loader keeps the last, partial batch: 3 images in batches of 2 are all scored."""
    root = generate_synthetic_segmentation(tmp_path / "ade", num_train=2, num_val=3, size_range=(32, 40), seed=2)
    dm = ADE20KDataModule(root=str(root), num_classes=NUM_CLASSES, val_batch_size=2, num_workers=0, scale=(40, 32))
    dm.setup("validate")
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        files = [f for batch in loader for f in batch["files"]]
        assert sorted(files) == sorted(p.name for p in (root / "images" / "validation").iterdir())


def test_resize_is_mmcv_bilinear_and_the_scale_is_truncated_first() -> None:
    """mmseg rescales with mmcv's ``imrescale`` (OpenCV ``INTER_LINEAR``, no antialiasing) to the
    scale ``(int(2048 * r), int(512 * r))``: vtdense's training and evaluation resize agree with
    OpenCV to rounding on a high-frequency image, where an antialiased resize would not."""
    import cv2

    from vtdense.data.ade20k import SegEvalTransform, _rescale_size

    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 96, 128), dtype=torch.uint8, generator=g)
    out = SegEvalTransform(scale=(64, 48))(image, torch.zeros(96, 128, dtype=torch.long))["image"]
    h, w = out.shape[-2:]
    assert (h, w) == _rescale_size(96, 128, (64, 48)) == (48, 64)
    ref = cv2.resize(image.permute(1, 2, 0).numpy(), (w, h), interpolation=cv2.INTER_LINEAR)
    diff = (out * 255).round().permute(1, 2, 0).numpy().astype(int) - ref.astype(int)
    assert np.abs(diff).max() <= 1, np.abs(diff).max()
    # the scale is truncated before the fit: ratio 0.7 of (2048, 512) is (1433, 358), not (1433.6, 358.4)
    random.seed(0)
    t = SegTrainTransform(scale=(2048, 512), ratio_range=(0.7, 0.7), crop_size=(1000, 2000), photometric=False,
                          flip_prob=0.0)
    o = t(torch.zeros(3, 500, 1000, dtype=torch.uint8), torch.zeros(500, 1000, dtype=torch.long))
    assert tuple(o["image_size"]) == _rescale_size(500, 1000, (1433, 358)) == (358, 716)  # (358, 717) from the untruncated scale
