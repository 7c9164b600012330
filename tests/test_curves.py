"""TrainingCurves: per-epoch CSV and PNG in the run directory, any logger, resume, DDP."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from vtdense.callbacks import TrainingCurves


class Tiny(L.LightningModule):
    """Linear regression logging step-only, step+epoch and epoch-only train values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x), y)
        self.log("train/loss", loss)
        self.log("train/aux", 2 * loss, on_step=True, on_epoch=True)
        self.log("train/ep", 3 * loss, on_step=False, on_epoch=True)
        self.log("not_plotted", 1.0)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("val/mse", torch.nn.functional.mse_loss(self.lin(x), y))

    def on_validation_epoch_end(self) -> None:
        self.log("val/IoU.cls", 0.5 + self.current_epoch)  # a per-item metric: CSV only

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class Record(L.Callback):
    """What the module logged, from Lightning's side, and what the callback had written so far."""

    def __init__(self, curves: TrainingCurves) -> None:
        self.curves = curves
        self.losses: dict[int, list[float]] = {}
        self.epoch_values: dict[int, dict[str, float]] = {}
        self.val: dict[int, float] = {}
        self.rows_at_epoch_start: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        path = self.curves.csv_path
        self.rows_at_epoch_start.append(len(_read_csv(path)[1]) if path.exists() else 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.setdefault(trainer.current_epoch, []).append(float(outputs["loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if not trainer.sanity_checking:
            self.val[trainer.current_epoch] = float(trainer.callback_metrics["val/mse"])

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        m = trainer.callback_metrics
        self.epoch_values[trainer.current_epoch] = {"train/aux": float(m["train/aux_epoch"]), "train/ep": float(m["train/ep"])}


def _loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(24, 2, generator=g), torch.randn(24, 1, generator=g))
    return DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=12)


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def _fit(tmp_path: Path, epochs: int, logger, curves: TrainingCurves, **kw) -> L.Trainer:  # noqa: ANN001
    torch.manual_seed(0)
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=logger, default_root_dir=tmp_path, callbacks=[curves, *kw.pop("callbacks", [])],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kw,
    )
    trainer.fit(Tiny(), *_loaders(), ckpt_path=ckpt_path)
    return trainer


def test_curves_csv_and_png_per_epoch(tmp_path: Path) -> None:
    curves = TrainingCurves()
    record = Record(curves)
    trainer = _fit(tmp_path, 3, CSVLogger(tmp_path), curves, callbacks=[record])
    run = Path(trainer.log_dir)
    assert curves.run_dir == run and run.name == "version_0"

    cols, rows = _read_csv(run / "curves.csv")
    assert cols == ["epoch", "step", "train/aux", "train/ep", "train/loss", "lr", "val/IoU.cls", "val/mse"]
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert [int(r["step"]) for r in rows] == [3, 6, 9]  # 3 batches per epoch
    for e, r in enumerate(rows):
        assert float(r["train/loss"]) == pytest.approx(np.mean(record.losses[e]), rel=1e-6)
        assert float(r["train/aux"]) == pytest.approx(record.epoch_values[e]["train/aux"], rel=1e-6)
        assert float(r["train/ep"]) == pytest.approx(record.epoch_values[e]["train/ep"], rel=1e-6)
        assert float(r["lr"]) == pytest.approx(0.1 * 0.5**e)
        assert float(r["val/mse"]) == pytest.approx(record.val[e], rel=1e-6)
        assert float(r["val/IoU.cls"]) == 0.5 + e
    # rewritten after each validation: epoch e starts with e rows written
    assert record.rows_at_epoch_start == [0, 1, 2]

    with Image.open(run / "curves.png") as img:
        assert img.format == "PNG"
        assert img.size == (1200, 300)  # 3 panels (train terms, lr, val/mse) of 4 x 3 in at 100 dpi
        pixels = np.asarray(img.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # lines and text were drawn
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("curves")) == ["curves.csv", "curves.png"]


def test_without_logger_writes_to_default_root_and_resume_keeps_rows(tmp_path: Path) -> None:
    curves = TrainingCurves(filename="plots")
    trainer = _fit(tmp_path, 2, False, curves)
    assert curves.csv_path == tmp_path / "plots.csv" and (tmp_path / "plots.png").is_file()
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = TrainingCurves(filename="plots")
    _fit(tmp_path, 3, False, resumed, ckpt_path=str(ckpt))
    _, rows = _read_csv(tmp_path / "plots.csv")
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert all(r["val/mse"] for r in rows)


def test_lr_column_is_the_largest_group_rate_per_optimiser() -> None:
    """``lr`` is the largest learning rate over the optimiser's parameter groups (layer-wise decay
    gives the backbone groups far smaller rates: their minimum would hide the schedule); with
    several optimisers each gets its own ``lr/opt<i>`` column."""

    def sgd(*rates: float) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": r} for r in rates])

    class Trainer:
        optimizers = [sgd(1e-4, 3e-2, 1e-3)]

    assert TrainingCurves._learning_rates(Trainer()) == {"lr": 3e-2}
    Trainer.optimizers = [sgd(1e-4, 3e-2), sgd(5e-3)]
    assert TrainingCurves._learning_rates(Trainer()) == {"lr/opt0": 3e-2, "lr/opt1": 5e-3}


def test_max_val_panels_limits_the_plot_not_the_csv(tmp_path: Path) -> None:
    """``max_val_panels`` caps the validation panels of the PNG; the CSV keeps every metric."""
    curves = TrainingCurves(max_val_panels=1)
    curves.run_dir = tmp_path
    curves.rows = {0: {"step": 3.0, "lr": 0.1, "val/a": 1.0, "val/b": 2.0, "val/c": 3.0}}
    curves.write()
    cols, rows = _read_csv(curves.csv_path)
    assert cols == ["epoch", "step", "lr", "val/a", "val/b", "val/c"] and rows[0]["val/c"] == "3.0"
    with Image.open(curves.png_path) as img:
        assert img.size == (800, 300)  # 2 panels (lr, val/a) of 4 x 3 in at 100 dpi


DDP_SCRIPT = '''
import sys, torch, lightning as L
from lightning.pytorch.loggers import CSVLogger
sys.path.insert(0, {tests!r})
from test_curves import Tiny, _loaders
from vtdense.callbacks import TrainingCurves
torch.manual_seed(0)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=CSVLogger({root!r}),
                    default_root_dir={root!r}, callbacks=[TrainingCurves()], enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False)
trainer.fit(Tiny(), *_loaders())
print("rank", trainer.global_rank, "done", flush=True)
'''


def test_ddp_two_processes_one_writer(tmp_path: Path) -> None:
    script = tmp_path / "ddp_curves.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT.format(tests=str(Path(__file__).parent), root=str(tmp_path / "runs"))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    written = sorted(p.relative_to(tmp_path / "runs") for p in (tmp_path / "runs").rglob("curves.*"))
    assert written == [Path("lightning_logs/version_0/curves.csv"), Path("lightning_logs/version_0/curves.png")]
    _, rows = _read_csv(tmp_path / "runs/lightning_logs/version_0/curves.csv")
    assert [int(r["epoch"]) for r in rows] == [0, 1] and all(r["train/loss"] and r["val/mse"] for r in rows)
