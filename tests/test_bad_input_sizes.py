"""Bad input sizes: images smaller than the backbone stride, huge images, portrait and landscape in one batch.

Each test is one row of the README's "Bad input: what you see" table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vtdense.data import COCODetection, SegmentationFolder, collate_detection, seg_collate
from vtdense.data.transforms import detection_eval_transforms, detection_train_transforms
from vtdense.models.detection import build_detector
from vtdense.tasks.segmentation import SegmentationTask

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "swin_tiny": dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1),
}
CATS = [{"id": 1, "name": "thing"}]


def write_coco(root: Path, images: list[tuple[str, int, int]], boxes: list[list[float]]) -> Path:
    """``root/ann.json`` with one box (and its rectangle polygon) per image."""
    anns = [
        {"id": i + 1, "image_id": i + 1, "category_id": 1, "bbox": b, "iscrowd": 0,
         "segmentation": [[b[0], b[1], b[0] + b[2], b[1], b[0] + b[2], b[1] + b[3], b[0], b[1] + b[3]]]}
        for i, b in enumerate(boxes)
    ]
    data = {"images": [{"id": i + 1, "file_name": f, "height": h, "width": w} for i, (f, h, w) in enumerate(images)],
            "annotations": anns, "categories": CATS}
    path = root / "ann.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def check_detections(dets: list[dict[str, torch.Tensor]], sizes: list[tuple[int, int]]) -> None:
    for det, (h, w) in zip(dets, sizes):
        boxes = det["boxes"]
        assert torch.isfinite(boxes).all() and torch.isfinite(det["scores"]).all()
        assert ((det["scores"] >= 0) & (det["scores"] <= 1)).all()
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
        assert (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
        if "masks" in det:
            assert det["masks"].shape[-2:] == (h, w)


# --------------------------------------------------------------------- smaller than the stride
@pytest.mark.parametrize("backbone", sorted(TINY))
@pytest.mark.parametrize(("head", "fpn_channels"), [("mask_rcnn", 64), ("fcos", 64), ("fcos", 32)])
def test_images_smaller_than_the_stride_through_detectors(backbone: str, head: str, fpn_channels: int) -> None:
    torch.manual_seed(0)
    # fcos norms with GroupNorm: at 32 FPN channels vtdense keeps two channels per group, so P7's 1x1
    # map (batch 1) is still defined
    model = build_detector(backbone, head, 2, fpn_channels=fpn_channels, slim_heads=True, backbone_kwargs=TINY[backbone])
    if head == "fcos":
        norms = [m for m in model.head.modules() if isinstance(m, torch.nn.GroupNorm)]
        assert norms and all(m.num_channels // m.num_groups == 2 for m in norms)  # 64: GroupNorm(32), 32: (16)
    sizes = [(8, 8), (1, 500)]
    for h, w in sizes:
        model.train()
        target = {"boxes": torch.tensor([[0.0, 0.0, min(w, 6.0), 1.0]]), "labels": torch.tensor([1]),
                  "masks": torch.ones(1, h, w, dtype=torch.uint8)}
        losses = model([torch.rand(3, h, w)], [target])
        assert losses and all(torch.isfinite(v) for v in losses.values()), (h, w, losses)
        model.eval()
        with torch.no_grad():
            check_detections(model([torch.rand(3, h, w)]), [(h, w)])


@pytest.mark.parametrize("backbone", sorted(TINY))
def test_images_smaller_than_the_stride_through_segmenters(backbone: str) -> None:
    torch.manual_seed(0)
    task = SegmentationTask(arch="upernet", backbone=backbone, num_classes=3, backbone_kwargs=TINY[backbone])
    for h, w in [(8, 8), (1, 500)]:
        task.train()
        logits = task(torch.rand(2, 3, h, w))
        loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, 3, (2, h, w)))
        loss.backward()
        assert logits.shape == (2, 3, h, w) and torch.isfinite(loss)
        task.eval()
        with torch.no_grad():
            logits = task(torch.rand(1, 3, h, w))
        assert logits.shape == (1, 3, h, w) and torch.isfinite(logits).all()


def test_tiny_images_through_the_dataset(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8), (200, 0, 0)).save(tmp_path / "small.png")
    Image.new("RGB", (500, 1), (0, 200, 0)).save(tmp_path / "line.png")
    path = write_coco(tmp_path, [("small.png", 8, 8), ("line.png", 1, 500)], [[1, 1, 6, 6], [100, 0, 200, 1]])
    ds = COCODetection(tmp_path, path, detection_eval_transforms(64, 128))
    (small, t_small), (line, t_line) = ds[0], ds[1]
    assert small.shape == (3, 64, 64) and t_small["boxes"].tolist() == [[8, 8, 56, 56]]
    assert line.shape[1:] == (1, 128) and t_line["masks"].shape == (1, 1, 128)
    assert ds.skipped == []


# ------------------------------------------------------------------------------- huge images
HUGE_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from vtdense.data import COCODetection
    from vtdense.data.transforms import detection_train_transforms
    root = Path(sys.argv[1])
    side = None if sys.argv[2] == "none" else int(sys.argv[2])
    ds = COCODetection(root, root / "ann.json", detection_train_transforms([800], 1333, 0.0), train=True,
                       max_decode_side=side)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    image, target = ds[0]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew_mib": (after - before) / 1024, "shape": list(image.shape),
                      "boxes": target["boxes"].tolist(), "masks": list(target["masks"].shape)}))
    """
)


def test_huge_jpeg_is_decoded_reduced_without_the_full_pixels(tmp_path: Path) -> None:
    # 10000 x 10000 JPEG (grayscale, flat: about 1 MB and a fraction of a second to write)
    Image.new("L", (10000, 10000), 128).save(tmp_path / "huge.jpg", quality=50)
    write_coco(tmp_path, [("huge.jpg", 10000, 10000)], [[1000, 2000, 4000, 3000]])
    script = tmp_path / "load.py"
    script.write_text(HUGE_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "2048"], capture_output=True, text=True,
                         cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DecompressionBomb" not in out.stderr  # 100 Mpx is above PIL's warning limit: handled, not warned
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shape"] == [3, 800, 800] and result["masks"] == [1, 800, 800]
    assert result["boxes"] == [[80.0, 160.0, 400.0, 400.0]]  # the JSON box scaled by 800 / 10000
    # Decoding the full image costs 100 Mpx x 3 bytes for the RGB pixels alone (and the resize about 1 GiB:
    # measured 1052 MiB with max_decode_side=None); the reduced decode stays far below one full copy.
    assert result["grew_mib"] < 200, result


def test_huge_png_is_reduced_after_decoding_with_boxes_and_masks(tmp_path: Path) -> None:
    img = np.zeros((200, 300, 3), np.uint8)
    img[40:120, 60:180] = 255
    Image.fromarray(img).save(tmp_path / "big.png")
    path = write_coco(tmp_path, [("big.png", 200, 300)], [[60, 40, 120, 80]])
    image, t = COCODetection(tmp_path, path, train=True, max_decode_side=64)[0]
    assert image.shape == (3, 50, 75)  # reduced by 4, long side still >= 64
    assert t["boxes"].tolist() == [[15, 10, 45, 30]] and t["orig_size"] == (200, 300)
    mask = t["masks"][0].bool()
    assert mask.sum() == 30 * 20 and (image[:, mask] > 0.9).all() and (image[:, ~mask] < 0.1).all()
    ev = COCODetection(tmp_path, path, train=False, max_decode_side=64)
    _, t = ev[0]
    assert t["orig_masks"].shape == (1, 200, 300) and t["orig_boxes"].tolist() == [[60, 40, 180, 120]]


def test_decompression_bomb_limit_is_a_counted_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    Image.new("RGB", (12, 12)).save(tmp_path / "warned.png")   # 144 px: above the limit, below twice it
    Image.new("RGB", (20, 20)).save(tmp_path / "bomb.png")     # 400 px: PIL refuses it
    path = write_coco(tmp_path, [("warned.png", 12, 12), ("bomb.png", 20, 20)], [[1, 1, 5, 5], [1, 1, 5, 5]])
    ds = COCODetection(tmp_path, path)
    with _no_bomb_warning():
        assert ds[0][1]["image_id"] == 1
    assert ds[1][1]["image_id"] == 1  # the bomb is skipped
    [record] = ds.skipped
    assert record["image_id"] == 2 and "bomb.png (image id 2) is too large to decode" in record["reason"]
    assert "raise PIL.Image.MAX_IMAGE_PIXELS" in record["reason"]


class _no_bomb_warning:
    """Context manager asserting that no DecompressionBombWarning escapes."""

    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self._seen = self._ctx.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        assert not [w for w in self._seen if issubclass(w.category, Image.DecompressionBombWarning)]


def test_huge_segmentation_image_reduces_its_label_map(tmp_path: Path) -> None:
    root = tmp_path / "seg"
    (root / "images" / "training").mkdir(parents=True)
    (root / "annotations" / "training").mkdir(parents=True)
    img = np.zeros((64, 96, 3), np.uint8)
    img[:, 48:] = 255
    label = np.ones((64, 96), np.uint8)
    label[:, 48:] = 2
    Image.fromarray(img).save(root / "images" / "training" / "a.jpg", quality=95)
    Image.fromarray(label).save(root / "annotations" / "training" / "a.png")
    image, mask = SegmentationFolder(root, "training", 3, max_decode_side=24, on_bad_sample="error").load(0)
    assert image.shape == (3, 16, 24) and mask.shape == (16, 24)  # JPEG draft at 1/4: long side 24 >= 24
    assert (mask[:, 12:] == 1).all() and (mask[:, :12] == 0).all()
    assert image[:, :, 13:].float().mean() > 240 and image[:, :, :11].float().mean() < 15


# --------------------------------------------------------------------- portrait and landscape
def test_portrait_and_landscape_in_one_detection_batch(tmp_path: Path) -> None:
    Image.new("RGB", (48, 96), (200, 0, 0)).save(tmp_path / "portrait.png")
    Image.new("RGB", (96, 48), (0, 200, 0)).save(tmp_path / "landscape.png")
    path = write_coco(tmp_path, [("portrait.png", 96, 48), ("landscape.png", 48, 96)], [[4, 10, 30, 60], [10, 4, 60, 30]])
    train = COCODetection(tmp_path, path, detection_train_transforms([64], 128, 0.0), train=True)
    images, targets = next(iter(DataLoader(train, batch_size=2, collate_fn=collate_detection)))
    assert [tuple(i.shape[1:]) for i in images] == [(128, 64), (64, 128)]
    torch.manual_seed(0)
    model = build_detector("swin_tiny", "mask_rcnn", 1, fpn_channels=32, slim_heads=True, backbone_kwargs=TINY["swin_tiny"])
    model.train()
    losses = model(images, targets)
    assert all(torch.isfinite(v) for v in losses.values())
    model.eval()
    with torch.no_grad():
        check_detections(model(images), [(128, 64), (64, 128)])


def test_portrait_and_landscape_in_one_segmentation_batch() -> None:
    samples = [
        {"image": torch.rand(3, 96, 48), "mask": torch.ones(96, 48, dtype=torch.long), "image_size": (96, 48)},
        {"image": torch.rand(3, 48, 96), "mask": torch.zeros(48, 96, dtype=torch.long), "image_size": (48, 96)},
    ]
    batch = seg_collate(samples)
    assert batch["image"].shape == (2, 3, 96, 96) and batch["mask"].shape == (2, 96, 96)
    assert batch["image_size"].tolist() == [[96, 48], [48, 96]] and batch["mask_size"].tolist() == [[96, 48], [48, 96]]
    assert (batch["mask"][0, :, 48:] == 255).all() and (batch["mask"][1, 48:] == 255).all()
    assert (batch["image"][0, :, :, 48:] == 0).all()
    task = SegmentationTask(arch="upernet", backbone="swin_tiny", num_classes=2, backbone_kwargs=TINY["swin_tiny"]).eval()
    with torch.no_grad():
        pairs = task._predict_batch(batch)
    assert [tuple(p.shape) for p, _ in pairs] == [(96, 48), (48, 96)]
    assert [m.unique().tolist() for _, m in pairs] == [[1], [0]]  # padding cut away before the metric


EMPTY_CASES = {
    "swin_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), window_size=4, patch_size=2),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8, out_indices=(1, 3)),
}


@pytest.mark.parametrize("name", list(EMPTY_CASES))
def test_an_empty_batch_gives_empty_maps_of_the_right_shapes(name: str) -> None:
    """A batch of 0 images (as torchvision's backbones take it) gives 0-image maps of the shapes one
    image gets, in the input's dtype, without running the blocks; in training a loss over them
    backpropagates."""
    import vtdense

    model = vtdense.create_backbone(name, drop_path_rate=0.0, **EMPTY_CASES[name])
    for size in [(100, 140), (33, 257), (7, 5)]:
        for dtype in (torch.float32, torch.float64):
            model.to(dtype).eval()
            with torch.no_grad():
                one = model(torch.randn(1, 3, *size, dtype=dtype))
                none = model(torch.randn(0, 3, *size, dtype=dtype))
            assert list(none) == list(one)
            for key in one:
                assert none[key].shape == (0, *one[key].shape[1:]) and none[key].dtype == dtype, (key, size)
    model.float().train()
    out = model(torch.randn(0, 3, 64, 96))
    sum(o.sum() for o in out.values()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(not g.any() for g in grads)
