"""Aspect-ratio grouped batch sampler: homogeneous batches, each index once, disjoint DDP shards."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
from lightning.fabric.utilities.data import _replace_dunder_methods
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from vtdense.data import COCODataModule
from vtdense.data.samplers import EpochRandomSampler, GroupedBatchSampler, aspect_ratio_group_ids, make_train_loader
from vtdense.data.seeding import SampleKey

SMALL: dict[str, Any] = {"train_scales": [48, 64], "max_size": 96, "test_scale": 64}


def _groups(n: int, num_groups: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(num_groups) for _ in range(n)]


def _epoch(bs: GroupedBatchSampler, epoch: int) -> list[list[int]]:
    bs.set_epoch(epoch)
    return list(bs)


# ------------------------------------------------------------------------------- group ids
def test_aspect_ratio_group_ids() -> None:
    sizes = [(100, 50), (50, 100), (80, 80), (10, 30), (30, 10)]
    assert aspect_ratio_group_ids(sizes) == [0, 1, 1, 1, 0]
    assert aspect_ratio_group_ids(sizes, bins=(0.75, 1.5)) == [0, 2, 1, 2, 0]
    with pytest.raises(ValueError, match="image 1 has size 0x5"):
        aspect_ratio_group_ids([(4, 4), (0, 5)])
    with pytest.raises(ValueError, match="increasing"):
        aspect_ratio_group_ids(sizes, bins=(2.0, 1.0))


# -------------------------------------------------------------------------------- 1 process
@pytest.mark.parametrize("drop_last", [False, True])
def test_one_process_batches_are_homogeneous_and_cover_each_index_once(drop_last: bool) -> None:
    n, batch_size = 103, 4
    groups = _groups(n, 3)
    bs = GroupedBatchSampler(EpochRandomSampler(range(n), seed=5), batch_size, drop_last, group_ids=groups)
    counts = Counter(groups)
    for epoch in range(3):
        batches = _epoch(bs, epoch)
        assert len(batches) == len(bs)
        for batch in batches:
            assert len({groups[i] for i in batch}) == 1
            assert 1 <= len(batch) <= batch_size
            assert not drop_last or len(batch) == batch_size
        seen = Counter(i for b in batches for i in b)
        if drop_last:  # each index at most once; per group, fewer than batch_size left out
            assert max(seen.values()) == 1
            for g, c in counts.items():
                assert c - sum(1 for i in seen if groups[i] == g) == c % batch_size
        else:
            assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}
            # only the last incomplete batch of each group is short
            assert sum(len(b) < batch_size for b in batches) == sum(c % batch_size != 0 for c in counts.values())
    # the order is a function of (seed, epoch): reproducible, different between epochs and seeds
    assert _epoch(bs, 1) == _epoch(bs, 1)
    assert _epoch(bs, 1) != _epoch(bs, 2)
    other = GroupedBatchSampler(EpochRandomSampler(range(n), seed=6), batch_size, drop_last, group_ids=groups)
    assert _epoch(other, 1) != _epoch(bs, 1)


def test_no_groups_is_plain_shuffled_batching_and_with_epoch_tags_indices() -> None:
    sampler = EpochRandomSampler(range(10), seed=3)
    sampler.set_epoch(4)
    bs = GroupedBatchSampler(sampler, 3, with_epoch=True)
    batches = list(bs)
    order = sampler.order()
    assert [k.index for b in batches for k in b] == order  # one group: batches follow the permutation
    assert [len(b) for b in batches] == [3, 3, 3, 1] and len(bs) == 4
    assert all(isinstance(k, SampleKey) and k.epoch == 4 for b in batches for k in b)
    seq = GroupedBatchSampler(SequentialSampler(range(5)), 2)
    assert list(seq) == [[0, 1], [2, 3], [4]]


def test_plan_matches_a_hand_computed_example() -> None:
    """The exact batch plan of a small case, worked out by hand from the module's three rules: full
    batches in the order their group fills, then each group's leftover in group-id order, then
    (2 ranks) the first batches repeated to a multiple of the world size and dealt round-robin."""
    groups = [1, 0, 1, 1, 0, 0, 1, 2, 1]  # indices 0..8 in order (SequentialSampler)
    bs = GroupedBatchSampler(SequentialSampler(range(9)), 2, group_ids=groups)
    # group 1 fills [0, 2] then [3, 6]; group 0 fills [1, 4]; leftovers: group 0 [5], group 1 [8], group 2 [7]
    plan = [[0, 2], [1, 4], [3, 6], [5], [8], [7]]
    assert list(bs) == plan and len(bs) == 6
    dropped = GroupedBatchSampler(SequentialSampler(range(9)), 2, drop_last=True, group_ids=groups)
    assert list(dropped) == [[0, 2], [1, 4], [3, 6]] and len(dropped) == 3
    # 4 ranks: 6 batches padded with the first 2 to 8; rank r takes r, r + 4
    shards = []
    for rank in range(4):
        dist = DistributedSampler(range(9), num_replicas=4, rank=rank, shuffle=False)
        shard = GroupedBatchSampler(dist, 2, group_ids=groups)
        shards.append(list(shard))
        assert len(shard) == 2
    assert shards == [[[0, 2], [8]], [[1, 4], [7]], [[3, 6], [0, 2]], [[5], [1, 4]]]
    # drop_last: 3 full batches truncated to the 2 that make a multiple of 2 ranks
    halves = [list(GroupedBatchSampler(DistributedSampler(range(9), 2, r, shuffle=False), 2, True, groups)) for r in (0, 1)]
    assert halves == [[[0, 2]], [[1, 4]]]


def test_resume_at_the_end_of_an_epoch_and_past_it() -> None:
    """A checkpoint saved after the last batch of an epoch (Lightning saves on the last step too)
    restores to an exhausted iterator; a position past the end or negative is a clear error."""
    bs = GroupedBatchSampler(EpochRandomSampler(range(7), seed=2), 2)
    bs.set_epoch(3)
    it = iter(bs)
    full = list(it)
    state = it.state_dict()
    assert len(full) == 4 and state == {"epoch": 3, "world_size": 1, "yielded": 4}
    bs.set_epoch(0)  # a fresh run: the epoch comes from the state
    resumed = iter(bs)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    partial = iter(bs)
    partial.load_state_dict({**state, "yielded": 1})
    assert list(partial) == full[1:]
    for bad in (5, -1):
        with pytest.raises(ValueError, match=f"says {bad} batches were drawn of 4"):
            iter(bs).load_state_dict({**state, "yielded": bad})


def test_train_loader_seed_defaults_to_lightnings_global_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``seed=None`` takes ``$PL_GLOBAL_SEED`` (what ``seed_everything`` sets, and what Lightning's own
    DistributedSampler is seeded with), so the batch order and the per-sample seeds follow the run's seed."""
    data = list(range(10))

    def batches(loader: Any) -> list[list[int]]:
        return [list(b) for b in loader]

    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    loader = make_train_loader(data, 3, collate_fn=list)
    assert loader.batch_sampler.sampler.seed == 11 and loader.dataset.seed == 11
    assert batches(loader) == batches(make_train_loader(data, 3, collate_fn=list, seed=11))
    assert batches(loader) != batches(make_train_loader(data, 3, collate_fn=list, seed=0))
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert make_train_loader(data, 3, collate_fn=list).batch_sampler.sampler.seed == 0


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="group_ids has 3 entries but the sampler's dataset has 4"):
        GroupedBatchSampler(EpochRandomSampler(range(4)), 2, group_ids=[0, 1, 0])
    with pytest.raises(ValueError, match="batch_size"):
        GroupedBatchSampler(EpochRandomSampler(range(4)), 0)
    # a sampler whose order is not a function of the epoch cannot be resumed mid-epoch
    bs = GroupedBatchSampler(torch.utils.data.RandomSampler(range(6)), 2)
    it = iter(bs)
    next(it)
    with pytest.raises(TypeError, match="not a function of the epoch"):
        it.load_state_dict(it.state_dict())

    # a DistributedSampler subclass with its own indices cannot be sharded by batch: refused, not ignored
    class OwnShard(DistributedSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(self.rank, len(self.dataset), self.num_replicas))

    with pytest.raises(TypeError, match="cannot shard by batch with OwnShard"):
        list(GroupedBatchSampler(OwnShard(range(6), num_replicas=2, rank=0), 2))

    # a sampler that yields fewer indices than its length would silently skip items
    class Short(torch.utils.data.Sampler):
        def __len__(self) -> int:
            return 6

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(5))

    with pytest.raises(ValueError, match="needs a sampler over all 6 items of the dataset, got 5 indices"):
        list(GroupedBatchSampler(Short(), 2))


# ------------------------------------------------------------------------------- 2 ranks
@pytest.mark.parametrize("n, drop_last", [(96, False), (103, False), (103, True)])
def test_two_ranks_get_disjoint_grouped_shards_of_equal_length(n: int, drop_last: bool) -> None:
    batch_size, world = 4, 2
    groups = _groups(n, 2, seed=1)
    single = GroupedBatchSampler(EpochRandomSampler(range(n), seed=7), batch_size, drop_last, group_ids=groups)
    shards = []
    for rank in range(world):
        dist = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
        bs = GroupedBatchSampler(dist, batch_size, drop_last, group_ids=groups)
        shards.append(_epoch(bs, 3))
        assert len(shards[-1]) == len(bs)
    assert len(shards[0]) == len(shards[1])  # DDP needs the same step count on every rank
    for batch in shards[0] + shards[1]:
        assert len({groups[i] for i in batch}) == 1
    # rank r takes batches r, r + 2, ... of the one-process plan of the same seed and epoch
    plan = _epoch(single, 3)
    for rank in range(world):
        assert shards[rank] == (plan + plan)[rank : 2 * len(shards[rank]) : world]
    ids = [set(i for b in shard for i in b) for shard in shards]
    if drop_last:
        assert not ids[0] & ids[1]
    elif len(plan) % world == 0:
        assert not ids[0] & ids[1] and ids[0] | ids[1] == set(range(n))
    else:  # one batch repeated so both ranks take the same number of steps
        assert ids[0] | ids[1] == set(range(n))
        assert shards[1][-1] == plan[0] and ids[0] & ids[1] == set(plan[0])
    # the epoch reaches the shards through the DistributedSampler
    dist0 = DistributedSampler(range(n), num_replicas=world, rank=0, shuffle=True, seed=7)
    assert _epoch(GroupedBatchSampler(dist0, batch_size, drop_last, group_ids=groups), 4) != shards[0]


def _lightning_loader(dm: COCODataModule) -> DataLoader:
    """The training loader as Lightning requests it (init arguments captured for re-instantiation)."""
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        return dm.train_dataloader()


def test_lightning_injects_its_distributed_sampler_into_the_grouped_loader(coco_root: Path) -> None:
    """What Lightning does under DDP with ``use_distributed_sampler=True``, for ranks 0 and 1."""
    sizes = {
        img["id"]: (img["height"], img["width"])
        for img in json.loads((coco_root / "annotations" / "instances_train2017.json").read_text())["images"]
    }
    dm = COCODataModule(root=str(coco_root), batch_size=2, group_by_aspect_ratio=True, **SMALL)
    dm.setup("fit")
    loader = _lightning_loader(dm)
    assert _is_dataloader_shuffled(loader)  # so Lightning's DistributedSampler shuffles
    shards: list[list[list[int]]] = []
    for rank in range(2):
        dist = _get_distributed_sampler(
            loader, shuffle=True, overfit_batches=0, mode=RunningStage.TRAINING, num_replicas=2, rank=rank, seed=0
        )
        assert type(dist) is DistributedSampler
        wrapped = _update_dataloader(loader, dist, mode=RunningStage.TRAINING)
        assert type(wrapped) is type(loader) and isinstance(wrapped.batch_sampler, GroupedBatchSampler)
        assert wrapped.batch_sampler.sampler is dist and wrapped.batch_sampler.group_ids == loader.batch_sampler.group_ids
        _set_sampler_epoch(wrapped, 1)  # what the fit loop calls at each epoch start
        assert dist.epoch == 1
        batches = [[t["image_id"] for t in targets] for _, targets in wrapped]
        assert len(batches) == len(wrapped)
        for ids in batches:
            assert len({sizes[i][1] >= sizes[i][0] for i in ids}) == 1  # all landscape or all portrait
        shards.append(batches)
    ids = [set(i for b in s for i in b) for s in shards]
    assert len(shards[0]) == len(shards[1])
    assert not ids[0] & ids[1] and ids[0] | ids[1] == set(sizes)  # 6 portrait + 6 landscape, 2 per batch


def test_datamodule_grouping_off_gives_mixed_shuffled_batches(coco_root: Path) -> None:
    dm = COCODataModule(root=str(coco_root), batch_size=3, **SMALL)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.batch_sampler.group_ids is None
    epoch0 = [[t["image_id"] for t in targets] for _, targets in loader]
    assert sorted(i for b in epoch0 for i in b) == sorted(dm.train_dataset.ids)
    loader.batch_sampler.sampler.set_epoch(1)
    epoch1 = [[t["image_id"] for t in targets] for _, targets in loader]
    assert epoch1 != epoch0 and sorted(map(sorted, epoch1)) != sorted(map(sorted, epoch0))


_DDP_SCRIPT = '''
import json, sys
import lightning as L
import torch
from vtdense.data import COCODataModule


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        images, targets = batch
        self.seen.append([self.current_epoch, [t["image_id"] for t in targets], [float(i.double().sum()) for i in images]])
        return sum((self.w - i.mean()) ** 2 for i in images)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


root, out, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
L.seed_everything(0, verbose=False)
dm = COCODataModule(root=root, batch_size=2, num_workers=0, group_by_aspect_ratio=True,
                    train_scales=[48, 64], max_size=96, test_scale=64)
model = Recorder()
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, num_sanity_val_steps=0)
trainer.fit(model, datamodule=dm)
json.dump(model.seen, open(f"{out}.{trainer.global_rank}.json", "w"))
'''


@pytest.mark.slow
def test_real_two_process_ddp_fit_gets_disjoint_grouped_shards(coco_root: Path, tmp_path: Path) -> None:
    """Lightning's own DDP launcher (gloo, 2 processes) versus the one-process loader, same seed."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ddp_fit.py"
    script.write_text(_DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(script), str(coco_root), str(tmp_path / "seen"), "2"],
        env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300,
    )
    ranks = [json.loads((tmp_path / f"seen.{r}.json").read_text()) for r in range(2)]
    # the same two epochs in one process, without Lightning (seed_everything(0) -> seed 0)
    dm = COCODataModule(root=str(coco_root), batch_size=2, group_by_aspect_ratio=True, **SMALL)
    dm.setup("fit")
    loader = dm.train_dataloader()
    one = []
    for epoch in (0, 1):
        loader.batch_sampler.sampler.set_epoch(epoch)
        for images, targets in loader:
            one.append([epoch, [t["image_id"] for t in targets], [float(i.double().sum()) for i in images]])
    sizes = {
        img["id"]: (img["height"], img["width"])
        for img in json.loads((coco_root / "annotations" / "instances_train2017.json").read_text())["images"]
    }
    pixels = {(e, i): s for e, ids, sums in one for i, s in zip(ids, sums)}
    for epoch in (0, 1):
        plan = [ids for e, ids, _ in one if e == epoch]
        shards = [[ids for e, ids, _ in seen if e == epoch] for seen in ranks]
        assert shards[0] == plan[0::2] and shards[1] == plan[1::2]  # whole batches of the one global order
        ids = [{i for b in s for i in b} for s in shards]
        assert not ids[0] & ids[1] and ids[0] | ids[1] == set(sizes)
        for batch in shards[0] + shards[1]:
            assert len({sizes[i][1] >= sizes[i][0] for i in batch}) == 1
    assert [ids for e, ids, _ in one if e == 0] != [ids for e, ids, _ in one if e == 1]  # set_epoch reached
    for seen in ranks:  # each image is augmented as in the one-process run
        for e, ids, sums in seen:
            assert [pixels[(e, i)] for i in ids] == sums
