"""The ADE20K Swin V2 recipe end to end through the CLI on tiny generated data."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

from vtdense.data.synthetic_seg import SYNTHETIC_CLASSES, generate_synthetic_segmentation
from vtdense.tasks.segmentation import SegmentationTask

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "ade20k_swinv2.py"
PUBLISHED = REPO / "recipes" / "configs" / "ade20k_swinv2_t_upernet_160k.yaml"


def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ade20k_swinv2_recipe", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # the recipe gets its arguments from ``args``; keep pytest's own flags out of sys.argv
    monkeypatch.setattr(sys, "argv", [str(RECIPE)])


def make_tiny_args(tmp_path: Path) -> list[str]:
    """The demo config shrunk to 16-channel Swin V2 and 32 px crops, on 4+2 generated images."""
    root = generate_synthetic_segmentation(tmp_path / "ade", num_train=4, num_val=2, size_range=(48, 64), seed=2)
    config = {
        "model": {
            "backbone_kwargs": {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 4], "window_size": 4},
            "arch_kwargs": {"decoder_channels": 16},
            "aux_channels": 16,
            "num_vis": 2,
        },
        "data": {"root": str(root), "batch_size": 2, "val_batch_size": 2, "num_workers": 0, "scale": [64, 48], "crop_size": [32, 32]},
        "trainer": {"default_root_dir": str(tmp_path / "run"), "enable_progress_bar": False, "enable_model_summary": False},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return ["--config", str(RECIPE.parent / "configs" / "ade20k_swinv2_demo.yaml"), "--config", str(path)]


@pytest.fixture
def tiny_args(tmp_path: Path) -> list[str]:
    return make_tiny_args(tmp_path)


def test_recipe_fast_dev_run(tiny_args: list[str], capsys: pytest.CaptureFixture) -> None:
    """(With LightningCLI's ``fit`` first: the same as no subcommand.)"""
    metrics = _recipe().main(["fit", *tiny_args, "--trainer.fast_dev_run", "true"])
    assert 0.0 <= metrics["val/mIoU"] <= 1.0
    assert 0.0 <= metrics["val/aAcc"] <= 1.0
    assert "final metrics" in capsys.readouterr().out


def test_recipe_trains_and_writes_its_outputs(tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = tiny_args + ["--trainer.max_epochs", "1", "--trainer.max_steps", "2", "--trainer.check_val_every_n_epoch", "1"]
    metrics = _recipe().main(args)
    out = capsys.readouterr().out
    assert "val/mIoU" in out and "per-class IoU" in out
    assert all(f"val/IoU.{name}" in metrics for name in SYNTHETIC_CLASSES)  # 8 classes from classes.txt
    run = next((tmp_path / "run").rglob("metrics.json")).parent
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["metrics"]["val/mIoU"] == pytest.approx(metrics["val/mIoU"])
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "last.ckpt" in ckpts and any(p.startswith("best-") for p in ckpts)
    assert sorted(p.name for p in (run / "predictions").iterdir()) == ["val_000.png", "val_001.png"]
    # the class count resolved from the data is saved, so the checkpoint rebuilds the same model
    best = next(run.glob("checkpoints/best-*.ckpt"))
    task = SegmentationTask.load_from_checkpoint(best, map_location="cpu")
    assert task.hparams.num_classes == len(SYNTHETIC_CLASSES)
    with torch.no_grad():
        assert task.eval()(torch.rand(1, 3, 40, 56)).shape == (1, 8, 40, 56)


def test_published_command_line_is_valid(capsys: pytest.CaptureFixture) -> None:
    args = ["--data.root", "/data/ade20k", "--trainer.devices", "8", "--trainer.precision", "bf16-mixed"]
    for extra in ([], ["--config", str(PUBLISHED)]):
        with pytest.raises(SystemExit) as exit_info:
            _recipe().main(extra + args + ["--print_config"])
        assert exit_info.value.code == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert str(printed["trainer"]["devices"]) == "8" and printed["trainer"]["precision"] == "bf16-mixed"
        assert printed["data"]["root"] == "/data/ade20k"
        # with or without --config, the command line of the issue is the published recipe
        assert printed["model"]["lr"] == 6e-5 and printed["model"]["warmup_steps"] == 1500
        assert printed["model"]["backbone_kwargs"]["drop_path_rate"] == 0.3
        assert printed["trainer"]["max_steps"] == 160000
        assert printed["data"]["crop_size"] == [512, 512]
        assert printed["data"]["batch_size"] * int(printed["trainer"]["devices"]) == 16
