"""The fine-tune recipe, shortened: train at window 8 / 64-128 px, save, fine-tune at window 16."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import vtdense
from vtdense.data.synthetic_seg import generate_synthetic_segmentation

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune_highres.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("finetune_highres", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_finetune_recipe_path_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = generate_synthetic_segmentation(tmp_path / "data", num_train=8, num_val=4, size_range=(96, 128))
    short = {"trainer.max_epochs": 1, "trainer.check_val_every_n_epoch": 1, "data.num_workers": 0, "model.num_vis": 0}
    out = _recipe().demo(
        tmp_path / "runs",
        data_root=data,
        pretrain_overrides={**short, "data.scale": [128, 64], "data.crop_size": [64, 64], "data.eval_scale": [128, 64]},
        finetune_overrides={**short, "data.scale": [192, 128], "data.crop_size": [128, 128], "data.eval_scale": [192, 128]},
    )
    text = capsys.readouterr().out
    assert set(out) == {"before", "after"} and all(0.0 <= v <= 1.0 for v in out.values())
    assert f"validation mIoU before (window 8, 128 px): {out['before']:.4f}" in text
    # the saved stage-1 backbone: safetensors with its config (window 8)
    saved = tmp_path / "runs" / "backbone_window8_128px.safetensors"
    backbone = vtdense.load_backbone(saved)
    assert backbone.window_size == (8, 8) and backbone.load_report.container == "safetensors"
    # stage 2 loaded every backbone tensor from it and said why nothing needed resizing
    assert f"checkpoint {saved} (safetensors, vtdense layout)" in text
    assert "0 resized, 0 derived, 0 dropped" in text
    # its pretrained windows are those stage 1 trained with: 8, shrunk to the 4 and 2 px maps of
    # its 64 px crops at stages 3 and 4, which the saved file cannot know (the report says so)
    assert "pretrained_window_size=(8, 8, 4, 2), smaller than the training window at stage(s) 3, 4" in text
    # stage 2 really ran at window 16 with pretrained window 8, from the saved weights
    run = sorted((tmp_path / "runs" / "finetune" / "lightning_logs").glob("version_*"))[-1]
    ckpt = json.loads((run / "metrics.json").read_text())["checkpoint"]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    kwargs = state["hyper_parameters"]["backbone_kwargs"]
    assert kwargs["window_size"] == 16 and kwargs["pretrained_window_size"] == [[8, 8], [8, 8], [4, 4], [2, 2]]
    assert state["hyper_parameters"]["layer_decay"] == 0.75
    tuned = vtdense.create_backbone("swinv2_tiny", **kwargs)
    vtdense.load_pretrained(tuned, ckpt)
    assert [stage.blocks[0].attn.pretrained_window_size for stage in tuned.layers] == [(8, 8), (8, 8), (4, 4), (2, 2)]


def test_recipe_rejects_unknown_task() -> None:
    with pytest.raises(SystemExit, match="--task must be one of segmentation, detection"):
        _recipe().main(["--task", "classification"])


def test_finetune_recipe_detection_task(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--task detection``: a window-4 Swin V2 backbone file fine-tuned at window 8 with layer decay."""
    from tests.test_recipe_coco import tiny_args
    from vtdense.data.synthetic import make_synthetic_coco

    coco = make_synthetic_coco(tmp_path / "coco", num_train=4, num_val=2, size_range=(64, 96), num_classes=2)
    small = vtdense.create_backbone("swinv2_tiny", embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=4)
    vtdense.save_backbone(small, tmp_path / "bb.safetensors")
    metrics = _recipe().main([
        "--task", "detection", *tiny_args(coco, tmp_path / "run"), "--model.backbone=swinv2_tiny",
        "--model.backbone_kwargs={embed_dim: 32, depths: [1, 1, 1, 1], num_heads: [1, 2, 4, 8], window_size: 8, "
        "pretrained_window_size: 4}",
        f"--model.backbone_weights={tmp_path / 'bb.safetensors'}", "--model.layer_decay=0.8",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.check_val_every_n_epoch=1",
    ])
    assert "val/bbox_mAP" in metrics and "val/segm_mAP" in metrics
    assert "bb.safetensors" in capsys.readouterr().out  # the load report is printed
    run = sorted((tmp_path / "run" / "lightning_logs").glob("version_*"))[-1]
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    hp = state["hyper_parameters"]
    assert hp["layer_decay"] == 0.8 and hp["backbone_kwargs"]["window_size"] == 8
    groups = state["optimizer_states"][0]["param_groups"]
    ratios = sorted({round(g["initial_lr"] / max(x["initial_lr"] for x in groups), 6) for g in groups})
    assert ratios == [round(0.8 ** k, 6) for k in range(len(ratios) - 1, -1, -1)] and len(ratios) >= 5  # 0.8^k per layer
