"""Segmentation test-time augmentation (multi-scale and flip), as mmseg's ``MultiScaleFlipAug`` + ``aug_test``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vtdense.data.ade20k import ADE20KDataModule, SegEvalTransform, check_eval_ratios, seg_collate
from vtdense.data.synthetic_seg import generate_synthetic_segmentation
from tests.test_tasks_segmentation import _keep_ratio_size, _task, _trainer

RATIOS = (0.5, 1.0, 1.5)
MMSEG_ORDER = [(r, f) for r in RATIOS for f in (False, True)]


def test_views_follow_mmseg_multi_scale_flip_aug() -> None:
    """Each view is the single-scale evaluation resize at ``(int(long * r), int(short * r))``
    (mmseg truncates the scaled scale, then fits the image into it), flipped for flip views; the
    view nearest ratio 1 is the sample's ``image``, the others follow in mmseg's order. Without a
    scale the ratio rescales the image itself, as mmseg 1.x's ``Resize(scale_factor=r)``."""
    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 30, 90), dtype=torch.uint8, generator=g)
    mask = torch.zeros(30, 90, dtype=torch.long)
    t = SegEvalTransform((64, 48), RATIOS, flip=True)
    assert t.specs == [(1.0, False)] + [s for s in MMSEG_ORDER if s != (1.0, False)]
    sample = t(image, mask)
    views = [(sample["image"], sample["image_size"], False)] + [(v["image"], v["image_size"], v["flip"]) for v in sample["views"]]
    sizes = set()
    for (ratio, flip), (view, size, flipped) in zip(t.specs, views):
        scale = (int(64 * ratio), int(48 * ratio))
        single = SegEvalTransform(scale)(image, mask)["image"]
        assert flipped == flip and tuple(size) == tuple(view.shape[-2:]) == _keep_ratio_size(30, 90, scale)
        assert torch.equal(view, single.flip(-1) if flip else single)
        sizes.add(tuple(size))
    assert len(sizes) == 3 and sample["mask"] is mask  # the label map stays at its original size
    own = SegEvalTransform(None, (0.5, 1.25))(image, mask)
    assert tuple(own["image_size"]) == (38, 113) and tuple(own["views"][0]["image_size"]) == (15, 45)
    assert "views" not in SegEvalTransform((64, 48), [1.0])(image, mask)  # one view: the plain sample

    # the batch pads each view on its own; a flipped view is padded after flipping (right and bottom)
    batch = seg_collate([sample, t(image[:, :20, :50], mask[:20, :50])])
    assert len(batch["views"]) == 5 and [v["flip"] for v in batch["views"]] == [s[1] for s in t.specs[1:]]
    for v in batch["views"]:
        h, w = v["image_size"][1].tolist()
        assert v["image"][1, :, h:].abs().sum() == 0 and v["image"][1, :, :, w:].abs().sum() == 0


@pytest.mark.parametrize("bad", [[], [0.5, 0], [-1.0], "1.0", [float("nan")], [True], 2.0])
def test_bad_ratios_are_one_error_naming_the_option(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^--data\.eval_ratios must be a non-empty list of positive numbers"):
        check_eval_ratios(bad, "--data.eval_ratios")
    with pytest.raises(ValueError, match=r"ADE20KDataModule: eval_ratios"):
        ADE20KDataModule(root="unused", eval_ratios=bad)
    with pytest.raises(ValueError, match=r"eval_flip must be true or false"):
        ADE20KDataModule(root="unused", eval_flip="yes")


def _mmseg_aug_test(task, image: torch.Tensor, scale: tuple[int, int], out_size: tuple[int, int]) -> torch.Tensor:  # noqa: ANN001
    """mmseg's ``aug_test`` written out: per (ratio, flip), the image resized at the scaled scale
    (flipped), the model's logits resized to the original size with ``F.interpolate``, softmax,
    flipped back; the probabilities summed and divided by the view count."""
    total = 0
    for ratio, flip in MMSEG_ORDER:
        x = SegEvalTransform((int(scale[0] * ratio), int(scale[1] * ratio)))(image, None)["image"]
        x = x.flip(-1) if flip else x
        p = F.interpolate(task(x[None]), size=out_size, mode="bilinear", align_corners=False).softmax(1)[0]
        total = total + (p.flip(-1) if flip else p)
    return total / len(MMSEG_ORDER)


@pytest.mark.parametrize("inference", ["whole", "slide"])
def test_prediction_is_the_mean_softmax_of_the_views_as_mmseg(inference: str) -> None:
    """Validation's prediction, ``predict_step`` on an evaluation batch and on predict's image
    lists, all equal mmseg's ``aug_test`` written out, at the label's (original) size, with
    whole-image and sliding-window inference; and the views change the prediction (a random model
    is not flip- or scale-invariant)."""
    torch.manual_seed(0)
    task = _task(aux_weight=0.0, inference=inference, slide_crop=(24, 32), slide_stride=(16, 24)).eval()
    task.predict_probs = True
    g = torch.Generator().manual_seed(1)
    image = torch.randint(0, 256, (3, 30, 90), dtype=torch.uint8, generator=g)
    mask = torch.randint(0, 3, (30, 90), generator=g)
    t = SegEvalTransform((64, 48), RATIOS, flip=True)
    batch = seg_collate([t(image, mask)])
    from vtdense.data.predict import PredictImages, collate_predict, segmentation_predict_transform

    listed = collate_predict([PredictImages([image], segmentation_predict_transform((64, 48), RATIOS, True))[0]])
    with torch.no_grad():
        ref = _mmseg_aug_test(task, image, (64, 48), (30, 90))
        probs = task.predict_step(batch, 0)[0]["probs"]
        from_files = task.predict_step(listed, 0)[0]
        label = task._predict_batch(batch)[0][0]
        single = task.predict_step(seg_collate([SegEvalTransform((64, 48))(image, mask)]), 0)[0]["probs"]
    torch.testing.assert_close(probs, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(from_files["probs"], ref, atol=1e-5, rtol=1e-4)
    top2 = ref.topk(2, dim=0).values
    clear = (top2[0] - top2[1]) > 1e-4  # the class of a near-tie may go either way in float rounding
    assert clear.float().mean() > 0.99
    assert torch.equal(label[clear], ref.argmax(0)[clear]) and torch.equal(from_files["label_map"][clear], ref.argmax(0)[clear])
    assert (single - ref).abs().max() > 1e-2


def test_validate_scores_the_views_and_predict_gives_the_same_labels(tmp_path: Path) -> None:
    """``ADE20KDataModule(eval_ratios=..., eval_flip=True)``: ``trainer.validate`` scores the
    augmented predictions; ``predict_images`` on the same files, reading the settings from the
    checkpoint's datamodule options, gives the label maps whose mIoU is validate's."""
    from torchmetrics.classification import MulticlassJaccardIndex

    from vtdense.data.ade20k import SegmentationFolder

    root = generate_synthetic_segmentation(tmp_path / "ade", num_train=1, num_val=3, size_range=(36, 60), seed=3)
    dm = ADE20KDataModule(root=str(root), num_workers=0, scale=(64, 48), eval_ratios=[0.75, 1.25], eval_flip=True)
    torch.manual_seed(0)
    task = _task(num_classes=dm.num_classes, aux_weight=0.0)
    metrics = _trainer(tmp_path, logger=False).validate(task, datamodule=dm, verbose=False)[0]
    plain = _trainer(tmp_path, logger=False).validate(
        task, datamodule=ADE20KDataModule(root=str(root), num_workers=0, scale=(64, 48)), verbose=False)[0]

    task.datamodule_hparams = dict(dm.hparams)  # as a checkpoint of this run holds them
    val = SegmentationFolder(root, "validation", dm.num_classes)
    preds = task.predict_images([str(p) for p in val.images])
    miou = MulticlassJaccardIndex(num_classes=dm.num_classes, ignore_index=255, average="macro")
    for i, pred in enumerate(preds):
        miou.update(pred["label_map"], val.load(i)[1])
    assert float(miou.compute()) == pytest.approx(metrics["val/mIoU"], abs=1e-6)
    batches = _trainer(tmp_path, logger=False).predict(task, datamodule=dm)  # the datamodule's evaluation batches
    by_trainer = [p["label_map"] for batch in batches for p in batch]
    assert len(by_trainer) == len(preds) and all(torch.equal(a, b["label_map"]) for a, b in zip(by_trainer, preds))
    assert metrics["val/mIoU"] != pytest.approx(plain["val/mIoU"], abs=1e-6)  # the views were used
    one = task.predict_images([str(val.images[0])], eval_ratios=[1.0], eval_flip=False)[0]["label_map"]
    assert not torch.equal(one, preds[0]["label_map"])  # an argument replaces the checkpoint's setting
