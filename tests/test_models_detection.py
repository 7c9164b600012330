"""Tests for vtdense.models.detection: FPN levels per head, no-resize transform, training, fp32 boxes."""

from __future__ import annotations

import math
import re

import pytest
import torch

from vtdense import create_backbone
from vtdense.models.detection import (
    BackboneWithFPN,
    NoResizeTransform,
    build_detector,
    list_heads,
    set_size_divisibility,
)

TINY = dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), window_size=4)


def tiny_backbone() -> torch.nn.Module:
    return create_backbone("swin_tiny", **TINY)


def tiny_detector(head: str, **kwargs: object) -> torch.nn.Module:
    opts = dict(fpn_channels=32, slim_heads=True, backbone_kwargs=TINY)
    opts.update(kwargs)
    return build_detector("swin_tiny", head, 3, **opts)


def train_steps(model: torch.nn.Module, images: list, targets: list, steps: int = 8) -> tuple[list[float], list[set[str]]]:
    """A few AdamW steps on one batch: each step's total loss (finite) and its loss-term names."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses, terms = [], []
    for _ in range(steps):
        loss_dict = model(images, targets)
        terms.append(set(loss_dict))
        loss = sum(loss_dict.values())
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, terms


def toy_batch(with_masks: bool) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Two non-square images whose sides are not multiples of 32, with boxes and masks."""
    g = torch.Generator().manual_seed(0)
    sizes = [(72, 100), (90, 61)]
    boxes = [torch.tensor([[8.0, 10.0, 50.0, 60.0], [55.0, 5.0, 95.0, 40.0]]), torch.tensor([[4.0, 20.0, 40.0, 85.0]])]
    labels = [torch.tensor([1, 3]), torch.tensor([2])]
    images, targets = [], []
    for (h, w), b, lab in zip(sizes, boxes, labels):
        img = torch.rand(3, h, w, generator=g) * 0.2
        masks = torch.zeros(len(b), h, w, dtype=torch.uint8)
        for i, (x0, y0, x1, y1) in enumerate(b.long().tolist()):
            img[lab[i] - 1, y0:y1, x0:x1] = 0.9  # class = colour channel, so it is learnable
            masks[i, y0:y1, x0:x1] = 1
        t = {"boxes": b, "labels": lab}
        if with_masks:
            t["masks"] = masks
        images.append(img)
        targets.append(t)
    return images, targets


@pytest.mark.parametrize(
    ("head", "names", "strides"),
    [
        ("mask_rcnn", ["p2", "p3", "p4", "p5", "pool"], [4, 8, 16, 32, 64]),
        ("faster_rcnn", ["p2", "p3", "p4", "p5", "pool"], [4, 8, 16, 32, 64]),
        ("retinanet", ["p3", "p4", "p5", "p6", "p7"], [8, 16, 32, 64, 128]),
        ("fcos", ["p3", "p4", "p5", "p6", "p7"], [8, 16, 32, 64, 128]),
    ],
)
def test_pyramid_levels_per_head(head: str, names: list[str], strides: list[int]) -> None:
    model = tiny_detector(head)
    neck = model.backbone
    assert isinstance(neck, BackboneWithFPN)
    assert neck.level_names == names and neck.level_strides == strides
    assert neck.out_channels == 32
    # Non-square input whose sides are not multiples of 32: every level is ceil(size / stride).
    h, w = 96, 160
    with torch.no_grad():
        feats = neck(torch.rand(1, 3, h, w))
    assert list(feats) == names
    for name, stride in zip(names, strides):
        assert feats[name].shape == (1, 32, math.ceil(h / stride), math.ceil(w / stride)), name
    # Anchors: one set of anchors per pyramid level.
    anchor_gen = model.rpn.anchor_generator if hasattr(model, "rpn") else model.anchor_generator
    assert len(anchor_gen.sizes) == len(names)


def test_rcnn_roi_pools_use_fpn_levels_only() -> None:
    model = tiny_detector("mask_rcnn")
    assert model.roi_heads.box_roi_pool.featmap_names == ["p2", "p3", "p4", "p5"]
    assert model.roi_heads.mask_roi_pool.featmap_names == ["p2", "p3", "p4", "p5"]
    assert [s[0] for s in model.rpn.anchor_generator.sizes] == [32, 64, 128, 256, 512]


def test_p6p7_source() -> None:
    # RetinaNet builds P6 from C5 (backbone channels), FCOS from P5 (FPN channels), both overridable.
    c5 = tiny_backbone().out_channels[-1]
    retina = tiny_detector("retinanet")
    assert retina.backbone.fpn.extra_blocks.p6.in_channels == c5 and not retina.backbone.fpn.extra_blocks.use_P5
    fcos = tiny_detector("fcos")
    assert fcos.backbone.fpn.extra_blocks.p6.in_channels == 32 and fcos.backbone.fpn.extra_blocks.use_P5
    retina_p5 = tiny_detector("retinanet", p6p7_from="p5")
    assert retina_p5.backbone.fpn.extra_blocks.p6.in_channels == 32 and retina_p5.backbone.fpn.extra_blocks.use_P5
    assert [s[0] for s in fcos.anchor_generator.sizes] == [8, 16, 32, 64, 128]


def test_heads_built_without_running_the_backbone(monkeypatch: pytest.MonkeyPatch) -> None:
    backbone = tiny_backbone()

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the builder must not run the backbone")

    monkeypatch.setattr(backbone, "forward", boom)
    for head in list_heads():
        build_detector(backbone, head, 2, fpn_channels=32, slim_heads=True)


def test_slim_and_published_head_sizes() -> None:
    slim = tiny_detector("mask_rcnn")
    assert slim.roi_heads.box_head.fc7.out_features == 256
    assert slim.roi_heads.mask_head[0][0].out_channels == 64
    assert slim.roi_heads.fg_bg_sampler.batch_size_per_image == 64
    full = tiny_detector("mask_rcnn", slim_heads=False)
    assert full.roi_heads.box_head.fc7.out_features == 1024
    assert len(full.roi_heads.mask_head) == 4 and full.roi_heads.mask_head[0][0].out_channels == 256
    assert full.roi_heads.fg_bg_sampler.batch_size_per_image == 512
    assert full.roi_heads.box_predictor.cls_score.out_features == 4  # 3 classes + background
    custom = tiny_detector("mask_rcnn", mask_head_channels=16, box_head_width=48, rois_per_image=32)
    assert custom.roi_heads.box_head.fc7.out_features == 48
    assert custom.roi_heads.mask_predictor.mask_fcn_logits.out_channels == 4


def test_transform_pads_and_normalises_but_never_resizes() -> None:
    model = tiny_detector("faster_rcnn")
    assert isinstance(model.transform, NoResizeTransform)
    images = [torch.rand(3, 70, 90), torch.rand(3, 45, 130)]
    boxes = torch.tensor([[1.0, 2.0, 30.0, 40.0]])
    for training in (True, False):
        model.transform.train(training)
        batch, targets = model.transform(images, [{"boxes": boxes.clone(), "labels": torch.tensor([1])}] * 2)
        assert batch.image_sizes == [(70, 90), (45, 130)]
        assert batch.tensors.shape == (2, 3, 96, 160)  # padded to multiples of 32
        assert torch.equal(targets[0]["boxes"], boxes)
        mean = torch.tensor(model.transform.image_mean)[:, None, None]
        std = torch.tensor(model.transform.image_std)[:, None, None]
        assert torch.allclose(batch.tensors[1, :, :45, :130], (images[1] - mean) / std)
        assert batch.tensors[1, :, 45:, :].abs().sum() == 0


def test_size_divisibility_pads_batches_to_a_coarser_grid() -> None:
    images = [torch.rand(3, 70, 90), torch.rand(3, 45, 130)]
    model = tiny_detector("faster_rcnn", size_divisibility=128).eval()
    batch, _ = model.transform(images)
    assert batch.tensors.shape == (2, 3, 128, 256) and batch.image_sizes == [(70, 90), (45, 130)]
    with torch.no_grad():
        dets = model(images)
    for det, (h, w) in zip(dets, batch.image_sizes):  # detections stay inside each image, not the padding
        assert (det["boxes"][:, 2] <= w).all() and (det["boxes"][:, 3] <= h).all()
    assert set_size_divisibility(model, None) == 32
    assert model.transform(images)[0].tensors.shape == (2, 3, 96, 160)
    assert set_size_divisibility(model, 64) == 64
    assert model.transform(images)[0].tensors.shape == (2, 3, 128, 192)
    for bad in (48, 0, -32, 64.0, True):
        with pytest.raises(ValueError, match=rf"size_divisibility={bad!r}: must be a positive multiple of the backbone's size_divisibility \(32\)"):
            set_size_divisibility(model, bad)
    with pytest.raises(ValueError, match="size_divisibility=100"):
        tiny_detector("fcos", size_divisibility=100)


@pytest.mark.parametrize("head", ["mask_rcnn", "faster_rcnn", "retinanet", "fcos"])
def test_training_steps_reduce_the_loss(head: str) -> None:
    torch.manual_seed(0)
    model = tiny_detector(head, anchor_sizes=None)
    images, targets = toy_batch(with_masks=head == "mask_rcnn")
    losses, terms = train_steps(model, images, targets)
    expected = {
        "mask_rcnn": {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"},
        "faster_rcnn": {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"},
        "retinanet": {"classification", "bbox_regression"},
        "fcos": {"classification", "bbox_regression", "bbox_ctrness"},
    }[head]
    assert all(t == expected for t in terms)
    assert min(losses[-3:]) < 0.9 * losses[0], losses

    # Inference returns detections in the coordinates of the images given (no resize).
    model.eval()
    with torch.no_grad():
        dets = model(images)
    for img, det in zip(images, dets):
        h, w = img.shape[-2:]
        assert det["boxes"].dtype == torch.float32
        if len(det["boxes"]):
            assert det["boxes"][:, 2].max() <= w and det["boxes"][:, 3].max() <= h
        if head == "mask_rcnn":
            assert det["masks"].shape[1:] == (1, h, w)


def test_box_math_stays_fp32_under_autocast() -> None:
    torch.manual_seed(0)
    model = tiny_detector("mask_rcnn")
    images, targets = toy_batch(with_masks=True)
    seen: dict[str, torch.dtype] = {}

    def record(key: str, pick: int) -> object:
        def hook(module: torch.nn.Module, args: object, out: tuple) -> None:
            first = out[pick][0] if isinstance(out[pick], list) else out[pick]
            seen.setdefault(key, first.dtype)

        return hook

    model.backbone.register_forward_hook(lambda m, args, out: seen.update(fpn=next(iter(out.values())).dtype) and None)
    model.rpn.head.register_forward_hook(record("rpn", 1))
    model.roi_heads.box_predictor.register_forward_hook(record("box", 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()
        losses = model(images, targets)
        model.eval()
        with torch.no_grad():
            dets = model(images)
    assert all(torch.isfinite(v) for v in losses.values())
    assert seen == {"fpn": torch.bfloat16, "rpn": torch.float32, "box": torch.float32}  # bf16 features, fp32 box math
    assert dets[0]["boxes"].dtype == torch.float32 and dets[0]["scores"].dtype == torch.float32


def test_bad_options_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown detection head 'yolo'.*fcos.*mask_rcnn"):
        build_detector("swin_tiny", "yolo", 3, backbone_kwargs=TINY)
    with pytest.raises(ValueError, match=r"unknown backbone 'resnet50'.*swin_tiny"):
        build_detector("resnet50", "mask_rcnn", 3)
    with pytest.raises(ValueError, match="anchor_sizes has 2 entries but the pyramid has 5 levels"):
        tiny_detector("mask_rcnn", anchor_sizes=[16, 32])
    with pytest.raises(ValueError, match="p6p7_from"):
        tiny_detector("retinanet", p6p7_from="c4")
    with pytest.raises(ValueError, match="fpn_channels=48: the fcos head"):
        tiny_detector("fcos", fpn_channels=48)
    with pytest.raises(ValueError, match="num_classes"):
        build_detector(tiny_backbone(), "mask_rcnn", 0)
    # widths and counts that built a detector failing at its first forward (fpn_channels=0), or
    # one that never detects anything (detections_per_img=0, score_thresh=2)
    for bad, message in ((dict(fpn_channels=0), "fpn_channels must be a positive int (option 'fpn_channels'), got 0"),
                         (dict(detections_per_img=0), "detections_per_img must be a positive int (option 'detections_per_img')"),
                         (dict(box_head_width=-8), "box_head_width must be a positive int or None (option 'box_head_width')"),
                         (dict(score_thresh=2.0), "score_thresh must be a number in [0, 1] (option 'score_thresh'), got 2.0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            tiny_detector("mask_rcnn", **bad)


def test_mvitv2_mask_rcnn_with_hybrid_windows_trains() -> None:
    """The second backbone family in a detector: MViTv2 with hybrid windows (padding masked)."""
    torch.manual_seed(0)
    mvit = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8, drop_path_rate=0.0)
    model = build_detector("mvitv2_tiny", "mask_rcnn", 3, fpn_channels=32, slim_heads=True, backbone_kwargs=mvit)
    assert model.backbone.body.window_size == 8
    images, targets = toy_batch(with_masks=True)
    losses, _ = train_steps(model, images, targets)
    assert min(losses[-3:]) < 0.9 * losses[0], losses
