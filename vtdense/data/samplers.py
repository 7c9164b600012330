"""Training batch samplers: aspect-ratio groups, an epoch-seeded order, sharding by batch, resumable.

:class:`GroupedBatchSampler` forms batches whose images share an aspect-ratio group (portrait
or landscape by default, as detectron2 does; any bins via :func:`aspect_ratio_group_ids`), so
padding a batch to its largest image wastes little. The batch plan of an epoch is a function of
``(seed, epoch)`` only:

1. the whole dataset is permuted by a generator seeded with ``seed + epoch`` (the rule of
   :class:`torch.utils.data.DistributedSampler`, so one process and N processes see the same
   global order);
2. indices are dealt into per-group buffers in that order, and a buffer that reaches
   ``batch_size`` becomes a batch; leftovers become smaller batches at the end of the epoch
   (or are dropped with ``drop_last``);
3. under distribution the batch list is padded by repeating its first batches (or truncated
   with ``drop_last``) to a multiple of the world size, and rank ``r`` takes batches
   ``r, r + W, r + 2W, ...``: shards are disjoint (up to the padding) and every rank yields the
   same number of batches, which DDP needs.

Lightning (``use_distributed_sampler=True``) re-creates the batch sampler with a
:class:`~torch.utils.data.DistributedSampler` in place of :class:`EpochRandomSampler` and calls
``set_epoch`` on it each epoch; the batch sampler reads ``num_replicas``, ``rank``, ``seed``,
``epoch`` and ``shuffle`` from it and shards by batch as above.

The iterator is stateful (``state_dict``/``load_state_dict``: epoch, world size, batches
yielded), so :class:`torchdata.stateful_dataloader.StatefulDataLoader` resumes an epoch at the
exact batch. With ``with_epoch=True`` batches hold :class:`~vtdense.data.seeding.SampleKey`
``(index, epoch)`` pairs for :class:`~vtdense.data.seeding.SeededDataset`.
"""

from __future__ import annotations

import bisect
import math
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, RandomSampler, Sampler, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from vtdense.data.seeding import SampleKey, SeededDataset

__all__ = [
    "EpochRandomSampler",
    "GroupedBatchSampler",
    "ResumableDataLoader",
    "aspect_ratio_group_ids",
    "default_seed",
    "make_train_loader",
]


def aspect_ratio_group_ids(sizes: Sequence[tuple[int, int]], bins: Sequence[float] = (1.0,)) -> list[int]:
    """Group id of each image from its ``(height, width)``: the bin of ``width / height``.

    Args:
        sizes: ``(height, width)`` per image, e.g. from a COCO annotation file.
        bins: Increasing ratio boundaries; ``(1.0,)`` gives 0 for portrait and 1 for landscape
            or square images.

    Returns:
        ``len(sizes)`` ids in ``0..len(bins)``.

    Raises:
        ValueError: On a non-positive size (naming its position) or unsorted bins.
    """
    edges = [float(b) for b in bins]
    if edges != sorted(edges):
        raise ValueError(f"aspect-ratio bins must be increasing, got {list(bins)}")
    ids = []
    for pos, (height, width) in enumerate(sizes):
        if not (height > 0 and width > 0):
            raise ValueError(f"image {pos} has size {height}x{width}; aspect-ratio grouping needs positive sizes")
        ids.append(bisect.bisect_right(edges, width / height))
    return ids


class EpochRandomSampler(RandomSampler):
    """A random permutation per epoch, seeded with ``seed + epoch`` (as ``DistributedSampler``).

    It is a :class:`~torch.utils.data.RandomSampler`, so Lightning knows the loader shuffles
    and injects a shuffling ``DistributedSampler`` under DDP.

    Args:
        data_source: The dataset (only its length is used).
        seed: Base seed.
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)  # type: ignore[arg-type]
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (Lightning calls this before each epoch)."""
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> list[int]:
        """The permutation of ``epoch`` (default: the current one)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + (self.epoch if epoch is None else int(epoch)))
        return torch.randperm(len(self.data_source), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        """Indices of the current epoch."""
        return iter(self.order())


def _num_items(sampler: Sampler[int]) -> int:
    """Size of the whole index set the sampler draws from (all ranks)."""
    if isinstance(sampler, DistributedSampler):
        return len(sampler.dataset)  # type: ignore[arg-type]
    return len(sampler)  # type: ignore[arg-type]


def _epoch_plan_inputs(sampler: Sampler[int], epoch: int | None) -> tuple[list[int], int, int, int]:
    """``(global order, epoch, world size, rank)`` of ``sampler`` at ``epoch`` (default: its current one)."""
    if isinstance(sampler, DistributedSampler):
        if type(sampler).__iter__ is not DistributedSampler.__iter__:
            raise TypeError(
                f"GroupedBatchSampler cannot shard by batch with {type(sampler).__name__}, which changes the "
                "indices of DistributedSampler; give it an EpochRandomSampler or a plain DistributedSampler"
            )
        ep = sampler.epoch if epoch is None else int(epoch)
        n = len(sampler.dataset)  # type: ignore[arg-type]
        if sampler.shuffle:
            generator = torch.Generator()
            generator.manual_seed(sampler.seed + ep)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        return order, ep, sampler.num_replicas, sampler.rank
    if isinstance(sampler, EpochRandomSampler):
        ep = sampler.epoch if epoch is None else int(epoch)
        return sampler.order(ep), ep, 1, 0
    if isinstance(sampler, SequentialSampler):
        return list(range(len(sampler))), 0 if epoch is None else int(epoch), 1, 0
    if epoch is not None:
        raise TypeError(
            f"cannot restore a mid-epoch position of GroupedBatchSampler over {type(sampler).__name__}: its order is "
            "not a function of the epoch; use EpochRandomSampler, SequentialSampler or DistributedSampler"
        )
    return list(sampler), int(getattr(sampler, "epoch", 0)), 1, 0


class GroupedBatchSampler(BatchSampler):
    """Batches of one aspect-ratio group, sharded by batch across ranks, with a resumable iterator.

    Args:
        sampler: Global order of the indices: :class:`EpochRandomSampler` (shuffled training),
            :class:`~torch.utils.data.SequentialSampler`, a plain
            :class:`~torch.utils.data.DistributedSampler` (as Lightning injects under DDP; its
            rank and world size select the shard), or any sampler that yields each index of
            ``range(len(group_ids))`` once (not resumable mid-epoch).
        batch_size: Images per batch.
        drop_last: Drop each group's last incomplete batch (and, under distribution, the
            batches past the last multiple of the world size) instead of keeping it.
        group_ids: Group of each dataset index (see :func:`aspect_ratio_group_ids`); ``None``:
            one group, i.e. plain shuffled batches.
        with_epoch: Yield :class:`~vtdense.data.seeding.SampleKey` ``(index, epoch)`` pairs
            instead of ints, for :class:`~vtdense.data.seeding.SeededDataset`.

    Raises:
        ValueError: If ``group_ids`` does not have one entry per index of the sampler's dataset.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool = False,
        group_ids: Sequence[int] | None = None,
        with_epoch: bool = False,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        n = _num_items(sampler)
        if group_ids is not None and len(group_ids) != n:
            raise ValueError(f"group_ids has {len(group_ids)} entries but the sampler's dataset has {n} items")
        self.group_ids = [int(g) for g in group_ids] if group_ids is not None else None
        self.with_epoch = bool(with_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the sampler (Lightning already calls the sampler's ``set_epoch``)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _world(self) -> int:
        return self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1

    def plan(self, epoch: int | None = None) -> tuple[int, list[list[int]]]:
        """``(epoch, batches of this rank)`` for ``epoch`` (default: the sampler's current epoch)."""
        order, ep, world, rank = _epoch_plan_inputs(self.sampler, epoch)
        n = _num_items(self.sampler)
        if len(order) != n:
            raise ValueError(
                f"GroupedBatchSampler needs a sampler over all {n} items of the dataset, got {len(order)} indices"
            )
        buffers: dict[int, list[int]] = {}
        batches: list[list[int]] = []
        for index in order:
            group = self.group_ids[index] if self.group_ids is not None else 0
            buffer = buffers.setdefault(group, [])
            buffer.append(index)
            if len(buffer) == self.batch_size:
                batches.append(buffer)
                buffers[group] = []
        if not self.drop_last:
            batches.extend(buffer for _, buffer in sorted(buffers.items()) if buffer)
        if world > 1:
            if self.drop_last:
                batches = batches[: len(batches) // world * world]
            elif batches and len(batches) % world:
                batches = batches + [batches[k % len(batches)] for k in range(world - len(batches) % world)]
            batches = batches[rank::world]
        return ep, batches

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        counts = Counter(self.group_ids) if self.group_ids is not None else Counter({0: _num_items(self.sampler)})
        if self.drop_last:
            total = sum(c // self.batch_size for c in counts.values())
            return total // self._world()
        total = sum(math.ceil(c / self.batch_size) for c in counts.values())
        return math.ceil(total / self._world())

    def __iter__(self) -> Iterator[list[Any]]:
        """A stateful iterator over this epoch's batches (``state_dict``/``load_state_dict``)."""
        return _GroupedBatchIterator(self)


class _GroupedBatchIterator(Iterator[list[Any]]):
    """One epoch of a :class:`GroupedBatchSampler`; its state is ``(epoch, world size, yielded)``."""

    def __init__(self, owner: GroupedBatchSampler) -> None:
        self.owner = owner
        self.epoch, self.batches = owner.plan()
        self.world_size = owner._world()
        self.yielded = 0

    def __iter__(self) -> _GroupedBatchIterator:
        return self

    def __next__(self) -> list[Any]:
        if self.yielded >= len(self.batches):
            raise StopIteration
        batch = self.batches[self.yielded]
        self.yielded += 1
        if self.owner.with_epoch:
            return [SampleKey(i, self.epoch) for i in batch]
        return list(batch)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "world_size", "yielded"}``: enough to rebuild the rest of the epoch."""
        return {"epoch": self.epoch, "world_size": self.world_size, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the epoch ``state["epoch"]`` after ``state["yielded"]`` batches.

        Raises:
            ValueError: If the state was saved with another world size or is past the epoch's end.
        """
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"the data-loader state was saved with {state['world_size']} processes but this run has "
                f"{self.world_size}; a mid-epoch position cannot be restored across world sizes"
            )
        self.epoch, self.batches = self.owner.plan(int(state["epoch"]))
        if not 0 <= int(state["yielded"]) <= len(self.batches):
            raise ValueError(f"the data-loader state says {state['yielded']} batches were drawn of {len(self.batches)}")
        self.yielded = int(state["yielded"])


def _saved_num_workers(state: dict[str, Any]) -> int | None:
    """Worker count a ``StatefulDataLoader`` state was saved with (None: unknown layout)."""
    if "_sampler_iter_state" in state:  # single-process layout
        return 0
    main = state.get("_snapshot", {}).get("_main_snapshot", {})
    return int(main["_num_workers"]) if "_num_workers" in main else None


class ResumableDataLoader(StatefulDataLoader):
    """:class:`~torchdata.stateful_dataloader.StatefulDataLoader` that names the option when a state does not fit.

    torchdata's state layout depends on the worker count and it fails with a bare
    ``AssertionError`` (or a ``KeyError``) when a run resumes with another ``num_workers``;
    this loader raises one ``ValueError`` saying which value to resume with instead.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the worker count, then restore the position (applied at the next ``iter``).

        Raises:
            ValueError: If the state was saved with another ``num_workers``.
        """
        saved = _saved_num_workers(state_dict) if state_dict else None
        if saved is not None and saved != self.num_workers:
            raise ValueError(
                f"the training data-loader state in this checkpoint was saved with num_workers={saved}, but this run "
                f"has num_workers={self.num_workers}; resume with --data.num_workers {saved} to continue the epoch "
                "where it stopped"
            )
        super().load_state_dict(state_dict)


def default_seed() -> int:
    """The run's base seed: ``$PL_GLOBAL_SEED`` (set by ``seed_everything``) or 0, as Lightning's samplers use."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def make_train_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    collate_fn: Callable[[list[Any]], Any],
    group_ids: Sequence[int] | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    seed: int | None = None,
) -> ResumableDataLoader:
    """A resumable, per-sample-seeded training loader over ``dataset``.

    It is a :class:`~torchdata.stateful_dataloader.StatefulDataLoader` (:class:`ResumableDataLoader`; Lightning saves its
    ``state_dict`` in checkpoints and restores it on resume) over
    ``SeededDataset(dataset, seed)``, batched by ``GroupedBatchSampler(EpochRandomSampler(...),
    with_epoch=True)``. Batch ``k`` of epoch ``e`` and each sample's augmentation depend only on
    ``(seed, e, k)``, not on the worker count or on a resume.

    Args:
        dataset: Map-style dataset whose transforms draw from the global generators.
        batch_size: Images per batch (per process).
        collate_fn: Batch collation.
        group_ids: Group of each index (e.g. aspect-ratio groups); ``None``: one group.
        drop_last: Drop incomplete batches.
        num_workers: Worker processes.
        pin_memory: Pin batches in page-locked memory.
        persistent_workers: Keep workers between epochs (only used with ``num_workers > 0``).
        seed: Base seed; ``None``: :func:`default_seed`.

    Returns:
        The loader; ``loader.batch_sampler.sampler.set_epoch(e)`` selects the epoch.
    """
    seed = default_seed() if seed is None else int(seed)
    sampler = EpochRandomSampler(dataset, seed=seed)  # type: ignore[arg-type]
    batch_sampler = GroupedBatchSampler(sampler, batch_size, drop_last, group_ids=group_ids, with_epoch=True)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in recent torch
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        return ResumableDataLoader(
            SeededDataset(dataset, seed),
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            # The loader's own base seed comes from this generator, not from the global one, so
            # iterating never advances the training RNG streams (augmentation does not use it).
            generator=torch.Generator().manual_seed(seed),
        )
