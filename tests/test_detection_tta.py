"""Detection test-time augmentation (multi-scale and flip), as detectron2's ``GeneralizedRCNNWithTTA``."""

from __future__ import annotations

import pytest
import torch
from torchvision import tv_tensors
from torchvision.models.detection.roi_heads import maskrcnn_inference
from torchvision.ops import batched_nms

from vtdense.data.predict import PredictImages, collate_predict, detection_predict_transform
from vtdense.data.transforms import DetectionEvalViews, check_test_scales, detection_eval_transforms
from vtdense.models.detection import unpasted_masks
from vtdense.models.paste_masks import paste_masks
from vtdense.tasks.detection import DetectionTask
from tests.test_tasks_detection import SLIM, TINY

SCALES, MAX_SIZE, TEST_SCALE = (80, 100, 130), 200, 100
D2_ORDER = [(s, f) for s in SCALES for f in (False, True)]


def test_views_follow_detectron2_test_aug() -> None:
    """Each view is the evaluation resize at one of the short sides (the long side capped), flipped
    for flip views; the view at ``test_scale`` is the sample's image, with its target resized as
    validation resizes it, and the others follow in detectron2's order."""
    g = torch.Generator().manual_seed(0)
    image = tv_tensors.Image(torch.randint(0, 256, (3, 90, 160), dtype=torch.uint8, generator=g))
    target = {"boxes": tv_tensors.BoundingBoxes(torch.tensor([[10.0, 20, 50, 60]]), format="XYXY", canvas_size=(90, 160))}
    t = DetectionEvalViews(TEST_SCALE, MAX_SIZE, SCALES, flip=True)
    assert t.specs == [(100, False)] + [s for s in D2_ORDER if s != (100, False)]
    out, tgt = t(image, target)
    ref, ref_tgt = detection_eval_transforms(TEST_SCALE, MAX_SIZE)(image, target)
    assert torch.equal(out, ref) and torch.equal(tgt["boxes"], ref_tgt["boxes"])
    for (short, flipped), view in zip(t.specs[1:], tgt["views"]):
        single = detection_eval_transforms(short, MAX_SIZE)(image)
        assert view["flip"] == flipped and torch.equal(view["image"], single.flip(-1) if flipped else single)
    assert tuple(tgt["views"][-1]["image"].shape[-2:]) == (113, 200)  # 130 x 231 capped at 200
    plain = DetectionEvalViews(TEST_SCALE, MAX_SIZE, [TEST_SCALE])(image, target)
    assert "views" not in plain[1] and torch.equal(plain[0], ref)
    # detectron2's TEST.AUG.MAX_SIZE: the views' own cap, so the largest scale is not capped back
    wide = DetectionEvalViews(TEST_SCALE, MAX_SIZE, SCALES, flip=False, views_max_size=4000)(image, target)[1]["views"]
    assert [tuple(v["image"].shape[-2:]) for v in wide] == [(80, 142), (130, 231)]
    assert "views" not in DetectionEvalViews(TEST_SCALE, 160, None, views_max_size=4000)(image, target)[1]  # no TTA: max_size


@pytest.mark.parametrize("bad", [[], [0], [100, -1], [1.5], "800", [True]])
def test_bad_scales_are_one_error_naming_the_option(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^--data\.test_scales must be a non-empty list of positive ints"):
        check_test_scales(bad, "--data.test_scales")


def _detectron2_tta(task: DetectionTask, image: torch.Tensor) -> dict[str, torch.Tensor]:
    """detectron2's TTA written out in the original image's pixels: every (short side, flip) view
    detected, its boxes mapped back to the original image, per-class NMS at the model's threshold
    and its detection count, then the mask head on the merged boxes in every view, masks flipped
    back and averaged, pasted into the original image."""
    det = task.model
    h0, w0 = image.shape[-2:]
    views, boxes, scores, labels = [], [], [], []
    for short, flipped in D2_ORDER:
        view = detection_eval_transforms(short, MAX_SIZE)(tv_tensors.Image(image)).as_subclass(torch.Tensor)
        view = view.flip(-1) if flipped else view
        views.append((view, flipped))
        with unpasted_masks(det):
            out = det([view])[0]
        b = out["boxes"].clone()
        vh, vw = view.shape[-2:]
        if flipped:
            b[:, [0, 2]] = vw - b[:, [2, 0]]
        boxes.append(b * torch.tensor([w0 / vw, h0 / vh, w0 / vw, h0 / vh]))
        scores.append(out["scores"])
        labels.append(out["labels"])
    boxes, scores, labels = torch.cat(boxes), torch.cat(scores), torch.cat(labels)
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w0)
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h0)
    keep = batched_nms(boxes, scores, labels, det.roi_heads.nms_thresh)[: det.roi_heads.detections_per_img]
    boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
    masks = 0
    for view, flipped in views:
        vh, vw = view.shape[-2:]
        b = boxes * torch.tensor([vw / w0, vh / h0, vw / w0, vh / h0])
        if flipped:
            b[:, [0, 2]] = vw - b[:, [2, 0]]
        images, _ = det.transform([view])
        feats = det.backbone(images.tensors)
        heads = det.roi_heads
        probs = maskrcnn_inference(heads.mask_predictor(heads.mask_head(heads.mask_roi_pool(feats, [b], images.image_sizes))), [labels])[0]
        masks = masks + (probs.flip(-1) if flipped else probs)
    pasted = paste_masks(masks / len(views), boxes, (h0, w0))[:, 0] > 0.5
    return {"boxes": boxes, "scores": scores, "labels": labels, "masks": pasted}


def test_merged_detections_are_detectron2s() -> None:
    """``predict_step`` with the views of ``detection_predict_transform(..., scales, flip)`` gives
    detectron2's merged detections and averaged masks (written out above), in original pixels; the
    views change the detections."""
    torch.manual_seed(0)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="mask_rcnn", num_classes=3, score_thresh=0.2,
                         **SLIM).eval()
    image = torch.rand(3, 90, 160)
    batch = collate_predict([PredictImages([image], detection_predict_transform(TEST_SCALE, MAX_SIZE, SCALES, True))[0]])
    with torch.no_grad():
        got = task.predict_step(batch, 0)[0]
        ref = _detectron2_tta(task, image)
        plain = task.predict_step(collate_predict([PredictImages([image], detection_predict_transform(TEST_SCALE, MAX_SIZE))[0]]), 0)[0]
    assert 5 < len(ref["scores"]) == len(got["scores"])
    torch.testing.assert_close(got["scores"], ref["scores"])
    assert torch.equal(got["labels"], ref["labels"])
    torch.testing.assert_close(got["boxes"], ref["boxes"], atol=1e-3, rtol=0)
    assert (got["masks"] != ref["masks"]).float().mean() < 1e-3  # a pixel on a box edge may round either way
    assert len(plain["scores"]) != len(got["scores"]) or not torch.allclose(plain["scores"], got["scores"])


@pytest.mark.parametrize("head", ["retinanet", "fcos"])
def test_dense_heads_merge_their_boxes(head: str) -> None:
    """RetinaNet and FCOS: the views' boxes merged by per-class NMS at the model's threshold, no masks."""
    torch.manual_seed(0)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head=head, num_classes=3, fpn_channels=32, score_thresh=0.0).eval()
    image = torch.rand(3, 90, 160)
    batch = collate_predict([PredictImages([image], detection_predict_transform(TEST_SCALE, MAX_SIZE, SCALES, True))[0]])
    with torch.no_grad():
        got = task.predict_step(batch, 0)[0]
        plain = task.predict_step(collate_predict([PredictImages([image], detection_predict_transform(TEST_SCALE, MAX_SIZE))[0]]), 0)[0]
    assert len(plain["scores"]) != len(got["scores"]) or not torch.allclose(plain["scores"], got["scores"])
    assert "masks" not in got and 0 < len(got["scores"]) <= task.model.detections_per_img
    keep = batched_nms(got["boxes"], got["scores"], got["labels"], task.model.nms_thresh)
    assert len(keep) == len(got["scores"])  # nothing left to suppress
