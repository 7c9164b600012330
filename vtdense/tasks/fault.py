"""Fault tolerance for long runs: atomic checkpoints, a checkpoint on SIGTERM, RNG state in
checkpoints, and one policy for non-finite losses.

- :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file beside its target and
  renames it into place, so a kill during a save never leaves a ``last.ckpt`` that fails to load
  and the previous one stays valid until the new one is complete.
- :class:`CheckpointOnSigterm` writes ``last.ckpt`` when Lightning stops a run on SIGTERM (SLURM
  pre-emption, ``kill``). It acts in ``on_exception``, after Lightning has made every rank agree
  on the signal, so under DDP every rank takes part in the save.
- :func:`rng_state` / :func:`set_rng_state` carry the global generators (torch, CUDA, numpy,
  ``random``) through a checkpoint, so a resumed run draws the same random numbers (RPN / RoI
  sampling, drop path) as an uninterrupted one.
- :func:`check_finite_losses` names the loss term and the batch's images when a loss is NaN or inf.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from vtdense.files import temp_path_beside

__all__ = [
    "NONFINITE_POLICIES",
    "AtomicCheckpointIO",
    "CheckpointOnSigterm",
    "NonFiniteLossError",
    "check_finite_losses",
    "rng_state",
    "set_rng_state",
]

#: ``nonfinite_loss`` choices: stop with an error, or skip the optimiser step (counted).
NONFINITE_POLICIES: tuple[str, ...] = ("error", "skip")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file beside the target (:func:`vtdense.files.temp_path_beside`),
    fsync, then ``os.replace``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (the old file stays valid until the rename)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path_beside(target)
        try:
            with open(tmp, "xb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                tmp.unlink()


def last_checkpoint_path(trainer: Trainer) -> Path | None:
    """Where ``last.ckpt`` goes: the first ``ModelCheckpoint``'s directory (``None`` without one)."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return None


class CheckpointOnSigterm(Callback):
    """Write ``last.ckpt`` before a run stopped by SIGTERM exits, so ``--ckpt_path last`` resumes it.

    The save happens at the end of the training batch during which the signal arrived: the same
    point as a step checkpoint, so the resume is exact. Whether any rank got the signal is decided
    collectively at every batch end, so under DDP all ranks save together. Lightning then stops the
    run. A signal that arrives outside a training batch (during validation) is saved when Lightning
    stops, at the end of the epoch's training.
    """

    def __init__(self) -> None:
        self._saved_step = -1

    def _save(self, trainer: Trainer) -> None:
        path = last_checkpoint_path(trainer)
        if path is None or self._saved_step == trainer.global_step:
            return
        trainer.save_checkpoint(path)
        self._saved_step = trainer.global_step
        if trainer.is_global_zero:
            print(f"SIGTERM: saved {path} at step {trainer.global_step}; resume with --ckpt_path last", flush=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Save if any rank has received SIGTERM (a collective: every rank, every batch)."""
        if trainer.strategy.reduce_boolean_decision(bool(trainer.received_sigterm), all=False):
            self._save(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """On Lightning's ``SIGTERMException`` (raised on every rank at the same point), save if not done yet."""
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            self._save(trainer)


def rng_state() -> dict[str, Any]:
    """The global generators' states (torch CPU, every CUDA device, numpy, ``random``), as tensors
    and plain Python values only, so the checkpoint loads with ``torch.load(weights_only=True)``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class NonFiniteLossError(FloatingPointError):
    """A loss term is NaN or inf; the message names the term, the step and the batch's images."""


def check_finite_losses(losses: dict[str, Tensor], step: int, images: list[Any]) -> str | None:
    """The message for the first non-finite loss term, or ``None`` when all are finite.

    Args:
        losses: ``{term: scalar}``.
        step: the global step.
        images: identifiers of the batch's images (COCO image ids, file names or dataset positions).
    """
    values = [v.detach() for v in losses.values()]
    if not values:
        return None
    # One read of the device for all the terms (on a GPU each read waits for the device to finish).
    if bool(torch.stack([torch.isfinite(v).all() for v in values]).all()):
        return None
    for name, value in losses.items():
        if not torch.isfinite(value.detach()).all():
            return (
                f"non-finite loss {name}={float(value.detach().float().mean())} at step {step}, "
                f"batch images {images}; lower the lr, check these images, or set "
                f"model.nonfinite_loss=skip to skip such steps"
            )
    return None
