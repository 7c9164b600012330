"""Large-scale jitter: output size, crop/pad geometry, boxes inside the crop and equal to their masks' extent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision import tv_tensors

from vtdense.data import COCODataModule
from vtdense.data.transforms import (
    IMAGENET_MEAN_UINT8,
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
    with pytest.raises(ValueError, match=r"train_augment must be one of \['multiscale', 'lsj'\], got 'jitter'"):
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
