"""LightningCLI wiring shared by the recipes in ``recipes/``.

A recipe is one call::

    run_recipe(DetectionTask, COCODataModule, default_config="recipes/configs/coco_swin_demo.yaml")

which builds a :class:`lightning.pytorch.cli.LightningCLI` with ``run=False`` (so ``--help``,
``--print_config``, ``--config file.yaml`` and ``class_path``/``init_args`` all work), fits,
validates the best checkpoint (by the task's monitored metric), prints a table of the final
metrics, writes them to ``metrics.json`` in the run directory and returns them.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import inspect
import math
import os
import pathlib
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from vtdense.allocator import enabled_by_environment, keep_freed_memory
from vtdense.cli_validate import VALIDATE_WORD, numeric_metrics, run_validate, write_metrics_json
from vtdense.tasks.base import resolve_run_dir

__all__ = [
    "VtdenseCLI",
    "choose_config",
    "find_last_checkpoint",
    "is_distributed_checkpoint",
    "format_metrics_table",
    "resume_path",
    "check_resume_checkpoint",
    "check_backbone_weights",
    "check_shared_hparams",
    "run_dir",
    "run_predict",
    "run_recipe",
    "run_validate",
    "run_script",
]

#: The exceptions a user's options, files or paths raise before a run starts (Lightning raises
#: ``MisconfigurationException`` for trainer options that do not fit together).
_USER_ERRORS = (ValueError, TypeError, OSError, MisconfigurationException)


@contextlib.contextmanager
def before_run():
    """Mark the errors raised inside as the user's (bad options, missing files): raised before
    any training or prediction starts, :func:`run_script` prints them as one line."""
    try:
        yield
    except _USER_ERRORS as err:
        err.vtdense_before_run = True  # type: ignore[union-attr]
        raise


def run_script(main: Any) -> None:
    """Run a recipe's ``main()`` as a command: an error :func:`before_run` marked (a bad option, a
    missing file) prints ``error: <message>`` and exits with status 2, like an argparse error, instead
    of a traceback through Lightning and jsonargparse; any other exception propagates unchanged.

    First, unless ``VTDENSE_KEEP_FREED_MEMORY=0``, glibc is told to keep freed CPU memory in the
    process (:func:`vtdense.allocator.keep_freed_memory`): each step then reuses the memory the last
    one freed instead of faulting fresh pages in."""
    if enabled_by_environment():
        keep_freed_memory()
    try:
        main()
    except _USER_ERRORS as err:
        if not getattr(err, "vtdense_before_run", False):
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _close_option(name: str, options: list[str]) -> str | None:
    """The option in ``options`` that ``name`` most likely misspells, or ``None``."""
    found = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
    return found[0] if found else None


def suggest_option(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` (a parser error) with ``; did you mean --x?`` added where it names an option that
    does not exist and a known one is spelt almost the same (on the command line or in a YAML group)."""
    options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        guesses = [g for tok in unknown.group(1).split() if tok.startswith("--")
                   for g in [_close_option(tok.split("=", 1)[0], options)] if g]
        return message + (f"; did you mean {', '.join(guesses)}?" if guesses else "")
    grouped = re.match(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    if grouped:
        prefix = f"--{grouped.group(1)}."
        names = [o[len(prefix):] for o in options if o.startswith(prefix)]
        guess = _close_option(grouped.group(2), names)
        return message + (f"; did you mean '{guess}' ({prefix}{guess})?" if guess else "")
    return message


class _ShortErrorParser(LightningArgumentParser):
    """A recipe's parser whose errors skip the usage (several screens of options for a recipe) and
    say the closest option name instead (:func:`suggest_option`); ``--help`` still lists them all."""

    _in_error = False

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]  # noqa: ANN201
        self._in_error = True
        try:
            super().error(suggest_option(message, self), ex)
        finally:
            self._in_error = False

    def print_usage(self, *args: Any, **kwargs: Any) -> None:
        if not self._in_error:
            super().print_usage(*args, **kwargs)


class VtdenseCLI(LightningCLI):
    """LightningCLI with the defaults vtdense recipes share.

    The task owns its optimiser and schedule (``configure_optimizers``), so the CLI's automatic
    ``--optimizer`` / ``--lr_scheduler`` groups are turned off; the config written to the run
    directory may be overwritten by a re-run in the same directory. A bad option gets a short error
    that names it and the closest valid one, without the full usage.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", _ShortErrorParser)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        """``--ckpt_path``: resume fitting from a checkpoint, or ``last`` (the newest ``last.ckpt`` of the run)."""
        parser.add_argument(
            "--ckpt_path",
            type=Optional[str],
            default=None,
            help="Resume training from this checkpoint; 'last' resumes the newest run under default_root_dir "
            "from its last.ckpt (written every model.checkpoint_every_n_steps, at each validation and on SIGTERM), "
            "in the same run directory.",
        )

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Trainer:
        """``strategy: fsdp`` means vtdense's block-sharded FSDP2 (:func:`vtdense.strategies.trainer_options`)."""
        if config.get("strategy") == "fsdp":
            from vtdense.strategies import trainer_options

            config = trainer_options(config)
        return super()._instantiate_trainer(config, callbacks)


#: The run directory of a trainer (``trainer.log_dir`` or ``default_root_dir``); a collective under DDP.
run_dir = resolve_run_dir


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is the folder of a sharded checkpoint (``torch.distributed.checkpoint``: one
    file per rank and a ``.metadata`` file), as Lightning's model-parallel strategy writes with
    ``save_distributed_checkpoint=True`` (:class:`vtdense.strategies.VtdenseFSDPStrategy`)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def find_last_checkpoint(root: str | Path) -> Path | None:
    """The newest ``<root>/**/checkpoints/last.ckpt`` (by modification time), a file or the folder
    of a sharded checkpoint, or ``None``."""
    found = [p for p in Path(root).glob("**/checkpoints/last.ckpt") if p.is_file() or is_distributed_checkpoint(p)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resume_path(trainer: Trainer, ckpt_path: str | None) -> str | None:
    """Resolve ``--ckpt_path`` and, for ``last``, continue in the run directory it came from.

    ``last`` finds the newest ``last.ckpt`` under ``default_root_dir`` and points the trainer's
    logger at that run's version, so checkpoints, metrics and outputs keep one run directory
    (Lightning alone would open a new ``version_N`` and find no ``last.ckpt`` there). No
    ``last.ckpt`` at all means a fresh start (the first run of a requeued job script).

    Raises:
        FileNotFoundError: ``ckpt_path`` is a path that does not exist.
    """
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        if os.path.isdir(ckpt_path) and not is_distributed_checkpoint(ckpt_path):
            raise FileNotFoundError(f"--ckpt_path {ckpt_path!r} is a folder, but no sharded checkpoint (no .metadata in it)")
        if not os.path.isfile(ckpt_path) and not is_distributed_checkpoint(ckpt_path):
            raise FileNotFoundError(f"--ckpt_path {ckpt_path!r} does not exist")
        return ckpt_path
    last = find_last_checkpoint(trainer.default_root_dir)
    if last is None:
        print(f"--ckpt_path last: no last.ckpt under {trainer.default_root_dir}; starting a new run")
        return None
    version = last.parent.parent.name
    logger = trainer.logger
    if logger is not None and version.startswith("version_") and hasattr(logger, "_version"):
        logger._version = int(version[len("version_"):]) if version[8:].isdigit() else version
    if trainer.is_global_zero:
        print(f"resuming from {last}")
    return str(last)


#: Entries of a checkpoint a Lightning fit resumes from (``save_weights_only`` checkpoints lack the last two).
_RESUME_KEYS = ("state_dict", "optimizer_states", "loops")


def check_resume_checkpoint(path: str, model: LightningModule) -> None:
    """Refuse, before any training starts, a checkpoint a fit of ``model`` cannot resume from.

    The file is read with its tensors mapped, not loaded (cheap at any size), and each rank reads
    it on its own (no collective). A checkpoint is refused when it is cut short (an interrupted save
    or copy), is no ``torch.save`` file or holds code, holds weights only (``save_weights_only``, or
    a backbone file: ``model.backbone_weights`` is the option for those), or was written for another
    task, backbone, head or class count (``check_checkpoint_fits``, where the task has it).

    Raises:
        ValueError: naming ``--ckpt_path``, the file and the reason.
    """
    from vtdense.checkpoints.io import read_task_checkpoint

    if is_distributed_checkpoint(path):
        return  # each rank reads its own shard inside the fit; Lightning checks the folder there
    try:
        ckpt = read_task_checkpoint(path, mapped=True)
    except ValueError as err:
        raise ValueError(f"--ckpt_path: {err}") from None
    missing = [k for k in _RESUME_KEYS if k not in ckpt]
    if missing:
        raise ValueError(
            f"--ckpt_path: {path!r} cannot resume a fit: it has no {', '.join(missing)} (a checkpoint written with "
            "save_weights_only, or not by a Lightning fit); to start a new run from a backbone's weights use "
            "--model.backbone_weights"
        )
    fits = getattr(model, "check_checkpoint_fits", None)
    if fits is not None:
        try:
            fits(ckpt, path)
        except ValueError as err:
            raise ValueError(f"--ckpt_path: {err}") from None


def check_shared_hparams(trainer: Trainer, model: LightningModule, datamodule: LightningDataModule) -> None:
    """Refuse, before the run starts, an option that the task and the data module both take with
    different values (``--model.ignore_index -1`` with the data's 255): Lightning refuses it too,
    with a traceback, once the fit has started and it first logs the hyperparameters. The same
    comparison as Lightning's: a different type or value.

    Raises:
        ValueError: naming each such option and both values.
    """
    if not trainer.loggers or not getattr(model, "_log_hyperparams", False) or not getattr(datamodule, "_log_hyperparams", False):
        return
    mine, theirs = model.hparams_initial, datamodule.hparams_initial

    def same(a: Any, b: Any) -> bool:
        if type(a) is not type(b):
            return False
        return a is b if isinstance(a, torch.Tensor) else bool(a == b)

    differ = [k for k in sorted(set(mine) & set(theirs)) if k != "_class_path" and not same(mine[k], theirs[k])]
    if differ:
        both = "; ".join(f"--model.{k}={mine[k]!r} but --data.{k}={theirs[k]!r}" for k in differ)
        raise ValueError(f"{both}: the task and the data module take this option alike; give both the same value")


def check_backbone_weights(spec: str | os.PathLike) -> None:
    """``--model.backbone_weights`` found and whole, before the run starts
    (:func:`vtdense.checkpoints.convert.check_checkpoint_source`; a Hub id is fetched into the cache).

    Raises:
        ValueError: naming the option and the file or Hub id.
    """
    from vtdense.checkpoints.convert import check_checkpoint_source

    try:
        check_checkpoint_source(spec)
    except ValueError as err:
        raise ValueError(f"--model.backbone_weights: {err}") from None


#: Classes a vtdense checkpoint may hold besides tensors and plain values (a datamodule given a ``Path``).
_SAFE_CHECKPOINT_CLASSES = (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)


def fit_resumable(trainer: Trainer, model: LightningModule, datamodule: LightningDataModule, ckpt_path: str | None) -> None:
    """``trainer.fit``; a checkpoint to resume from is read with ``torch.load(weights_only=True)``
    (only tensors, plain values and ``pathlib`` paths), as every checkpoint from elsewhere should be."""
    kwargs: dict[str, Any] = {}
    if ckpt_path is not None and "weights_only" in inspect.signature(trainer.fit).parameters:
        kwargs["weights_only"] = True
    with torch.serialization.safe_globals(list(_SAFE_CHECKPOINT_CLASSES)):
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)


def format_metrics_table(metrics: dict[str, float], title: str = "final metrics") -> str:
    """Format ``{name: value}`` as a two-column text table."""
    if not metrics:
        return f"{title}: (no metrics)"
    width = max(len(k) for k in metrics)
    width = max(width, len("metric"))
    rule = "-" * (width + 14)
    lines = [title, rule, f"{'metric':<{width}}  {'value':>10}", rule]
    for key, value in metrics.items():
        text = "nan" if math.isnan(value) else f"{value:10.4f}"
        lines.append(f"{key:<{width}}  {text:>10}")
    lines.append(rule)
    return "\n".join(lines)


_DATA_FLAG = re.compile(r"--data\.(root|\w+_ann|\w+_images)(=|$)")


def choose_config(
    datamodule_cls: type[LightningDataModule], args: list[str], default_config: Path, demo_config: Path
) -> Path | None:
    """Which recipe config the command line builds on.

    - ``None`` when the command line has ``--config``: the user's file is the whole base, so
      nothing of another config leaks into it.
    - ``demo_config`` when the command line names no data (``--data.root``, ``--data.*_ann``,
      ``--data.*_images``) and the datamodule finds no dataset at its default location
      (``datamodule_cls.default_data_found()``).
    - ``default_config`` (the published recipe) otherwise.
    """
    if any(a == "--config" or a.startswith("--config=") for a in args):
        return None
    if any(_DATA_FLAG.match(a) for a in args):
        return default_config
    found = getattr(datamodule_cls, "default_data_found", None)
    if found is not None and found():
        return default_config
    return demo_config


#: The first word that names training explicitly, as in LightningCLI (``fit`` or nothing: the recipe trains).
FIT_WORD = "fit"
#: LightningCLI subcommands a recipe does not have, and what to run instead.
_NOT_SUBCOMMANDS = {
    "test": "'test' is not a subcommand of the recipes: 'validate --ckpt_path CKPT' scores a checkpoint on a labelled "
            "split (its --data.* options name another split, e.g. a labelled test set); 'predict' runs it on images",
}


def run_recipe(
    task_cls: type[LightningModule],
    datamodule_cls: type[LightningDataModule],
    default_config: str | Path | None = None,
    args: list[str] | None = None,
    *,
    demo_config: str | Path | None = None,
) -> dict[str, float]:
    """Parse the command line, fit, validate the best checkpoint and report its metrics.

    Args:
        task_cls: the LightningModule class (its ``__init__`` arguments become ``--model.*``).
        datamodule_cls: the LightningDataModule class (``--data.*``).
        default_config: YAML file loaded before the command line (the recipe's defaults);
            ``--config other.yaml`` and individual flags override it.
        args: command-line arguments; ``None`` reads ``sys.argv``.
        demo_config: a small CPU config used instead of ``default_config`` when the command line
            names no data and none is found at the default location; with ``--config`` on the
            command line neither is loaded (see :func:`choose_config`).

    Returns:
        The final validation metrics of the best checkpoint (last weights when no checkpoint
        was saved, e.g. with ``--trainer.fast_dev_run``), ``{name: float}``.

    Raises:
        FileNotFoundError: ``default_config`` does not exist.

    A first argument ``predict`` runs :func:`run_predict` instead (``... predict --help``), and
    ``validate`` :func:`vtdense.cli_validate.run_validate` (a checkpoint scored on a dataset); ``fit``
    (LightningCLI's word) is the default, training; ``test`` is one clear error naming ``validate``.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == FIT_WORD:  # LightningCLI's name for what the recipe does with no subcommand
        argv = args = argv[1:]
    if argv and argv[0] in _NOT_SUBCOMMANDS:
        with before_run():
            raise ValueError(_NOT_SUBCOMMANDS[argv[0]])
    if argv and argv[0] == PREDICT_WORD:  # the predict subcommand (see run_predict)
        return run_predict(task_cls, argv[1:], prog=f"{Path(sys.argv[0]).name} {PREDICT_WORD}")
    if argv and argv[0] == VALIDATE_WORD:  # the validate subcommand (see vtdense.cli_validate)
        return run_validate(task_cls, datamodule_cls, argv[1:], prog=f"{Path(sys.argv[0]).name} {VALIDATE_WORD}")
    with before_run():  # parsing and building the task, the datamodule and the trainer
        cli = _build_cli(task_cls, datamodule_cls, default_config, args, demo_config)
    trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule

    with before_run():  # a missing, damaged or unfitting --ckpt_path: one line, before the run starts
        resume = resume_path(trainer, cli.config.get("ckpt_path"))
        if resume is not None:
            check_resume_checkpoint(resume, model)
        weights = (getattr(model, "hparams", None) or {}).get("backbone_weights")
        if weights is not None:
            check_backbone_weights(weights)
        check_shared_hparams(trainer, model, datamodule)
    fit_resumable(trainer, model, datamodule, resume)

    ckpt_path: str | None = None
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and not trainer.fast_dev_run:
        best = callback.best_model_path or callback.last_model_path
        if best and (os.path.isfile(best) or is_distributed_checkpoint(best)):
            ckpt_path = best
    # every rank validates the same checkpoint (rank 0's view of the file system decides)
    ckpt_path = trainer.strategy.broadcast(ckpt_path)
    results = trainer.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)

    metrics = numeric_metrics(results)
    out_dir = resolve_run_dir(trainer)  # a collective under DDP: every rank, before the rank-0 branch
    if trainer.is_global_zero:
        write_metrics_json(out_dir, metrics, checkpoint=ckpt_path)
        print(format_metrics_table(metrics, title=f"final metrics ({ckpt_path or 'last weights'})"))
        print(describe_run_dir(out_dir))
    return metrics


def _build_cli(
    task_cls: type[LightningModule],
    datamodule_cls: type[LightningDataModule],
    default_config: str | Path | None,
    args: list[str] | None,
    demo_config: str | Path | None,
) -> VtdenseCLI:
    """The recipe's :class:`VtdenseCLI` (parsed, task / datamodule / trainer built, nothing run)."""
    prog = Path(sys.argv[0]).name
    parser_kwargs: dict[str, Any] = {"description": (
        f"Fit, then validate the best checkpoint (the options below). Two subcommands use a trained checkpoint: "
        f"'{prog} {VALIDATE_WORD} --ckpt_path CKPT' scores it on a dataset, and "
        f"'{prog} {PREDICT_WORD} --ckpt_path CKPT --data.predict_path IMAGES' predicts on images "
        f"(each with its own --help)."
    )}
    if demo_config is not None and default_config is not None:
        argv = sys.argv[1:] if args is None else list(args)
        chosen = choose_config(datamodule_cls, argv, Path(default_config), Path(demo_config))
        if chosen == Path(demo_config):
            print(f"config: CPU demo {Path(demo_config).name} "
                  f"(pass --data.root for the published recipe, {Path(default_config).name})")
        default_config = chosen
    if default_config is not None:
        default_config = Path(default_config)
        if not default_config.is_file():
            raise FileNotFoundError(f"default_config {str(default_config)!r} does not exist")
        parser_kwargs["default_config_files"] = [str(default_config)]
    return VtdenseCLI(task_cls, datamodule_cls, run=False, args=args, parser_kwargs=parser_kwargs)


def describe_run_dir(out_dir: Path) -> str:
    """``run directory: PATH`` and what is in it (files, and folders with their file counts)."""
    lines = [f"run directory: {out_dir}"]
    for entry in sorted(out_dir.iterdir(), key=lambda e: (e.is_dir(), e.name)):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            files = sorted(f.name for f in entry.iterdir() if f.is_file())
            shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
            lines.append(f"  {entry.name}/  ({len(files)} files: {shown})")
        else:
            lines.append(f"  {entry.name}")
    return "\n".join(lines)


# ================================================================================================
# ``predict`` subcommand (issue 11): ``python recipes/x.py predict --ckpt_path ... --data.predict_path ...``
# ================================================================================================
PREDICT_WORD = "predict"
#: ``--device`` choice -> Lightning accelerator.
DEVICES: dict[str, str] = {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}


def _yaml_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def predict_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The options of the ``predict`` subcommand."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Predict with a trained checkpoint on an image, a folder of images or a glob. The model and "
        "its preprocessing are rebuilt from the checkpoint; outputs go to a new predict_<time> folder in "
        "the checkpoint's run directory unless --output is given.",
    )
    p.add_argument("--ckpt_path", required=True, help="checkpoint of a run of this recipe (e.g. RUN/checkpoints/best-....ckpt)")
    p.add_argument("--data.predict_path", dest="predict_path", required=True,
                   help="an image, a folder of images, a glob such as 'photos/*.jpg' (quote it), or (detection) a COCO "
                   "JSON file listing images, e.g. image_info_test-dev2017.json: results.json then has its image ids")
    p.add_argument("--data.predict_images", dest="predict_images", default=None,
                   help="with a COCO JSON --data.predict_path: the folder its file_name entries are relative to")
    p.add_argument("--output", default=None, help="output folder (default: RUN/predict_<YYYYmmdd-HHMMSS>)")
    p.add_argument("--score_thresh", type=float, default=None,
                   help="detection: keep detections scoring above this (default 0.5; with a COCO JSON file, the "
                   "model's own score_thresh, as validation: 0.05 in the recipes)")
    p.add_argument("--device", choices=sorted(DEVICES), default="auto", help="where the model runs (default auto)")
    p.add_argument("--devices", type=int, default=1, help="number of devices (several: DDP, each writes its share)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (bf16-mixed precision)")
    p.add_argument("--data.batch_size", dest="batch_size", type=int, default=1, help="images per batch (default 1)")
    p.add_argument("--data.num_workers", dest="num_workers", type=int, default=2, help="decoding workers (default 2)")
    p.add_argument("--data.test_scale", dest="test_scale", type=int, default=None,
                   help="detection: short side (default: the checkpoint's datamodule test_scale)")
    p.add_argument("--data.max_size", dest="max_size", type=int, default=None,
                   help="detection: long-side cap (default: the checkpoint's datamodule max_size)")
    p.add_argument("--data.test_scales", dest="test_scales", type=_yaml_value, default=None,
                   help="detection: test-time augmentation, short sides of the views, e.g. '[400, 600, 800, 1000, 1200]' "
                   "(default: the checkpoint's validation setting)")
    p.add_argument("--data.test_flip", dest="test_flip", type=_yaml_value, default=None,
                   help="detection: true adds horizontally flipped views (default: the checkpoint's)")
    p.add_argument("--data.test_max_size", dest="test_max_size", type=int, default=None,
                   help="detection: with --data.test_scales, the long-side cap of the views (detectron2: 4000; "
                   "default: the checkpoint's, else --data.max_size)")
    p.add_argument("--size_divisibility", type=int, default=None,
                   help="detection: pad images to a multiple of this (default: the checkpoint's, 32); a coarser grid "
                   "such as 128 bounds the distinct shapes of images of many sizes")
    p.add_argument("--data.eval_scale", dest="eval_scale", type=_yaml_value, default=None,
                   help="segmentation: (long, short) resize, e.g. '[2048, 512]' (default: the checkpoint's)")
    p.add_argument("--data.eval_ratios", dest="eval_ratios", type=_yaml_value, default=None,
                   help="segmentation: multi-scale test-time augmentation, multiples of the resize, e.g. "
                   "'[0.5, 0.75, 1.0, 1.25, 1.5, 1.75]' (default: the checkpoint's validation setting)")
    p.add_argument("--data.eval_flip", dest="eval_flip", type=_yaml_value, default=None,
                   help="segmentation: true adds horizontally flipped views (default: the checkpoint's)")
    p.add_argument("--compile_backbone", type=_yaml_value, default=False,
                   help="torch.compile the backbone for all image sizes: false (default, even for a checkpoint trained "
                   "compiled), true (inductor) or a backend name; pays off on a GPU over many images")
    p.add_argument("--progress_bar", type=_yaml_value, default=True, help="show the progress bar (default true)")
    return p


def _check_output_folder(output: str) -> None:
    """Raise :class:`NotADirectoryError` naming ``--output`` when ``output`` (or a folder above it) is
    an existing file: the outputs are written into a folder, checked before the model runs."""
    out = Path(output).expanduser()
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker == out:
        raise NotADirectoryError(f"--output {output} is a file; it must be a folder (new or existing) for the predictions")
    if blocker is not None:
        raise NotADirectoryError(f"--output {output} cannot be a folder: {blocker} is a file")


def run_predict(task_cls: type[LightningModule], args: list[str], prog: str | None = None) -> dict[str, Any]:
    """The ``predict`` subcommand: checkpoint + images -> drawn PNGs / label maps and a JSON index.

    Everything a user can get wrong (a missing checkpoint or path, a non-image file, an empty
    folder, an option of the other task or out of range, an ``--output`` that is a file) raises
    before the model runs. Under several devices each rank writes its own images' files and rank 0
    the JSON index (see :class:`vtdense.tasks.predict.PredictionWriter`).

    Returns:
        ``{"output_dir": str, "images": int, "files": [index files]}``.
    """
    import inspect

    from torch.utils.data import DataLoader

    from vtdense.data.ade20k import check_eval_ratios
    from vtdense.data.coco import category_tables
    from vtdense.data.predict import (
        PredictImages,
        check_eval_scale,
        collate_predict,
        first_names,
        list_coco_images,
        list_images,
    )
    from vtdense.data.transforms import check_test_scales
    from vtdense.models.compile import check_compile_option
    from vtdense.tasks.predict import PredictionWriter, default_output_dir

    with before_run():  # everything a user can get wrong, checked before the model runs
        ns = predict_parser(prog).parse_args(args)
        if not Path(ns.ckpt_path).expanduser().exists():
            raise FileNotFoundError(f"--ckpt_path: checkpoint not found: {ns.ckpt_path}")
        if ns.batch_size < 1 or ns.num_workers < 0 or ns.devices < 1:
            raise ValueError("--data.batch_size and --devices must be >= 1, --data.num_workers >= 0")
        if ns.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available (use --device cpu or auto)")
        if ns.output:
            _check_output_folder(ns.output)
        compile_backend = check_compile_option(ns.compile_backbone, "--compile_backbone")
        coco_file = str(ns.predict_path).lower().endswith(".json")
        if coco_file:  # the images a COCO file lists, with its image ids (a test-dev submission)
            if ns.predict_images is None:
                raise ValueError(f"--data.predict_path {ns.predict_path} is a COCO JSON file: give --data.predict_images, "
                                 "the folder its file_name entries are relative to")
            files, coco_categories = list_coco_images(ns.predict_path, ns.predict_images)
        elif ns.predict_images is not None:
            raise ValueError("--data.predict_images applies only to a COCO JSON --data.predict_path")
        else:
            files = list_images(ns.predict_path)
        task: Any = task_cls.from_checkpoint(ns.ckpt_path, map_location="cpu", compile_backbone=compile_backend or False)
        if coco_file:
            if not hasattr(task, "label_to_category_id"):
                raise ValueError(f"a COCO JSON --data.predict_path applies to detection checkpoints, not a {type(task).__name__} one")
            if coco_categories:  # its category ids must be the ones the model predicts
                task.check_data_fits(category_tables(coco_categories), ns.ckpt_path)

        given = {k: getattr(ns, k) for k in ("test_scale", "max_size", "eval_scale", "eval_ratios", "eval_flip",
                                             "test_scales", "test_flip", "test_max_size") if getattr(ns, k) is not None}
        accepted = inspect.signature(task.predict_transform).parameters
        wrong = [f"--data.{k}" for k in given if k not in accepted]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} does not apply to a {type(task).__name__} checkpoint")
        for k in ("test_scale", "max_size", "test_max_size"):
            if k in given and given[k] <= 0:
                raise ValueError(f"--data.{k} must be a positive int, got {given[k]}")
        if "eval_scale" in given:
            check_eval_scale(given["eval_scale"], "--data.eval_scale")
        if "eval_ratios" in given:
            check_eval_ratios(given["eval_ratios"], "--data.eval_ratios")
        if "test_scales" in given:
            check_test_scales(given["test_scales"], "--data.test_scales")
        for k in ("eval_flip", "test_flip"):
            if k in given and not isinstance(given[k], bool):
                raise ValueError(f"--data.{k} must be true or false, got {given[k]!r}")
        has_threshold = hasattr(task, "score_threshold")
        if ns.score_thresh is not None and not has_threshold:
            raise ValueError(f"--score_thresh does not apply to a {type(task).__name__} checkpoint")
        score_thresh = (0.5 if ns.score_thresh is None else ns.score_thresh) if has_threshold else None
        if coco_file and ns.score_thresh is None:
            score_thresh = float(task.hparams["score_thresh"])  # as validation keeps them, for COCO's scoring
        if score_thresh is not None and not 0.0 <= score_thresh <= 1.0:
            raise ValueError(f"--score_thresh must be in [0, 1], got {score_thresh}")
        if ns.size_divisibility is not None:
            if not hasattr(task, "set_size_divisibility"):
                raise ValueError(f"--size_divisibility does not apply to a {type(task).__name__} checkpoint")
            task.set_size_divisibility(ns.size_divisibility)

        dataset = PredictImages(files, task.predict_transform(**given))
        loader = DataLoader(dataset, batch_size=ns.batch_size, num_workers=ns.num_workers, collate_fn=collate_predict)
        out_dir = Path(ns.output).expanduser() if ns.output else default_output_dir(ns.ckpt_path)
        info: dict[str, Any] = {"checkpoint": str(Path(ns.ckpt_path).expanduser().resolve()), "predict_path": ns.predict_path}
        if ns.predict_images is not None:
            info["predict_images"] = ns.predict_images
        if score_thresh is not None:
            info["score_thresh"] = score_thresh
        if ns.size_divisibility is not None:
            info["size_divisibility"] = ns.size_divisibility
        info["preprocessing"] = {k: v for k, v in (task.datamodule_hparams or {}).items()
                                 if k in ("test_scale", "max_size", "scale", "eval_scale", "eval_ratios", "eval_flip",
                                          "test_scales", "test_flip", "test_max_size")} | given
        writer = PredictionWriter(out_dir, info)
        trainer = Trainer(
            accelerator=DEVICES[ns.device],
            devices=ns.devices,
            precision="bf16-mixed" if ns.bf16 else "32-true",
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=bool(ns.progress_bar),
            callbacks=[writer],
            default_root_dir=str(out_dir),
        )
    context = task.score_threshold(score_thresh) if has_threshold else contextlib.nullcontext()
    with context:
        trainer.predict(task, dataloaders=loader, return_predictions=False)
    out_dir = writer.output_dir
    if trainer.is_global_zero:
        subdirs = sorted({p.parent.relative_to(out_dir).as_posix() for p in out_dir.rglob("*.png")})
        print(f"predicted {writer.count} images with {ns.ckpt_path}")
        if writer.skipped:
            print(f"skipped {len(writer.skipped)} images that could not be decoded (listed under 'skipped' in the index): "
                  + first_names(writer.skipped))
        print(f"output directory: {out_dir}")
        for sub in subdirs:
            print(f"  {sub}/  ({sum(1 for _ in (out_dir / sub).glob('**/*.png'))} PNG)")
        for f in writer.files:
            print(f"  {f.relative_to(out_dir)}")
    return {"output_dir": str(out_dir), "images": writer.count, "skipped": list(writer.skipped),
            "files": [str(f) for f in writer.files]}
