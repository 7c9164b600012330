"""Bad model names and options: one error naming the option and listing the valid choices.

Each test is one row of the README's "Bad input: what you see" table. Checkpoints for the wrong
backbone, class count or task are tested with the checkpoint code, not here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
import torch

import vtdense
from hub_cache import hub_cache  # noqa: F401  (fixture)
from vtdense.models.detection import build_detector, list_heads
from vtdense.models.segmentation import ARCHITECTURES, build_segmentor
from vtdense.tasks.detection import LR_SCHEDULES, METRIC_BACKENDS, DetectionTask
from vtdense.tasks.segmentation import SegmentationTask

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "coco_swin.py"
BACKBONES = vtdense.list_backbones()

# (what is built, the wrong name, the text that must name it, the names the message must list)
CASES: list[tuple[str, Callable[[], Any], str, list[str]]] = [
    ("create_backbone", lambda: vtdense.create_backbone("swin_huge"), "unknown backbone 'swin_huge'", BACKBONES),
    ("build_detector head", lambda: build_detector("swin_tiny", "yolo", 3), "unknown detection head 'yolo'", list_heads()),
    ("build_detector backbone", lambda: build_detector("resnet50", "mask_rcnn", 3), "unknown backbone 'resnet50'", BACKBONES),
    ("DetectionTask head", lambda: DetectionTask(head="yolo"), "unknown head 'yolo' (option 'head')", list_heads()),
    ("DetectionTask backbone", lambda: DetectionTask(backbone="vit_b"), "unknown backbone 'vit_b' (option 'backbone')", BACKBONES),
    ("DetectionTask metric_backend", lambda: DetectionTask(metric_backend="cocoapi"),
     "unknown metric_backend 'cocoapi' (option 'metric_backend')", list(METRIC_BACKENDS)),
    ("DetectionTask lr_schedule", lambda: DetectionTask(lr_schedule="linear"),
     "unknown lr_schedule 'linear' (option 'lr_schedule')", list(LR_SCHEDULES)),
    ("build_segmentor arch", lambda: build_segmentor("segnet", "swin_tiny", 3), "unknown segmentation arch 'segnet'",
     list(ARCHITECTURES)),
    ("build_segmentor backbone", lambda: build_segmentor("upernet", "convnext", 3), "unknown backbone 'convnext'", BACKBONES),
    ("SegmentationTask arch", lambda: SegmentationTask(arch="segnet", num_classes=3),
     "model.arch: unknown architecture 'segnet'", list(ARCHITECTURES)),
    ("SegmentationTask backbone", lambda: SegmentationTask(backbone="convnext", num_classes=3),
     "unknown backbone 'convnext'", BACKBONES),
]


@pytest.mark.parametrize(("build", "expected", "valid"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unknown_names_list_the_valid_ones(build: Callable[[], Any], expected: str, valid: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert expected in message, message
    missing = [name for name in valid if name not in message]
    assert not missing, f"the message does not list {missing}: {message}"


def _recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coco_swin_recipe_bad_input", RECIPE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrong_type_in_yaml_through_the_recipe_script(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  accelerator: cpu\nmodel:\n  backbone: swin_tiny\n  fpn_channels: wide\n")
    proc = subprocess.run([sys.executable, str(RECIPE), "--config", str(config)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    error = proc.stderr[proc.stderr.index("error: "):]
    assert error.splitlines()[0] == 'error: Parser key "model.fpn_channels":', error
    assert "Expected a <class 'int'>. Got value: wide" in error
    assert not list(tmp_path.glob("runs")), "nothing may be written before the options are valid"


@pytest.mark.parametrize(
    ("yaml_text", "option", "detail"),
    [
        ("model:\n  lr: [1, 2]\n", "model.lr", "Expected a <class 'float'>"),
        ("data:\n  batch_size: two\n", "data.batch_size", "Got value: two"),
        ("data:\n  train_scales: 600\n", "data.train_scales", "Got value: 600"),
        ("model:\n  backbone_kwargs: 5\n", "model.backbone_kwargs", "Given value: 5"),
        ("trainer:\n  max_epochs: many\n", "trainer.max_epochs", "Given value: many"),
    ],
)
def test_wrong_type_in_yaml_names_the_option(tmp_path: Path, yaml_text: str, option: str, detail: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises(SystemExit) as info:
        _recipe().main([f"--config={config}", f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f'error: Parser key "{option}":' in err and detail in err, err[-2000:]
    assert not (tmp_path / "run").exists()


def test_mvitv2_num_heads_list_names_the_option() -> None:
    import vtdense

    with pytest.raises(ValueError, match=r"MViTv2 num_heads is the head count of stage 1 .* got \[1, 2, 4, 8\]"):
        vtdense.create_backbone("mvitv2_tiny", num_heads=[1, 2, 4, 8])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model.fused_optimizr", "true", "--data.batch_sise=3", "--bogus"],
         "error: unrecognized arguments: --model.fused_optimizr true --data.batch_sise=3 --bogus; "
         "did you mean --model.fused_optimizer, --data.batch_size?"),
        (["--config={yaml}"],
         "error: Group 'model' does not accept option 'fused_optimizr'; "
         "did you mean 'fused_optimizer' (--model.fused_optimizer)?"),
        (["--bogus"], "error: unrecognized arguments: --bogus"),
    ],
)
def test_misspelt_option_gets_one_short_error_with_the_closest_name(
        tmp_path: Path, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text("model:\n  fused_optimizr: true\n")
    argv = [a.format(yaml=config) for a in argv] + [f"--trainer.default_root_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as info:
        _recipe().main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == expected, err[-2000:]
    assert "usage:" not in err and len(err.strip().splitlines()) <= 3, err[-2000:]
    assert "--help" in err  # where the valid options are listed
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model.compile_backbone", "inductr"], "error: compile_backbone='inductr' is not a torch.compile backend"),
        (["--model.size_divisibility", "0"], "error: size_divisibility must be a positive int (option 'size_divisibility')"),
        (["--model.mask_rois_multiple", "0"], "error: mask_rois_multiple must be a positive int or null (option 'mask_rois_multiple')"),
        (["--model.head", "mask_rcn"], "error: unknown head 'mask_rcn'"),
        (["--model.triton_attention", "maybe"],
         "error: triton_attention must be true, false or 'auto' (option 'triton_attention'), got 'maybe'"),
        (["--model.lr", "-1"], "error: lr must be a number in (0, inf) (option 'lr'), got -1.0"),
        # the network is built in setup (its class count comes from the data); a meta-device build checks it first
        (["--model.backbone_kwargs", "{window_size: 0}"], "error: window_size must be positive, got 0"),
        (["--model.fpn_channels", "0"], "error: fpn_channels must be a positive int (option 'fpn_channels'), got 0"),
        (["--model.weight_decay", "-0.05"], "error: weight_decay must be a number in [0, inf) (option 'weight_decay'), got -0.05"),
        (["predict", "--ckpt_path", "missing.ckpt", "--data.predict_path", "."],
         "error: --ckpt_path: checkpoint not found: missing.ckpt"),
        (["test", "--ckpt_path", "best.ckpt"], "error: 'test' is not a subcommand of the recipes: 'validate --ckpt_path CKPT'"),
    ],
)
def test_bad_option_value_gets_one_line_from_the_script(
        tmp_path: Path, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A value the task / datamodule / predict rejects: ``error: <message>``, status 2, no traceback."""
    recipe = _recipe()
    if argv[0] != "predict":
        argv = argv + [f"--trainer.default_root_dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *argv])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        recipe.run_script(recipe.main)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected), err
    assert not (tmp_path / "run").exists()


def _script_error(recipe: ModuleType, argv: list[str], run: Path, monkeypatch: pytest.MonkeyPatch,
                  capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run ``recipe`` as a command with ``argv``: it must exit with status 2 before the trainer made
    ``run``; returns the lines it printed to stderr."""
    monkeypatch.setattr(sys, "argv", [str(RECIPE), *argv])
    with pytest.raises(SystemExit) as info:
        recipe.run_script(recipe.main)
    assert info.value.code == 2, argv
    assert not run.exists()
    return capsys.readouterr().err.strip().splitlines()


def _resume_files(where: Path) -> dict[str, str]:
    """Files a fit cannot resume from -> the start of the one line the recipe prints for each."""
    import pickle

    import torch

    resumable = {"state_dict": {}, "optimizer_states": [], "loops": {}, "epoch": 0, "global_step": 0}
    torch.save({**resumable, "vtdense_task": "DetectionTask"}, where / "whole.ckpt")
    whole = (where / "whole.ckpt").read_bytes()
    (where / "cut.ckpt").write_bytes(whole[:-10])  # a copy interrupted near its end
    torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 3}, where / "weights.ckpt")  # save_weights_only
    torch.save({**resumable, "vtdense_task": "SegmentationTask"}, where / "segment.ckpt")
    torch.save({**resumable, "vtdense_task": "DetectionTask", "hyper_parameters": {"backbone": "swinv2_tiny"}},
               where / "other.ckpt")
    (where / "code.ckpt").write_bytes(pickle.dumps({**resumable, "x": print}, protocol=2))  # a global: not weights only
    return {
        "missing.ckpt": "error: --ckpt_path 'missing.ckpt' does not exist",
        "cut.ckpt": f"error: --ckpt_path: cannot read checkpoint 'cut.ckpt': it is a zip archive (torch.save's format) "
                    f"of {len(whole) - 10:,} bytes without the end record that closes one: the file is cut short",
        "weights.ckpt": "error: --ckpt_path: 'weights.ckpt' cannot resume a fit: it has no optimizer_states, loops (a "
                        "checkpoint written with save_weights_only",
        "segment.ckpt": "error: --ckpt_path: checkpoint segment.ckpt is a SegmentationTask checkpoint, not a DetectionTask one",
        "other.ckpt": "error: --ckpt_path: checkpoint other.ckpt does not fit this model: it was trained with "
                      "backbone='swinv2_tiny' (this run: 'swin_tiny')",
        "code.ckpt": "error: --ckpt_path: cannot load 'code.ckpt' safely with torch.load(weights_only=True)",
    }


def test_a_ckpt_path_a_fit_cannot_resume_from_is_one_line_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--ckpt_path`` to resume a fit: a missing file, one cut short, one with weights only, one of
    another task or backbone, one holding code: ``error: <message>`` naming it, status 2, before the
    trainer starts (no run directory); the whole checkpoint passes the same check."""
    from vtdense.cli import check_resume_checkpoint

    recipe = _recipe()
    monkeypatch.chdir(tmp_path)
    cases = _resume_files(tmp_path)
    for name, expected in cases.items():
        err = _script_error(recipe, ["--ckpt_path", name, "--trainer.default_root_dir=run"], tmp_path / "run", monkeypatch, capsys)
        assert len(err) == 1 and err[0].startswith(expected), (name, err)
    from vtdense.tasks.detection import DetectionTask

    check_resume_checkpoint("whole.ckpt", DetectionTask(backbone="swin_tiny", num_classes=3))


def test_backbone_weights_missing_or_cut_short_is_one_line_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        hub_cache: Callable[..., Path]) -> None:  # noqa: F811
    """``--model.backbone_weights``: a misspelt path, a file cut short, a Hub id in neither the cache
    nor (offline) the Hub: ``error: --model.backbone_weights: ...`` naming it, status 2, no run
    directory (these used to end the run once it had started, with a traceback). A Hub id in the
    cache passes the same check."""
    from vtdense.cli import check_backbone_weights

    recipe = _recipe()
    monkeypatch.chdir(tmp_path)
    model = vtdense.create_backbone("swin_tiny", embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8))
    whole = vtdense.save_backbone(model, tmp_path / "whole.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    cases = {
        "swin_tiny_in1k.pth": "error: --model.backbone_weights: checkpoint file not found: swin_tiny_in1k.pth",
        "cut.safetensors": f"error: --model.backbone_weights: cannot read checkpoint cut.safetensors: it is a safetensors "
                           f"file of {len(whole) // 2:,} bytes where its header describes {len(whole):,}: the file is cut short",
        "timm/no_such_model": "error: --model.backbone_weights: Hub checkpoint 'timm/no_such_model': none of",
    }
    for name, expected in cases.items():
        err = _script_error(recipe, ["--model.backbone_weights", name, "--trainer.default_root_dir=run"], tmp_path / "run",
                            monkeypatch, capsys)
        assert len(err) == 1 and err[0].startswith(expected), (name, err)
    hub_cache("timm/tiny_swin", {"model.safetensors": model.state_dict()})
    check_backbone_weights("timm/tiny_swin")
    check_backbone_weights(tmp_path / "whole.safetensors")


def test_a_sharded_checkpoint_folder_resumes_and_other_folders_are_refused(tmp_path: Path) -> None:
    """FSDP with ``save_distributed_checkpoint=True`` writes ``last.ckpt`` as a folder (one shard per
    rank and ``.metadata``): ``--ckpt_path last`` finds it (before, a folder was passed over and the
    run started anew) and so does a path to it; a folder that is no sharded checkpoint is one error.
    (A 2-process FSDP fit resumed from such a folder by the recipe: checked by hand, 2026-11-29.)"""
    from lightning.pytorch import Trainer

    from vtdense.cli import check_resume_checkpoint, find_last_checkpoint, resume_path
    from vtdense.tasks.detection import DetectionTask

    sharded = tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt"
    sharded.mkdir(parents=True)
    (sharded / "__0_0.distcp").write_bytes(b"")
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, enable_progress_bar=False)
    assert find_last_checkpoint(tmp_path) is None and resume_path(trainer, "last") is None  # no .metadata yet
    with pytest.raises(FileNotFoundError, match=r"is a folder, but no sharded checkpoint \(no \.metadata in it\)$"):
        resume_path(trainer, str(sharded))
    (sharded / ".metadata").write_bytes(b"")
    assert find_last_checkpoint(tmp_path) == sharded
    assert resume_path(trainer, "last") == str(sharded) and trainer.logger.version == 3  # the same run directory
    assert resume_path(trainer, str(sharded)) == str(sharded)
    check_resume_checkpoint(str(sharded), DetectionTask(backbone="swin_tiny", num_classes=3))  # the shards: Lightning's


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(lr=0.0), "lr must be a number in (0, inf) (option 'lr'), got 0.0"),
        (dict(lr=float("nan")), "lr must be a number in (0, inf) (option 'lr'), got nan"),
        (dict(warmup_factor=1.5), "warmup_factor must be a number in [0, 1] (option 'warmup_factor'), got 1.5"),
        (dict(poly_power=-1.0), "poly_power must be a number in [0, inf) (option 'poly_power'), got -1.0"),
        (dict(min_lr_factor=2.0), "min_lr_factor must be a number in [0, 1] (option 'min_lr_factor'), got 2.0"),
        (dict(warmup_steps=2.5), "warmup_steps must be a whole number >= 0 (option 'warmup_steps'), got 2.5"),
        (dict(betas=(0.9, 1.0)), "betas must be two numbers in [0, 1) (option 'betas'), got (0.9, 1.0)"),
    ],
)
def test_segmentation_schedule_numbers_out_of_range_name_the_option(options: dict[str, Any], expected: str) -> None:
    """Optimiser and schedule numbers are checked when the task is built (before, torch's AdamW refused
    a negative lr only once the trainer had started, and a negative weight decay or a warmup factor
    over 1 trained without a word)."""
    with pytest.raises(ValueError) as info:
        SegmentationTask(num_classes=3, backbone_kwargs=dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8]),
                         **options)
    assert str(info.value) == expected
    with pytest.raises(ValueError, match=r"^lr_gamma must be a number in \(0, inf\) \(option 'lr_gamma'\), got 0$"):
        DetectionTask(num_classes=3, lr_gamma=0)


def test_an_option_the_task_and_the_data_take_differently_is_one_line_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model.ignore_index -5`` with the data module's 255: Lightning refuses it once the fit has
    started ("Error while merging hparams", a traceback); the recipe says so first, in one line. The
    segmentation task's own widths are checked when it is made."""
    spec = importlib.util.spec_from_file_location("ade20k_recipe_bad_input", REPO / "recipes" / "ade20k_swinv2.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    from tests.test_recipe_ade20k import make_tiny_args

    args = make_tiny_args(tmp_path)  # its run directory: tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    for option, expected in (
        ("--model.ignore_index=-5", "error: --model.ignore_index=-5 but --data.ignore_index=255: the task and the data "
                                    "module take this option alike; give both the same value"),
        ("--model.aux_channels=0", "error: aux_channels must be a positive int (option 'aux_channels'), got 0"),
    ):
        assert _script_error(recipe, [*args, option], tmp_path / "run", monkeypatch, capsys) == [expected]


def test_a_task_without_a_class_count_checks_its_network_on_the_meta_device() -> None:
    """With ``num_classes`` left to the datamodule, the task builds its network on the meta device once
    to check the options, and keeps nothing of it: no model yet, hyperparameters as given."""
    tiny = dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8])
    task = SegmentationTask(backbone_kwargs=tiny, backbone_weights="not/read_here")
    assert task.model is None and not hasattr(task, "aux_head") and task.hparams["num_classes"] is None
    assert task.hparams["backbone_weights"] == "not/read_here" and list(task.parameters()) == []
    with pytest.raises(ValueError, match=r"depths \(1, 1\) and num_heads \(1, 2, 4, 8\) must have the same length"):
        SegmentationTask(backbone_kwargs={**tiny, "depths": [1, 1]})
    det = DetectionTask(backbone_kwargs=tiny)
    assert det.model is None and list(det.parameters()) == []
    # nothing of the meta build lingers in the tables the backbones cache: a network built next is all on the CPU
    real = SegmentationTask(num_classes=2, backbone_kwargs=tiny).eval()
    assert {t.device.type for t in [*real.parameters(), *real.buffers()]} == {"cpu"}
    with torch.no_grad():
        assert real.model(torch.rand(1, 3, 64, 64)).shape == (1, 2, 16, 16)  # the decoder's stride 4


def test_errors_during_the_run_keep_their_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from vtdense import cli

    def failing_run() -> None:
        raise ValueError("a bug in the training loop")

    def bad_option() -> None:
        with cli.before_run():
            raise ValueError("bad option")

    with pytest.raises(ValueError, match="a bug in the training loop"):
        cli.run_script(failing_run)
    with pytest.raises(SystemExit) as info:
        cli.run_script(bad_option)
    assert info.value.code == 2 and capsys.readouterr().err == "error: bad option\n"
