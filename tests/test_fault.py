"""Atomic checkpoints under a kill, and the non-finite loss policy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from vtdense.data.coco import COCODataModule
from vtdense.data.synthetic import make_synthetic_coco
from vtdense.tasks.detection import DetectionTask
from vtdense.tasks.fault import AtomicCheckpointIO, NonFiniteLossError

REPO = Path(__file__).resolve().parents[1]

_SAVER = """
import sys, torch
sys.path.insert(0, {repo!r})
from vtdense.tasks.fault import AtomicCheckpointIO
io = AtomicCheckpointIO()
print("saving", flush=True)
io.save_checkpoint({{"state_dict": {{"w": torch.randn(64, 1024, 1024)}}, "n": 2}}, {path!r})  # 256 MiB
print("saved", flush=True)
"""


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}, "n": 1}, path)
    proc = subprocess.Popen([sys.executable, "-c", _SAVER.format(repo=str(REPO), path=str(path))],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.stdout.readline().strip() == "saving"
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob(".last.ckpt.tmp*")):
        time.sleep(0.005)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-write: the temporary file exists, the rename has not happened
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["n"] == 1 and torch.equal(ckpt["state_dict"]["w"], torch.ones(3))


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_coco(tmp_path_factory.mktemp("fault") / "coco", num_train=6, num_val=2, size_range=(64, 80),
                               num_classes=2, seed=9)


class _NaNAt(DetectionTask):
    """Turns one loss term into NaN at one step."""

    nan_step = 1

    def forward(self, images: list[torch.Tensor], targets: Any = None) -> Any:
        out = super().forward(images, targets)
        if self.training and self.global_step == self.nan_step:
            out = dict(out, loss_box_reg=out["loss_box_reg"] * float("nan"))
        return out


def _fit(task: DetectionTask, coco: Path, tmp_path: Path, steps: int = 3) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, limit_val_batches=0, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), logger=False,
                        enable_checkpointing=True)
    dm = COCODataModule(root=str(coco), batch_size=2, num_workers=0, train_scales=[64], max_size=96, test_scale=64)
    trainer.fit(task, datamodule=dm)
    return trainer


def _task(**kw: Any) -> _NaNAt:
    torch.manual_seed(0)
    return _NaNAt(backbone="swin_tiny", backbone_kwargs={"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 2, 2],
                  "window_size": 4}, head="faster_rcnn", num_classes=2, fpn_channels=16, slim_heads=True,
                  box_head_width=32, rois_per_image=16, warmup_steps=1, **kw)


def test_nonfinite_loss_stops_naming_the_term_and_images(coco: Path, tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss loss_box_reg=nan at step 1, batch images \[\d+, \d+\]"):
        _fit(_task(), coco, tmp_path)
    assert not list(tmp_path.glob("**/*.ckpt"))  # nothing NaN was written


def test_nonfinite_loss_skip_leaves_the_weights_and_counts(coco: Path, tmp_path: Path) -> None:
    task = _task(nonfinite_loss="skip")
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *a: Any) -> None:
            seen[trainer.global_step] = {k: v.clone() for k, v in module.state_dict().items()}

    trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), logger=False, callbacks=[Snap()])
    trainer.fit(task, datamodule=COCODataModule(root=str(coco), batch_size=2, num_workers=0, train_scales=[64],
                                                max_size=96, test_scale=64))
    assert float(trainer.callback_metrics["train/nonfinite_skipped"]) == 1.0
    # step 1 was skipped: the weights before and after it are the same, and every weight is finite
    after = {k: v for k, v in task.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert any(not torch.equal(seen[0][k], seen[1][k]) for k in seen[0])  # step 0 trained
    assert all(torch.equal(seen[1][k], seen[2][k]) for k in seen[1])  # step 1 (NaN) changed nothing
    assert trainer.global_step >= 2


def test_nonfinite_weights_are_never_saved(coco: Path, tmp_path: Path) -> None:
    task = _task(nonfinite_loss="skip")
    trainer = _fit(task, coco, tmp_path, steps=1)
    with torch.no_grad():
        next(task.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match="non-finite weights"):
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()


def test_bad_fault_options_are_named() -> None:
    with pytest.raises(ValueError, match="nonfinite_loss"):
        _task(nonfinite_loss="ignore")
    with pytest.raises(ValueError, match="checkpoint_every_n_steps"):
        _task(checkpoint_every_n_steps=0)


def test_checkpoint_for_another_model_is_one_clear_error(coco: Path, tmp_path: Path) -> None:
    task = _task(nonfinite_loss="skip")
    trainer = _fit(task, coco, tmp_path / "a", steps=1)
    ckpt_path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt_path)
    ckpt = torch.load(ckpt_path, weights_only=True)
    # resuming with another class count: one error naming the file and the option, before any step
    other = _task(nonfinite_loss="skip")
    other.hparams["num_classes"] = 5
    with pytest.raises(ValueError, match=r"a\.ckpt does not fit this model: it was trained with num_classes=2 \(this run: 5\)"):
        other.check_checkpoint_fits(ckpt, str(ckpt_path))
    wide = _NaNAt(backbone="swin_tiny", backbone_kwargs={"embed_dim": 32, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 2, 2],
                  "window_size": 4}, head="faster_rcnn", num_classes=2, fpn_channels=16, slim_heads=True, box_head_width=32)
    with pytest.raises(ValueError, match=r"backbone_kwargs\.embed_dim=16 \(this run: 32\)"):
        wide.check_checkpoint_fits(ckpt, "a.ckpt")
    mvit = _NaNAt(backbone="mvitv2_tiny", backbone_kwargs={"embed_dim": 16, "depths": [1, 1, 1, 1]}, head="faster_rcnn",
                  num_classes=2, fpn_channels=16, slim_heads=True, box_head_width=32)
    with pytest.raises(ValueError, match=r"backbone='swin_tiny' \(this run: 'mvitv2_tiny'\)"):
        mvit.check_checkpoint_fits(ckpt, "a.ckpt")
    # another task's checkpoint
    from vtdense.tasks.segmentation import SegmentationTask

    seg = SegmentationTask(backbone="swin_tiny", backbone_kwargs={"embed_dim": 16, "depths": [1, 1, 1, 1],
                           "num_heads": [1, 1, 2, 2], "window_size": 4}, num_classes=2, arch_kwargs={"decoder_channels": 16},
                           aux_weight=0.0)
    with pytest.raises(ValueError, match="is a DetectionTask checkpoint, not a SegmentationTask one"):
        seg.check_checkpoint_fits(ckpt, "a.ckpt")
    # and through Trainer.fit(ckpt_path=...): the error comes before training
    fresh_trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, default_root_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"a\.ckpt does not fit this model: it was trained with backbone_kwargs\.embed_dim"):
        fresh_trainer.fit(wide, datamodule=COCODataModule(root=str(coco), batch_size=2, num_workers=0, train_scales=[64],
                                                            max_size=96, test_scale=64), ckpt_path=str(ckpt_path))


def test_skip_report_lists_bad_images_and_keeps_earlier_records(tmp_path: Path) -> None:
    import json

    from vtdense.data.errors import SKIP_REPORT_NAME

    root = make_synthetic_coco(tmp_path / "coco", num_train=4, num_val=2, size_range=(64, 80), num_classes=2, seed=3)
    victim = sorted((root / "train2017").glob("*.jpg"))[1]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated JPEG: skipped at load time
    run = tmp_path / "run"
    run.mkdir()
    earlier = {"file": "earlier.jpg", "image_id": 9, "annotation_id": None, "reason": "from before the kill", "when": "load"}
    (run / SKIP_REPORT_NAME).write_text(json.dumps(earlier) + "\n")
    _fit(_task(nonfinite_loss="skip"), root, run, steps=2)
    records = [json.loads(line) for line in (run / SKIP_REPORT_NAME).read_text().splitlines()]
    assert records[0] == earlier  # a resumed run keeps what was recorded before
    assert any(r["file"] == str(victim) and r["when"] == "load" for r in records)
