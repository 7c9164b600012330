"""Padding grids for detection batches: distinct shapes per epoch, padded pixels, and the cost of a
new shape on this device.

Multi-scale training (short side drawn from ``train_scales`` per image, long side capped) pads every
batch to its largest image, rounded up to ``size_divisibility``. Every distinct padded shape costs a
one-off set-up the first time a process meets it: cuDNN plans on a GPU (measured 0.45 s per shape
on an H100 for the published Swin-T Mask R-CNN), oneDNN primitives on the CPU, a graph under
``torch.compile``. A coarser grid bounds the shapes and pads more pixels. This module measures
both sides of that trade:

- :func:`epoch_shapes` walks one epoch of vtdense's own training batch plan
  (:class:`~vtdense.data.samplers.GroupedBatchSampler` with aspect-ratio groups, as the published
  recipe) and counts the distinct padded shapes per process, and the padded pixels relative to the
  32-pixel grid. With the published Mask R-CNN configs' DETR-style crop (``multiscale_crop``) the
  sizes come from the real training transform, run on an empty box list per image under the
  loader's per-sample seed (:func:`augmented_size`): a cropped image can change orientation after
  the sampler grouped it by its file's, as in mmdetection's grouping (detectron2 groups after the
  augmentation);
- :func:`new_shape_cost` times a training step the first time a shape is seen and again at the
  same shape, for the demo detector (CPU) or the published one (GPU);
- :func:`mask_roi_cost` does the same for Mask R-CNN's mask branch, whose batch is the step's RoI
  count, with and without :mod:`vtdense.models.mask_rois`' padding of that count.

Image sizes come from a COCO annotation file (``--ann-file``) or, without one, from a stand-in for
COCO's sizes (long side 640, short side 360..640, two thirds landscape). Run alone::

    python benchmarks/padding.py --device cpu [--ann-file instances_train2017.json]

``benchmarks/run.py`` runs it as the last section of ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torchvision import tv_tensors  # noqa: E402

from vtdense.data.samplers import EpochRandomSampler, GroupedBatchSampler, aspect_ratio_group_ids  # noqa: E402
from vtdense.data.seeding import sample_seed, seeded_rng  # noqa: E402
from vtdense.data.transforms import detection_crop_transforms, shortest_edge_size  # noqa: E402

GRIDS = (32, 64, 128)
#: The published recipe's multi-scale training (recipes/configs/coco_swin_t_maskrcnn_1x.yaml), and its crop.
PUBLISHED = dict(scales=tuple(range(480, 801, 32)), max_size=1333, test_scale=800, batch_size=2, world=8,
                 crop=dict(crop_prob=0.5, crop_scales=(400, 500, 600), crop_max_size=1333, crop_size_range=(384, 600)))
#: The CPU demo's (recipes/configs/coco_swin_demo.yaml).
DEMO = dict(scales=(112, 128, 144), max_size=256, test_scale=128, batch_size=4, world=1)


def coco_like_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` ``(height, width)`` pairs standing in for COCO's: long side 640, short side uniform in
    360..640, two thirds landscape. Use :func:`sizes_from_annotations` for the real distribution."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        short = rng.randint(360, 640)
        sizes.append((short, 640) if rng.random() < 2 / 3 else (640, short))
    return sizes


def sizes_from_annotations(path: str) -> list[tuple[int, int]]:
    """``(height, width)`` of every image of a COCO annotation file."""
    with open(path) as f:
        images = json.load(f)["images"]
    return [(int(im["height"]), int(im["width"])) for im in images]


def padded(h: int, w: int, grid: int) -> tuple[int, int]:
    """``(h, w)`` rounded up to multiples of ``grid``."""
    return math.ceil(h / grid) * grid, math.ceil(w / grid) * grid


def augmented_size(transform: Any, height: int, width: int, index: int, seed: int = 0, epoch: int = 0) -> tuple[int, int]:
    """``(height, width)`` that ``transform`` gives image ``index`` of ``height x width`` in ``epoch``:
    the transform runs on an empty box list of that canvas under the training loader's per-sample
    seed (:class:`~vtdense.data.seeding.SeededDataset`), so it makes the same draws as on the image."""
    with seeded_rng(sample_seed(seed, epoch, index)):
        out = transform(tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(height, width)))
    return int(out.canvas_size[0]), int(out.canvas_size[1])


def epoch_shapes(
    sizes: Sequence[tuple[int, int]],
    scales: Sequence[int],
    max_size: int,
    batch_size: int,
    grids: Sequence[int] = GRIDS,
    world: int = 1,
    seed: int = 0,
    crop: dict[str, Any] | None = None,
) -> dict[int, dict[str, float]]:
    """One training epoch's padded batch shapes at every grid, with the same batches and scales.

    ``crop``: :func:`~vtdense.data.transforms.detection_crop_transforms` options (``crop_prob``,
    ...); the sizes then come from that transform (:func:`augmented_size`).

    Returns:
        ``{grid: {"shapes": distinct shapes over the epoch, "shapes_per_rank": the most any of
        ``world`` processes meets (its batches ``r, r + world, ...``), "pad_fraction": padded pixels
        / image pixels, "pixels_vs_32": pixels computed relative to the 32-pixel grid}}``.
    """
    rng = random.Random(seed)
    sampler = GroupedBatchSampler(
        EpochRandomSampler(range(len(sizes)), seed=seed), batch_size, group_ids=aspect_ratio_group_ids(sizes)
    )
    if crop is None:
        batches = [[shortest_edge_size(*sizes[i], rng.choice(scales), max_size) for i in b] for b in sampler]
    else:
        transform = detection_crop_transforms(scales, max_size, **crop)
        batches = [[augmented_size(transform, *sizes[i], i, seed) for i in b] for b in sampler]
    content = sum(h * w for b in batches for h, w in b)
    out: dict[int, dict[str, float]] = {}
    for grid in grids:
        shapes = [padded(max(h for h, _ in b), max(w for _, w in b), grid) for b in batches]
        pixels = sum(len(b) * sh * sw for b, (sh, sw) in zip(batches, shapes))
        per_rank = max(len(set(shapes[r::world])) for r in range(world))
        out[grid] = dict(shapes=len(set(shapes)), shapes_per_rank=per_rank, pad_fraction=pixels / content - 1,
                         pixels=pixels)
    base = out[32]["pixels"] if 32 in out else content
    for grid in grids:
        out[grid]["pixels_vs_32"] = out[grid].pop("pixels") / base
    return out


def eval_shapes(sizes: Sequence[tuple[int, int]], test_scale: int, max_size: int,
                grids: Sequence[int] = GRIDS) -> dict[int, int]:
    """Distinct padded shapes of single-image evaluation (or prediction) at every grid."""
    resized = [shortest_edge_size(h, w, test_scale, max_size) for h, w in sizes]
    return {g: len({padded(h, w, g) for h, w in resized}) for g in grids}


def new_shape_cost(device: str, published: bool, shapes: Sequence[tuple[int, int]], batch: int) -> dict[str, float]:
    """Median seconds of a detector training step (AdamW) at a shape seen for the first time, and
    at the same shape again; ``published``: the published Swin-T Mask R-CNN heads, else the demo's."""
    from common import sync
    from contenders import _autocast, _detection_batch, build_model

    family = "maskrcnn" if published else "maskrcnn_demo"
    case: dict[str, Any] = dict(family=family, mode="train", batch=batch, size=list(shapes[0]),
                                dtype="bf16" if device == "cuda" else "fp32")
    torch.manual_seed(0)
    model = build_model("vtdense", case).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    num_classes = 80 if published else 4

    def step(size: tuple[int, int]) -> float:
        images, targets = _detection_batch(dict(case, size=list(size)), device, num_classes)
        sync(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _autocast(case, device):
            losses = model(images, targets)
        sum(losses.values()).backward()
        opt.step()
        sync(device)
        return time.perf_counter() - t

    # Warm up the process (allocator, first-call costs) at a shape not measured.
    warm = (shapes[0][0] + 64, shapes[0][1] + 64)
    step(warm)
    step(warm)
    first, again = [], []
    for size in shapes[1:]:
        first.append(step(size))
        again.append(step(size))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return dict(first_s=med(first), again_s=med(again), new_shape_s=med([a - b for a, b in zip(first, again)]),
                measured_shapes=len(first))


def mask_roi_cost(device: str, published: bool, counts: int = 8, multiple: int = 32, seed: int = 2) -> dict[str, Any]:
    """Forward and backward of the mask branch (mask head and predictor, bf16 autocast on a GPU)
    at ``counts`` RoI counts met for the first time and again, padded to ``multiple`` and not.

    The counts are drawn from the recipe's range (up to a quarter of its sampled RoIs, the positive
    fraction, over the batch), none a multiple of ``multiple``. The padded branch runs first, so the
    unpadded one meets only shapes the process has not seen. ``published``: 256 channels, 81
    classes, counts up to 256; else the CPU demo's 64 channels, 5 classes, counts up to 64."""
    from common import sync
    from torch import nn
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

    from vtdense.models.mask_rois import pad_mask_rois

    channels, classes, most = (256, 81, 256) if published else (64, 5, 64)
    rng = random.Random(seed)
    ns = rng.sample([n for n in range(1, most + 1) if n % multiple], counts)
    dtype = torch.bfloat16 if device == "cuda" else None

    def branch(pad: bool) -> nn.Module:
        torch.manual_seed(0)
        heads = nn.Module()
        heads.mask_head = MaskRCNNHeads(channels, [channels] * 4, 1)
        heads.mask_predictor = MaskRCNNPredictor(channels, channels, classes)
        if pad:
            pad_mask_rois(heads, multiple, cuda_only=False)
        return heads.to(device)

    def step(heads: nn.Module, n: int) -> float:
        x = torch.randn(n, channels, 14, 14, device=device, requires_grad=True)
        sync(device)
        t = time.perf_counter()
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = heads.mask_predictor(heads.mask_head(x))
        logits.float().square().mean().backward()
        sync(device)
        return time.perf_counter() - t

    out: dict[str, Any] = dict(counts=ns, multiple=multiple, channels=channels)
    for name, pad in (("padded", True), ("unpadded", False)):
        heads = branch(pad)
        step(heads, multiple * (most // multiple + 2))  # warm-up at a shape neither run meets again
        first, again = [], []
        for n in ns:
            first.append(step(heads, n))
            again.append(step(heads, n))
        out[name] = dict(first_s=sum(first), again_s=sum(again), shapes=len({-(-n // multiple) for n in ns}) if pad
                         else len(ns))
    return out


def run(device: str = "cpu", ann_file: str | None = None, n_images: int = 20000, cost_shapes: int = 5) -> dict[str, Any]:
    """Shape counts for the published and demo recipes, and the new-shape cost on ``device``."""
    sizes = sizes_from_annotations(ann_file) if ann_file else coco_like_sizes(n_images)
    report: dict[str, Any] = dict(device=device, images=len(sizes),
                                  sizes="annotation file" if ann_file else "COCO-like stand-in (long side 640)")
    for name, cfg in (("published", PUBLISHED), ("published, no crop", dict(PUBLISHED, crop=None)), ("demo", DEMO)):
        train = epoch_shapes(sizes, cfg["scales"], cfg["max_size"], cfg["batch_size"], world=cfg["world"],
                             crop=cfg.get("crop"))
        report[name] = dict(cfg, scales=list(cfg["scales"]), train=train,
                            eval=eval_shapes(sizes, cfg["test_scale"], cfg["max_size"]))
    published = device == "cuda"
    cfg = PUBLISHED if published else DEMO
    rng = random.Random(1)
    measure = [shortest_edge_size(*sizes[rng.randrange(len(sizes))], rng.choice(cfg["scales"]), cfg["max_size"])
               for _ in range(cost_shapes + 1)]
    seen, shapes = set(), []
    for h, w in measure:  # distinct 32-grid shapes, so every "first" is a first
        key = padded(h, w, 32)
        if key not in seen:
            seen.add(key)
            shapes.append(key)
    report["cost"] = dict(new_shape_cost(device, published, shapes, cfg["batch_size"]),
                          detector="published Swin-T Mask R-CNN, bf16" if published else "CPU demo Mask R-CNN, fp32",
                          batch=cfg["batch_size"])
    report["mask_rois"] = mask_roi_cost(device, published)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    """The report as Markdown lines (a section of RESULTS.md)."""
    lines = [f"### Padding grid: batch shapes per epoch ({report['images']} images, {report['sizes']})", "",
             "| recipe | grid | train shapes / epoch | per process | padded pixels | pixels vs grid 32 | eval shapes |",
             "|---|---|---|---|---|---|---|"]
    for name in ("published", "published, no crop", "demo"):
        if name not in report:
            continue
        r = report[name]
        for grid, t in r["train"].items():
            lines.append(f"| {name} (batch {r['batch_size']} x {r['world']} processes) | {grid} | {t['shapes']} | "
                         f"{t['shapes_per_rank']} | {100 * t['pad_fraction']:.1f}% | {t['pixels_vs_32']:.3f}x | "
                         f"{r['eval'][grid]} |")
    c = report["cost"]
    lines += ["", f"A training step of the {c['detector']} (batch {c['batch']}) on {report['device']}: "
              f"{c['first_s'] * 1000:.0f} ms the first time a shape is seen, {c['again_s'] * 1000:.0f} ms again "
              f"(median of {c['measured_shapes']} shapes): {c['new_shape_s'] * 1000:.0f} ms per new shape. "
              "A run pays that once per shape and process; the coarser grid pays its extra pixels at every step."]
    if "published, no crop" in report:
        lines += ["", "\"published\" is the Mask R-CNN configs' `multiscale_crop`: half of the images resized to a short side "
                  "of 400-600 and cropped to 384-600 per side before the multi-scale resize. The sampler groups images by "
                  "their file's orientation (as mmdetection does; detectron2 groups after the augmentation), and a crop "
                  "can turn an image, so more batches mix orientations than without the crop."]
    m = report.get("mask_rois")
    if m:
        p, u = m["padded"], m["unpadded"]
        lines += ["", f"Mask R-CNN's mask branch ({m['channels']} channels), forward and backward at "
                  f"{len(m['counts'])} RoI counts ({', '.join(map(str, sorted(m['counts'])))}), each met for the first "
                  "time and then again:", "",
                  "| mask branch | shapes met | first time, total ms | again, total ms | first - again ms |",
                  "|---|---|---|---|---|"]
        for name, r in (("unpadded", u), (f"padded to a multiple of {m['multiple']}", p)):
            lines.append(f"| {name} | {r['shapes']} | {r['first_s'] * 1000:.1f} | {r['again_s'] * 1000:.1f} | "
                         f"{(r['first_s'] - r['again_s']) * 1000:.1f} |")
        lines += ["", "vtdense pads the branch on CUDA only (`mask_rois_multiple`, default 32): there each new "
                  "shape costs cuDNN plans; on the CPU the padded rows are only extra work."]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ann-file", default=None, help="COCO annotation file whose image sizes to use")
    ap.add_argument("--images", type=int, default=20000, help="stand-in images when no --ann-file (default 20000)")
    args = ap.parse_args(argv)
    report = run(args.device, args.ann_file, args.images)
    print("\n".join(markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
