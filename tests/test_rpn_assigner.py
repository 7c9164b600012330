"""The RPN's anchor matching: torchvision's rule by default, mmdet's ``MaxIoUAssigner`` with
``rpn_min_pos_iou`` (the rule of the mmdet configs behind the official Swin detection results)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from torchvision.models.detection._utils import Matcher

from vtdense.models.detection import build_detector
from vtdense.models.rcnn_waits import WaitFreeMatcher

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
TINY = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)


def mmdet_assign(overlaps: torch.Tensor, pos: float, neg: float, min_pos: float) -> torch.Tensor:
    """mmdet 2.x ``MaxIoUAssigner.assign_wrt_overlaps`` (``match_low_quality=True``,
    ``gt_max_assign_all=True``) as its documentation states it, one gt at a time, in mmdet's
    encoding: -1 ignored, 0 negative, ``i + 1`` gt ``i``."""
    num_gts, num_boxes = overlaps.shape
    out = torch.full((num_boxes,), -1, dtype=torch.long)
    best_of_box, gt_of_box = overlaps.max(dim=0)
    out[(best_of_box >= 0) & (best_of_box < neg)] = 0
    positive = best_of_box >= pos
    out[positive] = gt_of_box[positive] + 1
    for i in range(num_gts):
        best = overlaps[i].max()
        if best >= min_pos:
            out[overlaps[i] == best] = i + 1
    return out


def as_mmdet(matches: torch.Tensor) -> torch.Tensor:
    """torchvision's encoding (-1 below the low threshold, -2 between, else the gt) in mmdet's."""
    out = matches + 1
    out[matches == Matcher.BELOW_LOW_THRESHOLD] = 0
    out[matches == Matcher.BETWEEN_THRESHOLDS] = -1
    return out


def rpn_matcher(min_pos: float | None) -> WaitFreeMatcher:
    m = WaitFreeMatcher(0.7, 0.3, allow_low_quality_matches=True)
    m.min_low_quality = min_pos
    return m


@pytest.mark.parametrize("seed", range(6))
def test_min_pos_iou_matches_as_mmdet_on_random_overlaps_with_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    gts, boxes = 1 + seed, 300
    # IoUs on a coarse grid, so that ties (one box the best of several gts) are frequent
    overlaps = torch.randint(0, 21, (gts, boxes), generator=g).float() / 20
    overlaps[0] *= 0.5  # gt 0: best IoU at most 0.5, some gts below mmdet's 0.3
    if gts > 2:
        overlaps[2] *= 0.2
    got = as_mmdet(rpn_matcher(0.3)(overlaps))
    assert torch.equal(got, mmdet_assign(overlaps, 0.7, 0.3, 0.3))


def test_a_gt_whose_best_anchor_is_under_the_minimum_gets_none_and_ties_go_to_the_last_gt() -> None:
    overlaps = torch.tensor([
        # box:  0     1     2     3
        [0.60, 0.10, 0.00, 0.00],  # gt 0: best box 0 (0.60)
        [0.50, 0.00, 0.00, 0.00],  # gt 1: best box 0 too (0.50), where gt 0 overlaps it more
        [0.00, 0.05, 0.10, 0.10],  # gt 2: a gt smaller than every anchor, best IoU 0.10 (boxes 2 and 3)
    ])
    torchvision_rule, mmdet_rule = rpn_matcher(None)(overlaps), rpn_matcher(0.3)(overlaps)
    # box 0: the best of gts 0 and 1; torchvision gives it the gt it overlaps most, mmdet the last
    assert torchvision_rule[0] == 0 and mmdet_rule[0] == 1
    # boxes 2 and 3: gt 2's best; positives for torchvision, below mmdet's minimum (negatives: IoU < 0.3)
    assert torchvision_rule[2:].tolist() == [2, 2]
    assert mmdet_rule[2:].tolist() == [Matcher.BELOW_LOW_THRESHOLD] * 2
    # the default is torchvision's own matcher, value for value
    assert torch.equal(torchvision_rule, Matcher(0.7, 0.3, allow_low_quality_matches=True)(overlaps))


def test_build_detector_sets_the_rpn_rule_and_trains() -> None:
    torch.manual_seed(0)
    model = build_detector("swin_tiny", "faster_rcnn", 3, fpn_channels=32, backbone_kwargs=TINY, slim_heads=True,
                           rpn_min_pos_iou=0.3)
    assert model.rpn.proposal_matcher.min_low_quality == 0.3
    assert build_detector("swin_tiny", "faster_rcnn", 3, fpn_channels=32, backbone_kwargs=TINY,
                          slim_heads=True).rpn.proposal_matcher.min_low_quality is None
    images = [torch.rand(3, 96, 128)]
    # a 6x6 box: no anchor (32 px and up) reaches IoU 0.3 with it, so mmdet's rule gives it no positive
    targets = [{"boxes": torch.tensor([[10.0, 10.0, 70.0, 60.0], [80.0, 40.0, 86.0, 46.0]]), "labels": torch.tensor([1, 2])}]
    losses = model.train()(images, targets)
    assert set(losses) >= {"loss_objectness", "loss_rpn_box_reg"} and all(torch.isfinite(v) for v in losses.values())


@pytest.mark.parametrize(("head", "value", "message"), [
    ("retinanet", 0.3, "applies to the R-CNN heads"),
    ("mask_rcnn", 1.5, "rpn_min_pos_iou must be a number in [0, 1]"),
    ("mask_rcnn", "0.3", "rpn_min_pos_iou must be a number"),
])
def test_a_bad_rpn_min_pos_iou_is_one_error_naming_it(head: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_detector("swin_tiny", head, 3, fpn_channels=32, backbone_kwargs=TINY, slim_heads=True, rpn_min_pos_iou=value)


def test_published_configs_take_their_references_rule() -> None:
    def value(name: str) -> object:
        return yaml.safe_load((CONFIGS / name).read_text())["model"]["rpn_min_pos_iou"]

    assert value("coco_swin_t_maskrcnn_1x.yaml") == value("coco_swin_t_maskrcnn_3x.yaml") == 0.3  # mmdet 2.x
    assert value("coco_mvitv2_t_maskrcnn_3x.yaml") is None  # detectron2
