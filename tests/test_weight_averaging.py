"""Lightning's weight averaging callbacks with the tasks, whose network waits for the datamodule's class count.

``EMAWeightAveraging`` / ``WeightAveraging`` copy the model when fitting starts, before ``setup``
(where a task made with ``num_classes=None`` builds its network), after calling
``configure_model``: the tasks build the network there too. Before, the copy had no network and
the first update failed (segmentation), or the checkpoint held no network weights (detection).
``StochasticWeightAveraging`` copies it in its ``setup`` with no hook first: the task copies itself
for it again once built (before, it averaged nothing and its checkpoint state did not load).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

from tests.test_tasks_detection import SLIM, TINY, datamodule, trainer
from tests.test_tasks_segmentation import TINY_SWINV2
from vtdense.data.ade20k import ADE20KDataModule
from vtdense.data.synthetic import make_synthetic_coco
from vtdense.data.synthetic_seg import generate_synthetic_segmentation
from vtdense.tasks.detection import DetectionTask
from vtdense.tasks.segmentation import SegmentationTask

DECAY = 0.5


class _Weights(L.Callback):
    """Each step's weights, as the optimiser left them (runs before the averaging callback)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.starts: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.starts.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.steps.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def test_segmentation_trains_with_ema_and_its_checkpoints_hold_the_average(tmp_path: Path) -> None:
    root = generate_synthetic_segmentation(tmp_path / "ade", num_train=6, num_val=2, size_range=(36, 60), seed=3)
    dm = ADE20KDataModule(root=str(root), num_workers=0, scale=(64, 48), crop_size=(32, 32), batch_size=2)
    torch.manual_seed(0)
    task = SegmentationTask(backbone="swinv2_tiny", backbone_kwargs=TINY_SWINV2, arch_kwargs={"decoder_channels": 16},
                            aux_weight=0.0, warmup_steps=0, lr=1e-2)  # num_classes from the datamodule
    weights = _Weights()
    # 3 steps are one epoch: last.ckpt is written after its validation (with the weights swapped back)
    t = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, limit_val_batches=1,
                  num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[weights, EMAWeightAveraging(decay=DECAY)])
    t.fit(task, datamodule=dm)
    assert len(weights.steps) == 3
    ema = dict(weights.steps[0])  # the first update copies the weights, then ema = d * ema + (1 - d) * w
    for step in weights.steps[1:]:
        ema = {n: DECAY * ema[n] + (1 - DECAY) * step[n] for n in ema}
    final = dict(task.named_parameters())  # the fit ends with the average in the model
    for n, value in ema.items():
        torch.testing.assert_close(final[n], value, rtol=0, atol=1e-6)
    assert any(not torch.equal(weights.steps[-1][n], ema[n]) for n in ema)  # the average is not the last step

    last = t.checkpoint_callback.last_model_path  # the task's own checkpoint callback, in the run directory
    saved = torch.load(last, weights_only=True)
    assert "current_model_state" in saved  # the weights the run resumes with, beside the average
    loaded = SegmentationTask.from_checkpoint(last)
    for n, p in loaded.named_parameters():
        torch.testing.assert_close(p, ema[n], rtol=0, atol=1e-6)

    # resuming restores the weights the run had (not the average) and the average, which goes on
    more = _Weights()
    again = SegmentationTask(backbone="swinv2_tiny", backbone_kwargs=TINY_SWINV2, arch_kwargs={"decoder_channels": 16},
                             aux_weight=0.0, warmup_steps=0, lr=1e-2)
    L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False, limit_val_batches=0,
              default_root_dir=tmp_path / "resumed", callbacks=[more, EMAWeightAveraging(decay=DECAY)]).fit(
        again, datamodule=dm, ckpt_path=last)
    assert len(more.steps) == 1
    for n, value in more.starts[0].items():
        assert torch.equal(value, weights.steps[-1][n]), n
    for n, p in again.named_parameters():
        torch.testing.assert_close(p, DECAY * ema[n] + (1 - DECAY) * more.steps[0][n], rtol=0, atol=1e-6)


def test_detection_trains_with_ema_and_validates_the_average(tmp_path: Path) -> None:
    root = make_synthetic_coco(tmp_path / "coco", num_train=4, num_val=2, size_range=(64, 96), num_classes=2)
    torch.manual_seed(0)
    task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="faster_rcnn", num_classes=None, **SLIM)
    t = trainer(tmp_path, max_steps=2, logger=False, callbacks=[EMAWeightAveraging(decay=DECAY)])
    t.fit(task, datamodule=datamodule(root))
    last = t.checkpoint_callback.last_model_path
    saved = torch.load(last, weights_only=True)
    keys = [k for k in saved["state_dict"] if k.startswith("model.backbone.body.")]
    assert keys and set(saved["state_dict"]) == set(saved["current_model_state"])
    metrics = trainer(tmp_path, logger=False).validate(task, datamodule=datamodule(root), ckpt_path=last,
                                                       verbose=False)[0]
    assert "val/bbox_mAP" in metrics


def test_stochastic_weight_averaging_averages_the_built_network(tmp_path: Path) -> None:
    """Lightning's SWA averages the weights each SWA epoch starts with (``swa_epoch_start=2`` counts
    from 1: the second and third epochs of three here) and puts the average into the model when
    fitting ends."""
    root = generate_synthetic_segmentation(tmp_path / "ade", num_train=4, num_val=2, size_range=(36, 60), seed=3)
    dm = ADE20KDataModule(root=str(root), num_workers=0, scale=(64, 48), crop_size=(32, 32), batch_size=2)
    torch.manual_seed(0)
    task = SegmentationTask(arch="fpn", backbone="swinv2_tiny", backbone_kwargs=TINY_SWINV2, aux_weight=0.0, warmup_steps=0,
                            lr=1e-2, arch_kwargs={"decoder_pyramid_channels": 32, "decoder_segmentation_channels": 32})
    assert not StochasticWeightAveraging.pl_module_contains_batch_norm(task)  # no extra epoch to refresh BatchNorm
    weights = _Weights()
    L.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_progress_bar=False, limit_val_batches=0,
              default_root_dir=tmp_path, callbacks=[weights, StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2)]).fit(
        task, datamodule=dm)
    epoch_starts = weights.starts[::2]  # 2 steps per epoch
    assert len(epoch_starts) == 3
    for n, p in task.named_parameters():
        torch.testing.assert_close(p, (epoch_starts[1][n] + epoch_starts[2][n]) / 2, rtol=0, atol=1e-6)
