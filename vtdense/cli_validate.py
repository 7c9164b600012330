"""The recipes' ``validate`` subcommand: score a trained checkpoint on a dataset, without training.

::

    python recipes/coco_swin.py validate --ckpt_path RUN/checkpoints/best-....ckpt --data.root /data/coco
    python recipes/ade20k_swinv2.py validate --ckpt_path best.ckpt --data.root /data/ADEChallengeData2016 --devices 8

What detectron2's ``--eval-only``, mmdetection's ``tools/test.py`` and Lightning's ``validate`` do: the
model is rebuilt from the hyperparameters saved in the checkpoint (read with
``torch.load(weights_only=True)``), the data module from the checkpoint's data options with any
``--data.*`` given on the command line in their place, and the trainer runs one validation epoch.
The metrics are printed as a table and written, with the task's own files (COCO results JSON,
per-class IoU, drawn predictions), to a new ``validate_<time>/`` folder in the checkpoint's run
directory (or ``--output``).

Everything a user can get wrong (a missing or damaged checkpoint, a misspelt or mistyped option,
data that is not there, data with other classes than the checkpoint's) is one error before the
model runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from vtdense.tasks.base import atomic_write_bytes, resolve_run_dir

__all__ = ["VALIDATE_WORD", "numeric_metrics", "run_validate", "validate_parser", "write_metrics_json"]

VALIDATE_WORD = "validate"


def validate_parser(task_cls: type[LightningModule], datamodule_cls: type[LightningDataModule], prog: str | None = None) -> Any:
    """The options of the ``validate`` subcommand (a jsonargparse parser: typed ``--data.*`` and
    ``--model.*`` options, ``--data CONFIG.yaml``)."""
    from jsonargparse import ArgumentParser

    from vtdense.cli import DEVICES

    p = ArgumentParser(
        prog=prog,
        description="Score a trained checkpoint on a dataset's validation split. The model is rebuilt from the "
        "checkpoint; the data options default to the checkpoint's (--data.* replaces them: --data.root for "
        "data at another place, --data.val_ann/--data.val_images for another split). Only --model options that "
        "do not change the network's shapes apply (e.g. --model.score_thresh).",
    )
    p.add_argument("--ckpt_path", type=str, required=True, help="checkpoint of a run of this recipe")
    p.add_argument("--output", type=str | None, default=None, help="output folder (default: RUN/validate_<YYYYmmdd-HHMMSS>)")
    p.add_argument("--device", type=str, choices=sorted(DEVICES), default="auto", help="where the model runs")
    p.add_argument("--devices", type=int, default=1, help="number of devices (several: DDP, the metric over all images)")
    p.add_argument("--bf16", type=bool, default=False, help="bfloat16 autocast (bf16-mixed precision)")
    p.add_argument("--progress_bar", type=bool, default=True, help="show the progress bar")
    p.add_class_arguments(datamodule_cls, "data", sub_configs=True)
    p.add_class_arguments(task_cls, "model", sub_configs=True)
    return p


def numeric_metrics(results: list[dict[str, Any]]) -> dict[str, float]:
    """``{name: float}`` of what ``trainer.validate`` returned: scalars and one-element tensors."""
    import torch

    metrics: dict[str, float] = {}
    for result in results:
        for key, value in result.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.item()
            if isinstance(value, (int, float)):
                metrics[key] = float(value)
    return metrics


def write_metrics_json(out_dir: Path, metrics: dict[str, float], **extra: Any) -> Path:
    """Write ``out_dir/metrics.json`` (rank 0; no collective): ``extra`` and ``metrics``, merged into
    what the task wrote there (per-class IoU). NaN (a class absent from the data) is written as null."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.json"
    payload: dict[str, Any] = {}
    if path.is_file():  # keep what the task wrote there (e.g. per-class IoU)
        try:
            payload = json.loads(path.read_text())
        except ValueError:
            payload = {}
    payload.update(extra)
    payload["metrics"] = {k: None if math.isnan(v) else v for k, v in metrics.items()}
    atomic_write_bytes(path, (json.dumps(payload, indent=2, allow_nan=False, default=str) + "\n").encode("utf-8"))
    return path


def _datamodule_options(datamodule_cls: type[LightningDataModule], saved: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's data options (those the class still takes) with the command line's in their place."""
    import inspect

    params = inspect.signature(datamodule_cls.__init__).parameters
    options = {k: v for k, v in saved.items() if k in params}
    options.update(given)
    return options


def run_validate(
    task_cls: type[LightningModule], datamodule_cls: type[LightningDataModule], args: list[str], prog: str | None = None
) -> dict[str, float]:
    """The ``validate`` subcommand: checkpoint + data -> metrics (table, ``metrics.json``, the task's files).

    Args:
        task_cls: the recipe's task class (the checkpoint must be one of it).
        datamodule_cls: the recipe's data module class; its ``for_evaluation`` constructor is used
            where it has one (COCO: the training split need not exist).
        args: the command line after ``validate``.
        prog: the program name in the usage line.

    Returns:
        ``{metric: value}`` as logged by the task's validation (``val/bbox_mAP``, ``val/mIoU``, ...).

    Raises:
        FileNotFoundError, ValueError: before the model runs, naming the file or option.
    """
    from vtdense.cli import DEVICES, _check_output_folder, before_run, describe_run_dir, format_metrics_table
    from vtdense.models.compile import check_compile_option
    from vtdense.tasks.predict import default_output_dir

    with before_run():
        parser = validate_parser(task_cls, datamodule_cls, prog)
        ns = parser.parse_args(args, defaults=False)  # only what was given; the checkpoint has the rest
        ckpt = str(ns.ckpt_path)
        device = getattr(ns, "device", None) or "auto"
        devices = int(getattr(ns, "devices", None) or 1)
        output = getattr(ns, "output", None)
        if not Path(ckpt).expanduser().exists():  # a folder: one error from from_checkpoint
            raise FileNotFoundError(f"--ckpt_path: checkpoint not found: {ckpt}")
        if devices < 1:
            raise ValueError("--devices must be >= 1")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda but no CUDA device is available (use --device cpu or auto)")
        if output:
            _check_output_folder(output)
        given = ns.as_dict()
        model_given, data_given = ({k: v for k, v in (given.get(group) or {}).items() if not k.startswith("__")}
                                   for group in ("model", "data"))  # "__path__": a --data CONFIG.yaml
        model_given["compile_backbone"] = check_compile_option(model_given.get("compile_backbone", False), "--model.compile_backbone") or False
        task: Any = task_cls.from_checkpoint(ckpt, map_location="cpu", **model_given)
        if not task.datamodule_hparams and not data_given:  # else a default location, or synthetic data, would be scored
            raise ValueError(f"checkpoint {ckpt} holds no data options (it was not trained with a vtdense data module): "
                             "say where the data is, e.g. --data.root DIR")
        options = _datamodule_options(datamodule_cls, task.datamodule_hparams or {}, data_given)
        make = getattr(datamodule_cls, "for_evaluation", datamodule_cls)
        try:
            datamodule = make(**options)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--data: {err}") from None
        task.check_data_fits(datamodule, ckpt)
        out_dir = Path(output).expanduser() if output else default_output_dir(ckpt, "validate")
        trainer = Trainer(
            accelerator=DEVICES[device],
            devices=devices,
            precision="bf16-mixed" if getattr(ns, "bf16", False) else "32-true",
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=bool(getattr(ns, "progress_bar", True)),
            default_root_dir=str(out_dir),
        )
    metrics = numeric_metrics(trainer.validate(task, datamodule=datamodule, verbose=False))
    out_dir = resolve_run_dir(trainer)  # a collective under DDP: every rank, before the rank-0 branch
    if trainer.is_global_zero:
        data = {k: v for k, v in options.items() if v is not None}
        write_metrics_json(out_dir, metrics, checkpoint=str(Path(ckpt).expanduser().resolve()), data=data)
        print(format_metrics_table(metrics, title=f"metrics of {ckpt}"))
        print(describe_run_dir(out_dir))
    return metrics
