"""SegmentationTask: training reduces the loss, metrics match hand computation, outputs, inference, optimiser."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from PIL import Image
from torch.utils.data import DataLoader

from vtdense.data.ade20k import seg_collate
from vtdense.tasks.segmentation import SegmentationTask, color_palette, layer_ids

TINY_SWINV2 = dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), window_size=4)


def _task(**kw) -> SegmentationTask:
    args = dict(
        backbone="swinv2_tiny",
        backbone_kwargs=TINY_SWINV2,
        num_classes=3,
        arch_kwargs={"decoder_channels": 16},
        aux_channels=16,
        warmup_steps=0,
        num_vis=2,
    )
    args.update(kw)
    return SegmentationTask(**args)


def _trainer(tmp_path: Path, **kw) -> L.Trainer:
    args = dict(
        accelerator="cpu",
        default_root_dir=tmp_path,
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.update(kw)
    return L.Trainer(**args)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize(("layout", "lr"), [("mmseg", 2e-2), ("smp", 2e-3)])
def test_training_steps_reduce_the_loss(tmp_path: Path, layout: str, lr: float) -> None:
    """(mmseg's classifier starts at std 0.01, so its logits grow by about lr per AdamW step: this
    toy run of 8 steps needs a larger lr with that layout.)"""
    torch.manual_seed(0)
    # one fixed batch: left half class 0 (dark), right half class 1 (bright), a class-2 square, ignored border
    image = torch.zeros(3, 64, 64)
    image[:, :, 32:] = 0.9
    image[1, 20:40, 10:30] = 0.6
    mask = torch.zeros(64, 64, dtype=torch.long)
    mask[:, 32:] = 1
    mask[20:40, 10:30] = 2
    mask[:2] = 255
    sample = {"image": image, "mask": mask, "image_size": (64, 64)}
    loader = DataLoader([sample] * 16, batch_size=2, collate_fn=seg_collate)
    task = _task(lr=lr, head_layout=layout)
    record = _Losses()
    trainer = _trainer(tmp_path, max_steps=8, limit_val_batches=0, callbacks=[record], enable_checkpointing=False)
    trainer.fit(task, train_dataloaders=loader)
    assert len(record.losses) == 8
    assert np.mean(record.losses[-2:]) < 0.7 * record.losses[0], record.losses
    # the aux head was trained too
    assert task.aux_head is not None and trainer.logged_metrics["train/loss_aux"] > 0


def _handmade_batch() -> dict[str, torch.Tensor]:
    mask = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 255]])
    return seg_collate([{"image": torch.rand(3, 2, 4), "mask": mask, "image_size": (2, 4)}])


PRED = torch.tensor([[0, 1, 1, 1], [2, 0, 0, 1]])


def test_miou_equals_hand_computation(tmp_path: Path) -> None:
    task = _task(num_classes=4, aux_weight=0.0)
    # replace the network by a fixed prediction (one-hot logits of PRED)
    task.forward = lambda image: F.one_hot(PRED, 4).permute(2, 0, 1)[None].float().expand(image.shape[0], -1, -1, -1)
    loader = DataLoader([_handmade_batch()], batch_size=None)
    trainer = _trainer(tmp_path)
    metrics = trainer.validate(task, dataloaders=loader, verbose=False)[0]
    # valid pixels (target != 255): targets 0 0 1 1 2 2, predictions 0 1 1 1 2 0
    # class 0: tp 1, fp 1, fn 1 -> 1/3; class 1: tp 2, fp 1, fn 0 -> 2/3; class 2: tp 1, fp 0, fn 1 -> 1/2
    # class 3 is absent from target and prediction: left out of the mean (as mmseg does)
    by_hand = (1 / 3 + 2 / 3 + 1 / 2) / 3
    assert metrics["val/mIoU"] == pytest.approx(by_hand, abs=1e-6)
    assert metrics["val/aAcc"] == pytest.approx(4 / 6, abs=1e-6)
    assert metrics["val/IoU.class_1"] == pytest.approx(2 / 3, abs=1e-6)
    # mmseg's mAcc: per class, correct over labelled pixels (0: 1/2, 1: 2/2, 2: 1/2; 3 has none: left out)
    assert metrics["val/mAcc"] == pytest.approx((1 / 2 + 1 + 1 / 2) / 3, abs=1e-6)
    out = json.loads((Path(trainer.log_dir) / "metrics.json").read_text())
    assert out["per_class_acc"] == {"class_0": 0.5, "class_1": 1.0, "class_2": 0.5, "class_3": None}
    assert out["mIoU"] == pytest.approx(by_hand, abs=1e-6)
    assert out["per_class_iou"]["class_0"] == pytest.approx(1 / 3, abs=1e-6)
    assert out["per_class_iou"]["class_3"] is None
    # the visualisation: image | ground truth | prediction, colourised with the palette
    panel = np.asarray(Image.open(Path(trainer.log_dir) / "predictions" / "val_000.png"))
    assert panel.shape == (2, 12, 3)
    palette = color_palette(4)
    np.testing.assert_array_equal(panel[:, 8:], palette[PRED.numpy()])
    np.testing.assert_array_equal(panel[1, 6:8], 0)  # ignored ground truth is black
    # the test loop scores the same way and writes its own files beside validation's
    tested = trainer.test(task, dataloaders=loader, verbose=False)[0]
    assert tested["test/mIoU"] == pytest.approx(by_hand, abs=1e-6)
    assert tested["test/aAcc"] == pytest.approx(4 / 6, abs=1e-6)
    assert tested["test/IoU.class_1"] == pytest.approx(2 / 3, abs=1e-6)
    assert json.loads((Path(trainer.log_dir) / "test_metrics.json").read_text())["mIoU"] == pytest.approx(by_hand, abs=1e-6)
    assert json.loads((Path(trainer.log_dir) / "metrics.json").read_text()) == out  # validation's file is kept
    test_panel = np.asarray(Image.open(Path(trainer.log_dir) / "predictions" / "test_000.png"))
    np.testing.assert_array_equal(test_panel, panel)


def test_visualisations_go_to_a_logger_that_takes_images(tmp_path: Path) -> None:
    """As detection's: each panel written to ``predictions/`` is also sent to a TensorBoard-style
    logger (``add_image``, ``[3, H, W]`` uint8), tagged by split and dataset position."""
    from tests.test_tasks_detection import _ImageLogger

    task = _task(num_classes=4, aux_weight=0.0)
    task.forward = lambda image: F.one_hot(PRED, 4).permute(2, 0, 1)[None].float().expand(image.shape[0], -1, -1, -1)
    logger = _ImageLogger(str(tmp_path))
    trainer = _trainer(tmp_path, logger=logger)
    loader = DataLoader([_handmade_batch()], batch_size=None)
    trainer.validate(task, dataloaders=loader, verbose=False)
    trainer.test(task, dataloaders=loader, verbose=False)
    assert logger.images == [("val/pred_000", (3, 2, 12), 0), ("test/pred_000", (3, 2, 12), 0)]
    assert sorted(p.name for p in (Path(logger.log_dir) / "predictions").glob("*.png")) == ["test_000.png", "val_000.png"]


def test_aacc_is_pooled_over_all_labelled_pixels(tmp_path: Path) -> None:
    """aAcc is micro-averaged, as mmseg's: correct pixels / labelled pixels over the whole dataset,
    not a mean of per-image or per-class accuracies. One image has a single labelled pixel (wrong),
    the other 99 (all right): pooled 99/100, per-image mean 1/2, per-class mean 2/3."""
    # the "network" predicts the class stored in the image's first channel
    task = _task(num_classes=3, aux_weight=0.0)
    task.forward = lambda image: F.one_hot(image[:, 0].long(), 3).permute(0, 3, 1, 2).float()
    one_mask = torch.full((10, 10), 255)
    one_mask[4, 4] = 2  # the only labelled pixel, predicted 0
    one_image = torch.zeros(3, 10, 10)
    many_mask = torch.zeros(10, 10, dtype=torch.long)
    many_mask[5:] = 1
    many_mask[9, 9] = 255  # 50 pixels of class 0, 49 of class 1, one ignored
    many_image = torch.zeros(3, 10, 10)
    many_image[0] = many_mask.clamp(max=1).float()  # every labelled pixel right
    batches = [
        seg_collate([{"image": img, "mask": mask, "image_size": (10, 10)}])
        for img, mask in ((one_image, one_mask), (many_image, many_mask))
    ]
    metrics = _trainer(tmp_path).validate(task, dataloaders=DataLoader(batches, batch_size=None), verbose=False)[0]
    assert metrics["val/aAcc"] == pytest.approx(99 / 100, abs=1e-6)


def test_prediction_is_resized_to_the_label_bilinearly() -> None:
    """When the image was resized for evaluation, the logits (padding cut off first) are resized to
    the label map's size bilinearly with ``align_corners=False`` before the argmax, as mmseg does."""
    task = _task(num_classes=4, aux_weight=0.0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 12, 16, generator=gen)
    logits[..., 9:, :] = logits[..., :, 13:] = 0.0
    logits[:, 3, 9:, :] = logits[:, 3, :, 13:] = 100.0  # the padding: class 3 wherever it leaks in
    task.forward = lambda image: logits
    mask = torch.randint(0, 4, (23, 31), generator=gen)
    batch = {"image": torch.zeros(1, 3, 12, 16), "mask": mask[None], "image_size": torch.tensor([[9, 13]]),
             "mask_size": torch.tensor([[23, 31]])}
    ((pred, label),) = task._predict_batch(batch)
    crop = logits[..., :9, :13]
    expected = F.interpolate(crop, size=(23, 31), mode="bilinear", align_corners=False).argmax(1)[0]
    assert torch.equal(pred, expected) and torch.equal(label, mask)
    # the modes disagree on these logits, so the comparison above pins the mode
    for other in (dict(mode="nearest"), dict(mode="bilinear", align_corners=True), dict(mode="bicubic")):
        assert not torch.equal(F.interpolate(crop, size=(23, 31), **other).argmax(1)[0], expected), other


def test_sliding_window_matches_whole_image_for_a_pointwise_model() -> None:
    task = _task(num_classes=4, inference="slide", slide_crop=(16, 24), slide_stride=(10, 13), aux_weight=0.0).eval()
    # a per-pixel "network": sliding windows must stitch to exactly the whole-image result
    task._logits = lambda x, with_aux=False: (torch.cat([x, x.sum(1, keepdim=True)], 1), None)
    image = torch.rand(2, 3, 37, 50)
    x = task.normalize(image)
    slide = task(image)
    whole = torch.cat([x, x.sum(1, keepdim=True)], 1)
    assert slide.shape == (2, 4, 37, 50)
    torch.testing.assert_close(slide, whole)


def test_whole_inference_handles_any_size() -> None:
    task = _task(aux_weight=0.4).eval()
    with torch.no_grad():
        assert task(torch.rand(1, 3, 45, 70)).shape == (1, 3, 45, 70)


def test_optimizer_groups_and_layer_decay() -> None:
    task = _task(layer_decay=0.5, lr=1e-3, weight_decay=0.05)
    ids, top = layer_ids(task.model.encoder.backbone)
    assert top == 5  # 4 blocks + 1
    assert all(v == 0 for k, v in ids.items() if k.startswith("patch_embed."))
    assert all(v == top for k, v in ids.items() if k.startswith("out_norms."))
    optimizer = task.configure_optimizers()["optimizer"]
    lr_of, wd_of, ndim = {}, {}, {}
    names = {id(p): n for n, p in task.named_parameters()}
    for g in optimizer.param_groups:
        for n, p in ((names[id(p)], p) for p in g["params"]):
            lr_of[n], wd_of[n], ndim[n] = g["lr"], g["weight_decay"], p.ndim
    assert len(lr_of) == sum(1 for p in task.parameters() if p.requires_grad)
    pe = next(n for n in lr_of if n.startswith("model.encoder.backbone.patch_embed") and n.endswith("weight"))
    assert lr_of[pe] == pytest.approx(1e-3 * 0.5**5)
    head = next(n for n in lr_of if n.startswith("model.segmentation_head") and n.endswith("weight"))
    assert lr_of[head] == pytest.approx(1e-3)
    assert wd_of[head] == 0.05
    # no_decay="names" (mmseg's Swin UPerNet paramwise_cfg): norms and position terms 0; biases, and the
    # heads' BatchNorms (named by position in SMP's blocks, not "norm"), the full decay
    for n in lr_of:
        assert (wd_of[n] == 0.0) == ("norm" in n or "cpb_mlp" in n or "logit_scale" in n), n
    assert any(n.endswith(".bias") and wd_of[n] == 0.05 for n in lr_of)


def test_layer_ids_follow_beit_and_timm_block_numbering() -> None:
    """Layer ids of a Swin with depths (1, 2, 1, 1), by hand in the BEiT / SimMIM convention (stem 0,
    block ``k`` of the flattened sequence ``k``, what follows the last block ``N + 1`` like the head),
    with patch merging at the start of a stage taking the next block's id. timm's
    ``param_groups_layer_decay`` numbers the same layout the same way (its final norm shares the
    last block's id where the output norms here sit one above, with the head), so its lr scales
    equal ``decay ** (N - id)`` for every parameter inside the stem and the stages."""
    from vtdense.backbones import create_backbone
    from vtdense.tasks.optim import apply_layer_decay, param_groups

    bb = create_backbone("swin_tiny", embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)
    ids, top = layer_ids(bb)
    assert top == 6
    by_module = {"patch_embed": 0, "layers.0.blocks.0": 1, "layers.1.downsample": 2, "layers.1.blocks.0": 2,
                 "layers.1.blocks.1": 3, "layers.2.downsample": 4, "layers.2.blocks.0": 4, "layers.3.downsample": 5,
                 "layers.3.blocks.0": 5, "out_norms": 6}
    for name, _ in bb.named_parameters():
        (module,) = [m for m in by_module if name.startswith(m + ".")]
        assert ids[name] == by_module[module], name
    # the lr multipliers apply_layer_decay hands out, against timm's for the same layout
    timm_swin = pytest.importorskip("timm.models.swin_transformer")
    from timm.optim import param_groups_layer_decay

    ref = timm_swin.SwinTransformer(img_size=64, patch_size=4, embed_dim=16, depths=(1, 2, 1, 1), num_heads=(1, 1, 2, 2),
                                    window_size=4, num_classes=0)
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    ref_scale = {ref_names[id(p)]: g["lr_scale"] for g in param_groups_layer_decay(ref, 0.05, layer_decay=0.5)
                 for p in g["params"]}
    groups = apply_layer_decay(param_groups(bb, 0.05), bb, "", 0.5)
    mult = {n: g["lr_mult"] for g in groups for n in g["param_names"]}
    shared = [n for n in mult if n in ref_scale and not n.startswith("out_norms")]
    assert len(shared) > 0.9 * len(mult), sorted(set(mult) - set(shared))
    for n in shared:
        assert mult[n] == pytest.approx(ref_scale[n] * 0.5), n  # timm's top is one lower (see above)


def test_nested_blocks_count_once() -> None:
    """A ``*Block`` module inside another is part of that block's layer, not a layer of its own."""

    class InnerBlock(torch.nn.Linear):
        pass

    class OuterBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = InnerBlock(2, 2), InnerBlock(2, 2)

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), OuterBlock(), OuterBlock(), torch.nn.LayerNorm(2))
    ids, top = layer_ids(net)
    assert top == 3
    assert ids == {"0.weight": 0, "0.bias": 0, **{f"{i}.{m}.{p}": i for i in (1, 2) for m in "ab" for p in ("weight", "bias")},
                   "3.weight": 3, "3.bias": 3}


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="model.arch: unknown architecture 'segnet'.*upernet"):
        _task(arch="segnet")
    with pytest.raises(ValueError, match="model.inference must be 'whole' or 'slide'"):
        _task(inference="tiles")
    with pytest.raises(ValueError, match="encoder_depth >= 4"):
        _task(encoder_depth=3, aux_weight=0.4)


def test_unreadable_validation_image_is_not_counted_twice(tmp_path: Path) -> None:
    """A bad validation label map is skipped and its stand-in (another image) is not counted again."""
    from vtdense.data.ade20k import ADE20KDataModule
    from vtdense.data.synthetic_seg import generate_synthetic_segmentation

    def validate(root: Path) -> dict[str, float]:
        torch.manual_seed(0)
        task = _task(num_classes=8, aux_weight=0.0)
        dm = ADE20KDataModule(root=str(root), num_classes=8, batch_size=2, val_batch_size=1, num_workers=0,
                              scale=(64, 48), crop_size=(32, 32))
        return _trainer(tmp_path / root.name).validate(task, datamodule=dm, verbose=False)[0]

    bad = generate_synthetic_segmentation(tmp_path / "bad", num_train=2, num_val=4, size_range=(48, 64), seed=11)
    good = generate_synthetic_segmentation(tmp_path / "good", num_train=2, num_val=4, size_range=(48, 64), seed=11)
    victim = sorted((bad / "annotations" / "validation").glob("*.png"))[1]
    victim.write_bytes(victim.read_bytes()[:40])  # truncated: skipped at load time, image 2 stands in
    (good / "annotations" / "validation" / victim.name).unlink()
    next((good / "images" / "validation").glob(victim.stem + ".*")).unlink()
    with_bad, without = validate(bad), validate(good)
    assert with_bad["val/mIoU"] == pytest.approx(without["val/mIoU"], abs=1e-7)
    assert with_bad["val/aAcc"] == pytest.approx(without["val/aAcc"], abs=1e-7)


def test_batch_size_one_with_upernet_is_a_clear_error_before_training(tmp_path: Path) -> None:
    from vtdense.data.ade20k import ADE20KDataModule
    from vtdense.data.synthetic_seg import generate_synthetic_segmentation

    root = generate_synthetic_segmentation(tmp_path / "ade", num_train=2, num_val=1, size_range=(48, 64), seed=1)
    dm = ADE20KDataModule(root=str(root), num_classes=8, batch_size=1, num_workers=0, scale=(64, 48), crop_size=(32, 32))
    with pytest.raises(ValueError, match=r"data.batch_size=1 cannot train the upernet decoder"):
        _trainer(tmp_path, max_steps=1).fit(_task(num_classes=8), datamodule=dm)


# ------------------------------------------------------------------------ prediction on new images
def _keep_ratio_size(h: int, w: int, scale: tuple[int, int]) -> tuple[int, int]:
    """mmcv's keep-ratio rescale to (long, short), written out: the factor that fits both sides."""
    f = min(scale[0] / max(h, w), scale[1] / min(h, w))
    return int(h * f + 0.5), int(w * f + 0.5)


def test_predict_transform_scale_precedence() -> None:
    """The prediction resize is, first to last: the ``eval_scale`` argument, the checkpoint datamodule's
    ``eval_scale``, its ``scale`` (also when ``eval_scale`` was saved as ``None``), then (2048, 512).
    Each level's scale gives a different size for a 30 x 90 image, so the winner shows in the shape."""
    task = _task()
    image = torch.zeros(3, 30, 90, dtype=torch.uint8)
    both = {"eval_scale": [128, 96], "scale": [256, 32]}
    cases = [
        ((64, 48), both, (64, 48)),  # the argument beats both saved settings
        ((64, 48), None, (64, 48)),  # ... and needs none
        (None, both, (128, 96)),  # the saved eval_scale beats the saved scale
        (None, {"eval_scale": None, "scale": [256, 32]}, (256, 32)),  # eval_scale saved unset: scale
        (None, {"scale": [256, 32]}, (256, 32)),
        (None, {}, (2048, 512)),  # nothing saved: the ADE20K default
        (None, None, (2048, 512)),
    ]
    sizes = {_keep_ratio_size(30, 90, s) for _, _, s in cases}
    assert len(sizes) == 4  # (21, 64), (43, 128), (32, 96), (512, 1536): every level is told apart
    for arg, saved, winner in cases:
        task.datamodule_hparams = saved
        out = task.predict_transform(arg)(image)
        assert tuple(out.shape) == (3, *_keep_ratio_size(30, 90, winner)), (arg, saved)


def test_batched_prediction_crops_each_image_to_its_own_size() -> None:
    """Images of different sizes share one forward pass, padded bottom/right to the largest with
    the mean colour (0 after normalisation, as mmseg pads; like ``seg_collate`` in validation).
    Each image's output is the batch logits cropped to its own region, then resized to its original
    size; never the padded canvas. Batched and one-by-one predictions legitimately differ (the
    padding changes what windows see), so the reference is the padded batch's own forward."""
    torch.manual_seed(0)
    task = _task(aux_weight=0.0).eval()
    task.predict_probs = True
    images = [torch.rand(3, 40, 56), torch.rand(3, 24, 72)]  # one is cropped in width, the other in height
    canvas = torch.zeros(2, 3, 40, 72)
    for i, im in enumerate(images):
        canvas[i, :, : im.shape[1], : im.shape[2]] = im
    orig = [(80, 112), (36, 108)]
    sizes = [tuple(im.shape[-2:]) for im in images]
    with torch.no_grad():
        logits = task(task.fill_padding(canvas, sizes))
        black = task(canvas)  # the padding left as the loader's zeros: not what the model is given
        assert not torch.allclose(black[1, :, :24, :72], logits[1, :, :24, :72], atol=1e-3)
        plain = task.predict_step(images, 0)  # no targets: outputs at the input size
        sized = task.predict_step((images, [{"orig_size": s} for s in orig]), 0)
    for i, im in enumerate(images):
        h, w = im.shape[-2:]
        ref = logits[i, :, :h, :w]
        assert plain[i]["label_map"].shape == (h, w) and plain[i]["probs"].shape == (3, h, w)
        torch.testing.assert_close(plain[i]["probs"], ref.softmax(0))
        assert torch.equal(plain[i]["label_map"], ref.argmax(0))
        up = F.interpolate(ref[None], size=orig[i], mode="bilinear", align_corners=False)[0]
        assert sized[i]["label_map"].shape == orig[i]
        torch.testing.assert_close(sized[i]["probs"], up.softmax(0), atol=1e-5, rtol=1e-4)


def test_padding_is_the_mean_colour_in_training_validation_and_prediction(tmp_path: Path) -> None:
    """Whatever a batch was padded with, the model sees 0 (the mean colour after normalisation)
    beyond each image's ``image_size``, and the normalised image inside it: in the training step,
    in validation and in prediction, as mmseg normalises and then pads."""
    torch.manual_seed(0)
    task = _task(aux_weight=0.0)
    seen: list[torch.Tensor] = []
    logits_of = task._logits

    def spy(x: torch.Tensor, with_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        seen.append(x.detach().clone())
        return logits_of(x, with_aux)

    task._logits = spy  # type: ignore[method-assign]
    image = torch.rand(2, 3, 32, 40)
    sizes = torch.tensor([[32, 24], [20, 40]])
    batch = {"image": image, "mask": torch.zeros(2, 32, 40, dtype=torch.long), "image_size": sizes,
             "mask_size": sizes.clone()}
    _trainer(tmp_path, max_steps=1, limit_val_batches=0, enable_checkpointing=False).fit(
        task, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    with torch.no_grad():
        task.eval()
        task._predict_batch(batch)
        task.predict_step([image[0, :, :32, :24], image[1, :, :20, :40]], 0)
    normalised = (image - task.mean) / task.std
    assert len(seen) == 3
    for x in seen:
        for i, (h, w) in enumerate(sizes.tolist()):
            torch.testing.assert_close(x[i, :, :h, :w], normalised[i, :, :h, :w])
            assert (x[i, :, h:] == 0).all() and (x[i, :, :, w:] == 0).all()
            assert x[i].abs().sum() > 0


@pytest.mark.parametrize("num_classes", [256, 300])
def test_label_png_keeps_class_ids_above_255(tmp_path: Path, num_classes: int) -> None:
    """``labels/<name>.png`` holds the class ids exactly: a palette PNG up to 256 classes (ids 0..255
    fit 8 bits; the palette is the task's), a 16-bit greyscale PNG above, where id 299 must not wrap
    to 43. Read back with PIL, the file equals the prediction."""
    task = _task(num_classes=num_classes, aux_weight=0.0)
    label = torch.tensor([[0, 1, 255, num_classes - 1, 7], [num_classes - 1, 254, 3, 0, 255], [2, 2, 2, 2, 2]])
    target = {"name": "img", "orig_size": (3, 5), "index": 0, "file_name": None, "path": None}
    record = task.write_prediction_files(tmp_path, target, {"label_map": label}, torch.rand(3, 3, 5))
    assert record["label_map"] == "labels/img.png"
    png_path = tmp_path / "labels" / "img.png"
    with Image.open(png_path) as png:
        png.load()
        mode, values, palette = png.mode, np.asarray(png).astype(np.int64), png.getpalette()
    np.testing.assert_array_equal(values, label.numpy())
    bit_depth = png_path.read_bytes()[24]  # IHDR: 8-byte signature, length, type, width, height, then depth
    if num_classes <= 256:
        assert mode == "P" and bit_depth == 8
        assert np.array_equal(np.asarray(palette).reshape(-1, 3), color_palette(num_classes))
    else:
        assert mode.startswith("I") and bit_depth == 16
    ids, counts = np.unique(label.numpy(), return_counts=True)
    assert record["classes"] == {f"class_{c}": pytest.approx(k / 15, abs=1e-6) for c, k in zip(ids, counts)}


def test_mmseg_layout_is_the_default_head() -> None:
    """``head_layout="mmseg"``: the backbone's output norms feed the decoder (no second LayerNorm),
    Dropout2d(0.1) precedes the classifier (active in training only), the logits are upsampled
    with ``align_corners=False``, and the heads start from mmcv's initialisation."""
    from vtdense.models.segmentation import DropoutConv2d

    torch.manual_seed(0)
    task = _task(arch_kwargs={"decoder_channels": 64}, aux_channels=64)
    model = task.model
    assert all(isinstance(n, torch.nn.Identity) for n in model.decoder.feature_norms)
    assert model.encoder.backbone.out_norms is not None
    head = model.segmentation_head
    assert isinstance(head[0], DropoutConv2d) and head[0].p == 0.1 and isinstance(head[1], torch.nn.Identity)
    assert task.size_divisibility == 1  # no padding to 32: the backbone pads inside, as mmseg's Swin
    assert 0.005 < float(head[0].weight.std()) < 0.015 and float(head[0].bias.abs().max()) == 0.0
    aux_cls = task.aux_head.block[-1]
    assert 0.005 < float(aux_cls.weight.std()) < 0.015
    fusion = model.decoder.fusion_block[0]  # 3x3 conv, kaiming normal over fan-out
    expected = math.sqrt(2.0 / (fusion.out_channels * 9))
    assert abs(float(fusion.weight.std()) / expected - 1) < 0.1
    task.eval()
    for size in ((64, 96), (60, 70)):  # (60, 70): no multiple of 32, fed unpadded, resized in one step
        x = torch.rand(1, 3, *size)
        with torch.no_grad():
            feats = model.encoder(task.normalize(x))
            low = head[0](model.decoder(list(feats)))
            ref = F.interpolate(low, size=size, mode="bilinear", align_corners=False)
            torch.testing.assert_close(task(x), ref)
            assert not torch.allclose(ref, F.interpolate(low, size=size, mode="bilinear", align_corners=True))
    task.train()  # (a batch of 2: the pooled branch's BatchNorm needs it in training)
    x2 = task.normalize(torch.rand(2, 3, 64, 96))
    with torch.no_grad():
        assert not torch.equal(task._logits(x2)[0], task._logits(x2)[0])
    smp_task = _task(head_layout="smp")
    assert not any(isinstance(n, torch.nn.Identity) for n in smp_task.model.decoder.feature_norms)
    assert smp_task.model.segmentation_head[1].align_corners and smp_task.size_divisibility == 32


def test_loss_is_averaged_over_all_pixels_as_mmseg_or_over_labelled_ones() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 5)
    mask = torch.randint(0, 3, (2, 4, 5))
    mask[0, :, 2:] = 255  # a padded crop
    per_pixel = F.cross_entropy(logits, mask, ignore_index=255, reduction="none")
    valid = mask != 255
    torch.testing.assert_close(_task().seg_loss(logits, mask), per_pixel[valid].sum() / mask.numel())
    torch.testing.assert_close(_task(loss_average="valid").seg_loss(logits, mask), per_pixel[valid].mean())
    with pytest.raises(ValueError, match="model.loss_average: unknown 'pixels'; choose one of all, valid"):
        _task(loss_average="pixels")
    with pytest.raises(ValueError, match="model.head_layout: unknown layout 'timm'; choose one of mmseg, smp"):
        _task(head_layout="timm")


def test_checkpoint_without_the_layout_options_loads_as_it_was_trained(tmp_path: Path) -> None:
    """A checkpoint written before ``head_layout`` / ``loss_average`` holds SMP's own model, trained
    with the valid-pixel average: it loads into that model, with the same outputs."""
    torch.manual_seed(0)
    old = _task(head_layout="smp", loss_average="valid").eval()
    hparams = {k: v for k, v in old.hparams.items() if k not in ("head_layout", "loss_average")}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": old.state_dict(), "hyper_parameters": hparams,
                "pytorch-lightning_version": L.__version__}, path)
    loaded = SegmentationTask.load_from_checkpoint(path).eval()
    assert loaded.hparams.head_layout == "smp" and loaded.hparams.loss_average == "valid"
    # an option given to the loader wins over the earlier release's value
    assert SegmentationTask.load_from_checkpoint(path, loss_average="all").hparams.loss_average == "all"
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), old(x))
    new = _task().eval()  # a checkpoint that names its layout keeps it
    path = tmp_path / "new.ckpt"
    torch.save({"state_dict": new.state_dict(), "hyper_parameters": dict(new.hparams),
                "pytorch-lightning_version": L.__version__}, path)
    again = SegmentationTask.load_from_checkpoint(path).eval()
    assert again.hparams.head_layout == "mmseg" and again.hparams.loss_average == "all"
    with torch.no_grad():
        torch.testing.assert_close(again(x), new(x))


def test_a_shallow_encoder_fine_tuned_from_weights_reloads(tmp_path: Path) -> None:
    """``encoder_depth=4`` leaves out backbone stage 4 with or without ``backbone_weights``, so the
    checkpoint reloads into the model rebuilt from its options alone (which has no weights to
    read); an earlier release's checkpoint that holds stage 4 loads without it for prediction and
    is refused for a resume, with the option that builds it."""
    import vtdense
    from vtdense.export import model_from_checkpoint

    torch.manual_seed(0)
    weights = tmp_path / "bb.safetensors"
    vtdense.save_backbone(vtdense.create_backbone("swinv2_tiny", **TINY_SWINV2), weights)
    task = _task(encoder_depth=4, backbone_weights=str(weights), aux_weight=0.0).eval()
    assert len(task.model.encoder.backbone.layers) == 3
    path = tmp_path / "d4.ckpt"
    torch.save({"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams), "vtdense_task": "SegmentationTask",
                "pytorch-lightning_version": L.__version__}, path)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        want = task(x)
        torch.testing.assert_close(SegmentationTask.from_checkpoint(path).eval()(x), want)
        torch.testing.assert_close(model_from_checkpoint(path)[0](x), task.model(x))
    # an earlier release built stage 4 when given weights: its checkpoint holds weights SMP never read
    whole = _task(encoder_depth=4, aux_weight=0.0, backbone_kwargs={**TINY_SWINV2, "out_indices": (0, 1, 2, 3)})
    old = {**task.state_dict(), **{k: v for k, v in whole.state_dict().items() if ".layers.3." in k}}
    old_path = tmp_path / "old.ckpt"
    torch.save({"state_dict": old, "hyper_parameters": dict(task.hparams), "vtdense_task": "SegmentationTask",
                "pytorch-lightning_version": L.__version__}, old_path)
    with torch.no_grad():
        torch.testing.assert_close(SegmentationTask.from_checkpoint(old_path).eval()(x), want)
        torch.testing.assert_close(model_from_checkpoint(old_path)[0](x), task.model(x))
    sample = {"image": x[0], "mask": torch.zeros(64, 64, dtype=torch.long), "image_size": (64, 64)}
    loader = DataLoader([sample] * 2, batch_size=2, collate_fn=seg_collate)
    resumed = _task(encoder_depth=4, aux_weight=0.0)
    with pytest.raises(ValueError, match=r"old\.ckpt holds \d+ weights of backbone stages .*out_indices=\[0, 1, 2, 3\]"):
        _trainer(tmp_path, max_steps=2, limit_val_batches=0, enable_checkpointing=False).fit(
            resumed, train_dataloaders=loader, ckpt_path=str(old_path))
