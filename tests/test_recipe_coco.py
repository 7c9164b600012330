"""End-to-end tests of recipes/coco_swin.py through vtdense.cli.run_recipe on tiny generated data."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from vtdense.data.synthetic import make_synthetic_coco

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "coco_swin.py"
CONFIGS = REPO / "recipes" / "configs"


def load_recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coco_swin_recipe", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    return load_recipe()


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recipe") / "coco"
    return make_synthetic_coco(root, num_train=6, num_val=4, size_range=(64, 96), num_classes=2)


def tiny_args(root: Path, out: Path) -> list[str]:
    """The demo config, shrunk: tiny Swin, tiny heads, 64 px images."""
    return [
        f"--config={CONFIGS / 'coco_swin_demo.yaml'}",
        f"--data.root={root}",
        "--data.batch_size=2",
        "--data.num_workers=0",
        "--data.train_scales=[64]",
        "--data.test_scale=64",
        "--data.max_size=128",
        "--model.backbone_kwargs={embed_dim: 32, depths: [1, 1, 1, 1], num_heads: [1, 2, 4, 8], window_size: 4}",
        "--model.fpn_channels=32",
        "--model.mask_head_channels=16",
        "--model.mask_head_layers=1",
        "--model.box_head_width=64",
        "--model.num_vis_images=2",
        "--model.score_thresh=0.0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={out}",
    ]


def test_recipe_end_to_end_writes_outputs(recipe: ModuleType, coco_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = tiny_args(coco_root, tmp_path) + [
        "--trainer.max_epochs=2",
        "--trainer.limit_train_batches=2",
        "--trainer.check_val_every_n_epoch=1",
    ]
    metrics = recipe.main(args)
    out = capsys.readouterr().out
    assert "final metrics" in out and "val/bbox_mAP" in out and "val/segm_mAP50" in out
    # the table names the run directory and what is in it; training curves are there
    for name in ("run directory:", "metrics.json", "bbox.json", "curves.png", "curves.csv", "checkpoints/", "predictions/"):
        assert name in out, name

    run = tmp_path / "lightning_logs" / "version_0"
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["metrics"] == pytest.approx(metrics)
    assert Path(saved["checkpoint"]).name.startswith("best-epoch")
    for key in ("val/bbox_mAP", "val/bbox_mAP50", "val/bbox_mAP75", "val/segm_mAP"):
        assert key in metrics
    ckpts = {p.name for p in (run / "checkpoints").glob("*.ckpt")}
    assert "last.ckpt" in ckpts and any(n.startswith("best-epoch") for n in ckpts)
    assert (run / "config.yaml").is_file()
    assert len(list((run / "predictions").glob("validate_*.png"))) == 2

    # The results files of the final validation re-score to the reported numbers with pycocotools.
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(coco_root / "annotations" / "instances_val2017.json"))
        for iou in ("bbox", "segm"):
            results = json.loads((run / f"{iou}.json").read_text())
            assert results  # score_thresh=0 keeps detections even from a barely trained model
            ev = COCOeval(gt, gt.loadRes(results), iou)
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            assert abs(ev.stats[0] - metrics[f"val/{iou}_mAP"]) < 1e-6
            assert abs(ev.stats[1] - metrics[f"val/{iou}_mAP50"]) < 1e-6


def test_recipe_fast_dev_run(recipe: ModuleType, coco_root: Path, tmp_path: Path) -> None:
    metrics = recipe.main(tiny_args(coco_root, tmp_path) + ["--trainer.fast_dev_run=true"])
    assert "val/bbox_mAP" in metrics
    saved = json.loads((tmp_path / "metrics.json").read_text())  # no logger with fast_dev_run
    assert saved["checkpoint"] is None and saved["metrics"] == pytest.approx(metrics)
    assert (tmp_path / "bbox.json").is_file() and (tmp_path / "segm.json").is_file()


@pytest.mark.parametrize(
    "config",
    [None, "coco_swin_t_maskrcnn_1x.yaml", "coco_swin_t_maskrcnn_3x.yaml", "coco_swin_t_retinanet_1x.yaml"],
)
def test_print_config(recipe: ModuleType, config: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--print_config"]
    if config is not None:
        # the published command line: only parsed, nothing is instantiated or downloaded
        args = [f"--config={CONFIGS / config}", "--data.root=/data/coco", "--trainer.devices=8",
                "--trainer.precision=bf16-mixed", "--print_config"]
    with pytest.raises(SystemExit) as exc:
        recipe.main(args)
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "backbone: swin_tiny" in printed
    if config is None:
        assert "slim_heads: true" in printed and "max_epochs: 8" in printed
    else:
        # nothing of the CPU demo leaks into the published recipes
        assert "slim_heads: false" in printed and "fpn_channels: 256" in printed
        # the official configs: 0.1 for the mstrain 1x (43.7 box AP), 0.2 for the 3x
        assert f"drop_path_rate: {0.1 if config == 'coco_swin_t_maskrcnn_1x.yaml' else 0.2}" in printed and "embed_dim" not in printed
        assert "precision: bf16-mixed" in printed and "root: /data/coco" in printed
        assert "anchor_sizes: null" in printed and "max_size: 1333" in printed
        assert "filter_empty: true" in printed  # detectron2's / mmdet's training split: annotated images only
    if config == "coco_swin_t_maskrcnn_1x.yaml":
        assert "max_epochs: 12" in printed and "- 8.0\n  - 11.0" in printed
        assert "box_head_width: 1024" in printed and "mask_head_channels: 256" in printed
    if config == "coco_swin_t_retinanet_1x.yaml":
        # mmdet's retinanet_swin-t-p4-w7_fpn_1x_coco: SGD on every parameter, single scale
        assert "optimizer: sgd" in printed and "momentum: 0.9" in printed and "lr: 0.01\n" in printed
        assert "weight_decay: 0.0001" in printed and "no_decay: none" in printed
        assert "train_scales:\n  - 800\n" in printed and "train_augment: multiscale\n" in printed
    elif "optimizer: adamw" not in printed:
        raise AssertionError("the other recipes train with AdamW")
    if config in ("coco_swin_t_maskrcnn_1x.yaml", "coco_swin_t_maskrcnn_3x.yaml"):
        # the official configs' DETR-style crop (AutoAugment) on half of the images
        assert "train_augment: multiscale_crop" in printed and "crop_prob: 0.5" in printed
        assert "crop_max_size: 1333" in printed and "crop_size_range:\n  - 384\n  - 600" in printed


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--model.head=yolo", r"unknown head 'yolo' \(option 'head'\)"),
        ("--model.backbone=resnet50", r"unknown backbone 'resnet50' \(option 'backbone'\)"),
    ],
)
def test_bad_option_on_the_command_line(recipe: ModuleType, coco_root: Path, tmp_path: Path, flag: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        recipe.main(tiny_args(coco_root, tmp_path) + [flag, "--trainer.fast_dev_run=true"])


def test_script_help_runs_standalone() -> None:
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, cwd=REPO, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "--model.backbone" in proc.stdout and "--data.root" in proc.stdout and "--config" in proc.stdout


def test_recipe_picks_published_config_when_data_is_given(recipe: ModuleType, coco_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vtdense.cli import choose_config
    from vtdense.data.coco import COCODataModule

    monkeypatch.chdir(tmp_path)  # no data/coco here
    monkeypatch.delenv("VTDENSE_DATA", raising=False)
    pick = lambda args: choose_config(COCODataModule, args, recipe.DEFAULT_CONFIG, recipe.DEMO_CONFIG)  # noqa: E731
    assert recipe.DEFAULT_CONFIG.name == "coco_swin_t_maskrcnn_1x.yaml"
    assert pick([]) == recipe.DEMO_CONFIG
    assert pick(["--trainer.max_epochs=1"]) == recipe.DEMO_CONFIG
    assert pick(["--data.root", "/data/coco"]) == recipe.DEFAULT_CONFIG
    assert pick(["--data.root=/data/coco", "--trainer.devices=8"]) == recipe.DEFAULT_CONFIG
    assert pick(["--data.val_ann=x.json"]) == recipe.DEFAULT_CONFIG
    assert pick(["--config=mine.yaml"]) is None  # the user's config is the whole base
    assert pick(["--config", "mine.yaml", "--data.root=/x"]) is None
    monkeypatch.setenv("VTDENSE_DATA", str(coco_root.parent))  # $VTDENSE_DATA/coco holds a dataset
    assert pick([]) == recipe.DEFAULT_CONFIG


def test_published_command_line_without_config_is_the_1x_recipe(recipe: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        recipe.main(["--data.root=/data/coco", "--trainer.devices=8", "--trainer.precision=bf16-mixed", "--print_config"])
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "slim_heads: false" in printed and "fpn_channels: 256" in printed and "max_epochs: 12" in printed
    assert "precision: bf16-mixed" in printed and "root: /data/coco" in printed


def test_mvitv2_config_parses_with_hybrid_windows(recipe: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        recipe.main([f"--config={CONFIGS / 'coco_mvitv2_t_maskrcnn_3x.yaml'}", "--data.root=/data/coco", "--print_config"])
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "backbone: mvitv2_tiny" in printed and "window_size: 56" in printed
    assert "max_epochs: 36" in printed and "slim_heads: false" in printed and "weight_decay: 0.1" in printed
    # detectron2's mask_rcnn_mvitv2_t_3x: 64 images per step on 8 GPUs, drop path 0.2, steps at 78% / 93%
    assert "batch_size: 8" in printed and "drop_path_rate: 0.2" in printed and "- 28.0\n  - 33.0" in printed
    assert "train_augment: multiscale_crop" in printed and "crop_max_size: null" in printed and "test_scale: 800" in printed and "warmup_steps: 250" in printed
