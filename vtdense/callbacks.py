"""Training curves at a glance: a Lightning callback writing ``curves.png`` and ``curves.csv``.

:class:`TrainingCurves` collects, per epoch, the mean of every ``train/*`` value the module logs at
each step, the learning rate, and the ``val/*`` metrics at the end of each validation. It writes
them into the run directory (the logger's ``log_dir``, else ``default_root_dir``) as a CSV with
one row per epoch and a PNG of small plots, after every validation and when fitting ends. It
reads ``trainer.callback_metrics`` and the optimisers itself, so it works with any logger or none.

.. code-block:: python

    trainer = L.Trainer(callbacks=[TrainingCurves()])
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from vtdense.distributed import destroy_process_group_at_exit

__all__ = ["TrainingCurves"]


def _scalar(value: Any) -> Any:
    """A 1-element tensor or a number, else ``None`` (kept as a tensor: no device sync per step)."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class TrainingCurves(Callback):
    """Write per-epoch loss terms, learning rate and validation metrics as ``curves.png`` / ``curves.csv``.

    Columns: ``epoch``, ``step`` (global step when the row was last updated), the per-epoch mean of
    each ``train/*`` value logged at training steps (``*_step`` suffixes dropped; values logged
    with ``on_epoch=True`` take Lightning's epoch aggregate), ``lr`` (the largest learning rate of
    the optimiser's parameter groups at the epoch's last step; ``lr/opt<i>`` with several
    optimisers) and every ``val/*`` scalar of the epoch's last validation.

    The plot has one panel for the ``train/*`` terms, one for the learning rate and one per
    validation metric; per-item metrics (a dot in the name, like ``val/IoU.wall``) are only in
    the CSV.

    DDP: the run directory is resolved on every rank in :meth:`setup` (``trainer.log_dir`` is a
    collective there); only global rank 0 collects values (its own, unsynchronised step values)
    and writes, and that code calls no collective. The rows are saved in checkpoints, so a
    resumed run keeps its earlier epochs.

    Args:
        filename: base name of the files (``curves`` -> ``curves.png`` and ``curves.csv``).
        max_val_panels: at most this many validation metrics are plotted (the CSV has all).
        dpi: resolution of the PNG.
    """

    def __init__(self, filename: str = "curves", max_val_panels: int = 16, dpi: int = 100) -> None:
        if not filename or os.sep in filename:
            raise ValueError(f"TrainingCurves: filename must be a plain file name, got {filename!r}")
        self.filename = filename
        self.max_val_panels = int(max_val_panels)
        self.dpi = int(dpi)
        self.rows: dict[int, dict[str, float]] = {}
        self.run_dir: Path | None = None
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._seen: dict[str, Any] = {}
        self._stale: dict[str, float] = {}
        self._lr: dict[str, float] = {}

    # ----------------------------------------------------------------- paths
    @property
    def png_path(self) -> Path:
        """Where the plot is written (after :meth:`setup`)."""
        return self._dir() / f"{self.filename}.png"

    @property
    def csv_path(self) -> Path:
        """Where the table is written (after :meth:`setup`)."""
        return self._dir() / f"{self.filename}.csv"

    def _dir(self) -> Path:
        if self.run_dir is None:
            raise RuntimeError("TrainingCurves: the run directory is known only after Trainer setup")
        return self.run_dir

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Resolve the run directory on every rank (``trainer.log_dir`` broadcasts under DDP)."""
        destroy_process_group_at_exit()  # a clean exit under gloo (see vtdense.distributed)
        log_dir = trainer.log_dir if trainer.loggers else None
        self.run_dir = Path(log_dir if log_dir is not None else trainer.default_root_dir)

    # ------------------------------------------------------------- collecting
    @staticmethod
    def _fitting(trainer: Trainer) -> bool:
        return trainer.is_global_zero and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the epoch's sums; values already present are stale until logged again."""
        self._sums, self._counts = {}, {}
        if not self._fitting(trainer):
            return
        self._seen = dict(trainer.callback_metrics)
        # Lightning may hand stale values back as new tensors: a key counts only once its value changed.
        self._stale = {k: _float(v) for k, v in self._seen.items() if k.startswith("train/") and _scalar(v) is not None}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Add this step's ``train/*`` values (rank 0)."""
        if not self._fitting(trainer):
            return
        for key, value in trainer.callback_metrics.items():
            if not key.startswith("train/") or key.endswith("_epoch") or value is self._seen.get(key):
                continue  # not logged at this step
            self._seen[key] = value
            v = _scalar(value)
            if v is None:
                continue
            name = key[: -len("_step")] if key.endswith("_step") else key
            if name not in self._counts and key in self._stale and _float(v) == self._stale[key]:
                continue  # the previous epoch's value (e.g. a value logged with on_epoch=True only)
            self._sums[name] = self._sums.get(name, 0.0) + v
            self._counts[name] = self._counts.get(name, 0) + 1

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Note the learning rate this step uses (schedulers step before ``on_train_batch_end``)."""
        if self._fitting(trainer):
            self._lr = self._learning_rates(trainer)

    @staticmethod
    def _learning_rates(trainer: Trainer) -> dict[str, float]:
        opts = trainer.optimizers
        rates = [max(float(g["lr"]) for g in opt.param_groups) for opt in opts if opt.param_groups]
        if len(rates) == 1:
            return {"lr": rates[0]}
        return {f"lr/opt{i}": r for i, r in enumerate(rates)}

    def _train_row(self, trainer: Trainer, final: bool) -> dict[str, float]:
        row = {name: _float(total) / self._counts[name] for name, total in self._sums.items()}
        if final:  # epoch aggregates of values logged with on_epoch=True
            for key, value in trainer.callback_metrics.items():
                v = _scalar(value)
                if not key.startswith("train/") or v is None:
                    continue
                if key.endswith("_epoch"):
                    row[key[: -len("_epoch")]] = _float(v)
                elif key not in row and not key.endswith("_step"):
                    row[key] = _float(v)  # logged with on_epoch=True only
        row.update(self._lr)
        return row

    def _update(self, trainer: Trainer, values: dict[str, float]) -> None:
        row = self.rows.setdefault(int(trainer.current_epoch), {})
        row.update(values)
        row["step"] = float(trainer.global_step)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Record the ``val/*`` metrics and rewrite the files (rank 0, fitting only)."""
        if not self._fitting(trainer):
            return
        vals = {}
        for key, value in trainer.callback_metrics.items():
            v = _scalar(value)
            if key.startswith("val/") and v is not None:
                vals[key] = _float(v)
        self._update(trainer, {**self._train_row(trainer, final=False), **vals})
        self.write()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close the epoch's training means."""
        if self._fitting(trainer) and self._counts:
            self._update(trainer, self._train_row(trainer, final=True))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write the final files (rank 0)."""
        if trainer.is_global_zero and self.rows:
            self.write()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rows so far (plain types), so a resumed run keeps its curves."""
        return {"rows": {int(e): dict(r) for e, r in self.rows.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the rows of a checkpoint."""
        self.rows = {int(e): {str(k): float(v) for k, v in r.items()} for e, r in state_dict.get("rows", {}).items()}

    # ---------------------------------------------------------------- writing
    def columns(self) -> list[str]:
        """CSV columns: epoch, step, train terms, learning rates, validation metrics."""
        keys = {k for r in self.rows.values() for k in r} - {"step"}
        train = sorted(k for k in keys if k.startswith("train/"))
        lr = sorted(k for k in keys if k == "lr" or k.startswith("lr/"))
        val = sorted(k for k in keys if k.startswith("val/"))
        return ["epoch", "step", *train, *lr, *val]

    def write(self) -> None:
        """Write ``curves.csv`` and ``curves.png`` now (atomically: a reader never sees half a file)."""
        out = self._dir()
        out.mkdir(parents=True, exist_ok=True)
        cols = self.columns()
        tmp = self.csv_path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(cols)
            for epoch in sorted(self.rows):
                row = {**self.rows[epoch], "epoch": epoch}
                row["step"] = int(row.get("step", 0))
                writer.writerow([_cell(row.get(c)) for c in cols])
        os.replace(tmp, self.csv_path)
        self._plot(cols)

    def _plot(self, cols: list[str]) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        epochs = sorted(self.rows)
        train = [c for c in cols if c.startswith("train/")]
        lrs = [c for c in cols if c == "lr" or c.startswith("lr/")]
        vals = [c for c in cols if c.startswith("val/") and "." not in c[len("val/"):]][: self.max_val_panels]
        panels: list[tuple[str, list[str]]] = []
        if train:
            panels.append(("train/* (epoch mean)", train))
        if lrs:
            panels.append(("learning rate", lrs))
        panels += [(c, [c]) for c in vals]
        if not panels:
            panels = [("no values logged yet", [])]
        ncols = min(4, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig = Figure(figsize=(4.0 * ncols, 3.0 * nrows), dpi=self.dpi)
        FigureCanvasAgg(fig)
        for i, (title, keys) in enumerate(panels):
            ax = fig.add_subplot(nrows, ncols, i + 1)
            for key in keys:
                xs = [e for e in epochs if _finite(self.rows[e].get(key))]
                ax.plot(xs, [self.rows[e][key] for e in xs], marker="o", markersize=3, label=key.removeprefix("train/"))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("epoch", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if len(keys) > 1:
                ax.legend(fontsize=7)
        fig.tight_layout()
        tmp = self.png_path.with_suffix(".png.tmp")
        fig.savefig(tmp, format="png")
        os.replace(tmp, self.png_path)


def _finite(v: Any) -> bool:
    return v is not None and math.isfinite(v)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
