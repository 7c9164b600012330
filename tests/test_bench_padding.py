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
