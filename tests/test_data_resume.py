"""Resumable training data: a restored loader continues the epoch bit-for-bit; augmentation is per-sample seeded."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from vtdense.data import ADE20KDataModule, COCODataModule
from vtdense.data.synthetic_seg import SYNTHETIC_CLASSES, generate_synthetic_segmentation

SMALL: dict[str, Any] = {"train_scales": [48, 64], "max_size": 96, "test_scale": 64}


@pytest.fixture(scope="module")
def ade_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_synthetic_segmentation(
        tmp_path_factory.mktemp("ade") / "ade", num_train=9, num_val=1, size_range=(40, 56), seed=3
    )


def _coco(root: Path, workers: int, grouped: bool) -> COCODataModule:
    return COCODataModule(
        root=str(root), batch_size=2, num_workers=workers, persistent_workers=False, group_by_aspect_ratio=grouped,
        **SMALL,
    )


def _ade(root: Path, workers: int) -> ADE20KDataModule:
    return ADE20KDataModule(
        root=str(root), num_classes=len(SYNTHETIC_CLASSES), batch_size=2, num_workers=workers,
        persistent_workers=False, scale=(64, 48), crop_size=(32, 32),
    )


def _loader(make: Callable[[], Any], epoch: int | None) -> StatefulDataLoader:
    dm = make()
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    if epoch is not None:
        loader.batch_sampler.sampler.set_epoch(epoch)  # what Lightning's fit loop does each epoch
    return loader


def _assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """Bit-for-bit equality of nested batches (tensors: dtype, shape and values)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint stores and reloads it (``weights_only=True``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


CASES = {
    "coco": lambda root, ade, w: _coco(root, w, grouped=False),
    "coco_grouped": lambda root, ade, w: _coco(root, w, grouped=True),
    "ade20k": lambda root, ade, w: _ade(ade, w),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_restored_loader_continues_the_epoch_bit_for_bit(
    case: str, workers: int, coco_root: Path, ade_small: Path
) -> None:
    make = lambda: CASES[case](coco_root, ade_small, workers)  # noqa: E731
    reference = list(_loader(make, epoch=1))
    assert len(reference) >= 4
    for k in (1, 3) if workers == 0 else (3,):
        loader = _loader(make, epoch=1)
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = _roundtrip(loader.state_dict())  # mid-epoch, with batches prefetched by the workers
        _assert_same(head + list(it), reference, "uninterrupted")  # (drained: workers exit normally)
        del it, loader
        resumed = _loader(make, epoch=None)  # fresh datamodule; the epoch comes from the state
        resumed.load_state_dict(state)
        _assert_same(list(resumed), reference[k:], f"tail after {k}")
        if k == 3:  # the following epoch is the uninterrupted run's next epoch
            resumed.batch_sampler.sampler.set_epoch(2)
            _assert_same(list(resumed), list(_loader(make, epoch=2)), "next epoch")


def _by_image(batches: list[Any], case: str) -> dict[Any, Any]:
    """``{image key: (image, target)}`` over an epoch."""
    out = {}
    if case == "ade20k":
        for b in batches:
            for image, mask, size in zip(b["image"], b["mask"], b["image_size"]):
                out[len(out)] = (image, mask, size)
        return out
    for images, targets in batches:
        for image, target in zip(images, targets):
            out[target["image_id"]] = (image, target)
    return out


def test_augmentation_is_per_sample_whatever_the_workers_or_batch_size(coco_root: Path) -> None:
    def epoch(workers: int, batch_size: int, ep: int, grouped: bool = False) -> dict[Any, Any]:
        dm = COCODataModule(
            root=str(coco_root), batch_size=batch_size, num_workers=workers, persistent_workers=False,
            group_by_aspect_ratio=grouped, **SMALL,
        )
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.batch_sampler.sampler.set_epoch(ep)
        return _by_image(list(loader), "coco")

    base = epoch(0, 2, 1)
    assert len(base) == 12
    for other in (epoch(0, 5, 1, grouped=True), epoch(2, 3, 1, grouped=True)):
        assert other.keys() == base.keys()
        for key in base:
            _assert_same(other[key], base[key], f"image {key}")
    # another epoch draws other augmentations (scale choice or flip) for some images
    next_epoch = epoch(0, 2, 2)
    differ = sum(
        base[k][0].shape != next_epoch[k][0].shape or not torch.equal(base[k][0], next_epoch[k][0]) for k in base
    )
    assert differ >= 6


def test_ade20k_augmentation_does_not_depend_on_workers(ade_small: Path) -> None:
    a = list(_loader(lambda: _ade(ade_small, 0), epoch=3))
    b = list(_loader(lambda: _ade(ade_small, 2), epoch=3))
    _assert_same(a, b)
    c = list(_loader(lambda: _ade(ade_small, 0), epoch=4))
    assert not torch.equal(torch.cat([x["image"] for x in a]), torch.cat([x["image"] for x in c]))


def test_loading_in_the_main_process_leaves_the_global_rng_alone(coco_root: Path, ade_small: Path) -> None:
    import random

    import numpy as np

    for make in (lambda: _coco(coco_root, 0, True), lambda: _ade(ade_small, 0)):
        loader = _loader(make, epoch=0)
        torch.manual_seed(123)
        random.seed(123)
        np.random.seed(123)
        states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        for _ in loader:
            pass
        assert torch.equal(torch.get_rng_state(), states[0])
        assert random.getstate() == states[1]
        assert np.array_equal(np.random.get_state()[1], states[2])


def test_sample_seeds_are_distinct_63_bit_and_documented() -> None:
    """``sample_seed`` mixes ``(base seed, epoch, index)`` with numpy's SeedSequence, as documented:
    no two (epoch, index) pairs share a seed (a sum or a dropped term would make e.g. sample 1 of
    epoch 0 and sample 0 of epoch 1 augment alike), and seeds use the whole 63-bit range."""
    import numpy as np

    from vtdense.data.seeding import sample_seed

    seeds = {(e, i): sample_seed(3, e, i) for e in range(8) for i in range(64)}
    assert len(set(seeds.values())) == len(seeds)
    assert sample_seed(3, 1, 2) != sample_seed(3, 2, 1) != sample_seed(2, 1, 3)
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert max(seeds.values()) >= 2**62  # 512 draws from [0, 2**63): all below 2**62 has odds 2**-512
    # the documented mixing, so a run resumed with a later vtdense augments its samples the same way
    ref = np.random.SeedSequence([3, 5, 7]).generate_state(1, dtype=np.uint64)[0]
    assert sample_seed(3, 5, 7) == int(ref) >> 1


def test_seeded_dataset_seeds_torch_random_and_numpy_per_sample() -> None:
    """A sample's draws from any of the three global generators depend only on its key, and a
    negative base seed (SeedSequence rejects it) is refused up front."""
    import random

    import numpy as np

    from vtdense.data.seeding import SampleKey, SeededDataset

    class Draws(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[float, float, float]:
            return float(torch.rand(())), random.random(), float(np.random.rand())

    ds = SeededDataset(Draws(), seed=5)
    a = ds[SampleKey(2, 1)]
    np.random.seed(0)  # the caller's state must not matter
    random.seed(0)
    torch.manual_seed(0)
    assert ds[SampleKey(2, 1)] == a and ds[(2, 1)] == a
    for other in (ds[SampleKey(2, 0)], ds[SampleKey(1, 1)], SeededDataset(Draws(), seed=6)[SampleKey(2, 1)]):
        assert all(x != y for x, y in zip(a, other))  # each generator is reseeded per sample
    assert ds[2] == ds[SampleKey(2, 0)]
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        SeededDataset(Draws(), seed=-1)


def test_state_from_another_world_size_is_a_clear_error(coco_root: Path) -> None:
    loader = _loader(lambda: _coco(coco_root, 0, True), epoch=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["_sampler_iter_state"]["world_size"] = 2
    fresh = _loader(lambda: _coco(coco_root, 0, True), epoch=0)
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match="saved with 2 processes but this run has 1"):
        iter(fresh)


# ------------------------------------------------------------------------------ through Lightning
class _Recorder(L.LightningModule):
    """Records ``(epoch, batch_idx, image ids, per-image pixel sums)`` of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, int, list[int], list[float]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        self.seen.append(
            (self.current_epoch, batch_idx, [t["image_id"] for t in targets], [float(i.double().sum()) for i in images])
        )
        return sum((self.w - i.mean()) ** 2 for i in images)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_checkpoint_holds_the_loader_position_and_resume_continues_the_epoch(
    coco_root: Path, tmp_path: Path
) -> None:
    def fit(max_steps: int = -1, ckpt_path: str | None = None, callbacks: list[Any] | None = None) -> _Recorder:
        L.seed_everything(0, verbose=False)
        model = _Recorder()
        trainer = L.Trainer(
            accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, num_sanity_val_steps=0, max_epochs=2, max_steps=max_steps,
            callbacks=callbacks, enable_checkpointing=callbacks is not None, default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule=_coco(coco_root, 0, grouped=True), ckpt_path=ckpt_path)
        return model

    full = fit().seen
    assert len(full) == 12 and {e for e, *_ in full} == {0, 1}
    ckpt_dir = tmp_path / "ckpt"
    part = fit(max_steps=3, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)]).seen
    (ckpt_file,) = ckpt_dir.glob("*.ckpt")
    state = torch.load(ckpt_file, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state[0]["_sampler_iter_state"] == {"epoch": 0, "world_size": 1, "yielded": 3}
    resumed = fit(ckpt_path=str(ckpt_file)).seen
    assert part == full[:3] and resumed == full[3:]  # same images, same augmentation, same batch indices


def test_state_from_another_worker_count_names_the_option(coco_root: Path) -> None:
    for saved_workers, now_workers in ((0, 2), (2, 0)):
        loader = _loader(lambda: _coco(coco_root, saved_workers, False), epoch=0)
        it = iter(loader)
        next(it)
        state = _roundtrip(loader.state_dict())
        list(it)
        fresh = _loader(lambda: _coco(coco_root, now_workers, False), epoch=0)
        with pytest.raises(ValueError, match=f"saved with num_workers={saved_workers}, but this run has num_workers={now_workers}"):
            fresh.load_state_dict(state)
