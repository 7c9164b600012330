"""Prediction from a checkpoint: ``Task.from_checkpoint`` + ``predict_images``, the recipes' ``predict``
subcommand (in process and under 2-process DDP), input checks, and class names carried by checkpoints.

Checkpoints come from a one-step fit of tiny models on generated data whose class names are
renamed first; the dataset is deleted after saving, so names can only come from the checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from PIL import Image, ImageOps
from pycocotools.coco import COCO
from torchvision.ops import box_convert
from torchvision.transforms.v2 import functional as TF

from vtdense.data.ade20k import ADE20KDataModule
from vtdense.data.coco import COCODataModule
from vtdense.data.errors import BadSampleError
from vtdense.data.predict import PredictImages, list_images
from vtdense.data.synthetic import make_synthetic_coco
from vtdense.data.synthetic_seg import SYNTHETIC_CLASSES, generate_synthetic_segmentation
from vtdense.data.transforms import shortest_edge_size
from vtdense.tasks.detection import DetectionTask
from vtdense.tasks.predict import read_display_image
from vtdense.tasks.segmentation import SegmentationTask, color_palette, resize_logits

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 4], "window_size": 4}
DET_NAMES = {"red_square": "widget", "green_circle": "gadget"}
SEG_NAMES = [f"my_{n}" for n in SYNTHETIC_CLASSES]


def _recipe(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", REPO / "recipes" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fit_one_step(task: Any, dm: Any, ckpt: Path) -> Path:
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(ckpt.parent.parent))
    trainer.fit(task, datamodule=dm)
    trainer.save_checkpoint(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def det_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step Mask R-CNN checkpoint in ``run/checkpoints/``; its dataset (renamed classes) is deleted."""
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("det")
    root = make_synthetic_coco(tmp / "coco", num_train=4, num_val=2, size_range=(64, 96), num_classes=2, seed=1)
    for ann in (root / "annotations").glob("*.json"):
        data = json.loads(ann.read_text())
        for c in data["categories"]:
            c["name"] = DET_NAMES[c["name"]]
        ann.write_text(json.dumps(data))
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY_SWIN, head="mask_rcnn", fpn_channels=16,
                         slim_heads=True, mask_head_channels=8, mask_head_layers=1, box_head_width=32,
                         rois_per_image=16, score_thresh=0.0, warmup_steps=1)
    dm = COCODataModule(root=str(root), batch_size=2, num_workers=0, train_scales=[64], test_scale=64, max_size=128)
    ckpt = _fit_one_step(task, dm, tmp / "run" / "checkpoints" / "tiny.ckpt")
    shutil.rmtree(root)
    return ckpt


@pytest.fixture(scope="module")
def seg_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step UPerNet checkpoint; its dataset (renamed classes in classes.txt) is deleted."""
    torch.manual_seed(0)  # the same weights in every run (near-tied logits made the argmax check flaky)
    tmp = tmp_path_factory.mktemp("seg")
    root = generate_synthetic_segmentation(tmp / "ade", num_train=2, num_val=1, size_range=(40, 48), seed=5)
    (root / "classes.txt").write_text("\n".join(SEG_NAMES) + "\n")
    task = SegmentationTask(backbone="swinv2_tiny", backbone_kwargs=TINY_SWIN, arch_kwargs={"decoder_channels": 8},
                            aux_channels=8, warmup_steps=1)
    dm = ADE20KDataModule(root=str(root), batch_size=2, num_workers=0, scale=(64, 48), crop_size=(32, 32))
    ckpt = _fit_one_step(task, dm, tmp / "run" / "checkpoints" / "tiny.ckpt")
    shutil.rmtree(root)
    return ckpt


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixed sizes: a landscape JPEG, a portrait PNG, an EXIF-rotated JPEG (stored 72x40, shown 40x72), a grey PNG."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)

    def pixels(h: int, w: int) -> Image.Image:
        a = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        a[h // 4 : h // 2, w // 4 : w // 2] = (220, 30, 30)  # a red block
        return Image.fromarray(a)

    pixels(60, 100).save(folder / "a_landscape.jpg", quality=95)
    pixels(90, 50).save(folder / "b_portrait.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    pixels(40, 72).save(folder / "c_exif.jpg", exif=exif, quality=95)
    Image.fromarray(rng.integers(0, 255, (50, 70), dtype=np.uint8)).save(folder / "d_grey.png")
    return folder


def _displayed(path: Path) -> torch.Tensor:
    """Reference decoding: PIL with EXIF applied, RGB, uint8 [3, H, W]."""
    with Image.open(path) as img:
        return TF.pil_to_tensor(ImageOps.exif_transpose(img).convert("RGB"))


# ------------------------------------------------------------------------------------ inputs
def test_list_images_names_and_bad_input(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("x.jpg", "x.png", "sub/y.jpg"):
        Image.new("RGB", (8, 6)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("hello")
    with caplog.at_level(logging.WARNING):
        files = list_images(tmp_path)
    assert [(f.file_name, f.name) for f in files] == [("x.jpg", "x_jpg"), ("x.png", "x_png")]
    assert "left out 1 files" in caplog.text and "notes.txt" in caplog.text
    assert [(f.file_name, f.name) for f in list_images(f"{tmp_path}/**/*.jpg")] == [("sub/y.jpg", "sub/y"), ("x.jpg", "x")]
    # names unique also where suffixes differ in case only, or a suffixed name is another file's stem
    clash = tmp_path / "clash"
    clash.mkdir()
    for name in ("a.JPG", "a.jpg", "b.jpg", "b.png", "b_png.png", "c.png"):
        Image.new("RGB", (8, 6)).save(clash / name, format="PNG")
    names = {f.file_name: f.name for f in list_images(clash)}
    assert names == {"a.JPG": "a_jpg", "a.jpg": "a_jpg_2", "b.jpg": "b_jpg", "b.png": "b_png", "b_png.png": "b_png_2", "c.png": "c"}

    with pytest.raises(FileNotFoundError, match="predict path not found: .*missing.jpg"):
        list_images(tmp_path / "missing.jpg")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no images in folder .*empty"):
        list_images(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no images in glob .*\*\.webp"):
        list_images(f"{tmp_path}/*.webp")
    (tmp_path / "fake.jpg").write_text("not a picture")
    with pytest.raises(BadSampleError, match=r"fake\.jpg is not an image"):
        list_images(tmp_path)  # the folder holds it: named before anything runs
    with pytest.raises(BadSampleError, match=r"notes\.txt is not an image"):
        list_images(tmp_path / "notes.txt")


def test_bad_input_raises_before_the_model_runs(det_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = DetectionTask.from_checkpoint(det_ckpt)

    def never(*a: Any, **k: Any) -> None:
        raise AssertionError("the model ran")

    monkeypatch.setattr(task, "predict_step", never)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.png").write_bytes(b"\x89PNG nothing else")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        task.predict_images(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="empty"):
        task.predict_images(tmp_path / "empty")
    with pytest.raises(BadSampleError, match="broken.png"):
        task.predict_images([torch.zeros(3, 8, 8, dtype=torch.uint8), tmp_path / "broken.png"])


# ------------------------------------------------------------------------------- checkpoints
def test_from_checkpoint_weights_only_with_names_and_preprocessing(det_ckpt: Path, tmp_path: Path) -> None:
    task = DetectionTask.from_checkpoint(det_ckpt)
    saved = torch.load(det_ckpt, map_location="cpu", weights_only=True)
    assert not task.training and task.checkpoint_path == det_ckpt
    for k, v in saved["state_dict"].items():
        assert torch.equal(task.state_dict()[k], v), k
    # the dataset is gone: names and COCO ids come from the checkpoint
    assert task.category_names == {1: "widget", 2: "gadget"} and task.label_to_category_id == {1: 1, 2: 3}
    assert task.datamodule_hparams["test_scale"] == 64 and task.datamodule_hparams["max_size"] == 128
    assert task.predict_transform()(torch.zeros(3, 100, 300, dtype=torch.uint8)).shape == (3, 43, 128)
    assert task.predict_transform(test_scale=32)(torch.zeros(3, 100, 300, dtype=torch.uint8)).shape == (3, 32, 96)

    # a datamodule given root=Path(...) saved a pathlib object: it loads (as vtdense.export reads it)
    torch.save(dict(saved, datamodule_hyper_parameters={**saved["datamodule_hyper_parameters"], "root": Path("/data/coco")}),
               tmp_path / "path.ckpt")
    assert DetectionTask.from_checkpoint(tmp_path / "path.ckpt").datamodule_hparams["root"] == Path("/data/coco")

    # a checkpoint holding an arbitrary Python object is refused, not unpickled
    evil = dict(saved, extra=argparse.Namespace(run="code"))
    torch.save(evil, tmp_path / "evil.ckpt")
    with pytest.raises(ValueError, match="weights_only=True"):
        DetectionTask.from_checkpoint(tmp_path / "evil.ckpt")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        DetectionTask.from_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match="another task"):
        SegmentationTask.from_checkpoint(det_ckpt)


def test_segmentation_checkpoint_carries_class_names_and_palette(seg_ckpt: Path) -> None:
    saved = torch.load(seg_ckpt, map_location="cpu", weights_only=True)
    assert saved["class_names"] == SEG_NAMES and saved["palette"] == color_palette(8).tolist()
    task = SegmentationTask.from_checkpoint(seg_ckpt)
    assert task.class_names == SEG_NAMES  # the dataset (and its classes.txt) is gone
    assert task.hparams.num_classes == 8 and task.palette.shape == (8, 3)
    assert task.predict_transform()(torch.zeros(3, 30, 90, dtype=torch.uint8)).shape == (3, 21, 64)  # scale (64, 48)


def test_load_from_checkpoint_and_a_fit_resize_as_validation(det_ckpt: Path, seg_ckpt: Path, tmp_path: Path) -> None:
    """``predict_images`` resizes as validation did however the task was made: Lightning's
    ``load_from_checkpoint`` and a task just fitted in this process (both used the default 800 /
    1333 and 2048 x 512 before, boxes and masks silently different)."""
    image = torch.zeros(3, 100, 300, dtype=torch.uint8)
    det = DetectionTask.load_from_checkpoint(det_ckpt, map_location="cpu")
    assert det.predict_transform()(image).shape == DetectionTask.from_checkpoint(det_ckpt).predict_transform()(image).shape == (3, 43, 128)
    seg = SegmentationTask.load_from_checkpoint(seg_ckpt, map_location="cpu")
    assert seg.predict_transform()(torch.zeros(3, 30, 90, dtype=torch.uint8)).shape == (3, 21, 64)
    root = make_synthetic_coco(tmp_path / "coco", num_train=2, num_val=1, size_range=(64, 96), num_classes=2, seed=2)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY_SWIN, head="faster_rcnn", fpn_channels=16,
                         slim_heads=True, box_head_width=32, rois_per_image=16, warmup_steps=1)
    assert task.predict_transform()(image).shape == (3, 444, 1333)  # no datamodule seen yet: the defaults
    dm = COCODataModule(root=str(root), batch_size=2, num_workers=0, train_scales=[64], test_scale=48, max_size=96)
    _fit_one_step(task, dm, tmp_path / "run" / "checkpoints" / "fit.ckpt")
    assert task.predict_transform()(image).shape == (3, 32, 96)


def test_shape_changing_overrides_are_one_clear_error(det_ckpt: Path) -> None:
    """An override that changes the model's shapes: one ``ValueError`` naming the option (and the
    file where the loader knows it), not torch's state-dict size-mismatch ``RuntimeError``."""
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(det_ckpt))} does not fit this model: it was trained with num_classes=2 \(this run: 5\)"):
        DetectionTask.from_checkpoint(det_ckpt, num_classes=5)
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(det_ckpt))} does not fit this model: \d+ tensor\(s\) differ in shape .*fpn_channels"):
        DetectionTask.from_checkpoint(det_ckpt, fpn_channels=32)
    with pytest.raises(ValueError, match=r"the checkpoint does not fit this model: 6 tensor\(s\) differ in shape \(model\.roi_heads"):
        DetectionTask.load_from_checkpoint(det_ckpt, num_classes=5)
    assert DetectionTask.from_checkpoint(det_ckpt, score_thresh=0.3).hparams.score_thresh == 0.3  # others still apply


# ------------------------------------------------------------------------------ predict_images
def test_detection_predict_images_original_coordinates(det_ckpt: Path, photos: Path) -> None:
    task = DetectionTask.from_checkpoint(det_ckpt)
    results = task.predict_images(photos, score_thresh=0.0)
    assert [Path(r["path"]).name for r in results] == ["a_landscape.jpg", "b_portrait.png", "c_exif.jpg", "d_grey.png"]
    for r in results:
        pic = _displayed(Path(r["path"]))
        h0, w0 = pic.shape[-2:]
        if r["path"].endswith("c_exif.jpg"):
            assert (h0, w0) == (72, 40)  # stored 40x72: EXIF applied
        # reference: validation's resize, the raw detector, boxes scaled back by hand
        h, w = shortest_edge_size(h0, w0, 64, 128)
        x = TF.resize(pic, [h, w], antialias=True).float() / 255
        with torch.no_grad():
            det = task.model([x])[0]
        ref = det["boxes"] * torch.tensor([w0 / w, h0 / h, w0 / w, h0 / h])
        ref[:, 0::2] = ref[:, 0::2].clamp(0, w0)
        ref[:, 1::2] = ref[:, 1::2].clamp(0, h0)
        assert len(r["boxes"]) > 0
        torch.testing.assert_close(r["boxes"], ref, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(r["scores"], det["scores"])
        assert r["masks"].shape == (len(r["boxes"]), h0, w0) and r["masks"].dtype == torch.bool
        assert r["label_names"] == [{1: "widget", 2: "gadget"}[int(v)] for v in r["labels"]]
        assert r["category_ids"].tolist() == [{1: 1, 2: 3}[int(v)] for v in r["labels"]]

    # a threshold keeps exactly the detections above it; the model's own threshold is restored after
    kept = task.predict_images(photos / "a_landscape.jpg", score_thresh=0.5)[0]
    assert torch.equal(kept["scores"], results[0]["scores"][results[0]["scores"] > 0.5])
    assert task.model.roi_heads.score_thresh == 0.0
    # mixed sizes in one batch still give every image in its own coordinates
    batched = task.predict_images(photos, score_thresh=0.0, batch_size=4)
    for r, b in zip(results, batched):
        assert b["masks"].shape[-2:] == r["masks"].shape[-2:]


def test_detection_predict_images_bf16_and_tensors(det_ckpt: Path, photos: Path) -> None:
    task = DetectionTask.from_checkpoint(det_ckpt)
    out = task.predict_images(photos / "b_portrait.png", score_thresh=0.0, bf16=True)[0]
    assert out["boxes"].dtype == torch.float32 and out["scores"].dtype == torch.float32
    assert out["labels"].dtype == torch.int64 and out["boxes"].shape[0] > 0
    assert bool((out["boxes"][:, 2] <= 50).all() and (out["boxes"][:, 3] <= 90).all())
    # uint8 and float tensors of an image already at the model's size give the same detections
    img = TF.resize(_displayed(photos / "a_landscape.jpg"), [64, 100], antialias=True)  # already test_scale
    as_uint8, as_float = task.predict_images([img, img.float() / 255], score_thresh=0.0)
    torch.testing.assert_close(as_uint8["boxes"], as_float["boxes"])
    assert as_uint8["path"] is None and as_uint8["masks"].shape[-2:] == (64, 100)


def test_segmentation_predict_images(seg_ckpt: Path, photos: Path) -> None:
    task = SegmentationTask.from_checkpoint(seg_ckpt)
    results = task.predict_images(photos, return_probs=True)
    for r in results:
        pic = _displayed(Path(r["path"]))
        h0, w0 = pic.shape[-2:]
        assert r["label_map"].shape == (h0, w0) and r["label_map"].dtype == torch.int64
        assert r["class_names"] == SEG_NAMES
        # reference: validation's keep-ratio resize (bilinear, no antialiasing, as mmcv), logits at the original size
        f = min(64 / max(h0, w0), 48 / min(h0, w0))
        x = TF.resize(pic, [int(h0 * f + 0.5), int(w0 * f + 0.5)], antialias=False).float() / 255
        with torch.no_grad():
            logits = F.interpolate(task(x[None]), size=(h0, w0), mode="bilinear", align_corners=False)[0]
        torch.testing.assert_close(r["probs"], logits.softmax(0), atol=1e-5, rtol=1e-4)
        assert (r["label_map"] == r["probs"].argmax(0)).float().mean() > 0.999  # argmax ties aside
    bf = task.predict_images(photos / "c_exif.jpg", bf16=True)[0]
    assert bf["label_map"].shape == (72, 40) and "probs" not in bf
    # uint8 and float tensors of an image already at the model's size give the same maps
    img = TF.resize(_displayed(photos / "a_landscape.jpg"), [38, 64], antialias=True)  # 60x100 at scale (64, 48)
    as_uint8, as_float = task.predict_images([img, img.float() / 255], return_probs=True)
    torch.testing.assert_close(as_uint8["probs"], as_float["probs"], atol=1e-5, rtol=1e-4)
    assert as_uint8["label_map"].shape == (38, 64) and as_uint8["probs"].std() > 0.01


def test_images_over_4096_px_are_decoded_reduced_and_predicted_at_full_size(tmp_path: Path) -> None:
    """A file longer than 4096 px is decoded reduced by the largest integer factor that keeps its long
    side >= 4096 (PNG: a box reduce after decoding), so 4100 and 8191 px wide stay whole, 8192 becomes
    4096 and 8200 becomes 4100; ``orig_size`` stays the file's full size, so the label map comes back
    at 16 x 8200, resized from the model's view of the reduced pixels. Strips 16 px high keep it cheap."""
    arrays = {}
    for w in (4100, 8191, 8192, 8200):
        cols = (np.arange(w) // 2 % 251).astype(np.uint8)  # equal column pairs: a 2x box reduce keeps the values
        arrays[w] = np.repeat(np.stack([cols, 250 - cols, cols // 2], -1)[None], 16, axis=0)  # 16 x w x 3
        Image.fromarray(arrays[w]).save(tmp_path / f"w{w}.png")
    items = PredictImages(list_images(tmp_path), lambda pixels: pixels)  # identity: what the decoder gave
    decoded = {w: items[i] for i, w in enumerate((4100, 8191, 8192, 8200))}
    for w, factor in ((4100, 1), (8191, 1), (8192, 2), (8200, 2)):
        pixels, target = decoded[w]
        assert target["orig_size"] == (16, w), w
        assert tuple(pixels.shape) == (3, 16 // factor, -(-w // factor)), w
        assert torch.equal(pixels, torch.from_numpy(arrays[w][::factor, ::factor]).permute(2, 0, 1)), w

    torch.manual_seed(0)
    task = SegmentationTask(backbone="swinv2_tiny", backbone_kwargs=TINY_SWIN, num_classes=3,
                            arch_kwargs={"decoder_channels": 8}, aux_channels=8).eval()
    task.datamodule_hparams = {"eval_scale": [1024, 64]}  # the reduced 8 x 4100 -> 2 x 1024
    (pred,) = task.predict_images(tmp_path / "w8200.png", return_probs=True)
    assert pred["label_map"].shape == (16, 8200) and pred["probs"].shape == (3, 16, 8200)
    x = task.predict_transform()(torch.from_numpy(arrays[8200][::2, ::2]).permute(2, 0, 1))
    assert x.shape == (3, 2, 1024)
    with torch.no_grad():
        ref = F.interpolate(task(x[None]), size=(16, 8200), mode="bilinear", align_corners=False)[0].softmax(0)
    torch.testing.assert_close(pred["probs"], ref, atol=1e-5, rtol=1e-4)

    # a resize whose model input is longer than 4096 px is not fed an upsampled reduced decode: the
    # file is decoded at least that long (whole for a long side of 8200; reduced to 4100 for 4096)
    from vtdense.data.predict import detection_predict_transform, segmentation_predict_transform

    full = torch.from_numpy(arrays[8200]).permute(2, 0, 1)
    for transform, decode in ((segmentation_predict_transform((8200, 16)), full), (detection_predict_transform(16, 8200), full),
                              (segmentation_predict_transform((4096, 16)), full[:, ::2, ::2])):
        x, _ = PredictImages(list_images(tmp_path / "w8200.png"), transform)[0]
        torch.testing.assert_close(x, transform(decode))

    # the written files: the label PNG at the full size; the overlay drawn on a copy reduced to a long
    # side of at least 2048 (8200 // 2048 = 4: 4 x 2050), whose scale to the original is 1/4
    target = decoded[8200][1]
    pic, scale = read_display_image(target)
    assert tuple(pic.shape) == (3, 4, 2050) and scale == (0.25, 0.25)
    record = task.write_prediction_files(tmp_path / "out", target, pred, decoded[8200][0])
    assert (record["height"], record["width"]) == (16, 8200)
    with Image.open(tmp_path / "out" / record["label_map"]) as png:
        assert np.array_equal(np.asarray(png), pred["label_map"].numpy())
    with Image.open(tmp_path / "out" / record["overlay"]) as png:
        assert png.size == (2050, 4)


@pytest.mark.parametrize("size", [(37, 91), (5, 7), (64, 20)])
def test_resize_logits_matches_interpolate(size: tuple[int, int]) -> None:
    logits = torch.randn(5, 16, 24)
    label, probs = resize_logits(logits, size, with_probs=True, max_elements=5 * size[1] * 3)  # 3-row strips
    ref = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)[0]
    torch.testing.assert_close(probs, ref.softmax(0), atol=1e-5, rtol=1e-5)
    assert torch.equal(label, ref.argmax(0))


# ------------------------------------------------------------------------ recipe subcommand
def test_recipe_predict_detection(det_ckpt: Path, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    summary = _recipe("coco_swin").main(
        ["predict", f"--ckpt_path={det_ckpt}", f"--data.predict_path={photos}", "--score_thresh=0.0",
         "--data.num_workers=0", "--data.batch_size=1", f"--output={out}", "--progress_bar=false",
         "--size_divisibility=128"]
    )
    printed = capsys.readouterr().out
    assert f"output directory: {out}" in printed and "vis/  (4 PNG)" in printed and summary["images"] == 4
    index = json.loads((out / "images.json").read_text())
    results = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in index["categories"]] == ["widget", "gadget"]
    task = DetectionTask.from_checkpoint(det_ckpt)
    assert task.set_size_divisibility(128) == 128 and task.model.transform.size_divisible == 128
    api = task.predict_images(photos, score_thresh=0.0)
    for image, ref in zip(index["images"], api):
        assert image["path"] == ref["path"] and image["file_name"] == Path(ref["path"]).name
        with Image.open(out / image["vis"]) as png:
            png.load()
            assert png.mode == "RGB" and png.width >= image["width"]
        mine = [r for r in results if r["image_id"] == image["id"]]
        assert all(r["file_name"] == image["file_name"] for r in mine)
        boxes = torch.tensor([r["bbox"] for r in mine]).reshape(-1, 4)
        torch.testing.assert_close(boxes, box_convert(ref["boxes"], "xyxy", "xywh"))
        assert [r["category_name"] for r in mine] == ref["label_names"]
    coco = COCO()  # the index and the results load as a COCO ground truth / results pair
    coco.dataset = {"images": index["images"], "categories": index["categories"], "annotations": []}
    coco.createIndex()
    assert len(coco.loadRes(str(out / "results.json")).getAnnIds()) == len(results)


def test_an_undecodable_file_is_skipped_and_counted(
    det_ckpt: Path, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """A JPEG cut short passes the header check before the run; decoding it fails mid-run. It is
    skipped with a warning naming it, in a batch of its own and in one shared with a good image:
    the other images are predicted and written, the index lists it under ``skipped``, and the
    API returns the other images' results."""
    import shutil

    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("a_landscape.jpg", "b_portrait.png", "d_grey.png"):
        shutil.copy(photos / name, folder / name)
    whole = (photos / "c_exif.jpg").read_bytes()
    (folder / "c_cut.jpg").write_bytes(whole[: len(whole) // 2])
    for batch in (1, 2):
        out = tmp_path / f"out{batch}"
        with caplog.at_level(logging.WARNING):
            summary = _recipe("coco_swin").main(
                ["predict", f"--ckpt_path={det_ckpt}", f"--data.predict_path={folder}", "--score_thresh=0.0",
                 "--data.num_workers=0", f"--data.batch_size={batch}", f"--output={out}", "--progress_bar=false"]
            )
        assert summary["images"] == 3 and summary["skipped"] == ["c_cut.jpg"]
        assert "skipped 1 images that could not be decoded" in capsys.readouterr().out
        assert "c_cut.jpg cannot be decoded" in caplog.text
        index = json.loads((out / "images.json").read_text())
        assert index["skipped"] == ["c_cut.jpg"] and [i["file_name"] for i in index["images"]] == ["a_landscape.jpg", "b_portrait.png", "d_grey.png"]
        assert sorted(p.name for p in (out / "vis").iterdir()) == ["a_landscape.png", "b_portrait.png", "d_grey.png"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        api = DetectionTask.from_checkpoint(det_ckpt).predict_images(folder, score_thresh=0.0, batch_size=2)
    assert [Path(r["path"]).name for r in api] == ["a_landscape.jpg", "b_portrait.png", "d_grey.png"]
    assert "predicted 3 of 4 images; skipped 1 that could not be decoded: c_cut.jpg" in caplog.text


def test_recipe_predict_segmentation_default_output(seg_ckpt: Path, photos: Path, capsys: pytest.CaptureFixture) -> None:
    summary = _recipe("ade20k_swinv2").main(
        ["predict", "--ckpt_path", str(seg_ckpt), "--data.predict_path", f"{photos}/*.jpg", "--data.num_workers=0",
         "--device=cpu", "--progress_bar=false"]
    )
    out = Path(summary["output_dir"])
    assert out.parent == seg_ckpt.parent.parent and out.name.startswith("predict_")  # in the run directory
    index = json.loads((out / "predictions.json").read_text())
    assert index["class_names"] == SEG_NAMES and len(index["images"]) == 2
    api = SegmentationTask.from_checkpoint(seg_ckpt).predict_images(f"{photos}/*.jpg")
    for image, ref in zip(index["images"], api):
        with Image.open(out / image["label_map"]) as png:
            assert png.mode == "P" and np.array(png.getpalette()[:24]).reshape(8, 3).tolist() == index["palette"]
            assert np.array_equal(np.asarray(png), ref["label_map"].numpy())
        with Image.open(out / image["overlay"]) as png:
            assert png.size == (image["width"], image["height"])
        assert set(image["classes"]) <= set(SEG_NAMES)
    assert "labels/  (2 PNG)" in capsys.readouterr().out


def test_recipe_predict_options(det_ckpt: Path, seg_ckpt: Path, photos: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        _recipe("coco_swin").main(["predict", "--help"])
    assert e.value.code == 0 and "--data.predict_path" in capsys.readouterr().out
    base = [f"--data.predict_path={photos}", "--data.num_workers=0", "--progress_bar=false"]
    for bad in ("1.5", "-0.1"):  # checked with the other options, before the trainer is built
        with patch.object(DetectionTask, "predict_step", side_effect=AssertionError("the model ran")):
            with pytest.raises(ValueError, match=rf"--score_thresh must be in \[0, 1\], got {bad}") as err:
                _recipe("coco_swin").main(["predict", f"--ckpt_path={det_ckpt}", f"--score_thresh={bad}", *base])
        assert getattr(err.value, "vtdense_before_run", False)  # so run_script prints one line, exit 2
    with pytest.raises(ValueError, match="--score_thresh does not apply to a SegmentationTask"):
        _recipe("ade20k_swinv2").main(["predict", f"--ckpt_path={seg_ckpt}", "--score_thresh=0.3", *base])
    with pytest.raises(ValueError, match="--data.eval_scale does not apply to a DetectionTask"):
        _recipe("coco_swin").main(["predict", f"--ckpt_path={det_ckpt}", "--data.eval_scale=[64, 48]", *base])
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        _recipe("coco_swin").main(["predict", f"--ckpt_path={det_ckpt}", f"--data.predict_path={photos}/nothing_here"])
    with pytest.raises(ValueError, match="--size_divisibility does not apply to a SegmentationTask"):
        _recipe("ade20k_swinv2").main(["predict", f"--ckpt_path={seg_ckpt}", "--size_divisibility=64", *base])
    with pytest.raises(ValueError, match="size_divisibility=48: must be a positive multiple"):
        _recipe("coco_swin").main(["predict", f"--ckpt_path={det_ckpt}", "--size_divisibility=48", *base])
    with pytest.raises(ValueError, match="option 'size_divisibility'"):
        DetectionTask(num_classes=2, size_divisibility=0)
    with pytest.raises(ValueError, match="--compile_backbone='inductr' is not a torch.compile backend"):
        _recipe("coco_swin").main(["predict", f"--ckpt_path={det_ckpt}", "--compile_backbone=inductr", *base])
    # a checkpoint trained compiled predicts eagerly unless --compile_backbone asks
    class Loaded(Exception):
        pass

    def load(*args: Any, **kwargs: Any) -> None:
        raise Loaded(kwargs)

    for flag, backend in ((None, False), ("true", "inductor"), ("aot_eager", "aot_eager")):
        with patch.object(DetectionTask, "from_checkpoint", side_effect=load):
            with pytest.raises(Loaded) as loaded:
                _recipe("coco_swin").main(["predict", f"--ckpt_path={det_ckpt}", *base]
                                          + ([f"--compile_backbone={flag}"] if flag else []))
        assert loaded.value.args[0]["compile_backbone"] == backend


def test_recipe_predict_ddp_two_processes(det_ckpt: Path, photos: Path, tmp_path: Path) -> None:
    """2 CPU processes (gloo): each rank writes its images, the merged index equals one process's predictions."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "recipes" / "coco_swin.py"), "predict", f"--ckpt_path={det_ckpt}",
           f"--data.predict_path={photos}", "--score_thresh=0.0", "--data.num_workers=0", "--device=cpu",
           "--devices=2", f"--output={out}", "--progress_bar=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stderr + proc.stdout  # really two ranks
    assert proc.stdout.count("predicted 4 images") == 1  # rank 0 reports
    index = json.loads((out / "images.json").read_text())
    results = json.loads((out / "results.json").read_text())
    api = DetectionTask.from_checkpoint(det_ckpt).predict_images(photos, score_thresh=0.0)
    assert [i["path"] for i in index["images"]] == [r["path"] for r in api]
    assert sorted(p.name for p in (out / "vis").iterdir()) == ["a_landscape.png", "b_portrait.png", "c_exif.png", "d_grey.png"]
    for image, ref in zip(index["images"], api):
        boxes = torch.tensor([r["bbox"] for r in results if r["image_id"] == image["id"]]).reshape(-1, 4)
        torch.testing.assert_close(boxes, box_convert(ref["boxes"], "xyxy", "xywh"), atol=1e-3, rtol=1e-4)
