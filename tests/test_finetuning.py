"""Lightning's ``BackboneFinetuning`` with the tasks, in one process (two: ``tests/test_distributed.py``).

The backbone stays as it was while frozen, trains from the callback's epoch on, keeps its
``frozen_stages`` frozen, and goes on training after a resume past that epoch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback

from vtdense.backbones.base import Backbone
from vtdense.data.synthetic_seg import generate_synthetic_segmentation
from vtdense.strategies import VtdenseFSDPStrategy
from vtdense.tasks.detection import DetectionTask
from vtdense.tasks.finetuning import check_finetuning_callbacks
from vtdense.tasks.segmentation import SegmentationTask

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from ddp_validate import TINY_SWIN, build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def ade(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_synthetic_segmentation(tmp_path_factory.mktemp("ft") / "ade", num_train=4, num_val=2,
                                           size_range=(48, 64), seed=4)


class Snapshots(Callback):
    """The backbone's and the decoder's weights at fit start and after every epoch."""

    def __init__(self) -> None:
        self.seen: dict[object, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    def _take(self, pl_module: SegmentationTask) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        grab = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
        return grab(pl_module.backbone), grab(pl_module.model.decoder)

    def on_fit_start(self, trainer: L.Trainer, pl_module: SegmentationTask) -> None:
        self.seen["start"] = self._take(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: SegmentationTask) -> None:
        self.seen[trainer.current_epoch] = self._take(pl_module)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> set[str]:
    return {k for k in a if k.startswith(prefix) and not torch.equal(a[k], b[k])}


class StopAfter(Callback):
    """Stops the run after an epoch, as a killed job stops (its last checkpoint is then that epoch's)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: SegmentationTask) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def _fit(model: SegmentationTask, dm: object, root: Path, epochs: int, ckpt: str | None = None,
         stop_after: int | None = None) -> Snapshots:
    snaps = Snapshots()
    extra = [StopAfter(stop_after)] if stop_after is not None else []
    trainer = L.Trainer(max_epochs=epochs, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), snaps, *extra], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return snaps


def test_backbone_frozen_then_trained_and_resumed_past_the_unfreezing(ade: Path, tmp_path: Path) -> None:
    model, dm = build("segmentation", str(ade))
    snaps = _fit(model, dm, tmp_path, epochs=4, stop_after=2)
    assert set(snaps.seen) == {"start", 0, 1, 2}
    start, e0, e1 = snaps.seen["start"], snaps.seen[0], snaps.seen[1]
    assert not _changed(start[0], e0[0]) and _changed(start[1], e0[1]) == set(start[1])  # epoch 0: head only
    assert _changed(e0[0], e1[0]) == set(e0[0])  # epoch 1: every backbone weight trains
    # resumed past the unfreezing epoch: the backbone goes on training (Lightning alone froze it for good).
    # (Lightning resumes a checkpoint written at an epoch's last validation at that epoch or the next.)
    last = sorted(tmp_path.rglob("last.ckpt"))
    assert len(last) == 1
    model2, dm2 = build("segmentation", str(ade))
    again = _fit(model2, dm2, tmp_path / "resumed", epochs=4, ckpt=str(last[0]))
    resumed = sorted(k for k in again.seen if k != "start")
    assert resumed and resumed[-1] == 3 and resumed[0] in (2, 3)
    for name, value in again.seen["start"][0].items():  # it starts from the weights the checkpoint holds
        torch.testing.assert_close(value, snaps.seen[resumed[0] - 1][0][name], rtol=0, atol=0)
    assert _changed(again.seen["start"][0], again.seen[3][0]) == set(e1[0])


def test_frozen_stages_stay_frozen_when_the_backbone_is_unfrozen(ade: Path, tmp_path: Path) -> None:
    model, dm = build("segmentation", str(ade))
    torch.manual_seed(0)
    model = SegmentationTask(backbone="swin_tiny", backbone_kwargs={**TINY_SWIN, "frozen_stages": 1}, num_classes=8,
                             arch_kwargs={"decoder_channels": 16}, aux_channels=16, num_vis=0, lr=1e-3, warmup_steps=1,
                             head_layout="smp")
    snaps = _fit(model, dm, tmp_path, epochs=2)
    start, e1 = snaps.seen["start"][0], snaps.seen[1][0]
    frozen = {k for k in start if k.startswith(("patch_embed.", "layers.0.", "out_norms.stage1."))}
    assert frozen and not _changed(start, e1) & frozen
    assert _changed(start, e1) == set(start) - frozen


def test_task_backbone_is_the_vtdense_backbone(ade: Path) -> None:
    seg, _ = build("segmentation", str(ade))
    assert seg.backbone is seg.model.encoder.backbone and isinstance(seg.backbone, Backbone)
    det = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY_SWIN, num_classes=3, fpn_channels=16, slim_heads=True,
                        mask_head_channels=16, mask_head_layers=1, box_head_width=32)
    assert det.backbone is det.model.backbone.body and isinstance(det.backbone, Backbone)
    waiting = SegmentationTask(backbone="swin_tiny", backbone_kwargs=TINY_SWIN, num_classes=None)
    with pytest.raises(RuntimeError, match="class count comes from the datamodule"):
        waiting.backbone


def test_finetuning_callbacks_refused_under_sharding() -> None:
    sharded = SimpleNamespace(callbacks=[BackboneFinetuning()], strategy=VtdenseFSDPStrategy(), world_size=2)
    with pytest.raises(ValueError, match=r"BackboneFinetuning .* VtdenseFSDPStrategy cannot follow"):
        check_finetuning_callbacks(sharded)
    check_finetuning_callbacks(SimpleNamespace(callbacks=[], strategy=VtdenseFSDPStrategy(), world_size=2))
    check_finetuning_callbacks(SimpleNamespace(callbacks=[BackboneFinetuning()], strategy=VtdenseFSDPStrategy(), world_size=1))
