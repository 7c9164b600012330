"""The tasks' AdamW: torch's fused kernel where it applies, the default where Lightning or the
parameters rule it out, and the same updates either way."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from vtdense.data.coco import COCODataModule
from vtdense.data.synthetic import make_synthetic_coco
from vtdense.tasks.detection import DetectionTask
from vtdense.tasks.optim import adamw, fused_adamw_blocker, param_groups

TINY = dict(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=4)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _train(fused: bool, steps: int = 6) -> list[torch.Tensor]:
    model = _model()
    groups = param_groups(model, 0.05)
    for g, lr in zip(groups, (1e-2, 3e-3)):
        g["lr"] = lr
        g.pop("param_names")
    opt = adamw(groups, fused=fused, lr=1e-2, weight_decay=0.05)
    assert opt.defaults["fused"] is fused
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_updates_equal_the_default() -> None:
    start = [p.detach().clone() for p in _model().parameters()]
    fused, default = _train(True), _train(False)
    for a, b, s in zip(fused, default, start):
        assert not torch.equal(a, s)  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _trainer(tmp_path: Path, **kwargs: object) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), **kwargs)


def test_auto_choice_follows_precision_and_clipping(tmp_path: Path) -> None:
    params = list(_model().parameters())
    # fp32 with clipping, bf16 without: fused.
    assert fused_adamw_blocker(params, _trainer(tmp_path, precision="32-true", gradient_clip_val=1.0)) is None
    assert fused_adamw_blocker(params, _trainer(tmp_path, precision="bf16-mixed")) is None
    assert adamw([{"params": params}], trainer=_trainer(tmp_path, precision="bf16-mixed")).defaults["fused"] is True
    # bf16 with clipping: Lightning refuses to clip a fused optimizer, so auto keeps the default ...
    clipped = _trainer(tmp_path, precision="bf16-mixed", gradient_clip_val=1.0)
    reason = fused_adamw_blocker(params, clipped)
    assert reason is not None and "gradient_clip_val=1.0" in reason and "bf16-mixed" in reason
    assert adamw([{"params": params}], trainer=clipped).defaults["fused"] is False
    # ... and asking for it is one clear error naming the option and the cause.
    with pytest.raises(ValueError, match=r"fused_optimizer=True cannot be used with gradient clipping \(trainer.gradient_clip_val"):
        adamw([{"params": params}], fused=True, trainer=clipped)
    # fp16 loss scaling: auto keeps the default (callbacks see unscaled gradients); asked for, it is allowed.
    scaled = _trainer(tmp_path, plugins=[MixedPrecision("16-mixed", device="cpu")])
    assert "loss scaling" in str(fused_adamw_blocker(params, scaled))
    assert adamw([{"params": params}], trainer=scaled).defaults["fused"] is False
    assert adamw([{"params": params}], fused=True, trainer=scaled).defaults["fused"] is True


def test_parameters_torch_has_no_fused_kernel_for_keep_the_default() -> None:
    meta = [nn.Parameter(torch.empty(3, 3, device="meta"))]
    assert "meta" in str(fused_adamw_blocker(meta))
    assert adamw([{"params": meta}]).defaults["fused"] is False
    with pytest.raises(ValueError, match="parameters on meta"):
        adamw([{"params": meta}], fused=True)


def test_parameters_the_fused_kernel_cannot_step_are_named() -> None:
    """The blocker's parameter checks one by one: tensors on two devices (here the CPU and meta), a
    tensor subclass other than FSDP2's DTensor, and a non-float tensor each keep the default
    optimizer and name the cause; plain float parameters on one device pass."""

    class Sub(torch.Tensor):
        pass

    cpu = nn.Parameter(torch.zeros(2))
    assert fused_adamw_blocker([cpu, nn.Parameter(torch.zeros(2))]) is None
    assert "several devices (cpu, meta)" in str(fused_adamw_blocker([cpu, nn.Parameter(torch.zeros(2, device="meta"))]))
    assert "Sub (a tensor subclass)" in str(fused_adamw_blocker([cpu, torch.zeros(2).as_subclass(Sub)]))
    assert "dtype torch.int64" in str(fused_adamw_blocker([cpu, torch.zeros(2, dtype=torch.int64)]))


def test_bf16_training_with_clipping_runs_on_the_default_optimizer(tmp_path: Path) -> None:
    """Under ``bf16-mixed`` with ``gradient_clip_val`` the auto choice must not hand Lightning a fused
    optimizer (Lightning raises at the first step); without clipping the task steps fused."""
    root = make_synthetic_coco(tmp_path / "coco", num_train=4, num_val=2, size_range=(64, 80), num_classes=2, seed=3)
    for clip, fused in ((1.0, False), (None, True)):
        torch.manual_seed(0)
        task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="faster_rcnn", num_classes=2,
                             fpn_channels=32, slim_heads=True, box_head_width=32, rois_per_image=16, warmup_steps=1)
        before = {k: v.clone() for k, v in task.state_dict().items() if "backbone" in k}
        dm = COCODataModule(root=str(root), batch_size=2, num_workers=0, train_scales=[64], max_size=96, test_scale=64)
        trainer = _trainer(tmp_path, precision="bf16-mixed", gradient_clip_val=clip, max_steps=2, limit_val_batches=0)
        trainer.fit(task, datamodule=dm)
        assert trainer.global_step == 2
        assert trainer.optimizers[0].defaults["fused"] is fused
        moved = [k for k, v in task.state_dict().items() if k in before and not torch.equal(v, before[k])]
        assert moved, "the optimiser steps changed no backbone weight"


def test_resume_steps_with_the_implementation_chosen_now(tmp_path: Path) -> None:
    """A checkpoint of an unfused run resumes fused where fused applies (its step counts moved as the
    fused kernel keeps them), and a fused one resumes unfused under bf16 with clipping."""
    root = make_synthetic_coco(tmp_path / "coco", num_train=4, num_val=2, size_range=(64, 80), num_classes=2, seed=4)
    runs = (  # (fused_optimizer, precision, clip) saved -> resumed, and the implementation expected after the resume
        ((False, "32-true", None), (None, "32-true", None), True),
        ((None, "bf16-mixed", None), (None, "bf16-mixed", 1.0), False),
    )
    for i, (saved, resumed, expect) in enumerate(runs):
        ckpt = tmp_path / f"run{i}.ckpt"
        for (fused, precision, clip), steps in ((saved, 2), (resumed, 4)):
            torch.manual_seed(0)
            task = DetectionTask(backbone="swin_tiny", backbone_kwargs=TINY, head="faster_rcnn", num_classes=2,
                                 fpn_channels=32, slim_heads=True, box_head_width=32, rois_per_image=16, warmup_steps=1,
                                 fused_optimizer=fused)
            dm = COCODataModule(root=str(root), batch_size=2, num_workers=0, train_scales=[64], max_size=96,
                                test_scale=64)
            trainer = _trainer(tmp_path, precision=precision, gradient_clip_val=clip, max_steps=steps, limit_val_batches=0)
            trainer.fit(task, datamodule=dm, ckpt_path=str(ckpt) if steps == 4 else None)
            if steps == 2:
                assert trainer.optimizers[0].param_groups[0]["fused"] is (fused is not False)
                trainer.save_checkpoint(ckpt)
        opt = trainer.optimizers[0]
        assert trainer.global_step == 4
        assert all(g["fused"] is expect for g in opt.param_groups)
        steps_done = {float(s["step"]) for s in opt.state.values()}
        assert steps_done == {4.0}, steps_done  # restored at 2, then two more steps
        if expect:
            assert all(s["step"].dtype == torch.float32 for s in opt.state.values())
