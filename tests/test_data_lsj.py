"""Large-scale jitter: output size, crop/pad geometry, boxes inside the crop and equal to their masks' extent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision import tv_tensors

from vtdense.data import COCODataModule
from torchvision.transforms.v2 import functional as F

from vtdense.data.transforms import (
    IMAGENET_MEAN_UINT8,
    FixedSizeCropPad,
    RandomScaleResize,
    detection_lsj_transforms,
    drop_degenerate_instances,
    masks_to_tight_boxes,
)


def _tight(mask: torch.Tensor) -> list[float] | None:
    """Tight XYXY box of a mask (exclusive right/bottom), or None when empty."""
    ys, xs = torch.nonzero(mask, as_tuple=True)
    if len(ys) == 0:
        return None
    return [float(xs.min()), float(ys.min()), float(xs.max()) + 1, float(ys.max()) + 1]


def _sample(height: int, width: int, num: int, seed: int) -> tuple[tv_tensors.Image, dict[str, Any]]:
    """A random image with ``num`` ellipse instances; boxes are the masks' tight boxes."""
    g = torch.Generator().manual_seed(seed)
    image = tv_tensors.Image(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=g))
    yy, xx = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    masks = []
    for _ in range(num):
        cy, cx = float(torch.rand((), generator=g)) * height, float(torch.rand((), generator=g)) * width
        ry = 2 + float(torch.rand((), generator=g)) * height / 3
        rx = 2 + float(torch.rand((), generator=g)) * width / 3
        masks.append((((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1).to(torch.uint8))
    mask = torch.stack(masks) if masks else torch.zeros((0, height, width), dtype=torch.uint8)
    boxes = torch.tensor([_tight(m) for m in mask], dtype=torch.float32).reshape(-1, 4)
    target = {
        "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
        "masks": tv_tensors.Mask(mask),
        "labels": torch.arange(1, num + 1),
        "area": mask.flatten(1).sum(1).float(),
    }
    return image, target


@pytest.mark.parametrize("height, width", [(40, 70), (90, 30), (64, 64), (5, 200)])
def test_lsj_output_size_and_boxes_match_masks(height: int, width: int) -> None:
    size = 64
    transform = detection_lsj_transforms(size, (0.1, 2.0), flip_prob=0.5)
    image, target = _sample(height, width, 6, seed=height * 1000 + width)
    for seed in range(25):
        torch.manual_seed(seed)
        out, t = transform(image, target)
        assert isinstance(out, tv_tensors.Image) and out.shape == (3, size, size) and out.dtype == torch.float32
        assert t["masks"].shape == (6, size, size) and tuple(t["boxes"].canvas_size) == (size, size)
        kept, removed = drop_degenerate_instances(t)
        boxes, masks = kept["boxes"], kept["masks"]
        assert len(boxes) == len(masks) == len(kept["labels"]) == len(kept["area"]) == 6 - removed
        assert (boxes >= 0).all() and (boxes <= size).all()  # inside the crop (and the padded canvas)
        for box, mask in zip(boxes, masks):
            assert box.tolist() == _tight(mask)  # boxes recomputed from the cropped masks
        for label, mask in zip(t["labels"], t["masks"]):  # a removed instance had nothing left in the crop
            if int(label) not in kept["labels"].tolist():
                assert _tight(mask) is None or min(_tight(mask)[2] - _tight(mask)[0], _tight(mask)[3] - _tight(mask)[1]) < 1


def test_lsj_small_scale_pads_with_the_mean_colour_and_large_scale_crops() -> None:
    image, target = _sample(40, 80, 3, seed=1)
    # scale 0.5 of 64: fit in 32x32 -> 16x32, no crop, padded bottom/right to 64x64
    out, t = detection_lsj_transforms(64, (0.5, 0.5), flip_prob=0.0)(image, target)
    fill = torch.tensor(IMAGENET_MEAN_UINT8, dtype=torch.float32).view(3, 1, 1) / 255
    assert torch.allclose(out[:, 16:, :], fill.expand(3, 48, 64), atol=1e-6)
    assert torch.allclose(out[:, :, 32:], fill.expand(3, 64, 32), atol=1e-6)
    assert not torch.isclose(out[:, :16, :32], fill, atol=1e-6).all(dim=0).all()  # the image itself
    assert not t["masks"][:, 16:, :].any() and not t["masks"][:, :, 32:].any()
    assert (t["boxes"][:, 2] <= 32).all() and (t["boxes"][:, 3] <= 16).all()
    # scale 2 of 64: fit in 128x128 -> 64x128, a 64x64 crop, nothing padded
    for seed in range(5):
        torch.manual_seed(seed)
        out, t = detection_lsj_transforms(64, (2.0, 2.0), flip_prob=0.0)(image, target)
        assert out.shape == (3, 64, 64) and not torch.isclose(out, fill, atol=1e-6).all(dim=0).any()
    # without recompute_boxes, the clamped boxes still enclose their masks
    for seed in range(10):
        torch.manual_seed(seed)
        _, t = detection_lsj_transforms(64, recompute_boxes=False)(image, target)
        for box, mask in zip(t["boxes"], t["masks"]):
            tight = _tight(mask)
            if tight is not None:
                assert box[0] - 1 <= tight[0] and box[1] - 1 <= tight[1]
                assert tight[2] <= box[2] + 1 and tight[3] <= box[3] + 1


def test_random_scale_resize_rounds_sides_and_spans_the_scale_range() -> None:
    """The image is fitted to ``size * s``: sides rounded to the nearest pixel (37 x 70 at factor
    64/70 is 33.8 x 64 -> 34 x 64), and ``s`` is drawn over the whole of ``scale_range``."""
    for shape, expected in (((37, 70), (34, 64)), ((70, 37), (64, 34)), ((40, 80), (32, 64))):
        out = RandomScaleResize(64, (1.0, 1.0))(tv_tensors.Image(torch.zeros(3, *shape, dtype=torch.uint8)))
        assert tuple(out.shape[1:]) == expected
    torch.manual_seed(0)
    longs = [RandomScaleResize(64, (0.5, 2.0))(tv_tensors.Image(torch.zeros(1, 64, 64))).shape[-1] for _ in range(200)]
    assert 32 <= min(longs) <= 36 and 124 <= max(longs) <= 128


def test_fixed_size_crop_reaches_every_offset_and_matches_torchvision_crop() -> None:
    """A 70 x 66 sample cropped to 64: every top in 0..6 and left in 0..2 occurs (the last offset
    included), and image, boxes and masks equal torchvision's own crop at that offset."""
    image = tv_tensors.Image(torch.arange(70 * 66, dtype=torch.float32).view(1, 70, 66))
    boxes = tv_tensors.BoundingBoxes(
        torch.tensor([[0.0, 0.0, 66.0, 70.0], [60.0, 2.0, 66.0, 5.0], [1.0, 65.0, 3.0, 70.0]]), format="XYXY",
        canvas_size=(70, 66),
    )
    masks = tv_tensors.Mask(torch.randint(0, 2, (3, 70, 66), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    crop = FixedSizeCropPad(64)
    offsets = set()
    for seed in range(80):
        torch.manual_seed(seed)
        out, out_boxes, out_masks = crop(image, boxes, masks)
        top, left = divmod(int(out[0, 0, 0]), 66)
        offsets.add((top, left))
        torch.testing.assert_close(out, F.crop(image, top, left, 64, 64), rtol=0, atol=0)
        torch.testing.assert_close(out_boxes, F.crop(boxes, top, left, 64, 64), rtol=0, atol=0)
        assert torch.equal(out_masks, masks[:, top : top + 64, left : left + 64])
    assert {top for top, _ in offsets} == set(range(7)) and {left for _, left in offsets} == set(range(3))


def test_lsj_flip_mirrors_image_boxes_and_masks_and_recompute_is_optional() -> None:
    """At scale 1 with nothing cropped, ``flip_prob=1`` mirrors the image region, masks and boxes
    (``x' = W - x``); ``recompute_boxes=False`` keeps the (resized, clamped) boxes as given."""
    image = tv_tensors.Image(torch.randint(0, 256, (3, 40, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    mask = torch.zeros(1, 40, 80, dtype=torch.uint8)
    mask[0, 10:20, 20:50] = 1
    target = {
        "boxes": tv_tensors.BoundingBoxes(torch.tensor([[5.0, 2.0, 70.0, 38.0]]), format="XYXY", canvas_size=(40, 80)),
        "masks": tv_tensors.Mask(mask),
    }
    out, t = detection_lsj_transforms(80, (1.0, 1.0), flip_prob=0.0)(image, target)
    out_f, t_f = detection_lsj_transforms(80, (1.0, 1.0), flip_prob=1.0)(image, target)
    torch.testing.assert_close(out[:, :40], image.float() / 255)
    torch.testing.assert_close(out_f[:, :40], out[:, :40].flip(-1))
    torch.testing.assert_close(out_f[:, 40:], out[:, 40:])  # the pad stays bottom/right
    assert torch.equal(t_f["masks"][:, :40], t["masks"][:, :40].flip(-1))
    assert t["boxes"].tolist() == [[20.0, 10.0, 50.0, 20.0]] and t_f["boxes"].tolist() == [[30.0, 10.0, 60.0, 20.0]]
    _, kept = detection_lsj_transforms(80, (1.0, 1.0), flip_prob=0.0, recompute_boxes=False)(image, target)
    _, kept_f = detection_lsj_transforms(80, (1.0, 1.0), flip_prob=1.0, recompute_boxes=False)(image, target)
    assert kept["boxes"].tolist() == [[5.0, 2.0, 70.0, 38.0]] and kept_f["boxes"].tolist() == [[10.0, 2.0, 75.0, 38.0]]


def test_masks_to_tight_boxes() -> None:
    masks = torch.zeros(3, 5, 6, dtype=torch.uint8)
    masks[0, 1:3, 2:5] = 1
    masks[1, 4, 0] = 1
    assert masks_to_tight_boxes(masks).tolist() == [[2, 1, 5, 3], [0, 4, 1, 5], [0, 0, 0, 0]]


def test_lsj_options_are_checked() -> None:
    with pytest.raises(ValueError, match="lsj_scale_range"):
        detection_lsj_transforms(64, (0.0, 1.0))
    with pytest.raises(ValueError, match="lsj_size"):
        detection_lsj_transforms(0)
    with pytest.raises(ValueError, match="flip_prob must be in"):
        detection_lsj_transforms(64, flip_prob=1.5)
    with pytest.raises(ValueError, match=r"train_augment must be one of \['multiscale', 'multiscale_crop', 'lsj'\], got 'jitter'"):
        COCODataModule(train_augment="jitter")
    with pytest.raises(ValueError, match="lsj_scale_range"):
        COCODataModule(train_augment="lsj", lsj_scale_range=(2.0, 1.0))


def test_datamodule_lsj_batches(coco_root: Path) -> None:
    dm = COCODataModule(root=str(coco_root), batch_size=4, train_augment="lsj", lsj_size=96, test_scale=64)
    dm.setup("fit")
    seen = 0
    for images, targets in dm.train_dataloader():
        for image, t in zip(images, targets):
            assert image.shape == (3, 96, 96) and image.dtype == torch.float32
            n = len(t["boxes"])
            assert t["masks"].shape == (n, 96, 96) and t["labels"].shape == (n,) and t["area"].shape == (n,)
            wh = t["boxes"][:, 2:] - t["boxes"][:, :2]
            assert (wh >= 1).all() and (t["boxes"] >= 0).all() and (t["boxes"] <= 96).all()
            for box, mask in zip(t["boxes"], t["masks"]):
                assert box.tolist() == _tight(mask)
            seen += n
    assert seen > 0
    val_images, _ = next(iter(dm.val_dataloader()))  # evaluation keeps the short-side resize
    assert min(val_images[0].shape[1:]) == 64
