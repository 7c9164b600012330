"""Fine-tune a backbone checkpoint at a larger window and image size, for segmentation or detection.

With no arguments this shows the whole path on the CPU with built-in synthetic data:

1. a small Swin V2 UPerNet is trained from scratch at window 8 on 128 px crops;
2. its backbone is saved (``vtdense.save_backbone``: safetensors with the config);
3. a new UPerNet is built at window 16 on 256 px crops from that file, with
   ``pretrained_window_size=8`` and layer-wise lr decay, and fine-tuned;
4. the validation mIoU before (stage 1) and after (stage 3) is printed.

With arguments it is the segmentation or detection recipe with the checkpoint load reported
(what was mapped, resized and dropped, and why)::

    python recipes/finetune_highres.py --task segmentation --data.root /data/ade20k \\
        --model.backbone swinv2_tiny --model.backbone_weights timm/swinv2_tiny_window8_256.ms_in1k \\
        --model.backbone_kwargs '{window_size: 16, pretrained_window_size: 8, drop_path_rate: 0.3}' \\
        --model.layer_decay 0.9 --trainer.devices 8 --trainer.precision bf16-mixed
    python recipes/finetune_highres.py --task detection --data.root /data/coco \\
        --model.backbone swin_tiny --model.backbone_weights timm/swin_tiny_patch4_window7_224.ms_in1k \\
        --model.backbone_kwargs '{window_size: 12, drop_path_rate: 0.2}' --model.layer_decay 0.9

``--task`` picks the task, datamodule and published base config (``ade20k_swinv2_t_upernet_160k.yaml``
or ``coco_swin_t_maskrcnn_1x.yaml``); every other flag is the task's / datamodule's / trainer's
(``--help``). ``--model.backbone_weights`` takes any format ``vtdense.load_pretrained`` reads, or a
Hugging Face Hub id.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see ade20k_swinv2.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import yaml  # noqa: E402

import vtdense  # noqa: E402
from vtdense.backbones.swin import log_cpb_windows  # noqa: E402
from vtdense.cli import run_recipe, run_script  # noqa: E402

__all__ = ["DEMO_CONFIG", "FINETUNE_OVERRIDES", "demo", "main", "show_checkpoint_reports"]

CONFIGS = Path(__file__).resolve().parent / "configs"
#: Stage 1 of the demo (window 8, 128 px); stage 2 applies FINETUNE_OVERRIDES on top of it.
DEMO_CONFIG = CONFIGS / "finetune_highres_demo.yaml"
#: Stage 2 of the demo: window 16 from a window-8 checkpoint, 256 px crops, layer-wise lr decay;
#: :func:`demo` adds the ``pretrained_window_size`` per stage that stage 1's crops trained with.
FINETUNE_OVERRIDES: dict[str, Any] = {
    "model.backbone_kwargs": {
        "embed_dim": 32, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8],
        "window_size": 16, "drop_path_rate": 0.1,
    },
    "model.layer_decay": 0.75,
    "model.lr": 0.0005,
    "model.warmup_steps": 10,
    "data.scale": [384, 256],
    "data.crop_size": [256, 256],
    "data.eval_scale": [384, 256],
    "data.batch_size": 4,
    "trainer.max_epochs": 3,
    "trainer.check_val_every_n_epoch": 3,
}

_TASKS = {
    "segmentation": ("vtdense.tasks.segmentation:SegmentationTask", "vtdense.data.ade20k:ADE20KDataModule", "ade20k_swinv2_t_upernet_160k.yaml"),
    "detection": ("vtdense.tasks.detection:DetectionTask", "vtdense.data.coco:COCODataModule", "coco_swin_t_maskrcnn_1x.yaml"),
}


def show_checkpoint_reports() -> None:
    """Print every checkpoint load report (``vtdense.checkpoints`` logger) on rank 0."""
    logger = logging.getLogger("vtdense.checkpoints")
    if any(getattr(h, "_vtdense_recipe", False) for h in logger.handlers):
        return
    class _Stdout(logging.Handler):  # the current sys.stdout at each record (it may be swapped)
        def emit(self, record: logging.LogRecord) -> None:
            print(self.format(record), flush=True)

    handler = _Stdout()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda record: os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0")
    handler._vtdense_recipe = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _load(spec: str) -> type:
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _flags(overrides: dict[str, Any]) -> list[str]:
    out = []
    for key, value in overrides.items():
        out += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return out


def _latest_run(root: Path) -> Path:
    runs = sorted(root.glob("lightning_logs/version_*"), key=lambda p: int(p.name.split("_")[1]))
    if not runs:
        raise FileNotFoundError(f"no run directory under {root}")
    return runs[-1]


def demo(
    workdir: str | Path = "runs/finetune_highres_demo",
    *,
    data_root: str | Path | None = None,
    pretrain_overrides: dict[str, Any] | None = None,
    finetune_overrides: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Pre-train at window 8 / 128 px, save the backbone, fine-tune at window 16 / 256 px.

    Args:
        workdir: where both runs and the saved backbone go.
        data_root: an ADE20K-layout folder; ``None`` uses (and on first use generates) the
            synthetic set in the vtdense cache.
        pretrain_overrides: extra ``{"section.option": value}`` flags for stage 1 (tests shorten it).
        finetune_overrides: extra flags for stage 2, on top of :data:`FINETUNE_OVERRIDES`.

    Returns:
        ``{"before": mIoU of stage 1, "after": mIoU of stage 2}`` on the validation split.
    """
    from vtdense.data.ade20k import ADE20KDataModule
    from vtdense.tasks.segmentation import SegmentationTask

    show_checkpoint_reports()
    workdir = Path(workdir)
    common = {"data.root": str(data_root)} if data_root is not None else {}
    stage1 = {**common, "trainer.default_root_dir": str(workdir / "pretrain"), **(pretrain_overrides or {})}
    print("== stage 1: train at window 8 on 128 px crops")
    before = run_recipe(SegmentationTask, ADE20KDataModule, DEMO_CONFIG, args=_flags(stage1))["val/mIoU"]

    # Save the backbone of the best stage-1 checkpoint as a standalone file.
    run = _latest_run(workdir / "pretrain")
    checkpoint = json.loads((run / "metrics.json").read_text())["checkpoint"]
    config = yaml.safe_load(DEMO_CONFIG.read_text())["model"]
    kwargs = {**config["backbone_kwargs"], **(stage1.get("model.backbone_kwargs") or {})}
    backbone = vtdense.create_backbone(config["backbone"], **kwargs)
    vtdense.load_pretrained(backbone, checkpoint, log=False)  # a vtdense task checkpoint: the backbone part
    saved = vtdense.save_backbone(backbone, workdir / "backbone_window8_128px.safetensors")
    print(f"saved the stage-1 backbone (window 8) to {saved}")

    stage2 = {
        **common,
        **FINETUNE_OVERRIDES,
        "model.backbone_weights": str(saved),
        "trainer.default_root_dir": str(workdir / "finetune"),
        **(finetune_overrides or {}),
    }
    # Swin V2's Log-CPB coordinates were normalised by the windows stage 1 trained with: window 8,
    # shrunk to the map at the stages its crops made smaller than 8 (the last one at 128 px)
    crop = stage1.get("data.crop_size") or yaml.safe_load(DEMO_CONFIG.read_text())["data"]["crop_size"]
    tuned = dict(stage2["model.backbone_kwargs"])
    if "pretrained_window_size" not in tuned:
        windows = log_cpb_windows(kwargs["window_size"], crop, num_stages=len(tuned.get("depths", kwargs["depths"])))
        tuned["pretrained_window_size"] = [list(w) for w in windows]
        stage2["model.backbone_kwargs"] = tuned
    print("== stage 2: fine-tune at window 16 on 256 px crops from the saved backbone")
    after = run_recipe(SegmentationTask, ADE20KDataModule, DEMO_CONFIG, args=_flags(stage2))["val/mIoU"]
    verdict = "better" if after > before else "NOT better"
    print(f"validation mIoU before (window 8, 128 px): {before:.4f}\nvalidation mIoU after (window 16, 256 px): {after:.4f} ({verdict})")
    return {"before": before, "after": after}


def main(args: list[str] | None = None) -> dict[str, float]:
    """Run the demo (no arguments) or the fine-tuning recipe (``--task`` and CLI flags)."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv:
        return demo()
    task = "segmentation"
    if "--task" in argv:
        i = argv.index("--task")
        task = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
    elif any(a.startswith("--task=") for a in argv):
        i = next(j for j, a in enumerate(argv) if a.startswith("--task="))
        task = argv.pop(i).split("=", 1)[1]
    if task not in _TASKS:
        raise SystemExit(f"--task must be one of {', '.join(_TASKS)}, got {task!r}")
    task_cls, dm_cls, config = _TASKS[task]
    show_checkpoint_reports()
    default = None if any(a == "--config" or a.startswith("--config=") for a in argv) else CONFIGS / config
    if args is None:  # from the command line, less --task: LightningCLI reads it there (given both, it warns)
        sys.argv[1:] = argv
        return run_recipe(_load(task_cls), _load(dm_cls), default)
    return run_recipe(_load(task_cls), _load(dm_cls), default, args=argv)


if __name__ == "__main__":
    run_script(main)
