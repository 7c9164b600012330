"""The R-CNN heads with fewer host waits (vtdense.models.rcnn_waits, vtdense.models.roi_pool) give
torchvision's results from the same random draws, and wait fewer times (counted)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler, Matcher
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork
from torchvision.ops import MultiScaleRoIAlign

from tests.test_models_detection import tiny_detector, toy_batch
from vtdense.models.rcnn_waits import (
    CountingSampler,
    LowWaitRoIHeads,
    LowWaitRPN,
    WaitFreeMatcher,
    reduce_host_waits,
    restore_torchvision_heads,
)
from vtdense.models.roi_pool import LevelSortedRoIAlign

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_syncs  # noqa: E402


def _pair(head: str = "mask_rcnn") -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    # torchvision's own heads use smooth L1 (beta 1/9), per-image RetinaNet normalisation, unaligned
    # RoIAlign and soft mask targets
    ours = tiny_detector(head, box_loss_beta=1 / 9, retinanet_loss_norm="image", roi_aligned=False,
                         binary_mask_targets=False)
    theirs = restore_torchvision_heads(copy.deepcopy(ours))
    return ours, theirs


def test_built_detectors_take_the_classes_and_restore_gives_torchvision_back() -> None:
    ours, theirs = _pair()
    assert type(ours.rpn) is LowWaitRPN and type(ours.roi_heads) is LowWaitRoIHeads
    assert type(ours.rpn.proposal_matcher) is WaitFreeMatcher and type(ours.roi_heads.fg_bg_sampler) is CountingSampler
    assert type(ours.roi_heads.box_roi_pool) is LevelSortedRoIAlign and type(ours.roi_heads.mask_roi_pool) is LevelSortedRoIAlign
    assert type(theirs.rpn) is RegionProposalNetwork and type(theirs.roi_heads) is RoIHeads
    assert type(theirs.rpn.proposal_matcher) is Matcher and type(theirs.rpn.fg_bg_sampler) is BalancedPositiveNegativeSampler
    assert type(theirs.roi_heads.mask_roi_pool) is MultiScaleRoIAlign
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert type(tiny_detector("faster_rcnn").roi_heads) is LowWaitRoIHeads
    retina = tiny_detector("retinanet")
    assert type(retina.proposal_matcher) is WaitFreeMatcher
    assert type(restore_torchvision_heads(retina).proposal_matcher) is Matcher

    class Mine(RegionProposalNetwork):  # a user's own subclass is left alone
        pass

    ours.rpn.__class__ = Mine
    reduce_host_waits(ours)
    assert type(ours.rpn) is Mine


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("head", ["mask_rcnn", "faster_rcnn", "retinanet"])
def test_training_losses_and_gradients_equal_torchvisions(head: str) -> None:
    ours, theirs = _pair(head)
    images, targets = toy_batch(with_masks=head == "mask_rcnn")
    # A background image (no boxes) too: both heads' empty-target branches.
    images.append(torch.rand(3, 64, 80, generator=torch.Generator().manual_seed(5)))
    empty = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}
    if head == "mask_rcnn":
        empty["masks"] = torch.zeros(0, 64, 80, dtype=torch.uint8)
    targets.append(empty)
    opts = {}
    for model in (ours, theirs):
        model.train()
        opts[id(model)] = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):  # later steps start from updated weights: different proposals, the same draws
        results = []
        for model in (ours, theirs):
            torch.manual_seed(10 + step)
            losses = model(images, targets)
            sum(losses.values()).backward()
            results.append((losses, _grads(model)))
            opts[id(model)].step()
            opts[id(model)].zero_grad()
        (l_ours, g_ours), (l_theirs, g_theirs) = results
        assert l_ours.keys() == l_theirs.keys()
        for k in l_ours:
            torch.testing.assert_close(l_ours[k], l_theirs[k], rtol=1e-6, atol=1e-7, msg=f"step {step}: {k}")
        assert g_ours.keys() == g_theirs.keys() and g_ours
        for k in g_ours:
            # RoIAlign's backward adds into the feature maps' gradient in the RoIs' order, which the
            # level sort changes: float rounding only.
            torch.testing.assert_close(g_ours[k], g_theirs[k], rtol=1e-5, atol=1e-6, msg=f"step {step}: {k}")


def test_detections_equal_torchvisions_in_eval() -> None:
    ours, theirs = _pair()
    images, _ = toy_batch(with_masks=True)
    for m in (ours, theirs):
        m.eval()
        m.roi_heads.score_thresh = 0.0  # random weights: keep every detection, so there is much to compare
    with torch.no_grad():
        a, b = ours(images), theirs(images)
    assert any(len(d["boxes"]) for d in a)
    for da, db in zip(a, b):
        assert da.keys() == db.keys()
        for k in da:
            assert torch.equal(da[k], db[k]), k


def test_level_sorted_roi_align_is_torchvisions_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    names = ["p2", "p3", "p4", "p5"]
    feats = {n: torch.randn(3, 4, 512 // s, 640 // s, generator=g, requires_grad=True) for n, s in zip(names, (4, 8, 16, 32))}
    boxes = []
    for n in (37, 0, 12):  # an image without RoIs in between
        xy = torch.rand(n, 2, generator=g) * torch.tensor([100.0, 60.0])
        wh = torch.rand(n, 2, generator=g) ** 2 * 500 + 1  # sides 1-500 px: levels P2 to P5
        boxes.append(torch.cat([xy, xy + wh], 1))
    shapes = [(512, 640)] * 3
    ours = LevelSortedRoIAlign(names, 7, 2)
    theirs = MultiScaleRoIAlign(names, 7, 2)
    out_ours, out_theirs = ours(feats, boxes, shapes), theirs(feats, boxes, shapes)
    levels = ours.map_levels(boxes)
    assert set(levels.tolist()) == {0, 1, 2, 3}  # the RoIs really span the pyramid
    assert torch.equal(out_ours, out_theirs)
    w = torch.randn(out_ours.shape, generator=g)
    g_ours = torch.autograd.grad((out_ours * w).sum(), list(feats.values()))
    g_theirs = torch.autograd.grad((out_theirs * w).sum(), list(feats.values()))
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    none = ours(feats, [torch.zeros(0, 4)] * 3, shapes)  # no RoI at all
    assert none.shape == (0, 4, 7, 7) and none.shape == theirs(feats, [torch.zeros(0, 4)] * 3, shapes).shape


def test_matcher_equals_torchvisions_with_ties_and_low_quality_matches() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.rand(5, 300, generator=g)
    q[:, ::7] = q[:, ::7].round(decimals=1)  # ties, for the best-prediction-per-gt rule
    q[2, 40] = q[2, 41] = q[2].max() + 0.01  # a gt with two tied best predictions
    for low_quality in (True, False):
        ours = WaitFreeMatcher(0.7, 0.3, allow_low_quality_matches=low_quality)
        theirs = Matcher(0.7, 0.3, allow_low_quality_matches=low_quality)
        assert torch.equal(ours(q.clone()), theirs(q.clone()))
    with pytest.raises(ValueError, match="No ground-truth boxes"):
        WaitFreeMatcher(0.7, 0.3)(torch.zeros(0, 4))


def test_sampler_draws_what_torchvisions_draws() -> None:
    g = torch.Generator().manual_seed(2)
    labels = [torch.randint(-1, 3, (n,), generator=g).float() for n in (500, 40, 0)]
    ours, theirs = CountingSampler(64, 0.25), BalancedPositiveNegativeSampler(64, 0.25)
    torch.manual_seed(3)
    pos, neg, num_pos, num_neg = ours.sample(labels)
    torch.manual_seed(3)
    pos_t, neg_t = theirs(labels)
    for a, b in zip(pos + neg, pos_t + neg_t):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert num_pos == [int(p.sum()) for p in pos] and num_neg == [int(n.sum()) for n in neg]
    assert num_pos[0] == 16 and num_pos[0] + num_neg[0] == 64


def _published_heads_on_a_tiny_backbone(torchvision_heads: bool) -> torch.nn.Module:
    """The published detector's heads (``contenders.PUBLISHED_DETECTOR``: 80 classes, 512 RoIs per
    image, 256-channel FPN and mask head) on a tiny Swin: the waits and calls counted are the
    heads', and a Swin-T made the test four times longer."""
    import contenders

    from vtdense.models.detection import build_detector

    cfg = {**contenders.PUBLISHED_DETECTOR,
           "backbone_kwargs": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)}
    torch.manual_seed(0)
    model = build_detector("swin_tiny", "mask_rcnn", **cfg)
    return host_syncs.torchvision_heads(model) if torchvision_heads else model


def test_published_step_waits_a_fifth_as_often() -> None:
    """The counts of ``benchmarks/host_syncs.py`` at a small size: the published heads' training
    step waits 9 times (torchvision's heads: 61, blocking copies of Python data included) and
    launches fewer kernels in the heads."""
    ours = host_syncs.count_step("vtdense", (128, 192), model=_published_heads_on_a_tiny_backbone(False))
    theirs = host_syncs.count_step("vtdense torchvision-heads", (128, 192), model=_published_heads_on_a_tiny_backbone(True))
    waits = sum(ours["waits"].values())
    assert waits <= 9 and sum(theirs["waits"].values()) >= 45, (ours["wait_ops"], theirs["wait_ops"])
    assert ours["waits"]["rpn"] <= 4 and ours["waits"]["roi_heads"] <= 3
    for region in ("rpn", "roi_heads"):
        assert ours["calls"][region] < theirs["calls"][region], region


def test_offset_nms_keeps_what_torchvisions_coordinate_trick_keeps() -> None:
    from torchvision.ops import boxes as box_ops

    from vtdense.models.nms import _offset_nms

    g = torch.Generator().manual_seed(4)
    xy = torch.rand(3000, 2, generator=g) * 300
    boxes = torch.cat([xy, xy + torch.rand(3000, 2, generator=g) * 80 + 1], 1)
    scores = torch.rand(3000, generator=g)
    levels = torch.randint(0, 5, (3000,), generator=g)
    kept = _offset_nms(boxes, scores, levels, 0.7)
    assert torch.equal(kept, box_ops._batched_nms_coordinate_trick(boxes, scores, levels, 0.7))
    assert 0 < len(kept) < 3000
    assert _offset_nms(boxes[:0], scores[:0], levels[:0], 0.7).shape == (0,)


def test_grouped_nms_keeps_what_torchvisions_per_category_nms_keeps() -> None:
    from torchvision.ops import boxes as box_ops

    from vtdense.models.nms import _grouped_nms, batched_nms

    g = torch.Generator().manual_seed(8)
    xy = torch.rand(6000, 2, generator=g) * 300
    boxes = torch.cat([xy, xy + torch.rand(6000, 2, generator=g) * 80 + 1], 1)
    scores = torch.rand(6000, generator=g).round(decimals=2)  # ties across categories, for the final sort
    labels = torch.randint(1, 12, (6000,), generator=g)  # category 0 (and 12-15) absent
    theirs = box_ops._batched_nms_vanilla(boxes, scores, labels, 0.5)
    assert torch.equal(_grouped_nms(boxes, scores, labels, 0.5, 16), theirs)
    assert torch.equal(batched_nms(boxes, scores, labels, 0.5, 16), theirs)  # above 4,000 coordinates on the CPU
    assert torch.equal(batched_nms(boxes[:900], scores[:900], labels[:900], 0.5, 16),
                       box_ops.batched_nms(boxes[:900], scores[:900], labels[:900], 0.5))
    assert _grouped_nms(boxes[:0], scores[:0], labels[:0], 0.5, 16).shape == (0,)


def test_box_coder_keeps_one_weights_tensor_and_encodes_as_torchvision() -> None:
    from torchvision.models.detection._utils import BoxCoder

    from vtdense.models.rcnn_waits import CachedWeightsBoxCoder

    g = torch.Generator().manual_seed(6)
    gt = torch.rand(50, 4, generator=g).cumsum(1) * 40
    props = torch.rand(50, 4, generator=g).cumsum(1) * 40
    ours, theirs = CachedWeightsBoxCoder((10.0, 10.0, 5.0, 5.0)), BoxCoder((10.0, 10.0, 5.0, 5.0))
    assert torch.equal(ours.encode([gt], [props])[0], theirs.encode([gt], [props])[0])
    weights = ours._device_constants[("weights", torch.float32, gt.device, False)][1]
    ours.encode([gt[:3]], [props[:3]])
    assert ours._device_constants[("weights", torch.float32, gt.device, False)][1] is weights
    assert len(ours._device_constants) == 1


def test_box_coder_decodes_as_torchvision_without_copying_a_constant() -> None:
    """``decode`` gives torchvision's boxes bit for bit, the clamp of large size deltas included, and
    makes no tensor from Python data (torchvision copies a ``0.5`` to the device in every call)."""
    from torchvision.models.detection._utils import BoxCoder

    from vtdense.models.rcnn_waits import CachedWeightsBoxCoder

    g = torch.Generator().manual_seed(7)
    anchors = [torch.rand(40, 4, generator=g).cumsum(1) * 50, torch.rand(30, 4, generator=g).cumsum(1) * 50]
    deltas = torch.randn(70, 4 * 3, generator=g) * 3
    deltas[:5, 2::4] = 40.0  # past the clip: exp would overflow without it
    for weights in ((1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)):
        ours, theirs = CachedWeightsBoxCoder(weights), BoxCoder(weights)
        with host_syncs.HostWaits() as mode, mode.host_reads():
            got = ours.decode(deltas, anchors)
        assert got.shape == (70, 3, 4) and torch.equal(got, theirs.decode(deltas, anchors))
        assert torch.isfinite(got).all() and sum(mode.waits.values()) == 0, mode.wait_ops
        with host_syncs.HostWaits() as mode, mode.host_reads():
            theirs.decode(deltas, anchors)
        assert mode.wait_ops == {"other forward: tensor from host data": 2}  # the counter sees torchvision's


def test_no_resize_transform_normalizes_as_torchvision_with_one_mean_tensor() -> None:
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    from vtdense.models.detection import NoResizeTransform

    ours = NoResizeTransform(size_divisible=32)
    theirs = GeneralizedRCNNTransform(1, 1, ours.image_mean, ours.image_std)
    image = torch.rand(3, 20, 30, generator=torch.Generator().manual_seed(8))
    first = ours.normalize(image)  # makes the mean and std tensors
    with host_syncs.HostWaits() as mode, mode.host_reads():
        second = ours.normalize(image * 0.5)
    assert torch.equal(first, theirs.normalize(image)) and torch.equal(second, theirs.normalize(image * 0.5))
    assert sum(mode.waits.values()) == 0, mode.wait_ops  # torchvision copies both to the device again
    assert len(ours._device_constants) == 2  # mean and std, made once
    ours.image_mean = theirs.image_mean = [0.5, 0.4, 0.3]  # numbers assigned later are followed
    assert torch.equal(ours.normalize(image), theirs.normalize(image))
    assert not torch.equal(ours.normalize(image), first)
    with pytest.raises(TypeError, match="floating"):
        ours.normalize(torch.zeros(3, 4, 4, dtype=torch.uint8))


def test_anchor_generator_keeps_its_last_sizes_and_builds_torchvisions_anchors() -> None:
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.image_list import ImageList

    from tests.op_calls import OpCalls
    from vtdense.models.detection import Float32AnchorGenerator

    sizes, ratios = ((32,), (64,), (128,)), ((0.5, 1.0, 2.0),) * 3
    ours, theirs = Float32AnchorGenerator(sizes, ratios), AnchorGenerator(sizes, ratios)
    ours.cache_size = 2

    def call(gen: torch.nn.Module, h: int, w: int) -> list[torch.Tensor]:
        images = ImageList(torch.zeros(2, 3, h, w), [(h, w), (h - 8, w)])
        maps = [torch.zeros(2, 4, h // s, w // s) for s in (8, 16, 32)]
        return gen(images, maps)

    first = call(ours, 64, 96)
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, call(theirs, 64, 96)))
    with OpCalls(torch.ops.aten.arange, torch.ops.aten.cat) as calls:
        again = call(ours, 64, 96)
    assert calls.count == 0 and again[0] is first[0]  # kept: no kernel at all
    call(ours, 96, 96), call(ours, 128, 96)  # two more sizes push the first out (cache_size 2)
    assert call(ours, 64, 96)[0] is not first[0] and len(ours._anchors) == 2
    with torch.inference_mode():  # inference tensors are kept apart from the others
        inferred = call(ours, 64, 96)[0]
    assert inferred.is_inference() and not call(ours, 64, 96)[0].is_inference()


def test_paste_masks_gives_torchvisions_values() -> None:
    from torchvision.models.detection.roi_heads import paste_masks_in_image

    from vtdense.models.paste_masks import paste_masks

    g = torch.Generator().manual_seed(7)
    n, h, w = 40, 90, 130
    xy = torch.rand(n, 2, generator=g) * torch.tensor([w, h]) - 5
    boxes = torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 70], 1)
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)  # detections are clipped to the image, as the heads clip them
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
    boxes[0] = torch.tensor([0.0, 0.0, w, h])  # the whole image
    boxes[1] = torch.tensor([3.0, 4.0, 3.0, 4.0])  # a point
    masks = torch.rand(n, 1, 28, 28, generator=g)
    ours = paste_masks(masks, boxes, (h, w))
    assert torch.equal(ours, paste_masks_in_image(masks, boxes, (h, w)))
    assert ours.shape == (n, 1, h, w) and (ours[0] > 0).float().mean() > 0.9
    assert paste_masks(masks[:0], boxes[:0], (h, w)).shape == (0, 1, h, w)


def test_mask_rcnn_predictions_with_the_pasting_equal_torchvisions_postprocess() -> None:
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    ours, _ = _pair()
    images, _ = toy_batch(with_masks=True)
    ours.eval()
    ours.roi_heads.score_thresh = 0.0
    with torch.no_grad():
        a = ours(images)
        ours.transform.postprocess = lambda *args: GeneralizedRCNNTransform.postprocess(ours.transform, *args)
        b = ours(images)
    assert sum(len(d["masks"]) for d in a) > 10
    for da, db in zip(a, b):
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)


def test_training_targets_are_prepared_on_the_cpu_when_the_batch_is_moved() -> None:
    """In training, degenerate boxes are dropped while the targets are still on the CPU (on a GPU the
    boolean index would wait for the device three times per image); validation batches are moved as
    they are."""
    from types import SimpleNamespace

    from vtdense.tasks.detection import DetectionTask

    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=dict(embed_dim=16, depths=(1, 1, 1, 1),
                         num_heads=(1, 1, 1, 1), window_size=4), head="mask_rcnn", num_classes=3)
    boxes = torch.tensor([[1.0, 2.0, 30.0, 40.0], [5.0, 5.0, 5.0, 9.0], [0.0, 0.0, 10.0, 10.0]])  # the 2nd is flat
    target = {"boxes": boxes, "labels": torch.tensor([1, 2, 3], dtype=torch.int32), "masks": torch.ones(3, 8, 8),
              "image_id": 7}
    batch = ([torch.rand(3, 48, 48)], [target])
    task._trainer = SimpleNamespace(training=True)
    _, (moved,) = task.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert moved["image_id"] == 7 and torch.equal(moved["boxes"], boxes[[0, 2]])
    assert moved["labels"].dtype == torch.int64 and moved["labels"].tolist() == [1, 3] and moved["masks"].shape[0] == 2
    prepared = task._train_target(moved)
    assert prepared.keys() == {"boxes", "labels", "masks"} and prepared["boxes"] is moved["boxes"]
    assert all(torch.equal(prepared[k], v) for k, v in task._train_target(target).items())  # as on the device before
    task._trainer = SimpleNamespace(training=False)
    _, (kept,) = task.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert torch.equal(kept["boxes"], boxes) and "_vtdense_train_ready" not in kept


def test_finite_check_reads_the_device_once_and_still_names_the_term() -> None:
    from tests.op_calls import OpCalls
    from vtdense.tasks.fault import check_finite_losses

    losses = {"a": torch.tensor(1.0), "b": torch.tensor(2.0), "c": torch.tensor(3.0)}
    with OpCalls(torch.ops.aten._local_scalar_dense) as reads:
        assert check_finite_losses(losses, 5, [1, 2]) is None
    assert reads.count == 1
    losses["b"] = torch.tensor(float("nan"))
    message = check_finite_losses(losses, 5, [1, 2])
    assert message is not None and message.startswith("non-finite loss b=nan at step 5, batch images [1, 2]")


def test_task_training_step_under_lightning_waits_once_outside_the_model() -> None:
    """``host_syncs.py --task``: the rest of ``training_step`` (loss checks, backward, AdamW) reads the
    device once per step (the finite-loss check); the model's forward 9 times."""
    counts = host_syncs.count_task_steps(steps=2)
    assert counts["waits"]["training_step"] == 1, counts["wait_ops"]
    assert counts["waits"]["model"] <= 9, counts["wait_ops"]
    assert counts["calls"]["training_step"] > 100  # the backward and the optimizer really ran in the window


def _retina_case(g: torch.Generator) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:
    """Two images' targets, anchors and matches (foreground, background -1, ignored -2); the second
    image has no boxes at all."""
    anchors = [torch.cat([xy := torch.rand(60, 2, generator=g) * 50, xy + torch.rand(60, 2, generator=g) * 20 + 2], 1)
               for _ in range(2)]
    gt = torch.tensor([[2.0, 3.0, 20.0, 25.0], [30.0, 10.0, 60.0, 40.0]])
    targets = [{"boxes": gt, "labels": torch.tensor([1, 4])},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}]
    matched = [torch.randint(-2, 2, (60,), generator=g), torch.full((60,), -1)]
    return targets, anchors, matched


@pytest.mark.parametrize("loss_type", ["l1", "smooth_l1", "giou", "diou", "ciou"])
def test_retinanet_losses_equal_torchvisions_without_waits(loss_type: str) -> None:
    from torchvision.models.detection.retinanet import RetinaNetClassificationHead, RetinaNetRegressionHead

    from vtdense.models.retinanet_waits import LowWaitClassificationHead, LowWaitRegressionHead

    g = torch.Generator().manual_seed(9)
    targets, anchors, matched = _retina_case(g)
    torch.manual_seed(0)
    theirs_cls, theirs_reg = RetinaNetClassificationHead(8, 1, 5), RetinaNetRegressionHead(8, 1)
    theirs_reg._loss_type = loss_type
    ours_cls, ours_reg = copy.deepcopy(theirs_cls), copy.deepcopy(theirs_reg)
    ours_cls.__class__, ours_reg.__class__ = LowWaitClassificationHead, LowWaitRegressionHead
    logits = torch.randn(2, 60, 5, generator=g, requires_grad=True)
    deltas = (torch.randn(2, 60, 4, generator=g) * 0.1).requires_grad_()
    outputs = {"cls_logits": logits, "bbox_regression": deltas}
    results = []
    for cls_head, reg_head in ((ours_cls, ours_reg), (theirs_cls, theirs_reg)):
        with host_syncs.HostWaits() as waits:
            loss = cls_head.compute_loss(targets, outputs, matched) + reg_head.compute_loss(targets, outputs, anchors, matched)
        results.append((loss, torch.autograd.grad(loss, [logits, deltas]), sum(waits.waits.values())))
    (l_ours, g_ours, w_ours), (l_theirs, g_theirs, w_theirs) = results
    torch.testing.assert_close(l_ours, l_theirs, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    if loss_type in ("l1", "smooth_l1"):  # (torchvision's own IoU losses index through boolean masks inside)
        assert w_ours == 0 and w_theirs > 0
    else:
        assert w_ours < w_theirs
