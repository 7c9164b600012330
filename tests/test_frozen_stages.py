"""``frozen_stages``: the patch embedding and the first stages frozen, as mmdet's ``frozen_stages`` and detectron2's ``freeze_at``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vtdense
from tests.test_tasks_segmentation import TINY_SWINV2, _task, _trainer

TINY = {
    "swin_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "swinv2_tiny": dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4),
    "mvitv2_tiny": dict(embed_dim=16, depths=(1, 2, 2, 1), window_size=16, img_size=64),
}


def _dependencies(name: str, k: int) -> set[str]:
    """The parameters the first ``k`` outputs depend on, found by autograd on an unfrozen model."""
    model = vtdense.create_backbone(name, **TINY[name])
    out = list(model(torch.randn(1, 3, 64, 96)).values())
    loss = sum(o.sum() for o in out[:k]) if k > 0 else model.patch_embed(torch.randn(1, 3, 64, 96)).sum()
    loss.backward()
    return {n for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(TINY))
def test_frozen_stages_are_what_the_first_outputs_depend_on(name: str) -> None:
    everything = {n for n, _ in vtdense.create_backbone(name, **TINY[name]).named_parameters()}
    for k in (-1, 0, 1, 2, 4):
        model = vtdense.create_backbone(name, frozen_stages=k, **TINY[name])
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen == (_dependencies(name, k) if k >= 0 else set()), k
        assert (frozen == everything) == (k == 4)


@pytest.mark.parametrize("name", sorted(TINY))
def test_frozen_stages_stay_frozen_and_in_inference_mode_while_training(name: str) -> None:
    """Under ``.train()`` the frozen stages keep eval mode (stochastic depth off: their outputs are
    inference's), get no gradients, and AdamW with weight decay leaves them bit for bit; the stages
    after them train. ``set_frozen_stages(-1)`` gives them back."""
    torch.manual_seed(0)
    model = vtdense.create_backbone(name, frozen_stages=2, drop_path_rate=0.5, **TINY[name])
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        ref = model.eval()(x)
    model.train()
    assert not model.patch_embed.training and not model.stage_modules()[1].training and model.stage_modules()[2].training
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.5)
    for _ in range(2):
        out = model(x)
        sum(o.square().mean() for o in out.values()).backward()
        opt.step()
        opt.zero_grad()
    for level in ("stage1", "stage2"):
        torch.testing.assert_close(out[level], ref[level], rtol=0, atol=0)
        assert not out[level].requires_grad  # autograd keeps nothing for the frozen stages
    assert not torch.allclose(out["stage3"], ref["stage3"])
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (not p.requires_grad), n
        assert p.grad is None or p.requires_grad
    model.set_frozen_stages(-1)
    assert all(p.requires_grad for p in model.parameters()) and all(m.training for m in model.modules())


def test_bad_frozen_stages_is_one_error_naming_the_option() -> None:
    for bad in (5, -2, True, "1", 1.0):
        with pytest.raises(ValueError, match=r"^frozen_stages must be an int from -1 \(none\) to 4"):
            vtdense.create_backbone("swin_tiny", frozen_stages=bad, **TINY["swin_tiny"])
    with pytest.raises(ValueError, match=r"to 2 \(every stage\), got 3"):  # only the stages built count
        vtdense.create_backbone("mvitv2_tiny", frozen_stages=3, out_indices=(0, 1), **TINY["mvitv2_tiny"])


def test_a_task_trains_only_the_stages_after_the_frozen_ones(tmp_path: Path) -> None:
    """``--model.backbone_kwargs '{frozen_stages: 2}'``: a fit leaves the frozen weights bit for bit,
    the optimiser does not hold them, the rest of the backbone trains; a saved backbone keeps the
    setting."""
    torch.manual_seed(0)
    task = _task(backbone_kwargs={**TINY_SWINV2, "frozen_stages": 2, "drop_path_rate": 0.3}, aux_weight=0.0)
    backbone = task.model.encoder.backbone
    before = {n: p.detach().clone() for n, p in backbone.named_parameters()}
    image, mask = torch.rand(2, 3, 32, 48), torch.randint(0, 3, (2, 32, 48))
    batch = {"image": image, "mask": mask, "image_size": torch.tensor([[32, 48]] * 2), "mask_size": torch.tensor([[32, 48]] * 2)}
    _trainer(tmp_path, max_steps=3, limit_val_batches=0, enable_checkpointing=False, logger=False).fit(
        task, train_dataloaders=torch.utils.data.DataLoader([batch] * 3, batch_size=None))
    held = {id(p) for g in task.trainer.optimizers[0].param_groups for p in g["params"]}
    frozen = [n for n, p in backbone.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("patch_embed.", "layers.0.", "layers.1.", "out_norms.stage1.", "out_norms.stage2.")) for n in frozen)
    for n, p in backbone.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n
        assert (id(p) in held) == (n not in frozen), n
    vtdense.save_backbone(backbone, tmp_path / "b.safetensors")
    assert vtdense.load_backbone(tmp_path / "b.safetensors").frozen_stages == 2
