"""The detectors follow their references (mmdet 2.x Swin Mask R-CNN / RetinaNet, detectron2 MViTv2):
every parameter trains (DDP-safe), anchors at fixed level strides, 1000 training proposals, L1 box
losses, adaptive and aligned RoIAlign sampling, binary aligned mask targets, RetinaNet losses
normalised over the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import sigmoid_focal_loss

import vtdense.models.rcnn_waits as rcnn_waits
import vtdense.models.retinanet_waits as retinanet_waits
import vtdense.models.roi_pool as roi_pool
from tests.test_models_detection import TINY, tiny_detector, toy_batch
from vtdense import create_backbone
from vtdense.models.detection import build_detector

MVIT = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8, drop_path_rate=0.0)
HEADS = ["mask_rcnn", "faster_rcnn", "retinanet", "fcos"]


def _tiny(backbone: str, head: str, **kwargs: object) -> torch.nn.Module:
    kw = TINY if backbone == "swin_tiny" else MVIT
    return build_detector(backbone, head, 3, fpn_channels=32, slim_heads=True, backbone_kwargs=kw, **kwargs)


def _graph_like_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heads take the paths they take while a graph is built (torchvision's code, except losses)."""
    for mod in (rcnn_waits, retinanet_waits, roi_pool):
        monkeypatch.setattr(mod, "tracing", lambda: True)


# ---------------------------------------------------------------- 1. every parameter gets a gradient


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("backbone", ["swin_tiny", "mvitv2_tiny"])
def test_one_training_step_gives_every_parameter_a_gradient(backbone: str, head: str) -> None:
    torch.manual_seed(0)
    model = _tiny(backbone, head).train()
    images, targets = toy_batch(with_masks=head == "mask_rcnn")
    sum(model(images, targets).values()).backward()
    without = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert without == []
    body = model.backbone.body
    assert min(body.out_strides) == (8 if head in ("retinanet", "fcos") else 4)
    assert list(body.out_names) == [n for n in body.out_names if n in model.backbone.in_names]


def test_backbone_weights_and_old_detector_state_dicts_still_load() -> None:
    torch.manual_seed(0)
    full = create_backbone("swin_tiny", **TINY)  # all four outputs, out_norms.stage1 included
    model = build_detector("swin_tiny", "retinanet", 3, fpn_channels=32, backbone_kwargs=TINY,
                           backbone_weights=full.state_dict())
    body = model.backbone.body
    assert body.out_names == ["stage2", "stage3", "stage4"] and body.config["out_indices"] == (1, 2, 3)
    assert not body.load_report.missing and not body.load_report.unexpected
    ours = body.state_dict()
    for k, v in full.state_dict().items():
        if k in ours:
            assert torch.equal(ours[k], v), k
    # a detector saved with the stride-4 output norm (before this change) loads strictly
    old = build_detector("swin_tiny", "retinanet", 3, fpn_channels=32,
                         backbone_kwargs={**TINY, "out_indices": (0, 1, 2, 3)})
    assert "backbone.body.out_norms.stage1.weight" in old.state_dict()
    model.load_state_dict(old.state_dict())
    assert torch.equal(model.backbone.body.out_norms.stage2.weight, old.backbone.body.out_norms.stage2.weight)
    # but a norm of an output the backbone does emit is never dropped silently
    plain = build_detector("swin_tiny", "retinanet", 3, fpn_channels=32, backbone_kwargs={**TINY, "out_norm": False})
    with pytest.raises(RuntimeError, match="out_norms.stage2"):
        plain.load_state_dict(model.state_dict())


# ---------------------------------------------------------------- 2. anchors at fixed strides


@pytest.mark.parametrize(("head", "strides"), [("mask_rcnn", [4, 8, 16, 32, 64]), ("retinanet", [8, 16, 32, 64, 128])])
def test_anchor_centres_sit_at_the_fixed_level_strides(head: str, strides: list[int]) -> None:
    model = tiny_detector(head).eval()
    gen = model.rpn.anchor_generator if head == "mask_rcnn" else model.anchor_generator
    h, w = 800, 1088  # 800 / 32 = 25 is odd: P6 has 13 rows (800 // 13 = 61), P7 7 (800 // 7 = 114)
    with torch.no_grad():
        feats = list(model.backbone(torch.zeros(1, 3, h, w)).values())
    grids = [tuple(f.shape[-2:]) for f in feats]
    assert grids[-1] == ((13, 17) if head == "mask_rcnn" else (7, 9))
    anchors = gen(ImageList(torch.zeros(1, 3, h, w), [(h, w)]), feats)[0]
    per_cell = gen.num_anchors_per_location()
    levels = anchors.split([a * gh * gw for a, (gh, gw) in zip(per_cell, grids)])
    for level, stride, (gh, gw), a in zip(levels, strides, grids, per_cell):
        centres = ((level[:, :2] + level[:, 2:]) / 2).reshape(gh, gw, a, 2)
        # torchvision rounds its cell anchors, so a centre can sit half a pixel off the cell's corner
        ys = torch.arange(gh, dtype=torch.float32)[:, None, None] * stride
        xs = torch.arange(gw, dtype=torch.float32)[None, :, None] * stride
        assert (centres[..., 1] - ys).abs().max() <= 0.5, stride
        assert (centres[..., 0] - xs).abs().max() <= 0.5, stride
    last = levels[-1][-per_cell[-1]:]
    centre = ((last[:, :2] + last[:, 2:]) / 2).mean(0)
    assert centre.tolist() == pytest.approx([1024.0, 768.0], abs=0.5)  # mmdet / detectron2: (16, 12) * 64 or (8, 6) * 128


# ---------------------------------------------------------------- 3. proposals in training


def test_rpn_keeps_1000_proposals_per_image_in_training() -> None:
    for slim in (True, False):
        model = tiny_detector("faster_rcnn", slim_heads=slim)
        assert model.rpn._post_nms_top_n == {"training": 1000, "testing": 1000}
        assert model.rpn._pre_nms_top_n == {"training": 2000, "testing": 1000}
    custom = tiny_detector("mask_rcnn", head_kwargs={"rpn_post_nms_top_n_train": 2000})
    assert custom.rpn._post_nms_top_n["training"] == 2000  # head_kwargs still override it


# ---------------------------------------------------------------- 4. L1 box losses


def _rpn_case() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], float]:
    """Objectness and deltas of two images' 6 anchors (3 positives, all sampled), deltas within 1/9
    of their targets where smooth L1 (beta 1/9) and L1 differ, and the hand-computed L1 loss."""
    labels = [torch.tensor([1.0, 0.0, 1.0, 0.0, -1.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, -1.0, 0.0, 0.0])]
    targets = [torch.full((6, 4), 0.5), torch.full((6, 4), -0.25)]
    deltas = torch.cat(targets) + torch.tensor([0.05, -0.02, 0.1, 0.0]).repeat(12, 1)
    deltas.requires_grad_()
    objectness = torch.linspace(-2, 2, 12)[:, None]
    # positives: image 0 anchors 0 and 2, image 1 anchor 1 -> 3 * (0.05 + 0.02 + 0.1 + 0) over 10 sampled
    return objectness, deltas, labels, targets, 3 * 0.17 / 10


@pytest.mark.parametrize("graph", [False, True])
def test_rpn_box_loss_is_l1(graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if graph:
        _graph_like_tracing(monkeypatch)
    rpn = tiny_detector("mask_rcnn").rpn
    rpn.fg_bg_sampler.batch_size_per_image = 256  # every labelled anchor is sampled
    objectness, deltas, labels, targets, expected = _rpn_case()
    torch.manual_seed(0)
    cls_loss, box_loss = rpn.compute_loss(objectness, deltas, labels, targets)
    assert box_loss.item() == pytest.approx(expected, rel=1e-5)
    sampled = torch.cat(labels) >= 0
    want = F.binary_cross_entropy_with_logits(objectness[:, 0][sampled], torch.cat(labels)[sampled])
    assert cls_loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert rpn.box_loss_beta == 0.0
    rpn.box_loss_beta = 1 / 9  # torchvision's: smooth L1, 0.5 * d^2 / beta below beta
    _, smooth = rpn.compute_loss(objectness, deltas, labels, targets)
    assert smooth.item() == pytest.approx(3 * 4.5 * (0.05**2 + 0.02**2 + 0.1**2) / 10, rel=1e-5)


@pytest.mark.parametrize("graph", [False, True])
def test_roi_box_loss_is_l1(graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if graph:
        _graph_like_tracing(monkeypatch)
    torch.manual_seed(0)
    model = tiny_detector("faster_rcnn").train()
    heads = model.roi_heads
    images, targets = toy_batch(with_masks=False)
    batch, targets = model.transform(images, targets)
    feats = model.backbone(batch.tensors)
    g = torch.Generator().manual_seed(1)
    proposals = [t["boxes"].repeat(20, 1) + torch.randn(20 * len(t["boxes"]), 4, generator=g) * 6 for t in targets]
    proposals = [torch.cat([p[:, :2].clamp(min=0), p[:, :2].clamp(min=0) + (p[:, 2:] - p[:, :2]).abs() + 2], 1)
                 for p in proposals]
    torch.manual_seed(3)
    props, _, labels, reg_targets = heads.select_training_samples([p.clone() for p in proposals], targets)
    seen = {}
    heads.box_predictor.register_forward_hook(lambda m, a, out: seen.update(deltas=out[1]) and None)
    torch.manual_seed(3)
    _, losses = heads(feats, [p.clone() for p in proposals], batch.image_sizes, targets)
    labels_all, reg_all = torch.cat(labels), torch.cat(reg_targets)
    pos = labels_all > 0
    assert pos.sum() > 0
    deltas = seen["deltas"].reshape(len(labels_all), -1, 4)[pos, labels_all[pos]]
    expected = (deltas - reg_all[pos]).abs().sum() / len(labels_all)
    torch.testing.assert_close(losses["loss_box_reg"], expected, rtol=1e-5, atol=1e-7)
    assert heads.box_loss_beta == 0.0


@pytest.mark.parametrize("head", ["mask_rcnn", "retinanet"])
def test_graph_paths_give_the_eager_losses(head: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a graph is built the heads run torchvision's code for matching, sampling and pooling,
    but the losses are the reference's all the same."""
    torch.manual_seed(0)
    model = tiny_detector(head).train()
    images, targets = toy_batch(with_masks=head == "mask_rcnn")
    results = []
    for graph in (False, True):
        if graph:
            _graph_like_tracing(monkeypatch)
        torch.manual_seed(7)
        results.append(model(images, targets))
    eager, traced = results
    assert eager.keys() == traced.keys()
    for k in eager:
        torch.testing.assert_close(eager[k], traced[k], rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------- 5. RoIAlign sampling


def test_roi_align_samples_adaptively() -> None:
    heads = tiny_detector("mask_rcnn").roi_heads
    assert heads.box_roi_pool.sampling_ratio == 0 and heads.mask_roi_pool.sampling_ratio == 0


# ---------------------------------------------------------------- 6. RetinaNet normalisation


def _retina_batch(empty_second: bool) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:
    """Image 0: 12 foreground anchors of 4 objects; image 1: 1 foreground anchor of 1 object (or none)."""
    g = torch.Generator().manual_seed(4)
    anchors = []
    for _ in range(2):
        xy = torch.rand(80, 2, generator=g) * 60
        anchors.append(torch.cat([xy, xy + torch.rand(80, 2, generator=g) * 20 + 4], 1))
    t0 = {"boxes": torch.tensor([[0.0, 0, 30, 30], [10, 10, 50, 40], [40, 0, 70, 20], [5, 30, 25, 70]]),
          "labels": torch.tensor([1, 2, 3, 1])}
    m0 = torch.full((80,), -1)
    m0[:12] = torch.arange(12) % 4
    m0[12:20] = -2  # ignored
    if empty_second:
        t1, m1 = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}, torch.full((80,), -1)
    else:
        t1 = {"boxes": torch.tensor([[20.0, 20, 60, 60]]), "labels": torch.tensor([2])}
        m1 = torch.full((80,), -1)
        m1[5] = 0
        m1[30:34] = -2
    return [t0, t1], anchors, [m0, m1]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("empty_second", [False, True])
def test_retinanet_losses_are_normalised_over_the_batch(empty_second: bool, graph: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if graph:
        _graph_like_tracing(monkeypatch)
    model = tiny_detector("retinanet")
    cls_head, reg_head = model.head.classification_head, model.head.regression_head
    targets, anchors, matched = _retina_batch(empty_second)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 80, cls_head.num_classes, generator=g)
    deltas = torch.randn(2, 80, 4, generator=g) * 0.3
    outputs = {"cls_logits": logits, "bbox_regression": deltas}
    cls_sum, reg_sum = torch.tensor(0.0), torch.tensor(0.0)
    for t, lg, d, a, m in zip(targets, logits, deltas, anchors, matched):  # by hand, anchor by anchor
        for i in range(80):
            if m[i] == -2:
                continue
            want = torch.zeros(cls_head.num_classes)
            if m[i] >= 0:
                want[t["labels"][m[i]]] = 1
                reg_sum = reg_sum + (d[i] - reg_head.box_coder.encode_single(t["boxes"][m[i]][None], a[i][None])[0]).abs().sum()
            cls_sum = cls_sum + sigmoid_focal_loss(lg[i], want, reduction="sum")
    normaliser = 12 + 1  # mmdet: sum over images of max(1, foreground anchors)
    cls_loss = cls_head.compute_loss(targets, outputs, matched)
    reg_loss = reg_head.compute_loss(targets, outputs, anchors, matched)
    torch.testing.assert_close(cls_loss, cls_sum / normaliser, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reg_loss, reg_sum / normaliser, rtol=1e-5, atol=1e-6)
    assert cls_head.loss_normalization == reg_head.loss_normalization == "batch"
    per_image = build_detector("swin_tiny", "retinanet", 3, fpn_channels=32, backbone_kwargs=TINY, retinanet_loss_norm="image")
    assert per_image.head.classification_head.loss_normalization == "image"


def test_new_options_are_checked() -> None:
    with pytest.raises(ValueError, match="retinanet_loss_norm='anchor'"):
        tiny_detector("retinanet", retinanet_loss_norm="anchor")
    with pytest.raises(ValueError, match="box_loss_beta"):
        tiny_detector("mask_rcnn", box_loss_beta=-1.0)
    smooth = tiny_detector("mask_rcnn", box_loss_beta=1 / 9)
    assert smooth.rpn.box_loss_beta == smooth.roi_heads.box_loss_beta == pytest.approx(1 / 9)


# ---------------------------------------------------------------- 7. P7 and the box head's initialisation


def test_retinanet_p7_comes_from_p6_without_relu_and_fcos_keeps_it() -> None:
    torch.manual_seed(0)
    x = torch.rand(1, 3, 256, 256)
    for head, relu in (("retinanet", False), ("fcos", True)):
        neck = tiny_detector(head).backbone.eval()
        with torch.no_grad():
            feats = neck(x)
            p6 = feats["p6"]
            want = neck.fpn.extra_blocks.p7(F.relu(p6) if relu else p6)
        assert (p6 < 0).any()  # the ReLU would change something
        torch.testing.assert_close(feats["p7"], want)


def test_box_head_starts_as_mmdet_initialises_it() -> None:
    torch.manual_seed(0)
    heads = tiny_detector("faster_rcnn", slim_heads=False).roi_heads
    pred, fc6 = heads.box_predictor, heads.box_head.fc6
    assert pred.cls_score.weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert pred.bbox_pred.weight.std().item() == pytest.approx(0.001, rel=0.1)
    assert not pred.cls_score.bias.any() and not pred.bbox_pred.bias.any() and not fc6.bias.any()
    bound = (6 / (fc6.in_features + fc6.out_features)) ** 0.5  # Xavier uniform
    assert fc6.weight.abs().max().item() <= bound and fc6.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.05)


# ---------------------------------------------------------------- 8. aligned RoIAlign and binary mask targets


def _pyramid_and_rois() -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[tuple[int, int]]]:
    """Four FPN levels of a 2-image batch at 128x192, and RoIs of every size (so every level pools)."""
    g = torch.Generator().manual_seed(3)
    x = {name: torch.randn(2, 8, 128 // s, 192 // s, generator=g) for name, s in zip(("0", "1", "2", "3"), (4, 8, 16, 32))}
    boxes = []
    for _ in range(2):
        xy = torch.rand(24, 2, generator=g) * 100
        wh = torch.cat([torch.rand(12, 2, generator=g) * 20 + 2, torch.rand(12, 2, generator=g) * 150 + 40])
        boxes.append(torch.cat([xy, xy + wh], 1))
    return x, boxes, [(128, 192)] * 2


def _pooled_by_hand(pool: torch.nn.Module, x: dict, boxes: list, aligned: bool) -> torch.Tensor:
    """Each RoI pooled alone by torchvision's roi_align from the level the pooler assigns it."""
    from torchvision.ops import roi_align

    levels = pool.map_levels(boxes)
    rois = torch.cat([torch.cat([torch.full((len(b), 1), float(i)), b], 1) for i, b in enumerate(boxes)])
    maps = list(x.values())
    return torch.cat([roi_align(maps[lv], r[None], pool.output_size, spatial_scale=pool.scales[lv],
                                sampling_ratio=pool.sampling_ratio, aligned=aligned) for r, lv in zip(rois, levels.tolist())])


@pytest.mark.parametrize("graph", [False, True])
def test_rois_are_pooled_with_the_half_pixel_offset(graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The box and mask poolers sample as ``roi_align(aligned=True)`` (mmdet's RoIAlign, detectron2's
    ROIAlignV2), eagerly and in the per-level form graphs trace; ``roi_aligned=False`` keeps torchvision's."""
    from torchvision.ops import MultiScaleRoIAlign

    heads = tiny_detector("mask_rcnn").roi_heads
    assert heads.box_roi_pool.aligned and heads.mask_roi_pool.aligned
    assert heads.aligned_mask_targets and heads.binary_mask_targets
    if graph:
        _graph_like_tracing(monkeypatch)
    x, boxes, shapes = _pyramid_and_rois()
    for pool in (heads.box_roi_pool, heads.mask_roi_pool):
        pool.featmap_names = list(x)
        out = pool(x, boxes, shapes)
        torch.testing.assert_close(out, _pooled_by_hand(pool, x, boxes, aligned=True), rtol=0, atol=1e-6)
        assert not torch.allclose(out, _pooled_by_hand(pool, x, boxes, aligned=False), atol=1e-3)
    plain = tiny_detector("mask_rcnn", roi_aligned=False, binary_mask_targets=False).roi_heads
    reference = MultiScaleRoIAlign(list(x), 7, sampling_ratio=0)
    plain.box_roi_pool.featmap_names = list(x)
    torch.testing.assert_close(plain.box_roi_pool(x, boxes, shapes), reference(x, boxes, shapes), rtol=0, atol=0)
    assert not (plain.aligned_mask_targets or plain.binary_mask_targets)


def test_mask_targets_are_aligned_and_binary_as_the_references_make_them() -> None:
    """A box that exactly covers an object gets an all-ones target (mmdet's / detectron2's
    crop_and_resize); torchvision's samples half a pixel off and fades the bottom and right edges."""
    from torchvision.models.detection.roi_heads import maskrcnn_loss, project_masks_on_boxes

    from vtdense.models.mask_targets import mask_loss, mask_targets

    masks = torch.zeros(2, 40, 48, dtype=torch.uint8)
    masks[0, 8:24, 8:24] = 1
    masks[1, 20:36, 4:44] = 1
    boxes = torch.tensor([[8.0, 8.0, 24.0, 24.0], [4.0, 20.0, 44.0, 36.0], [0.0, 0.0, 16.0, 16.0]])
    matched = torch.tensor([0, 1, 0])
    ours = mask_targets(masks, boxes, matched, 4)
    assert torch.equal(ours[0], torch.ones(4, 4)) and torch.equal(ours[1], torch.ones(4, 4))
    # the third box covers the object's top-left quarter: its bottom-right quarter, all ones, the rest zeros
    assert torch.equal(ours[2], torch.tensor([[0.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]))
    tv = project_masks_on_boxes(masks, boxes, matched, 4)
    torch.testing.assert_close(mask_targets(masks, boxes, matched, 4, aligned=False, binary=False), tv, rtol=0, atol=0)
    assert tv[0, -1].max() < 1 and tv[0, :, -1].max() < 1  # torchvision's fade at the far edges
    assert set(ours.unique().tolist()) <= {0.0, 1.0}

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 4, 4, generator=g)
    labels = [torch.tensor([2, 3])]
    args = (logits, [boxes], [masks], labels, [matched])
    torch.testing.assert_close(mask_loss(*args, aligned=False, binary=False), maskrcnn_loss(*args), rtol=0, atol=0)
    picked = logits[torch.arange(3), labels[0][matched]]
    torch.testing.assert_close(mask_loss(*args), F.binary_cross_entropy_with_logits(picked, ours))


def test_roi_alignment_options_are_checked_kept_by_old_checkpoints_and_by_export(tmp_path) -> None:
    """A DetectionTask checkpoint saved before the options existed loads with torchvision's pooling and
    targets, as it was trained; ONNX below opset 16 cannot express aligned RoIAlign: one clear error."""
    import lightning as L

    import vtdense
    from vtdense.tasks.detection import DetectionTask

    with pytest.raises(ValueError, match="roi_aligned must be True or False"):
        tiny_detector("mask_rcnn", roi_aligned="yes")
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, num_classes=3, fpn_channels=32, slim_heads=True)
    hparams = {k: v for k, v in task.hparams.items() if k not in ("roi_aligned", "binary_mask_targets")}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": L.__version__}, path)
    old = DetectionTask.load_from_checkpoint(path)
    heads = old.model.roi_heads
    assert not (heads.box_roi_pool.aligned or heads.mask_roi_pool.aligned or heads.aligned_mask_targets
                or heads.binary_mask_targets)
    assert old.hparams.roi_aligned is False and DetectionTask.from_checkpoint(path).model.roi_heads.box_roi_pool.aligned is False
    asked = DetectionTask.from_checkpoint(path, roi_aligned=True, binary_mask_targets=True)  # an explicit override wins
    assert asked.hparams.roi_aligned and asked.model.roi_heads.box_roi_pool.aligned and asked.model.roi_heads.binary_mask_targets
    lit = DetectionTask.load_from_checkpoint(path, roi_aligned=True, map_location="cpu")  # Lightning's loader too
    assert lit.hparams.roi_aligned and lit.model.roi_heads.box_roi_pool.aligned and not lit.model.roi_heads.binary_mask_targets
    assert DetectionTask.load_from_checkpoint(path).model.roi_heads.box_roi_pool.aligned is False  # without it: as trained
    with pytest.raises(ValueError, match="opset=15.*opset >= 16"):
        vtdense.export(task.model, tmp_path / "det.onnx", input_size=(64, 64), opset=15)
