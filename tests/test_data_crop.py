"""The DETR-style random crop of the Swin / MViTv2 detection recipes (``train_augment="multiscale_crop"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from test_data_lsj import _tight
from vtdense.data import COCODataModule
from vtdense.data.transforms import (
    RandomRangeCrop,
    detection_crop_transforms,
    detection_train_transforms,
    drop_degenerate_instances,
)


def _sample(height: int, width: int) -> tuple[tv_tensors.Image, dict[str, Any]]:
    """An image with three rectangle instances: top-left corner, centre, bottom-right corner."""
    image = tv_tensors.Image(torch.randint(0, 256, (3, height, width), dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(0)))
    rects = [(0, 0, 6, 5), (width // 2 - 8, height // 2 - 6, width // 2 + 8, height // 2 + 6),
             (width - 7, height - 4, width, height)]
    masks = torch.zeros(len(rects), height, width, dtype=torch.uint8)
    for i, (x0, y0, x1, y1) in enumerate(rects):
        masks[i, y0:y1, x0:x1] = 1
    target = {
        "boxes": tv_tensors.BoundingBoxes(torch.tensor(rects, dtype=torch.float32), format="XYXY",
                                          canvas_size=(height, width)),
        "masks": tv_tensors.Mask(masks),
        "labels": torch.tensor([1, 2, 3]),
        "iscrowd": torch.zeros(3, dtype=torch.int64),
        "area": masks.flatten(1).sum(1).float(),
    }
    return image, target


def test_range_crop_draws_every_size_and_offset_and_matches_torchvision_crop() -> None:
    """On a 12 x 9 map with sides drawn from 4..7: heights 4..7 and widths 4..7 all occur, each
    offset from 0 to the last one occurs, and image, boxes and masks equal torchvision's crop there."""
    height, width = 12, 9
    image = tv_tensors.Image(torch.arange(height * width, dtype=torch.float32).view(1, height, width))
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[0.0, 0.0, 9.0, 12.0], [1.0, 2.0, 3.0, 4.0], [7.0, 9.0, 9.0, 12.0]]),
                                     format="XYXY", canvas_size=(height, width))
    masks = tv_tensors.Mask(torch.randint(0, 2, (3, height, width), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(1)))
    crop = RandomRangeCrop((4, 7))
    seen: set[tuple[int, int, int, int]] = set()
    for seed in range(800):
        torch.manual_seed(seed)
        out, out_boxes, out_masks = crop(image, boxes, masks)
        crop_h, crop_w = out.shape[1:]
        top, left = divmod(int(out[0, 0, 0]), width)
        seen.add((crop_h, crop_w, top, left))
        assert 4 <= crop_h <= 7 and 4 <= crop_w <= 7
        assert 0 <= top <= height - crop_h and 0 <= left <= width - crop_w
        torch.testing.assert_close(out, F.crop(image, top, left, crop_h, crop_w), rtol=0, atol=0)
        torch.testing.assert_close(out_boxes, F.crop(boxes, top, left, crop_h, crop_w), rtol=0, atol=0)
        assert out_boxes.canvas_size == (crop_h, crop_w)
        assert torch.equal(out_masks, masks[:, top : top + crop_h, left : left + crop_w])
    assert {s[0] for s in seen} == {4, 5, 6, 7} and {s[1] for s in seen} == {4, 5, 6, 7}
    for side in range(4, 8):  # every offset of every side, the last one included
        assert {t for h, _, t, _ in seen if h == side} == set(range(height - side + 1))
        assert {left for _, w, _, left in seen if w == side} == set(range(width - side + 1))


def test_range_crop_keeps_a_side_shorter_than_the_range() -> None:
    """As in the references, a side under ``low`` is kept whole, and one inside the range is drawn up to itself."""
    crop = RandomRangeCrop((384, 600))
    sizes = set()
    for seed in range(60):
        torch.manual_seed(seed)
        sizes.add(tuple(crop(tv_tensors.Image(torch.zeros(1, 300, 450))).shape[1:]))
    assert {h for h, _ in sizes} == {300}
    widths = {w for _, w in sizes}
    assert min(widths) >= 384 and max(widths) <= 450 and len(widths) > 20


def test_instances_cropped_away_are_dropped_with_every_instance_key() -> None:
    """A corner instance outside the crop gets a zero box; dropping removes its label, mask,
    crowd flag and area together, and the instances kept have boxes clamped to the crop."""
    image, target = _sample(40, 60)
    crop = RandomRangeCrop((20, 20))
    dropped_any = False
    for seed in range(40):
        torch.manual_seed(seed)
        out_image, out = crop(image, target)
        kept, removed = drop_degenerate_instances(out)
        n = len(kept["boxes"])
        assert n + removed == 3
        assert kept["labels"].shape == (n,) and kept["masks"].shape == (n, 20, 20)
        assert kept["iscrowd"].shape == (n,) and kept["area"].shape == (n,)
        assert (kept["boxes"] >= 0).all() and (kept["boxes"] <= 20).all()
        for box, mask in zip(kept["boxes"], kept["masks"]):  # rectangles: box == extent of the cropped mask
            assert box.tolist() == _tight(mask)
        dropped_any |= removed > 0
        assert out_image.shape == (3, 20, 20)
    assert dropped_any


def test_crop_transforms_crop_a_share_of_the_images_then_resize_like_multiscale() -> None:
    """With ``crop_prob`` 0 the output equals the multi-scale transforms'; with 1 every image is
    cropped; with 0.5 about half. Every output has the final short side (or the long-side cap),
    and boxes hold the resized extents of their masks."""
    image, target = _sample(200, 300)
    kwargs = dict(scales=[80], max_size=110, flip_prob=0.0, crop_scales=[100], crop_max_size=None,
                  crop_size_range=(40, 60))
    plain_image, plain = detection_train_transforms([80], 110, flip_prob=0.0)(image, target)
    assert plain_image.shape[1:] == (73, 110)  # 80 x 120 capped at 110
    out_image, out = detection_crop_transforms(crop_prob=0.0, **kwargs)(image, target)
    assert torch.equal(out_image, plain_image) and torch.equal(out["boxes"], plain["boxes"])

    def shape(crop_prob: float, seed: int) -> tuple[int, int]:
        torch.manual_seed(seed)
        img, tgt = detection_crop_transforms(crop_prob=crop_prob, **kwargs)(image, target)
        h, w = img.shape[1:]
        assert min(h, w) == 80 or max(h, w) == 110
        assert max(h, w) <= 110 and img.dtype == torch.float32
        kept, _ = drop_degenerate_instances(tgt)
        for box, mask in zip(kept["boxes"], kept["masks"]):
            extent = _tight(mask)
            if extent is not None:  # the nearest-neighbour mask lies within a pixel of the box
                assert all(abs(a - b) <= 1.0 for a, b in zip(box.tolist(), extent)), (box, extent)
        return int(h), int(w)

    cropped = [shape(1.0, seed) != (73, 110) for seed in range(30)]
    assert sum(cropped) >= 28  # a 40..60 crop of 100 x 150 is 2:3 only at 40 x 60
    share = sum(shape(0.5, seed) != (73, 110) for seed in range(200)) / 200
    assert 0.38 <= share <= 0.62


def test_crop_transforms_are_reproducible_from_the_seed() -> None:
    image, target = _sample(120, 90)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(detection_crop_transforms([64, 96], 160, crop_scales=[100], crop_size_range=(50, 80))(image, target))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1]["boxes"], outs[1][1]["boxes"])


def test_crop_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"crop_size_range must be \(low, high\) with 0 < low <= high, got \[600, 384\]"):
        detection_crop_transforms(crop_size_range=(600, 384))
    with pytest.raises(ValueError, match="crop_prob must be in"):
        detection_crop_transforms(crop_prob=-0.1)
    with pytest.raises(ValueError, match="crop_scales / crop_max_size: scales must be a non-empty list"):
        detection_crop_transforms(crop_scales=[])
    with pytest.raises(ValueError, match="crop_size_range"):
        COCODataModule(train_augment="multiscale_crop", crop_size_range=(0, 10))
    with pytest.raises(ValueError, match="crop_prob"):
        COCODataModule(train_augment="multiscale_crop", crop_prob=2.0)


def test_datamodule_crop_batches(coco_root: Path) -> None:
    """Training batches of ``multiscale_crop``: final short side from ``train_scales``, valid boxes
    inside the image, masks and labels aligned with them, some images cropped (their aspect ratio
    no longer the file's)."""
    dm = COCODataModule(root=str(coco_root), batch_size=4, train_augment="multiscale_crop", train_scales=[64, 80],
                        max_size=200, crop_prob=0.5, crop_scales=[96], crop_max_size=None, crop_size_range=(40, 60),
                        test_scale=64)
    dm.setup("fit")
    ds = dm.train_dataset
    assert ds is not None
    cropped = instances = 0
    for epoch in range(3):
        for index in range(len(ds)):
            torch.manual_seed(1000 * epoch + index)
            image, t = ds[index]
            h, w = image.shape[1:]
            assert min(h, w) in (64, 80) and image.dtype == torch.float32
            n = len(t["boxes"])
            assert t["masks"].shape == (n, h, w) and t["labels"].shape == (n,) and t["iscrowd"].shape == (n,)
            wh = t["boxes"][:, 2:] - t["boxes"][:, :2]
            assert (wh >= 1).all() and (t["boxes"] >= 0).all()
            assert (t["boxes"][:, 0::2] <= w).all() and (t["boxes"][:, 1::2] <= h).all()
            oh, ow = t["orig_size"]
            cropped += abs(w / h - ow / oh) > 0.05
            instances += n
    assert instances > 0 and 0 < cropped < 3 * len(ds)
    images, targets = next(iter(dm.train_dataloader()))
    assert len(images) == len(targets) == 4
