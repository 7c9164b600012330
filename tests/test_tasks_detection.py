"""Tests for vtdense.tasks.detection.DetectionTask: training, COCO evaluation, outputs, predict."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch import Tensor, nn

from vtdense.data.coco import COCODataModule
from vtdense.data.synthetic import make_synthetic_coco
from vtdense.tasks.detection import DetectionTask

TINY = dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=4)
SLIM = dict(fpn_channels=32, slim_heads=True, mask_head_channels=16, mask_head_layers=1, box_head_width=64)


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 train / 6 val images of 64-96 px, 2 classes (category ids 1 and 3), crowd annotations."""
    root = tmp_path_factory.mktemp("det") / "coco"
    return make_synthetic_coco(root, num_train=8, num_val=6, size_range=(64, 96), num_classes=2, with_crowd=True)


def datamodule(root: Path, **kwargs: Any) -> COCODataModule:
    # images are 64-96 px: test_scale 100 rescales every one, so predictions must be mapped back.
    opts = dict(root=str(root), batch_size=2, num_workers=0, train_scales=(80,), max_size=160, test_scale=100)
    opts.update(kwargs)
    return COCODataModule(**opts)


def trainer(tmp_path: Path, **kwargs: Any) -> L.Trainer:
    opts = dict(
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(str(tmp_path), name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    opts.update(kwargs)
    return L.Trainer(**opts)


class Oracle(nn.Module):
    """Stands in for the detector in eval: returns the (resized-coordinate) ground truth, jittered,
    with random scores, plus a false positive per image, so mAP is high but not 1."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[dict[str, Any]] = []
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, images: list[Tensor], targets: Any = None) -> list[dict[str, Tensor]]:
        out = []
        for img, t in zip(images, self.targets):
            h, w = img.shape[-2:]
            boxes = t["boxes"].clone() + torch.randn(t["boxes"].shape, generator=self.gen) * 1.5
            fp = torch.tensor([[0.0, 0.0, w / 3, h / 3]])
            boxes = torch.cat([boxes, fp]).clamp(min=0)
            labels = torch.cat([t["labels"], torch.tensor([1])])
            scores = torch.rand(len(boxes), generator=self.gen)
            masks = torch.cat([t["masks"].float(), torch.zeros(1, h, w)])[:, None]
            out.append({"boxes": boxes, "labels": labels, "scores": scores, "masks": masks})
        return out


def oracle_task(**kwargs: Any) -> tuple[DetectionTask, Oracle]:
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="mask_rcnn", num_classes=2, **SLIM, **kwargs)
    oracle = Oracle()
    task.model = oracle
    for name in ("validation_step", "test_step", "predict_step"):
        original = getattr(task, name)

        def step(batch: Any, batch_idx: int, _original: Any = original) -> Any:
            oracle.targets = batch[1]
            return _original(batch, batch_idx)

        setattr(task, name, step)
    return task, oracle


def cocoeval_stats(coco_gt: COCO, results: Path, iou_type: str) -> np.ndarray:
    with contextlib.redirect_stdout(io.StringIO()):
        dets = coco_gt.loadRes(str(results))
        ev = COCOeval(coco_gt, dets, iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats


def test_validation_metrics_match_pycocotools_on_written_results(coco_root: Path, tmp_path: Path) -> None:
    task, _ = oracle_task()
    dm = datamodule(coco_root)
    tr = trainer(tmp_path)
    (metrics,) = tr.validate(task, datamodule=dm, verbose=False)
    run = Path(tr.log_dir)
    # Predictions mapped back to original coordinates score high; a wrong rescale would not.
    assert 0.5 < metrics["val/bbox_mAP"] < 1.0
    assert 0.5 < metrics["val/segm_mAP"] < 1.0
    for key in ("mAP50", "mAP75", "mAP_s", "mAP_m", "mAP_l", "mAR100"):
        assert f"val/bbox_{key}" in metrics and f"val/segm_{key}" in metrics

    coco_gt = COCO(str(dm.paths["val"][0]))
    bbox = json.loads((run / "bbox.json").read_text())
    assert {d["category_id"] for d in bbox} <= {1, 3}  # COCO ids, not contiguous labels
    assert {d["image_id"] for d in bbox} <= set(coco_gt.getImgIds())
    for iou in ("bbox", "segm"):
        stats = cocoeval_stats(coco_gt, run / f"{iou}.json", iou)
        assert abs(stats[0] - metrics[f"val/{iou}_mAP"]) < 1e-6
        assert abs(stats[1] - metrics[f"val/{iou}_mAP50"]) < 1e-6
        assert abs(stats[2] - metrics[f"val/{iou}_mAP75"]) < 1e-6
        assert abs(stats[8] - metrics[f"val/{iou}_mAR100"]) < 1e-6
        for i, key in ((3, "mAP_s"), (4, "mAP_m"), (5, "mAP_l")):  # by COCO's area field, absent ranges -1 in both
            assert abs(stats[i] - metrics[f"val/{iou}_{key}"]) < 1e-6, key
        # per-category AP as detectron2 derives it from COCOeval's precisions (IoU .50:.95, all areas, 100 dets)
        with contextlib.redirect_stdout(io.StringIO()):
            ev = COCOeval(coco_gt, coco_gt.loadRes(str(run / f"{iou}.json")), iou)
            ev.evaluate()
            ev.accumulate()
        for k, cat in enumerate(ev.params.catIds):
            p = ev.eval["precision"][:, :, k, 0, -1]
            name = coco_gt.cats[int(cat)]["name"]
            assert abs(float(np.mean(p[p > -1])) - metrics[f"val/{iou}_AP.{name}"]) < 1e-6, (iou, name)
    pngs = sorted((run / "predictions").glob("*.png"))
    assert len(pngs) == 4
    # test split writes its own files
    tr.test(task, datamodule=dm, verbose=False)
    assert (run / "test_bbox.json").is_file() and (run / "test_segm.json").is_file()


def test_size_range_metrics_use_the_coco_area_field(coco_root: Path, tmp_path: Path) -> None:
    """mAP_s/m/l split the ground truth by the annotation's ``area`` field, as pycocotools does, not by
    the box or mask area. The synthetic objects are all small (< 32^2 px), so the file here gives them
    areas of every range: scored by their boxes or masks instead, mAP_m and mAP_l would be -1. An
    area of 0 is "small" and a negative one is ignored in every range, as pycocotools has them
    (torchmetrics alone would replace both by the box or mask area)."""
    data = json.loads((coco_root / "annotations" / "instances_val2017.json").read_text())
    for k, ann in enumerate(data["annotations"]):
        ann["area"] = (100.0, 5000.0, 20000.0, 0.0, 6000.0, -5.0, 30000.0)[k % 7]  # small, medium, large, ...
    val_ann = tmp_path / "val_areas.json"
    val_ann.write_text(json.dumps(data))
    task, _ = oracle_task()
    dm = datamodule(coco_root, val_ann=str(val_ann))
    tr = trainer(tmp_path)
    (metrics,) = tr.validate(task, datamodule=dm, verbose=False)
    run = Path(tr.log_dir)
    coco_gt = COCO(str(val_ann))
    for iou in ("bbox", "segm"):
        stats = cocoeval_stats(coco_gt, run / f"{iou}.json", iou)
        for i, key in ((3, "mAP_s"), (4, "mAP_m"), (5, "mAP_l")):
            assert stats[i] >= 0.0, (iou, key)  # every range holds ground truth
            assert abs(stats[i] - metrics[f"val/{iou}_{key}"]) < 1e-6, (iou, key)
        assert abs(stats[0] - metrics[f"val/{iou}_mAP"]) < 1e-6
        assert abs(stats[8] - metrics[f"val/{iou}_mAR100"]) < 1e-6


def test_ground_truth_fallback_scales_x_by_width_and_y_by_height() -> None:
    """Without ``orig_boxes`` the resized boxes are scaled back by ``w0 / w`` along x and ``h0 / h``
    along y. The transforms keep the aspect ratio (both scales nearly equal), so the size here does
    not: 80x50 -> 240x100 is x3 in x and x2 in y."""
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="faster_rcnn", num_classes=2, **SLIM)
    image = torch.zeros(3, 50, 80)
    target = {"boxes": torch.tensor([[10.0, 5.0, 30.0, 25.0]]), "labels": torch.tensor([2]), "orig_size": (100, 240)}
    gt = task._ground_truth(image, target)
    torch.testing.assert_close(gt["boxes"], torch.tensor([[30.0, 10.0, 90.0, 50.0]]))
    # orig_boxes, when present, are taken as they are
    target["orig_boxes"] = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(task._ground_truth(image, target)["boxes"], target["orig_boxes"])


def test_predict_returns_original_coordinates(coco_root: Path, tmp_path: Path) -> None:
    task, _ = oracle_task()
    dm = datamodule(coco_root)
    tr = trainer(tmp_path)
    preds = tr.predict(task, datamodule=dm)
    dm.setup("validate")
    val = dm.val_dataset
    n = 0
    for batch_preds, idx in zip(preds, range(0, len(val), 2)):
        for j, pred in enumerate(batch_preds):
            image, target = val[idx + j]
            h0, w0 = target["orig_size"]
            assert image.shape[-2:] != (h0, w0)  # the model saw a resized image
            k = len(target["orig_boxes"])
            # the oracle returned jittered resized GT boxes: mapped back they land on the original boxes
            assert torch.allclose(pred["boxes"][:k], target["orig_boxes"], atol=8.0)
            assert pred["masks"].shape == (k + 1, h0, w0) and pred["masks"].dtype == torch.bool
            if k:
                iou = (pred["masks"][:k] & target["orig_masks"]).sum((1, 2)) / (
                    pred["masks"][:k] | target["orig_masks"]
                ).sum((1, 2))
                assert iou.min() > 0.7
            assert pred["category_ids"].tolist() == [{1: 1, 2: 3}[int(v)] for v in pred["labels"]]
            n += 1
    assert n == len(val)


def test_predict_matches_manual_rescale_with_real_model(coco_root: Path) -> None:
    torch.manual_seed(0)
    task = DetectionTask(
        backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, score_thresh=0.0, **SLIM
    ).eval()
    image = torch.rand(3, 60, 90)
    target = {"orig_size": (120, 135)}
    with torch.no_grad():
        (pred,) = task.predict_step(([image], [target]), 0)
        (raw,) = task.model([image])
    assert len(raw["boxes"]) > 0
    expected = raw["boxes"] * torch.tensor([135 / 90, 120 / 60, 135 / 90, 120 / 60])
    assert torch.allclose(pred["boxes"], expected.clamp(min=0), atol=1e-4)
    assert pred["masks"].shape == (len(raw["boxes"]), 120, 135)
    assert torch.equal(pred["scores"], raw["scores"])


class FixedMasks(nn.Module):
    """Stands in for Mask R-CNN in eval: one image's detections with the given mask probabilities."""

    def __init__(self, probs: Tensor) -> None:
        super().__init__()
        self.probs = probs  # [N, 1, h, w], at the model input's size like torchvision's pasted masks

    def forward(self, images: list[Tensor], targets: Any = None) -> list[dict[str, Tensor]]:
        n = self.probs.shape[0]
        return [{"boxes": torch.tensor([[0.0, 0.0, 1.0, 1.0]]).repeat(n, 1), "labels": torch.ones(n, dtype=torch.long),
                 "scores": torch.linspace(0.9, 0.1, n), "masks": self.probs}]


def test_predicted_masks_are_binarised_above_one_half() -> None:
    """Mask probabilities become bool masks with ``p > 0.5`` after the bilinear resize to the original
    size (torchvision's references threshold pasted masks with ``> 0.5``): 0.49 and exactly 0.5 are
    off, 0.51 is on, down to the float32 neighbours of 0.5. 18 masks span two chunks of the resize."""
    half = torch.tensor(0.5)
    below, above = torch.nextafter(half, torch.tensor(0.0)), torch.nextafter(half, torch.tensor(1.0))
    values = torch.tensor([0.49, 0.5, 0.51, 0.0, 1.0, float(below), float(above)])
    on = torch.tensor([False, False, True, False, True, False, True])  # by hand, not by a comparison
    probs = torch.stack([values.roll(k)[:6].view(2, 3) for k in range(18)])[:, None]
    expected = torch.stack([on.roll(k)[:6].view(2, 3) for k in range(18)])
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="mask_rcnn", num_classes=2, **SLIM).eval()
    task.model = FixedMasks(probs)
    # original size = input size: the resize is the identity (exact values), only the threshold acts
    (pred,) = task.predict_step(([torch.rand(3, 2, 3)], [{"orig_size": (2, 3)}]), 0)
    assert pred["masks"].dtype == torch.bool and torch.equal(pred["masks"], expected)

    # upscaled x4: the probabilities are resized bilinearly first, then thresholded. [0, 0.6, 0] resizes to
    # 0, 0, .075, .225, .375, .525, .525, .375, ... (align_corners=False): only 2 pixels pass, where
    # thresholding first and resizing the bool mask would give 4.
    task.model = FixedMasks(torch.tensor([0.0, 0.6, 0.0]).view(1, 1, 1, 3))
    (pred,) = task.predict_step(([torch.rand(3, 1, 3)], [{"orig_size": (4, 12)}]), 0)
    row = torch.zeros(12, dtype=torch.bool)
    row[5:7] = True
    assert torch.equal(pred["masks"], row.expand(1, 4, 12))


def test_masks_are_pasted_once_into_the_original_image() -> None:
    """Evaluation and prediction paste each detection's mask head output once, into the original
    image with the rescaled box, as torchvision's own Mask R-CNN does when it resizes images itself
    (and mmdet and detectron2 do): not pasted into the resized input and then resized again."""
    from torchvision.models.detection.roi_heads import paste_masks_in_image

    from vtdense.models.detection import unpasted_masks

    torch.manual_seed(0)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="mask_rcnn", num_classes=2, score_thresh=0.0,
                         **SLIM).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in task.model.roi_heads.mask_predictor.parameters():  # spread the probabilities out of ~0.5
            p.add_(torch.randn(p.shape, generator=g))
    image = torch.rand(3, 64, 96, generator=g)
    target = {"orig_size": (150, 200)}  # the data pipeline shrank a 150 x 200 original to 64 x 96
    with torch.no_grad():
        with unpasted_masks(task.model) as unpasted:
            (raw,) = task.model([image])
        (pasted,) = task.model([image])
        (pred,) = task.predict_step(([image], [target]), 0)
    assert unpasted and raw["masks"].shape[-2:] == (28, 28) and len(raw["boxes"]) >= 5
    boxes = raw["boxes"] * torch.tensor([200 / 96, 150 / 64, 200 / 96, 150 / 64])
    want = paste_masks_in_image(raw["masks"], boxes, (150, 200))[:, 0] > 0.5
    assert pred["masks"].shape == (len(boxes), 150, 200) and torch.equal(pred["masks"], want)
    assert want.any()
    twice = task._to_original(image, pasted, target)["masks"]  # the former path: pasted at 64 x 96, then resized
    assert not torch.equal(twice, want)
    assert task.model.transform.paste  # restored: the model itself still returns pasted masks


class FixedOrderCOCO(COCODataModule):
    """Unshuffled training batches, so every epoch of one batch sees the same images."""

    def train_dataloader(self) -> Any:
        return self._loader(self.train_dataset, False, "train")


def test_fit_reduces_loss_and_uses_datamodule_classes(coco_root: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    task = DetectionTask(
        backbone="swin_tiny",
        backbone_kwargs=TINY,
        head="faster_rcnn",
        num_classes=None,  # taken from the datamodule
        lr=5e-4,  # at 2e-3 AdamW overshoots on this one batch (2.8 -> 2.3 -> 5.6)
        warmup_steps=2,
        lr_schedule="step",
        lr_milestones=[4.4],
        **SLIM,
    )
    dm = FixedOrderCOCO(
        root=str(coco_root), batch_size=2, num_workers=0, train_scales=(80,), max_size=160, test_scale=100, flip_prob=0.0
    )

    class Record(L.Callback):
        """Record each step's loss and the lr it used."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.lrs: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            # the same RPN / RoI sampling draws at every step (the batch is the same too): without
            # them the loss moves by ~10% from step to step with no weight update at all
            torch.manual_seed(0)

        def on_train_batch_end(
            self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, idx: int
        ) -> None:
            self.losses.append(float(outputs["loss"]))

    cb = Record()
    tr = trainer(tmp_path, max_epochs=6, limit_train_batches=1, limit_val_batches=1, callbacks=[cb], log_every_n_steps=1)
    tr.fit(task, datamodule=dm)
    assert task.hparams["num_classes"] == 2
    # with the draws fixed, a run without weight updates keeps its loss to 1e-6; this one falls ~20%
    assert sum(cb.losses[3:]) / 3 < 0.9 * cb.losses[0], cb.losses  # 0.82 here
    # linear warmup over 2 steps from lr * 1e-3, then x0.1 at epoch 4.4 -> step 4 (1 step per epoch)
    assert cb.lrs == pytest.approx([5e-7, 5e-4 * 0.5005, 5e-4, 5e-4, 5e-5, 5e-5])
    logged = tr.logged_metrics
    for key in ("train/loss", "train/loss_classifier", "train/loss_box_reg", "train/loss_objectness", "val/bbox_mAP"):
        assert key in logged, key
    ckpt_dir = Path(tr.checkpoint_callback.dirpath)
    names = sorted(p.name for p in ckpt_dir.glob("*.ckpt"))
    assert "last.ckpt" in names and any(p.startswith("best-epoch") for p in names), names
    # the checkpoint restores with the resolved class count and category table
    restored = DetectionTask.load_from_checkpoint(ckpt_dir / "last.ckpt")
    assert restored.hparams["num_classes"] == 2 and restored.label_to_category_id == {1: 1, 2: 3}


class _FakeTrainer:
    """What ``configure_optimizers`` reads of a trainer."""

    estimated_stepping_batches = 100
    num_training_batches = 10
    accumulate_grad_batches = 1


@pytest.mark.parametrize("rule", ["names", "1d"])
def test_optimizer_groups_skip_decay_on_norms_and_tables(rule: str) -> None:
    """``no_decay="names"`` (the default, mmdet's Swin ``paramwise_cfg`` and detectron2's MViTv2):
    norms and position tables get no weight decay, biases do. ``"1d"`` (timm's rule): every bias too."""
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, weight_decay=0.05, no_decay=rule, **SLIM)

    task._trainer = _FakeTrainer()  # type: ignore[assignment]
    conf = task.configure_optimizers()
    opt = conf["optimizer"]
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {id(p): n for n, p in task.model.named_parameters()}
    assert decay, "some parameters must decay"
    biases = [n for n in names.values() if n.endswith(".bias") and "norm" not in n]
    assert len(biases) > 10
    for pid, name in names.items():
        no_decay = "norm" in name or "relative_position_bias_table" in name or (rule == "1d" and name.endswith(".bias"))
        assert (pid in decay) == (not no_decay), name
    assert conf["lr_scheduler"]["interval"] == "step"


def test_sgd_with_every_parameter_decayed_steps_as_mmdet_sgd() -> None:
    """``optimizer="sgd"`` with ``no_decay="none"`` (mmdet's RetinaNet recipe): one group, every
    parameter (norms, biases, position tables) decayed, and two steps equal the hand-computed
    momentum update ``buf = m * buf + (g + wd * p)``, ``p -= lr * buf``."""
    torch.manual_seed(0)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="retinanet", num_classes=2, optimizer="sgd",
                         momentum=0.9, lr=0.01, weight_decay=1e-4, no_decay="none", fpn_channels=32)

    task._trainer = _FakeTrainer()  # type: ignore[assignment]
    opt = task.configure_optimizers()["optimizer"]
    assert type(opt) is torch.optim.SGD
    for group in opt.param_groups:  # backbone and the rest: the same settings, all decayed
        assert group["weight_decay"] == 1e-4 and group["momentum"] == 0.9 and group["dampening"] == 0
        assert not group["nesterov"] and group["lr"] == pytest.approx(0.01 * 0.001)  # the warm-up's first step
    lr = opt.param_groups[0]["lr"]
    params = [p for p in task.model.parameters() if p.requires_grad]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}
    assert any("relative_position_bias_table" in n for n, _ in task.model.named_parameters())
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    expected, bufs = [p.clone() for p in start], [torch.zeros_like(p) for p in start]
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = grads[step][i].clone()
            d = grads[step][i] + 1e-4 * expected[i]
            bufs[i] = d if step == 0 else 0.9 * bufs[i] + d
            expected[i] = expected[i] - lr * bufs[i]
        opt.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_lr_schedules_equal_hand_computed_multipliers() -> None:
    """``warmup_schedule`` against the formulas written out by hand: linear warmup from
    ``warmup_factor`` (mmdet's ``LinearLR``), the step schedule counting a milestone from its own
    step on, half-cosine and poly decay to ``min_factor``, and both held at the end past ``total_steps``
    (a poly base must never go negative: a fractional power of it would be complex)."""
    from vtdense.tasks.optim import warmup_schedule

    step = dict(kind="step", total_steps=20, warmup_steps=2, warmup_factor=1e-3, milestones=(4, 8), gamma=0.1)
    got = [warmup_schedule(s, **step) for s in range(10)]
    assert got == pytest.approx([1e-3, 0.5005, 1, 1, 0.1, 0.1, 0.1, 0.1, 0.01, 0.01])
    cos = dict(kind="cosine", total_steps=10, min_factor=0.1)
    assert [warmup_schedule(s, **cos) for s in (0, 5, 10, 15)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert warmup_schedule(2, **cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    # warmup multiplies the decay: step 1 of 4 is 1/4 of the way from 1e-3 to 1
    assert warmup_schedule(1, **cos, warmup_steps=4, warmup_factor=1e-3) == pytest.approx(
        (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.1))) * (1e-3 * 0.75 + 0.25))
    poly = dict(kind="poly", total_steps=10, power=0.9)
    assert [warmup_schedule(s, **poly) for s in (0, 5, 10, 12)] == pytest.approx([1.0, 0.5**0.9, 0.0, 0.0])
    assert warmup_schedule(3, **poly, min_factor=0.05) == pytest.approx(0.05 + 0.95 * 0.7**0.9)
    assert warmup_schedule(12, **poly, min_factor=0.05) == pytest.approx(0.05)
    assert warmup_schedule(7, kind="constant", total_steps=10) == 1.0


def test_param_groups_decay_and_backbone_multiplier_by_name() -> None:
    """Which parameters decay and which carry the backbone multiplier, by name: 1-D tensors, biases,
    the position tables of Swin and MViTv2 (``relative_position_bias_table``, ``rel_pos_h/w``,
    ``pos_embed``, all >= 2-D) and extra keywords never decay; frozen parameters are left out."""
    from vtdense.tasks.optim import param_groups

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Module()
            self.body.fc = nn.Linear(4, 4)
            self.body.pos_embed = nn.Parameter(torch.zeros(1, 4, 4))
            self.body.rel_pos_h = nn.Parameter(torch.zeros(7, 4))
            self.body.rel_pos_w = nn.Parameter(torch.zeros(7, 4))
            self.body.frozen = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
            self.head = nn.Linear(4, 2)
            self.head_scale_table = nn.Parameter(torch.zeros(2, 2))

    groups = param_groups(M(), 0.05, no_decay_keywords=("scale_table",), backbone_prefix="body.", backbone_lr_mult=0.1)
    got = {n: (g["weight_decay"], g["lr_mult"]) for g in groups for n in g["param_names"]}
    assert got == {
        "body.fc.weight": (0.05, 0.1), "body.fc.bias": (0.0, 0.1), "body.pos_embed": (0.0, 0.1),
        "body.rel_pos_h": (0.0, 0.1), "body.rel_pos_w": (0.0, 0.1),
        "head.weight": (0.05, 1.0), "head.bias": (0.0, 1.0), "head_scale_table": (0.0, 1.0),
    }


def test_layer_decay_composes_with_the_backbone_multiplier() -> None:
    """``layer_decay`` with ``backbone_lr_mult``: backbone layer ``i`` of ``N`` gets
    ``lr * backbone_lr_mult * layer_decay ** (N - i)``; the FPN and heads keep ``lr``."""
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, lr=1e-3, layer_decay=0.5,
                         backbone_lr_mult=0.1, **SLIM)

    task._trainer = _FakeTrainer()  # type: ignore[assignment]
    opt = task.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in task.model.named_parameters()}
    lr = {names[id(p)]: g["initial_lr"] for g in opt.param_groups for p in g["params"]}  # before the warmup factor
    assert lr["backbone.body.patch_embed.proj.weight"] == pytest.approx(1e-3 * 0.1 * 0.5**5)  # 4 blocks: top = 5
    assert lr["backbone.body.layers.3.blocks.0.attn.qkv.weight"] == pytest.approx(1e-3 * 0.1 * 0.5)
    assert lr["backbone.body.out_norms.stage4.weight"] == pytest.approx(1e-3 * 0.1)
    assert lr["backbone.fpn.inner_blocks.0.0.weight"] == pytest.approx(1e-3)
    assert lr["roi_heads.box_predictor.cls_score.weight"] == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("head", "yolo", r"unknown head 'yolo' \(option 'head'\); choose one of faster_rcnn, fcos, mask_rcnn, retinanet"),
        ("backbone", "resnet50", r"unknown backbone 'resnet50' \(option 'backbone'\).*swin_tiny"),
        ("lr_schedule", "linear", r"unknown lr_schedule 'linear' \(option 'lr_schedule'\)"),
        ("metric_backend", "cocoapi", r"unknown metric_backend 'cocoapi' \(option 'metric_backend'\)"),
        ("num_classes", 0, "num_classes must be >= 1"),
        ("no_decay", "bias", r"unknown no_decay 'bias' \(option 'no_decay'\); choose one of names, 1d, none"),
        ("optimizer", "adam", r"unknown optimizer 'adam' \(option 'optimizer'\); choose one of adamw, sgd"),
        ("momentum", 1.0, r"momentum must be in \[0, 1\) \(option 'momentum'\), got 1.0"),
    ],
)
def test_bad_options_raise(option: str, value: Any, message: str) -> None:
    kwargs: dict[str, Any] = dict(backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2)
    kwargs[option] = value
    with pytest.raises(ValueError, match=message):
        DetectionTask(**kwargs)


def test_backbone_weights_loaded_when_fitting_starts(tmp_path: Path) -> None:
    from vtdense import CheckpointError, create_backbone

    torch.manual_seed(1)
    source = create_backbone("swin_tiny", **TINY)
    torch.save(source.state_dict(), tmp_path / "backbone.pth")
    task = DetectionTask(
        backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, backbone_weights=str(tmp_path / "backbone.pth"), **SLIM
    )
    body = task.model.backbone.body
    key = next(k for k in source.state_dict() if k.endswith("weight"))
    assert not torch.equal(body.state_dict()[key], source.state_dict()[key])
    task.setup("fit")
    for name, value in source.state_dict().items():
        assert torch.equal(body.state_dict()[name], value), name
    missing = DetectionTask(
        backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, backbone_weights=str(tmp_path / "nope.pth"), **SLIM
    )
    with pytest.raises(CheckpointError, match="nope.pth"):
        missing.setup("fit")


def test_bf16_mixed_fit_and_validate(coco_root: Path, tmp_path: Path) -> None:
    """Mixed precision end to end: autocast backbone, fp32 box math, finite losses, metrics computed."""
    torch.manual_seed(0)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, num_classes=2, score_thresh=0.0, **SLIM)
    tr = trainer(
        tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1, precision="bf16-mixed", log_every_n_steps=1
    )
    fpn: set[torch.dtype] = set()
    task.model.backbone.register_forward_hook(lambda m, args, out: fpn.update(t.dtype for t in out.values()))
    tr.fit(task, datamodule=datamodule(coco_root))
    assert fpn == {torch.bfloat16}  # every forward, training and validation, ran under bf16 autocast
    assert torch.isfinite(tr.logged_metrics["train/loss"])
    assert tr.logged_metrics["val/bbox_mAP"] >= 0.0
    assert json.loads((Path(tr.log_dir) / "bbox.json").read_text())  # detections were written


class _ImageLogger(CSVLogger):
    """A CSV logger whose experiment also takes TensorBoard-style ``add_image`` calls."""

    def __init__(self, root: str) -> None:
        super().__init__(root, name="img")
        self.images: list[tuple[str, tuple[int, ...], int]] = []

    @property
    def experiment(self) -> Any:
        logger = self
        writer = super().experiment

        class _Experiment:
            def __getattr__(self, name: str) -> Any:
                return getattr(writer, name)

            def add_image(self, tag: str, img: torch.Tensor, step: int) -> None:
                logger.images.append((tag, tuple(img.shape), step))

        return _Experiment()


def test_prediction_images_are_logged_to_the_logger(coco_root: Path, tmp_path: Path) -> None:
    task, _ = oracle_task()
    logger = _ImageLogger(str(tmp_path))
    trainer(tmp_path, logger=logger).validate(task, datamodule=datamodule(coco_root), verbose=False)
    assert len(logger.images) == 4
    tag, shape, _ = logger.images[0]
    assert tag.startswith("val/pred_") and shape[0] == 3 and len(shape) == 3
    assert len(list((Path(logger.log_dir) / "predictions").glob("*.png"))) == 4  # the PNGs are still written


def test_class_names_from_a_list_are_indexed_by_label() -> None:
    """Labels are 1-based (0 is the background): a plain list names labels 1, 2, ...; a list that
    starts with ``"__background__"`` is indexed by label; a mapping is keyed by COCO category id."""
    from vtdense.tasks.detection import _as_name_map

    assert _as_name_map(["a", "b"], {}) == {1: "a", 2: "b"}
    assert _as_name_map(["__background__", "a", "b"], {}) == {1: "a", 2: "b"}
    assert _as_name_map({3: "cat", 7: "dog"}, {1: 3, 2: 7}) == {1: "cat", 2: "dog"}
