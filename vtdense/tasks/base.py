"""The base every vtdense task shares: build hooks, checkpoints, and DDP-safe evaluation outputs.

A task (:class:`~vtdense.tasks.detection.DetectionTask`,
:class:`~vtdense.tasks.segmentation.SegmentationTask`) fills in three hooks, in the manner of
torchgeo's ``BaseTask``:

- :meth:`BaseTask.configure_models` builds ``self.model`` from the hyperparameters;
- :meth:`BaseTask.configure_losses` builds loss modules (may do nothing);
- :meth:`BaseTask.configure_metrics` builds torchmetrics objects.

The base owns what every task needs to run on several processes:

- **The run directory** is resolved once, in :meth:`setup`, on every rank (``trainer.log_dir``
  is a broadcast under DDP, so it must never be read in rank-0-only code). :attr:`run_dir`
  then reads the cached path.
- **Evaluation samples counted once.** Lightning's ``DistributedSampler`` pads an evaluation
  set by repeating samples so every rank gets the same count. :meth:`eval_keep` tells, for
  each sample of an evaluation batch, whether it is a real sample or such a repeat, so that
  metrics count every sample exactly once.
- **Gathering** (:meth:`gather`) is a collective: every rank calls it.
- **Writing** (:meth:`write_text`, :meth:`write_image`, :meth:`log_image`) happens on rank 0
  only and calls no collective; files are written atomically (temporary file, then rename).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DistributedSampler

from vtdense.backbones.base import Backbone
from vtdense.data.errors import SKIP_REPORT_NAME, read_skip_report, write_skip_report
from vtdense.distributed import destroy_process_group_at_exit
from vtdense.files import temp_path_beside
from vtdense.layers.mlp import DEFAULT_RECOMPUTE_MIN_BYTES, set_activation_recompute
from vtdense.layers.scoped import is_auto_switch
from vtdense.layers.triton_window_attention import set_triton_window_attention
from vtdense.models.compile import check_compile_option, compile_backbone, is_compiled
from vtdense.tasks.finetuning import (
    check_finetuning_callbacks,
    frozen_backbone_param_ids,
    sync_unwrapped_grads,
    train_optimized_params,
    trainable_param_ids,
)
from vtdense.tasks.fault import (
    NONFINITE_POLICIES,
    AtomicCheckpointIO,
    CheckpointOnSigterm,
    NonFiniteLossError,
    check_finite_losses,
    rng_state,
    set_rng_state,
)

__all__ = ["BaseTask", "atomic_write_bytes", "resolve_run_dir", "task_family"]


def resolve_run_dir(trainer: Trainer) -> Path:
    """The run directory: the logger's ``log_dir`` if there is one, else ``default_root_dir``.

    Under DDP ``trainer.log_dir`` is a collective (a broadcast from rank 0): call this on every
    rank at the same point, never from rank-0-only code.
    """
    log_dir = trainer.log_dir if trainer.loggers else None
    return Path(log_dir if log_dir is not None else trainer.default_root_dir)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a reader (or a
    kill mid-write) never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_beside(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def task_family(cls: type) -> str:
    """The vtdense task a class is (``DetectionTask`` for any subclass of it): what checkpoints record."""
    for c in cls.__mro__:
        if c.__module__.startswith("vtdense.tasks.") and c.__name__ != "BaseTask" and hasattr(c, "monitor"):
            return c.__name__
    return cls.__name__


def _public(hparams: Any) -> dict[str, Any]:
    """Saved datamodule hyperparameters without Lightning's private entries."""
    return {k: v for k, v in dict(hparams).items() if not str(k).startswith("_")}


def _same_shape_option(a: Any, b: Any) -> bool:
    """Whether two saved options agree, a list and a tuple of the same items being the same
    (a YAML config gives ``[1, 1, 2, 1]`` where Python code gave ``(1, 1, 2, 1)``)."""

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return tuple(plain(x) for x in v)
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(a) == plain(b)


def _sampler_of(dataloader: Any) -> Any:
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    return sampler if sampler is not None else getattr(dataloader, "sampler", None)


def format_class_table(names: Sequence[str], values: Sequence[float], title: str = "per-class IoU",
                       column: str = "IoU", more: Mapping[str, Sequence[float]] | None = None) -> str:
    """Text table of a per-class metric, and of ``more`` columns (header -> values) after it
    (``nan``: not defined for that class, e.g. a class absent from prediction and ground truth)."""
    columns = {column: list(values), **{k: list(v) for k, v in (more or {}).items()}}
    width = max([len("class"), *(len(n) for n in names)])
    rule = "-" * (width + 2 + 10 * len(columns))
    header = "".join(f"  {c:>8}" for c in columns)
    lines = [title, rule, f"{'class':<{width}}{header}", rule]
    for i, n in enumerate(names):
        cells = "".join(f"  {'nan' if math.isnan(v[i]) else f'{v[i]:8.4f}':>8}" for v in columns.values())
        lines.append(f"{n:<{width}}{cells}")
    lines.append(rule)
    return "\n".join(lines)


class BaseTask(LightningModule):
    """LightningModule base with build hooks, a checkpoint policy and DDP-safe outputs.

    Subclasses set :attr:`monitor` / :attr:`monitor_mode` (what the best checkpoint is chosen
    by) and implement :meth:`configure_models`; ``self.model`` is the built network.
    """

    #: Logged metric the best checkpoint is chosen by.
    monitor: str = "val/loss"
    #: ``"max"`` or ``"min"``.
    monitor_mode: str = "max"
    #: File name pattern of the best checkpoint.
    checkpoint_filename: str = "best-epoch{epoch:03d}"

    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self._run_dir: Path | None = None
        self._eval_position = 0
        self._nonfinite_skipped = 0
        self._wrapped_params: frozenset[int] | None = None  # what DDP all-reduces (see finetuning)

    @staticmethod
    def check_recompute_option(min_bytes: int | None) -> None:
        """Validate ``activation_recompute_min_bytes`` (raises one ``ValueError`` naming the option)."""
        if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0):
            raise ValueError(f"activation_recompute_min_bytes must be a whole number of bytes >= 0 (0: every layer "
                             f"recomputes; null: vtdense's default), got {min_bytes!r}")

    @staticmethod
    def check_triton_attention_option(value: bool | str) -> None:
        """Validate ``triton_attention`` (raises one ``ValueError`` naming the option)."""
        if not is_auto_switch(value):
            raise ValueError(f"triton_attention must be true, false or 'auto' (option 'triton_attention'), got {value!r}")

    @staticmethod
    def check_fault_options(nonfinite_loss: str, checkpoint_every_n_steps: int | None) -> None:
        """Validate the fault-tolerance options every task takes (raises one ``ValueError`` naming the option)."""
        if nonfinite_loss not in NONFINITE_POLICIES:
            raise ValueError(
                f"unknown nonfinite_loss {nonfinite_loss!r} (option 'nonfinite_loss'); choose one of {', '.join(NONFINITE_POLICIES)}"
            )
        if checkpoint_every_n_steps is not None and checkpoint_every_n_steps < 1:
            raise ValueError(f"checkpoint_every_n_steps must be >= 1 or null, got {checkpoint_every_n_steps}")

    # ----------------------------------------------------------------- hooks
    def configure_models(self) -> None:
        """Build ``self.model`` from the hyperparameters."""
        raise NotImplementedError

    def configure_losses(self) -> None:
        """Build loss modules (none by default: e.g. torchvision detectors compute their own)."""

    def configure_metrics(self) -> None:
        """Build the evaluation metrics (none by default)."""

    def build(self) -> None:
        """Build the model and the metrics (once the class count is known)."""
        self.configure_models()
        self.configure_metrics()

    def build_from_datamodule(self, datamodule: Any) -> None:
        """Take the class count from ``datamodule`` and build the network (a task made with
        ``num_classes=None``)."""
        raise NotImplementedError

    def check_architecture(self) -> None:
        """Build the network once on the meta device (no memory, no weights read), with one class,
        and drop it: an option the backbone, neck or head refuses is then one error when the task
        is made, not a traceback from the trainer's setup, where a task whose class count comes from
        the datamodule builds its network."""
        hp = self.hparams
        saved = {k: hp[k] for k in ("num_classes", "backbone_weights") if k in hp}
        modules, plain = dict(self._modules), dict(self.__dict__)
        try:
            hp["num_classes"] = 1
            if "backbone_weights" in hp:
                hp["backbone_weights"] = None
            with torch.device("meta"):
                self.configure_models()
        finally:
            hp.update(saved)
            self._modules.clear()
            self._modules.update(modules)
            self.__dict__.clear()
            self.__dict__.update(plain)

    def _recopy_for_swa(self) -> None:
        """Lightning's ``StochasticWeightAveraging`` copies the model in its ``setup``, before the
        task's ``setup`` builds a network that waits for the datamodule's class count, and calls
        no hook first: its copy had no network, so it averaged nothing and its checkpoint state
        did not load. Copy the built task for it again, as its ``setup`` does."""
        if self.model is None or self._trainer is None:
            return
        for cb in self._trainer.callbacks:
            held = getattr(cb, "_average_model", None) if isinstance(cb, StochasticWeightAveraging) else None
            if held is not None and getattr(held, "model", None) is None:
                cb._average_model = copy.deepcopy(self)

    def fsdp_units(self) -> list[torch.nn.Module]:
        """The modules whose ``forward`` the task's steps call: under FSDP each becomes a unit that
        owns the parameters outside the transformer blocks (default: ``[self.model]``)."""
        return [self.model] if self.model is not None else []

    def backbone_part(self) -> torch.nn.Module:
        """The vtdense backbone inside the built network (subclasses say where it is)."""
        raise NotImplementedError

    @property
    def backbone(self) -> torch.nn.Module:
        """The vtdense backbone inside the network (a detector's ``model.backbone.body``, a
        segmentor's ``model.encoder.backbone``): the part Lightning's ``BackboneFinetuning``
        freezes and later trains (see :mod:`vtdense.tasks.finetuning`). A network that waits for
        the datamodule's class count is built first, when the task is attached to a trainer.

        Raises:
            RuntimeError: the network is not built and no trainer's datamodule can build it.
        """
        if self.model is None and self._trainer is not None:
            self.build_from_datamodule(getattr(self._trainer, "datamodule", None))
        if self.model is None:
            raise RuntimeError(
                f"{type(self).__name__} has no network yet: its class count comes from the datamodule, so it is built "
                "when a trainer runs it (or pass num_classes)"
            )
        return self.backbone_part()

    def configure_model(self) -> None:
        """Lightning's hook, called once the model is built and before the strategy wraps it.

        - Under ``--trainer.strategy fsdp`` (:class:`vtdense.strategies.VtdenseFSDPStrategy`) shard
          the network, one FSDP unit per transformer block plus :meth:`fsdp_units`.
        - With the ``compile_backbone`` hyperparameter set, compile the backbone part in place for
          all input sizes (:func:`vtdense.models.compile.compile_backbone`).
        - Apply the ``activation_recompute`` and ``activation_recompute_min_bytes`` hyperparameters, process-wide
          (:func:`vtdense.layers.mlp.set_activation_recompute`), and ``triton_attention``
          (:func:`vtdense.layers.triton_window_attention.set_triton_window_attention`).

        - Build the network first if it waits for the datamodule's class count: Lightning calls
          this hook after ``setup`` (which builds it), but a callback that copies the model when
          fitting starts calls it before (Lightning's ``WeightAveraging`` / ``EMAWeightAveraging``),
          and must copy the whole network.

        - Record which parameters need a gradient: Lightning calls this hook last before DDP wraps
          the model, and DDP all-reduces those; :meth:`on_after_backward` averages the others that
          train later (a backbone a fine-tuning callback unfreezes).

        Idempotent.
        """
        if self.model is None and self._trainer is not None:
            self.build_from_datamodule(getattr(self._trainer, "datamodule", None))
        self._wrapped_params = trainable_param_ids(self)
        self._recopy_for_swa()
        min_bytes = self.hparams.get("activation_recompute_min_bytes")
        set_activation_recompute(bool(self.hparams.get("activation_recompute", True)),
                                 min_bytes=DEFAULT_RECOMPUTE_MIN_BYTES if min_bytes is None else int(min_bytes))
        set_triton_window_attention(self.hparams.get("triton_attention", "auto"))
        if self.model is None:
            return
        shard = getattr(self._trainer.strategy, "shard", None) if self._trainer is not None else None
        if shard is not None:
            shard(self, self.fsdp_units())
        backend = check_compile_option(self.hparams.get("compile_backbone"))
        if backend is not None and is_compiled(self.model) is None:
            compile_backbone(self.model, backend)

    def setup(self, stage: str) -> None:
        """Resolve the run directory on every rank (a collective under DDP); save checkpoints atomically."""
        destroy_process_group_at_exit()  # a clean exit under gloo (see vtdense.distributed)
        if self._trainer is not None:
            self._run_dir = resolve_run_dir(self.trainer)
            dm_hparams = getattr(getattr(self.trainer, "datamodule", None), "hparams", None)
            if stage == "fit" and dm_hparams:  # predict_images after fit resizes as this validation does
                self.datamodule_hparams = _public(dm_hparams)
            check_finetuning_callbacks(self.trainer)
            strategy = self.trainer.strategy
            if type(strategy.checkpoint_io) is TorchCheckpointIO:
                strategy.checkpoint_io = AtomicCheckpointIO()

    def on_fit_start(self) -> None:
        """Start the run directory's skip report (``skipped.jsonl``); when resuming, let the fit loop
        rebuild the train loader after the restore so it continues mid-epoch.

        Rank 0 writes what the datasets dropped while parsing; then every rank points its
        datasets' ``skip_file`` there, so images skipped at load time in any DataLoader worker of
        any rank are appended to the same report.
        """
        if self.trainer.ckpt_path is not None:
            # A resumed fine-tuning callback restored its optimizer groups but froze their parameters
            # again in its setup (see vtdense.tasks.finetuning): what an optimizer holds trains.
            train_optimized_params(self.trainer.optimizers, frozen_backbone_param_ids(self))
        fit_loop = self.trainer.fit_loop
        if self.trainer.ckpt_path is not None and getattr(fit_loop, "_combined_loader", None) is not None:
            # Resuming. ``configure_optimizers`` asked for ``trainer.estimated_stepping_batches``, which
            # made Lightning build the train loader before the checkpoint's loop state is restored; it
            # would then never hand the loader its saved position, and a mid-epoch resume would
            # restart the epoch. Dropping that early loader makes the fit loop build it again, after the
            # restore, and load the saved position into it.
            fit_loop._combined_loader = None
        dm = getattr(self.trainer, "datamodule", None)
        datasets = [getattr(dm, n, None) for n in ("train_dataset", "val_dataset")]
        datasets = [d for d in datasets if d is not None and hasattr(d, "skipped")]
        if not datasets:
            return
        if self.trainer.is_global_zero:
            records = [r for d in datasets for r in d.skipped]
            report = self.run_dir / SKIP_REPORT_NAME
            if report.is_file():  # a resumed run: keep what the earlier part of the run recorded
                earlier = read_skip_report(report)
                records = earlier + [r for r in records if r not in earlier]
            write_skip_report(records, self.run_dir)
        self.trainer.strategy.barrier("vtdense_skip_report")  # every rank: the report exists before appends
        for d in datasets:
            d.skip_file = self.run_dir / SKIP_REPORT_NAME

    def on_train_epoch_start(self) -> None:
        """Keep the backbones' ``frozen_stages`` frozen after a fine-tuning callback, which runs
        first, made the whole backbone trainable."""
        for m in self.modules():
            if isinstance(m, Backbone) and m.frozen_stages >= 0:
                m.train(m.training)

    def on_after_backward(self) -> None:
        """Under DDP, average the gradients of the parameters DDP does not (those frozen when it
        wrapped the model and trained since: :func:`vtdense.tasks.finetuning.sync_unwrapped_grads`).
        Every process calls it after each backward."""
        sync_unwrapped_grads(self, self._wrapped_params, self._trainer)

    def on_train_start(self) -> None:
        """After a resume, step with the AdamW / SGD implementation chosen for this run (see
        :func:`vtdense.tasks.optim.adamw`), not the one the checkpoint was saved with.

        ``torch.optim`` restores each group's ``fused`` flag from the checkpoint, while the
        optimizer's amp handling (``_step_supports_amp_scaling``, read by Lightning and the grad
        scaler) follows the choice made now: a checkpoint of a fused run resumed with clipping under
        mixed precision, or an older unfused one resumed where fused applies, would mix the two.

        Rank 0 also prints where a resumed run goes on from (``resumed at epoch E, step S from
        PATH``): the state the checkpoint restored, not the one asked for.
        """
        if self.trainer.ckpt_path is not None and self.trainer.is_global_zero:
            print(f"resumed at epoch {self.current_epoch}, step {self.global_step} from {self.trainer.ckpt_path}", flush=True)
        for opt in self.trainer.optimizers:
            if not isinstance(opt, (torch.optim.AdamW, torch.optim.SGD)) or "fused" not in opt.defaults:
                continue
            fused = bool(opt.defaults["fused"])
            for group in opt.param_groups:
                if bool(group.get("fused")) == fused:
                    continue
                group["fused"] = fused
                if fused:  # the fused kernel keeps its step counts on the parameters' device
                    for p in group["params"]:
                        state = opt.state.get(p, {})
                        if isinstance(state.get("step"), Tensor):
                            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def configure_callbacks(self) -> list[Callback]:
        """Checkpoints: the best by :attr:`monitor`, ``last.ckpt`` at each validation, every
        ``checkpoint_every_n_steps`` optimiser steps (if set) and on SIGTERM. None if the trainer
        has checkpointing off. Always :class:`~vtdense.callbacks.TrainingCurves` (``curves.png`` / ``curves.csv``)."""
        from vtdense.callbacks import TrainingCurves

        if self._trainer is not None and not self.trainer.checkpoint_callbacks:
            return [TrainingCurves()]
        callbacks: list[Callback] = [
            TrainingCurves(),
            ModelCheckpoint(
                monitor=self.monitor,
                mode=self.monitor_mode,
                save_last=True,
                filename=self.checkpoint_filename,
                auto_insert_metric_name=False,
                enable_version_counter=False,  # one last.ckpt, whichever callback writes it
            )
        ]
        every = self.hparams.get("checkpoint_every_n_steps")
        if every:
            callbacks.append(
                ModelCheckpoint(save_top_k=0, save_last=True, every_n_train_steps=int(every), enable_version_counter=False)
            )
        callbacks.append(CheckpointOnSigterm())
        return callbacks

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse to write non-finite weights; store every rank's generator states (a collective)."""
        bad = [n for n, p in self.named_parameters() if not torch.isfinite(p.detach()).all()]
        if bad:
            raise NonFiniteLossError(
                f"refusing to save a checkpoint with non-finite weights ({', '.join(bad[:5])}"
                f"{', ...' if len(bad) > 5 else ''}); the previous checkpoint is kept"
            )
        checkpoint["vtdense_rng"] = self.gather(rng_state())
        checkpoint["vtdense_task"] = task_family(type(self))

    #: Hyperparameters that fix the shape of the weights: a checkpoint must agree on them to load.
    ARCHITECTURE_KEYS: tuple[str, ...] = ("backbone", "head", "arch", "num_classes")
    #: ``backbone_kwargs`` entries that fix the shape of the weights.
    BACKBONE_SHAPE_KEYS: tuple[str, ...] = ("embed_dim", "depths", "num_heads", "in_chans", "mlp_ratio", "expand_attn")

    def check_checkpoint_fits(self, checkpoint: dict[str, Any], source: str | None = None) -> None:
        """Raise one ``ValueError`` naming the file when a checkpoint was made for another task,
        backbone, head or class count than this one (instead of a long key-mismatch traceback)."""
        where = f"checkpoint {source}" if source else "the checkpoint"
        task = checkpoint.get("vtdense_task")
        if task is not None and task != task_family(type(self)):
            raise ValueError(f"{where} is a {task} checkpoint, not a {task_family(type(self))} one")
        saved = checkpoint.get("hyper_parameters") or {}
        if task is None and saved and not any(k in saved for k in self.ARCHITECTURE_KEYS if k in self.hparams):
            raise ValueError(f"{where} was not written by a {type(self).__name__} (its hyperparameters are {sorted(saved)[:8]})")
        problems = []
        for key in self.ARCHITECTURE_KEYS:
            if key in saved and key in self.hparams and saved[key] is not None and self.hparams[key] is not None:
                if not _same_shape_option(saved[key], self.hparams[key]):
                    problems.append(f"{key}={saved[key]!r} (this run: {self.hparams[key]!r})")
        mine, theirs = self.hparams.get("backbone_kwargs") or {}, saved.get("backbone_kwargs") or {}
        for key in self.BACKBONE_SHAPE_KEYS:
            if key in mine or key in theirs:
                if not _same_shape_option(mine.get(key), theirs.get(key)) and saved.get("backbone") == self.hparams.get("backbone"):
                    problems.append(f"backbone_kwargs.{key}={theirs.get(key)!r} (this run: {mine.get(key)!r})")
        if problems:
            raise ValueError(
                f"{where} does not fit this model: it was trained with {', '.join(problems)}; use the same options to "
                "resume, or load only the backbone with model.backbone_weights"
            )

    def check_data_fits(self, datamodule: Any, source: str | None = None) -> None:
        """Raise one ``ValueError`` naming ``source`` (the checkpoint) when a trained task is
        evaluated on data it cannot score: another class count here; the tasks add their class
        lists. Called before a run starts, on every rank (it reads files, no collective)."""
        mine, theirs = self.hparams.get("num_classes"), getattr(datamodule, "num_classes", None)
        if mine is not None and theirs is not None and int(mine) != int(theirs):
            where = f"checkpoint {source}" if source else "the model"
            raise ValueError(
                f"{where} was trained with num_classes={int(mine)} but the data ({type(datamodule).__name__}) has "
                f"{int(theirs)} classes: evaluate on data with the classes it was trained on"
            )

    def check_state_dict_fits(self, checkpoint: dict[str, Any], source: str | None = None, options: Iterable[str] | None = None) -> None:
        """Raise one ``ValueError`` naming the file when a tensor of the checkpoint's state dict and
        this task's differ in shape: an option that sets a shape was given another value than the
        checkpoint's (``load_from_checkpoint(path, num_classes=5)``), which the hyperparameter check
        cannot see once the override is merged into the saved hyperparameters. ``options``: the
        options given anew (the loader's overrides), named as the suspects."""
        state = checkpoint.get("state_dict")
        if not isinstance(state, dict):
            return
        own = self.state_dict()
        wrong = [f"{k}: checkpoint {tuple(v.shape)}, this model {tuple(own[k].shape)}"
                 for k, v in state.items() if k in own and isinstance(v, Tensor) and tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            where = f"checkpoint {source}" if source else "the checkpoint"
            given = sorted(options or ())
            suspects = (f"an option given here ({', '.join(given)})" if given else
                        f"an option that sets them ({', '.join(k for k in self.ARCHITECTURE_KEYS if k in self.hparams)}, "
                        "backbone_kwargs, a head's width)")
            raise ValueError(
                f"{where} does not fit this model: {len(wrong)} tensor(s) differ in shape ({'; '.join(wrong[:3])}"
                f"{' ...' if len(wrong) > 3 else ''}); {suspects} differs from the checkpoint's: leave it as saved, "
                "or load only the backbone with backbone_weights"
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check that the checkpoint fits; keep its datamodule hyperparameters (prediction resizes
        as validation did); when a fit resumes, restore this rank's generator states."""
        t = self._trainer
        self.check_checkpoint_fits(checkpoint, getattr(t, "ckpt_path", None) if t is not None else None)
        if t is None:  # load_from_checkpoint: Lightning loads the state dict strictly next
            self.check_state_dict_fits(checkpoint)
        saved_dm = checkpoint.get("datamodule_hyper_parameters")
        if saved_dm and self.datamodule_hparams is None:
            self.datamodule_hparams = _public(saved_dm)
        states = checkpoint.get("vtdense_rng")
        if not states or t is None or t.state.fn != "fit":
            return
        if len(states) == t.world_size:
            set_rng_state(states[t.global_rank])

    # --------------------------------------------------------- non-finite loss
    def nonfinite_step(self, losses: dict[str, Tensor], images: list[Any]) -> bool:
        """Whether to skip this optimiser step because some rank's loss is NaN or inf.

        With ``nonfinite_loss="error"`` (default) it raises :class:`NonFiniteLossError` naming the
        term, the step and the batch's images instead. Every rank calls it every training step
        (the decision is a collective, so all ranks skip or stop together).
        """
        message = check_finite_losses(losses, self.global_step, images)
        any_bad = self.trainer.strategy.reduce_boolean_decision(message is not None, all=False)
        if not any_bad:
            return False
        if self.hparams.get("nonfinite_loss", "error") == "error":
            raise NonFiniteLossError(message or f"non-finite loss on another rank at step {self.global_step}")
        self._nonfinite_skipped += 1
        self.log("train/nonfinite_skipped", float(self._nonfinite_skipped), batch_size=max(len(images), 1))
        return True

    # ------------------------------------------------------------ run directory
    @property
    def run_dir(self) -> Path:
        """The run directory (resolved in :meth:`setup`; safe to read from rank-0-only code)."""
        if self._run_dir is None:
            if self._trainer is None:
                raise RuntimeError("the task is not attached to a trainer: there is no run directory")
            if self.trainer.world_size > 1:
                raise RuntimeError("run_dir read before setup under a distributed strategy")
            self._run_dir = resolve_run_dir(self.trainer)
        return self._run_dir

    @property
    def writes_outputs(self) -> bool:
        """Whether this process writes files: rank 0, outside the sanity check."""
        t = self._trainer
        return t is not None and t.is_global_zero and not t.sanity_checking

    # ----------------------------------------------------- evaluation samples
    def on_validation_epoch_start(self) -> None:
        """Start counting this rank's evaluation samples."""
        self._eval_position = 0

    def on_test_epoch_start(self) -> None:
        """Start counting this rank's evaluation samples."""
        self._eval_position = 0

    def _eval_sampler(self) -> Any:
        t = self._trainer
        if t is None:
            return None
        stage = t.state.stage
        loaders = t.test_dataloaders if stage == RunningStage.TESTING else t.val_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        return _sampler_of(loaders) if loaders is not None else None

    def eval_positions(self, n: int) -> list[int | None]:
        """Dataset positions of the next ``n`` samples of this rank's evaluation stream, in the
        order one process would see them; ``None`` for a repeat that ``DistributedSampler`` added
        to even out the ranks. Call once per evaluation batch, in order.

        The sampler lays out ``len(dataset)`` positions, padded to a multiple of the world size by
        repeating the first ones, and rank ``r`` takes positions ``r, r + world, ...``; a position
        at or past ``len(dataset)`` is a repeat.
        """
        start = self._eval_position
        self._eval_position += n
        sampler = self._eval_sampler()
        if not isinstance(sampler, DistributedSampler):
            return list(range(start, start + n))
        world, rank = sampler.num_replicas, sampler.rank
        real = len(sampler.dataset)  # type: ignore[arg-type]
        positions = [rank + (start + i) * world for i in range(n)]
        return [p if sampler.drop_last or p < real else None for p in positions]

    def eval_keep(self, n: int) -> list[bool]:
        """For the next ``n`` evaluation samples: ``False`` for a distributed-sampler repeat (see :meth:`eval_positions`)."""
        return [p is not None for p in self.eval_positions(n)]

    # ---------------------------------------------------------------- gathering
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (``[obj]`` on one process). A collective: call it on every rank."""
        if self._trainer is None or self.trainer.world_size <= 1 or not torch.distributed.is_initialized():
            return [obj]
        parts: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, obj)
        return parts

    # ------------------------------------------------------------------ writing
    def write_text(self, name: str, text: str) -> Path:
        """Write ``run_dir/name`` atomically (call from rank 0; no collective)."""
        path = self.run_dir / name
        atomic_write_bytes(path, text.encode("utf-8"))
        return path

    def write_image(self, name: str, image: Tensor | np.ndarray) -> Path:
        """Write a uint8 image (``[3, H, W]`` tensor or ``(H, W[, 3])`` array) as PNG to ``run_dir/name``."""
        import io

        from PIL import Image

        if isinstance(image, Tensor):
            image = image.detach().cpu().permute(1, 2, 0).numpy() if image.ndim == 3 else image.cpu().numpy()
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).save(buf, format="PNG")
        path = self.run_dir / name
        atomic_write_bytes(path, buf.getvalue())
        return path

    def log_image(self, tag: str, image: Tensor) -> None:
        """Send a uint8 ``[3, H, W]`` image to the logger if it takes images (TensorBoard- or W&B-style)."""
        if self.logger is None:
            return
        experiment = getattr(self.logger, "experiment", None)
        if hasattr(experiment, "add_image"):
            experiment.add_image(tag, image, self.global_step)
        elif hasattr(self.logger, "log_image"):
            from torchvision.transforms.functional import to_pil_image

            self.logger.log_image(key=tag, images=[to_pil_image(image)], step=self.global_step)

    # ============================================================================================
    # Prediction from a checkpoint (issue 11). The task-specific parts are the hooks below; the
    # loading and the loop live in vtdense.tasks.predict.
    # ============================================================================================
    #: The datamodule hyperparameters saved in the checkpoint (set by :meth:`from_checkpoint`).
    datamodule_hparams: dict[str, Any] | None = None
    #: The checkpoint the task was loaded from (set by :meth:`from_checkpoint`).
    checkpoint_path: Path | None = None

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu", **overrides: Any) -> Any:
        """Load a trained task from a Lightning checkpoint for prediction (eval mode).

        The model is rebuilt from the hyperparameters saved in the checkpoint, which is read with
        ``torch.load(weights_only=True)``; class names and the datamodule's preprocessing settings
        come from it too. See :func:`vtdense.tasks.predict.load_task_checkpoint`.

        Example:
            >>> task = DetectionTask.from_checkpoint("runs/x/checkpoints/best.ckpt")  # doctest: +SKIP
            >>> task.predict_images("photos/", score_thresh=0.5)  # doctest: +SKIP
        """
        from vtdense.tasks.predict import load_task_checkpoint

        return load_task_checkpoint(cls, path, map_location=map_location, **overrides)

    def predict_images(
        self, images: Any, *, batch_size: int = 1, bf16: bool = False, num_workers: int = 0, **transform_options: Any
    ) -> list[dict[str, Any]]:
        """Predict on image files, folders, globs or ``[3, H, W]`` tensors (uint8, or float 0..1).

        Returns one dict per image (``predict_step``'s, original coordinates, with class names and
        ``path``), on the CPU. Runs on the task's device under ``torch.inference_mode``; ``bf16``
        adds bfloat16 autocast. Bad input (a missing path, a non-image file, an empty folder)
        raises before the model runs. ``transform_options`` go to :meth:`predict_transform`
        (``None`` values: the checkpoint's).
        """
        from vtdense.tasks.predict import predict_images

        transform = self.predict_transform(**{k: v for k, v in transform_options.items() if v is not None})
        return predict_images(self, images, batch_size=batch_size, bf16=bf16, num_workers=num_workers, transform=transform)

    def predict_transform(self, **overrides: Any) -> Any:
        """Preprocessing of one ``[3, H, W]`` image for prediction (the validation resize)."""
        raise NotImplementedError(f"{type(self).__name__} does not support predict")

    def name_prediction(self, pred: dict[str, Any]) -> dict[str, Any]:
        """``pred`` with class names added."""
        return pred

    def write_prediction_files(self, out_dir: Path, target: dict[str, Any], pred: dict[str, Any], image: Tensor) -> dict[str, Any]:
        """Write one image's prediction files (any rank, no collective); return its JSON-ready record with ``index``."""
        raise NotImplementedError(f"{type(self).__name__} does not support predict")

    def write_prediction_index(self, out_dir: Path, records: list[dict[str, Any]], info: dict[str, Any]) -> list[Path]:
        """Write the JSON index of all images (rank 0, no collective); return the files written."""
        raise NotImplementedError(f"{type(self).__name__} does not support predict")
