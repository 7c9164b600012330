"""ONNX export (run in onnxruntime against eager outputs) and torch.export of the backbones."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

import vtdense
from vtdense import create_backbone
from vtdense.export import export_program, load_checkpoint, main, model_from_checkpoint
from vtdense.models.detection import build_detector
from vtdense.models.segmentation import build_segmentor

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

FAMILIES = {
    "swin": ("swin_tiny", dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)),
    "swinv2": ("swinv2_tiny", dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4)),
    # hybrid windows: windowed stage 1, global last blocks in stages 2-4
    "mvitv2": ("mvitv2_tiny", dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=1, window_size=8)),
}
TINY_SWIN = FAMILIES["swin"][1]
# 96 x 128: stage-3/4 maps (6 x 8, 3 x 4) are padded to the window, so padding masks are in the graph.
H, W = 96, 128


def _backbone(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    name, kw = FAMILIES[family]
    return create_backbone(name, drop_path_rate=0.0, **kw).eval()


def _session(path: Path) -> "ort.InferenceSession":
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(sess: "ort.InferenceSession", x: Tensor) -> list[np.ndarray]:
    return sess.run(None, {"image": x.numpy()})


def _assert_close(ref: list[Tensor], got: list[np.ndarray], atol: float = 1e-4) -> None:
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert tuple(r.shape) == g.shape
        np.testing.assert_allclose(g, r.detach().numpy(), atol=atol, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_backbone_onnx_matches_eager_with_dynamic_batch(family: str, tmp_path: Path) -> None:
    """At 50 x 70 the image is padded to the patch size (52 x 72) and every stage map to its
    window: each ceiling division of a size is in the graph (ONNX's integer ``Div`` truncates, so
    a ceiling written as ``-(-n // d)`` there cropped instead of padding, and onnxruntime failed)."""
    H, W = 50, 70
    backbone = _backbone(family)
    backbone.train()  # export must trace in eval mode and give the model back as it was
    path = vtdense.export(backbone, tmp_path / "backbone.onnx", input_size=(H, W))
    assert backbone.training and all(m.training for m in backbone.modules())
    backbone.eval()
    sess = _session(path)
    assert [o.name for o in sess.get_outputs()] == ["stage1", "stage2", "stage3", "stage4"]
    assert sess.get_inputs()[0].shape == ["batch", 3, H, W]
    with torch.no_grad():
        for batch in (2, 3):  # the traced batch and another one
            x = torch.randn(batch, 3, H, W)
            _assert_close(list(backbone(x).values()), _run(sess, x))
    with pytest.raises(Exception, match="(?i)dimension|shape"):  # H, W are fixed: a clear error, not wrong numbers
        _run(sess, torch.randn(1, 3, H + 32, W))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_torch_export_of_backbone_with_dynamic_batch(family: str) -> None:
    backbone = _backbone(family)
    x2, x3 = torch.randn(2, 3, H, W), torch.randn(3, 3, H, W)
    # a batch-1 example is widened to 2 (torch.export would specialise a size-1 batch to 1)
    example = x2[:1] if family == "swin" else x2
    with torch.no_grad():
        before = backbone(x3)
        program = export_program(backbone, example)
        got = program.module()(x3)
        after = backbone(x3)  # eager again: the per-size caches must not hold traced (fake) tensors
    assert list(got) == list(before)
    for k in before:
        torch.testing.assert_close(got[k], before[k], atol=1e-5, rtol=0)
        assert type(after[k]) is Tensor
        torch.testing.assert_close(after[k], before[k], atol=0, rtol=0)


def test_bare_segmenter_onnx_without_normalisation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_segmentor("upernet", "swin_tiny", 4, backbone_kwargs=TINY_SWIN, decoder_channels=16).eval()
    path = vtdense.export(model, tmp_path / "seg.onnx", input_size=(64, 96), normalize=False)
    sess = _session(path)
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    assert sess.get_outputs()[0].shape[:2] == ["batch", 4]  # the batch is dynamic in the output too
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 64, 96)
            _assert_close([model(x)], _run(sess, x))


# ---------------------------------------------------------------------------- checkpoints
def _fit_and_save(task: L.LightningModule, loader: list, path: Path) -> Path:
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=path.parent,
    )
    trainer.fit(task, train_dataloaders=DataLoader(loader, batch_size=None))
    trainer.save_checkpoint(path)
    return path


def _with_path_hparams(ckpt: Path) -> None:
    """Add what a datamodule given ``root=Path(...)`` stores: a pathlib object (our own file, trusted)."""
    obj = torch.load(ckpt, map_location="cpu", weights_only=False)
    obj["datamodule_hyper_parameters"] = {"root": Path("/data/coco"), "batch_size": 2}
    torch.save(obj, ckpt)


def test_segmentation_checkpoint_exports_task_forward(tmp_path: Path) -> None:
    from vtdense.tasks.segmentation import SegmentationTask

    torch.manual_seed(0)
    task = SegmentationTask(
        backbone="swinv2_tiny", backbone_kwargs=FAMILIES["swinv2"][1], num_classes=3, arch_kwargs={"decoder_channels": 16},
        aux_channels=16, warmup_steps=0, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3),
    )
    batch = {"image": torch.rand(2, 3, 64, 64), "mask": torch.randint(0, 3, (2, 64, 64)), "image_size": torch.tensor([[64, 64]] * 2)}
    ckpt = _fit_and_save(task, [batch], tmp_path / "seg.ckpt")
    _with_path_hparams(ckpt)
    # 72 x 100 is not a multiple of 32: the graph pads and crops like the task does
    path = vtdense.export(str(ckpt), tmp_path / "seg.onnx", input_size=(72, 100))
    sess = _session(path)
    task.eval()
    with torch.no_grad():
        for batch_size in (1, 3):
            x = torch.rand(batch_size, 3, 72, 100)  # [0, 1] images: normalisation is in the graph
            _assert_close([task(x)], _run(sess, x))
    with pytest.raises(ValueError, match="what=.fpn. from a segmenter"):
        vtdense.export(ckpt, tmp_path / "x.onnx", what="fpn")


def test_segmentation_checkpoint_of_an_earlier_release_rebuilds_its_own_model(tmp_path: Path) -> None:
    """A checkpoint saved before ``head_layout`` existed holds SMP's own model: export rebuilds that
    model (as loading the task does) instead of refusing its weights."""
    import lightning as L

    from vtdense.tasks.segmentation import SegmentationTask

    torch.manual_seed(0)
    old = SegmentationTask(
        backbone="swinv2_tiny", backbone_kwargs=FAMILIES["swinv2"][1], num_classes=3, arch_kwargs={"decoder_channels": 16},
        aux_channels=16, warmup_steps=0, head_layout="smp", loss_average="valid",
    ).eval()
    hparams = {k: v for k, v in old.hparams.items() if k not in ("head_layout", "loss_average")}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": old.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": L.__version__}, path)
    model, info = model_from_checkpoint(path)
    assert info["kind"] == "segmenter"
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), old.model(x))


def _perturb_heads(model: torch.nn.Module) -> None:
    """Random-init heads give near-equal scores (ties order arbitrarily); spread them out."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("backbone.body."):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _threshold(scores: Tensor, keep: tuple[int, int] = (10, 40)) -> float:
    """A score threshold keeping between ``keep[0]`` and ``keep[1]`` eager detections, in the widest
    gap there, so scores that differ by float noise cannot fall on different sides of it."""
    s = scores.sort(descending=True).values[: keep[1] + 1].numpy()
    assert len(s) > keep[0], f"only {len(s)} detections to compare"
    gaps = s[keep[0] - 1 : -1] - s[keep[0] :]
    i = keep[0] - 1 + int(np.argmax(gaps))
    assert s[i] - s[i + 1] > 1e-4, s
    return float(s[i] + s[i + 1]) / 2


def _assert_same_detections(ref: dict[str, Tensor], got: list[np.ndarray], names: list[str]) -> None:
    scores = ref["scores"].numpy()
    thresh = _threshold(ref["scores"])
    keep_ref = scores > thresh
    keep_got = got[names.index("scores")] > thresh
    assert keep_ref.sum() >= 1 and keep_ref.sum() == keep_got.sum()
    np.testing.assert_array_equal(got[names.index("labels")][keep_got], ref["labels"].numpy()[keep_ref])
    np.testing.assert_allclose(got[names.index("boxes")][keep_got], ref["boxes"].numpy()[keep_ref], atol=1e-3, rtol=0)
    np.testing.assert_allclose(got[names.index("scores")][keep_got], scores[keep_ref], atol=1e-4, rtol=0)
    if "masks" in names:
        np.testing.assert_allclose(got[names.index("masks")][keep_got], ref["masks"].numpy()[keep_ref], atol=1e-3, rtol=0)


@pytest.mark.parametrize("head", ["retinanet", "fcos"])  # two-stage: the Mask R-CNN checkpoint test
def test_detector_onnx_same_detections(head: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    size = (160, 192)  # FCOS's GroupNorm needs P7 larger than 1 x 1
    model = build_detector(
        "swin_tiny", head, 3, fpn_channels=32, slim_heads=True, backbone_kwargs=TINY_SWIN, score_thresh=0.0
    ).eval()
    _perturb_heads(model)
    path = vtdense.export(model, tmp_path / "det.onnx", input_size=size)
    sess = _session(path)
    names = [o.name for o in sess.get_outputs()]
    assert names == ["boxes", "labels", "scores"]
    assert [o.shape[0] for o in sess.get_outputs()] == ["detections"] * 3  # D is declared dynamic, not the traced count
    image = torch.rand(3, *size)
    with torch.no_grad():
        ref = model([image])[0]
    _assert_same_detections(ref, _run(sess, image), names)


def test_mask_rcnn_checkpoint_exports_detector_and_fpn(tmp_path: Path) -> None:
    from vtdense.tasks.detection import DetectionTask

    torch.manual_seed(0)
    task = DetectionTask(
        backbone="swin_tiny", backbone_kwargs=TINY_SWIN, head="mask_rcnn", num_classes=2, fpn_channels=32,
        slim_heads=True, mask_head_channels=16, mask_head_layers=1, box_head_width=64, warmup_steps=0, score_thresh=0.0,
    )
    masks = torch.zeros(1, 96, 128, dtype=torch.uint8)
    masks[0, 20:60, 30:90] = 1
    target = {"boxes": torch.tensor([[30.0, 20.0, 90.0, 60.0]]), "labels": torch.tensor([1]), "masks": masks}
    ckpt = _fit_and_save(task, [([torch.rand(3, 96, 128)], [target])], tmp_path / "det.ckpt")
    _with_path_hparams(ckpt)
    assert isinstance(load_checkpoint(ckpt)["datamodule_hyper_parameters"]["root"], Path)

    model = task.model.eval()
    _perturb_heads(model)
    torch.save({**torch.load(ckpt, weights_only=False), "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, ckpt)
    path = vtdense.export(ckpt, tmp_path / "det.onnx", input_size=(H, W))
    sess = _session(path)
    names = [o.name for o in sess.get_outputs()]
    assert names == ["boxes", "labels", "scores", "masks"]
    image = torch.rand(3, H, W)
    with torch.no_grad():
        ref = model([image])[0]
    _assert_same_detections(ref, _run(sess, image), names)

    x = torch.randn(2, 3, H, W)
    sess = _session(vtdense.export(ckpt, tmp_path / "fpn.onnx", what="fpn", input_size=(H, W)))
    assert [o.name for o in sess.get_outputs()] == ["p2", "p3", "p4", "p5", "pool"]
    with torch.no_grad():
        _assert_close(list(model.backbone(x).values()), _run(sess, x))


def test_unsafe_or_missing_checkpoints_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    # e.g. an argparse Namespace among the hyper-parameters: any non-allowlisted class is refused
    torch.save({"hyper_parameters": {"head": "fcos", "args": argparse.Namespace(lr=1.0)}, "state_dict": {}}, bad)
    with pytest.raises(ValueError, match="bad.ckpt.*weights_only.*argparse.Namespace"):
        vtdense.export(bad, tmp_path / "x.onnx")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        vtdense.export(tmp_path / "missing.ckpt", tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="opset"):
        vtdense.export("swin_tiny", tmp_path / "x.onnx", opset=11)


def test_a_save_backbone_file_exports_as_its_help_says(tmp_path: Path) -> None:
    """``save_backbone`` writes safetensors (whatever the suffix), which the task-checkpoint reader
    cannot read: the file's backbone config is read instead; a safetensors file without it is one
    clear error."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = vtdense.create_backbone("swin_tiny", **TINY_SWIN).eval()
    x = torch.randn(1, 3, 64, 64)
    for name in ("bb.safetensors", "bb.pth"):
        path = vtdense.save_backbone(model, tmp_path / name)
        assert main([str(path), str(tmp_path / f"{name}.onnx"), "--input-size", "64", "64"]) == 0
        with torch.no_grad():
            _assert_close(list(model(x).values()), _run(_session(tmp_path / f"{name}.onnx"), x))
    save_file({"w": torch.ones(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="plain.safetensors' is a safetensors file without vtdense's backbone config"):
        vtdense.export(tmp_path / "plain.safetensors", tmp_path / "x.onnx")


def test_export_options_are_checked_before_tracing(tmp_path: Path) -> None:
    """Each bad option is a ValueError that names it (not an exporter failure deep in tracing)."""
    with pytest.raises(ValueError, match="unknown what='neck'; choose one of backbone, fpn, segmenter, detector"):
        vtdense.export("swin_tiny", tmp_path / "x.onnx", what="neck")
    with pytest.raises(ValueError, match=r"input_size must be two positive sizes \(H, W\), got \(0, 64\)"):
        vtdense.export("swin_tiny", tmp_path / "x.onnx", input_size=(0, 64))
    model = build_segmentor("upernet", "swin_tiny", 4, backbone_kwargs=TINY_SWIN, decoder_channels=16)
    with pytest.raises(ValueError, match="mean/std have 2/3 values but the images have 3 channels"):
        vtdense.export(model, tmp_path / "x.onnx", input_size=(64, 64), mean=(0.5, 0.5))
    with pytest.raises(ValueError, match="mean/std have 3/1 values"):
        vtdense.export(model, tmp_path / "x.onnx", input_size=(64, 64), std=(0.2,))
    listed = tmp_path / "list.ckpt"
    torch.save([1, 2], listed)
    with pytest.raises(ValueError, match="list.ckpt' holds a list, not a checkpoint dict"):
        vtdense.export(listed, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def test_backbone_of_a_detector_or_segmenter_exports_with_the_opset_asked(tmp_path: Path) -> None:
    """``what="backbone"`` exports the backbone inside a detector (``backbone.body``) or an SMP
    model (``encoder.backbone``): stage outputs equal to that module's, at the requested opset."""
    import onnx

    torch.manual_seed(0)
    detector = build_detector("swin_tiny", "retinanet", 3, fpn_channels=16, slim_heads=True, backbone_kwargs=TINY_SWIN).eval()
    segmenter = build_segmentor("upernet", "swin_tiny", 4, backbone_kwargs=TINY_SWIN, decoder_channels=16).eval()
    x = torch.randn(2, 3, 64, 64)
    for name, model, body in (
        ("det", detector, detector.backbone.body), ("seg", segmenter, segmenter.encoder.backbone)
    ):
        path = vtdense.export(model, tmp_path / f"{name}.onnx", what="backbone", input_size=(64, 64), opset=14)
        assert [op.version for op in onnx.load(str(path)).opset_import if op.domain in ("", "ai.onnx")] == [14]
        sess = _session(path)
        # (RetinaNet's backbone emits only the strides its FPN reads: stage2..4)
        assert [o.name for o in sess.get_outputs()] == list(body.out_names)
        assert list(body.out_names) == (["stage2", "stage3", "stage4"] if name == "det" else [f"stage{i}" for i in range(1, 5)])
        with torch.no_grad():
            _assert_close(list(body(x).values()), _run(sess, x))


def test_cli_exports_a_named_backbone(tmp_path: Path) -> None:
    out = tmp_path / "cli.onnx"
    kwargs = json.dumps({**TINY_SWIN, "num_heads": list(TINY_SWIN["num_heads"]), "depths": [1, 1, 1, 1]})
    cmd = [sys.executable, "-m", "vtdense.export", "swin_tiny", str(out), "--input-size", "64", "64", "--backbone-kwargs", kwargs]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    lines = proc.stdout.strip().splitlines()[1:]  # the signature, as the README shows it
    assert lines == ["# inputs  image [batch, 3, 64, 64]",
                     "# outputs " + "  ".join(f"stage{i + 1} [batch, {16 * 2**i}, {16 // 2**i}, {16 // 2**i}]" for i in range(4))]
    sess = _session(out)
    assert sess.get_inputs()[0].shape == ["batch", 3, 64, 64]
    assert [o.shape for o in sess.get_outputs()] == [["batch", 16 * 2**i, 16 // 2**i, 16 // 2**i] for i in range(4)]


def test_cli_bad_input_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path / "nope.ckpt"), str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "nope.ckpt" in err[0]
    assert main(["swin_tiny", str(tmp_path / "x.onnx"), "--what", "detector"]) == 2
    assert "cannot export what='detector' from a backbone" in capsys.readouterr().err
