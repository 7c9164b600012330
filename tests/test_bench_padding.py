"""The padding-grid benchmark counts what the training batch plan really pads to (fast, no model)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import padding  # noqa: E402


def test_shapes_and_padding_of_a_small_epoch_by_hand() -> None:
    # batch 1, one scale: every image is its own batch, resized to short side 100 (long side capped at 1000)
    sizes = [(50, 100), (100, 50), (50, 75)]  # -> (100, 200), (200, 100), (100, 150)
    out = padding.epoch_shapes(sizes, scales=[100], max_size=1000, batch_size=1, grids=(32, 128))
    assert out[32]["shapes"] == 3  # (128, 224), (224, 128), (128, 160)
    assert out[128]["shapes"] == 2  # (128, 256), (256, 128), (128, 256)
    pixels = {g: {padding.padded(h, w, g) for h, w in [(100, 200), (200, 100), (100, 150)]} for g in (32, 128)}
    assert pixels[32] == {(128, 224), (224, 128), (128, 160)}
    assert pixels[128] == {(128, 256), (256, 128)}
    content = 100 * 200 + 200 * 100 + 100 * 150
    assert abs(out[32]["pad_fraction"] - ((128 * 224 + 224 * 128 + 128 * 160) / content - 1)) < 1e-12
    assert abs(out[128]["pixels_vs_32"] - (3 * 128 * 256) / (128 * 224 + 224 * 128 + 128 * 160)) < 1e-12


def test_coarser_grids_bound_the_shapes_and_pad_more() -> None:
    sizes = padding.coco_like_sizes(2000, seed=1)
    cfg = padding.PUBLISHED
    out = padding.epoch_shapes(sizes, cfg["scales"], cfg["max_size"], cfg["batch_size"], world=cfg["world"])
    assert out[32]["shapes"] > out[64]["shapes"] > out[128]["shapes"]
    assert out[32]["pad_fraction"] < out[64]["pad_fraction"] < out[128]["pad_fraction"]
    assert out[32]["pixels_vs_32"] == 1.0 and out[128]["pixels_vs_32"] > 1.0
    for grid in (32, 64, 128):
        assert out[grid]["shapes_per_rank"] <= out[grid]["shapes"]
    ev = padding.eval_shapes(sizes, cfg["test_scale"], cfg["max_size"])
    assert ev[32] >= ev[64] >= ev[128] >= 1


def test_mask_branch_cost_meets_fewer_shapes_padded() -> None:
    out = padding.mask_roi_cost("cpu", published=False, counts=3, multiple=16)
    assert len(out["counts"]) == 3 and all(n % 16 for n in out["counts"])
    assert out["unpadded"]["shapes"] == 3
    assert out["padded"]["shapes"] == len({-(-n // 16) for n in out["counts"]}) <= 3
    for r in (out["padded"], out["unpadded"]):
        assert r["first_s"] > 0 and r["again_s"] > 0
    text = "\n".join(padding.markdown(_report(out)))
    assert "padded to a multiple of 16" in text and "| unpadded | 3 |" in text


def _report(mask: dict) -> dict:
    train = {g: dict(shapes=1, shapes_per_rank=1, pad_fraction=0.0, pixels_vs_32=1.0) for g in padding.GRIDS}
    recipe = dict(batch_size=1, world=1, train=train, eval={g: 1 for g in padding.GRIDS})
    cost = dict(detector="x", batch=1, first_s=0.2, again_s=0.1, new_shape_s=0.1, measured_shapes=1)
    return dict(images=1, sizes="s", device="cpu", published=recipe, demo=recipe, cost=cost, mask_rois=mask)


def test_augmented_size_is_the_training_transforms_output_size() -> None:
    """With the crop, the benchmark's sizes are those the training transform gives the image itself
    under the loader's per-sample seed: cropped ones and plain ones alike."""
    import torch
    from torchvision import tv_tensors

    from vtdense.data.seeding import sample_seed, seeded_rng
    from vtdense.data.transforms import detection_crop_transforms

    transform = detection_crop_transforms([64, 80], 120, crop_scales=[50], crop_size_range=(30, 45))
    sizes = [(60, 90), (90, 60), (100, 100), (40, 130)] * 5
    seen = set()
    for i, (h, w) in enumerate(sizes):
        with seeded_rng(sample_seed(3, 1, i)):
            image = transform(tv_tensors.Image(torch.zeros(3, h, w, dtype=torch.uint8)))
        got = padding.augmented_size(transform, h, w, i, seed=3, epoch=1)
        assert got == tuple(image.shape[1:])
        seen.add(got)
    assert len(seen) > 6  # crops of random sizes, not one resize per input size
    cfg = padding.PUBLISHED
    coco = padding.coco_like_sizes(200, seed=2)
    plain = padding.epoch_shapes(coco, cfg["scales"], cfg["max_size"], cfg["batch_size"], world=cfg["world"])
    cropped = padding.epoch_shapes(coco, cfg["scales"], cfg["max_size"], cfg["batch_size"], world=cfg["world"],
                                   crop=cfg["crop"])
    assert cropped != plain  # the crop changes the batches' sizes
    for grid in padding.GRIDS:
        assert 1 <= cropped[grid]["shapes_per_rank"] <= cropped[grid]["shapes"] and cropped[grid]["pad_fraction"] >= 0
