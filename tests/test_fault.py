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
    while time.time() < deadline and not list(tmp_path.glob(".last.ckpt.*.tmp")):
        time.sleep(0.005)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-write: the temporary file exists, the rename has not happened
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["n"] == 1 and torch.equal(ckpt["state_dict"]["w"], torch.ones(3))


def test_failed_save_keeps_the_previous_checkpoint_and_no_temporary(tmp_path: Path) -> None:
    """A save that raises (here an unpicklable value) leaves the previous file as it was and no
    ``.last.ckpt.<random>.tmp`` behind (those would pile up over a run's retries)."""
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"n": 1}, path)
    with pytest.raises(Exception):
        io.save_checkpoint({"n": 2, "bad": lambda: None}, path)
    assert torch.load(path, weights_only=True) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


class _SigtermTrainer:
    """What CheckpointOnSigterm reads of a trainer, on one rank of two; the other rank may have the signal."""

    def __init__(self, tmp_path: Path, other_rank_signalled: bool) -> None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        self.checkpoint_callbacks = [ModelCheckpoint(), ModelCheckpoint(dirpath=tmp_path / "a"),
                                     ModelCheckpoint(dirpath=tmp_path / "b")]
        self.received_sigterm, self.other = False, other_rank_signalled
        self.global_step, self.is_global_zero, self.saved = 5, False, []
        self.state = type("State", (), {"fn": "fit"})()
        self.strategy = self

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        return (decision and self.other) if all else (decision or self.other)

    def save_checkpoint(self, path: Path) -> None:
        self.saved.append((Path(path), self.global_step))


def test_sigterm_on_any_rank_saves_last_once_per_step(tmp_path: Path) -> None:
    """``CheckpointOnSigterm``: a signal on another rank is enough (the decision is an OR over ranks,
    or the ranks would save apart, a deadlock under DDP); the file is the first checkpoint
    directory's ``last.ckpt``; one save per step, whether from the batch end or from Lightning's
    ``SIGTERMException``; nothing without a signal, for other exceptions, or outside fitting."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from vtdense.tasks.fault import CheckpointOnSigterm

    quiet = _SigtermTrainer(tmp_path, other_rank_signalled=False)
    cb = CheckpointOnSigterm()
    cb.on_train_batch_end(quiet, None, None, None, 0)
    assert quiet.saved == []
    trainer = _SigtermTrainer(tmp_path, other_rank_signalled=True)
    cb = CheckpointOnSigterm()
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.saved == [(tmp_path / "a" / "last.ckpt", 5)]  # at the batch end, before Lightning stops
    cb.on_exception(trainer, None, SIGTERMException())
    assert trainer.saved == [(tmp_path / "a" / "last.ckpt", 5)]
    trainer.global_step = 6
    cb.on_exception(trainer, None, RuntimeError("not a signal"))
    trainer.state.fn = "validate"
    cb.on_exception(trainer, None, SIGTERMException())
    trainer.state.fn = "fit"
    assert len(trainer.saved) == 1
    cb.on_exception(trainer, None, SIGTERMException())
    assert trainer.saved[1:] == [(tmp_path / "a" / "last.ckpt", 6)]


def test_resume_restores_this_ranks_generators_only_when_fitting() -> None:
    """``on_load_checkpoint`` sets the generators from the checkpoint entry of this process's rank
    (rank 1 of 2 here), so each rank draws what it would have drawn uninterrupted; a checkpoint
    loaded to validate or test, or saved with another process count, leaves them alone."""
    import random

    import numpy as np

    from vtdense.tasks.fault import rng_state

    def draws() -> tuple:
        return torch.rand(3), random.random(), float(np.random.rand())

    states, expected = [], []
    for seed in (1, 2):
        L.seed_everything(seed, verbose=False)
        states.append(rng_state())
        expected.append(draws())
    task = _task()

    class Trainer:
        world_size, global_rank, ckpt_path = 2, 1, None
        state = type("State", (), {"fn": "fit"})()

    task._trainer = Trainer()  # type: ignore[assignment]
    L.seed_everything(7, verbose=False)
    untouched = draws()
    for fn, saved in (("validate", states), ("fit", states[:1])):
        Trainer.state.fn = fn
        L.seed_everything(7, verbose=False)
        task.on_load_checkpoint({"vtdense_rng": saved})
        t, r, n = draws()
        assert torch.equal(t, untouched[0]) and (r, n) == untouched[1:]
    Trainer.state.fn = "fit"
    task.on_load_checkpoint({"vtdense_rng": states})
    t, r, n = draws()
    assert torch.equal(t, expected[1][0]) and (r, n) == expected[1][1:]


def test_checkpoint_callbacks_and_saved_generator_states() -> None:
    """``configure_callbacks``: the best/last checkpoint, one writing ``last.ckpt`` every
    ``checkpoint_every_n_steps`` optimiser steps, and the SIGTERM saver; ``on_save_checkpoint`` stores
    one generator state per process (what a resume on each rank reads back)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from vtdense.tasks.fault import CheckpointOnSigterm

    callbacks = _task(checkpoint_every_n_steps=3).configure_callbacks()
    steps = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps]
    assert [(cb._every_n_train_steps, cb.save_last, cb.save_top_k) for cb in steps] == [(3, True, 0)]
    assert sum(isinstance(cb, CheckpointOnSigterm) for cb in callbacks) == 1
    assert not any(isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps for cb in _task().configure_callbacks())
    ckpt: dict[str, Any] = {}
    task = _task()
    torch.manual_seed(3)
    task.on_save_checkpoint(ckpt)
    expected = torch.rand(2)
    torch.set_rng_state(ckpt["vtdense_rng"][0]["torch"])
    assert len(ckpt["vtdense_rng"]) == 1 and torch.equal(torch.rand(2), expected)


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
    # the same options spelt as tuples (Python) where the checkpoint has lists (YAML): it fits
    tuples = _NaNAt(backbone="swin_tiny", backbone_kwargs={"embed_dim": 16, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 2, 2),
                    "window_size": 4}, head="faster_rcnn", num_classes=2, fpn_channels=16, slim_heads=True, box_head_width=32)
    tuples.check_checkpoint_fits(ckpt, "a.ckpt")
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


def test_atomic_writes_take_names_at_the_file_system_limit(tmp_path: Path) -> None:
    """A file name of 251 bytes (valid on ext4's 255) is written atomically: the temporary name no
    longer adds a suffix to it ("File name too long" after a whole prediction run, before)."""
    from vtdense.tasks.base import atomic_write_bytes

    name = "写" * 82 + "a.png"
    assert len(name.encode()) == 251
    atomic_write_bytes(tmp_path / name, b"data")
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(2)}, tmp_path / ("写" * 82 + ".ckpt"))
    import vtdense

    backbone = "写" * 80 + ".safetensors"  # 252 bytes: save_backbone writes through a temporary file too
    vtdense.save_backbone(vtdense.create_backbone("swin_tiny", embed_dim=8, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                                  window_size=4), tmp_path / backbone)
    assert vtdense.load_backbone(tmp_path / backbone).out_channels[0] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "写" * 82 + ".ckpt", backbone])  # no temporary left
    assert (tmp_path / name).read_bytes() == b"data"
    assert torch.equal(torch.load(tmp_path / ("写" * 82 + ".ckpt"), weights_only=True)["w"], torch.ones(2))
