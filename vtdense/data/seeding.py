"""Per-sample seeding of random augmentation, so a sample's augmentation depends only on
``(base seed, epoch, index)``.

A training loader's batch sampler (:class:`~vtdense.data.samplers.GroupedBatchSampler` with
``with_epoch=True``) yields :class:`SampleKey` ``(index, epoch)`` pairs instead of bare indices.
:class:`SeededDataset` seeds the global ``torch``, ``random`` and ``numpy`` generators from
:func:`sample_seed` for the duration of one ``__getitem__`` and restores them afterwards. The
augmentation of sample ``i`` in epoch ``e`` is then the same whichever worker loads it, however
many workers there are, and whether or not the run was resumed mid-epoch; and loading data in
the main process (``num_workers=0``) leaves the training RNG streams untouched.

The epoch travels with the index from the main process, so persistent workers see it too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["SampleKey", "SeededDataset", "sample_seed", "seeded_rng"]


class SampleKey(NamedTuple):
    """Dataset index of a sample and the epoch it is drawn in."""

    index: int
    epoch: int


def sample_seed(base_seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed mixed from ``(base_seed, epoch, index)`` with :class:`numpy.random.SeedSequence`.

    Args:
        base_seed: Run seed (``>= 0``).
        epoch: Epoch number (``>= 0``).
        index: Dataset index (``>= 0``).

    Returns:
        A seed in ``[0, 2**63)``; nearby inputs give unrelated seeds.
    """
    state = np.random.SeedSequence([int(base_seed), int(epoch), int(index)]).generate_state(1, dtype=np.uint64)
    return int(state[0]) >> 1


@contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Seed the global CPU ``torch``, ``random`` and ``numpy`` generators; restore them on exit.

    Args:
        seed: Seed in ``[0, 2**63)``.
    """
    torch_state = torch.get_rng_state()
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


class SeededDataset(Dataset):
    """Wrap a map-style dataset so each item is produced under :func:`seeded_rng`.

    Args:
        dataset: The dataset whose ``__getitem__`` (and its transforms) draws random numbers from
            the global generators.
        seed: Base seed (``>= 0``).

    ``dataset[SampleKey(i, e)]`` returns ``dataset.dataset[i]`` computed with seed
    ``sample_seed(seed, e, i)``; a bare ``int`` ``i`` means epoch 0.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        """Length of the wrapped dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: SampleKey | tuple[int, int] | int) -> Any:
        """The wrapped item ``key.index`` under the seed of ``(seed, key.epoch, key.index)``."""
        index, epoch = (int(key[0]), int(key[1])) if isinstance(key, tuple) else (int(key), 0)
        with seeded_rng(sample_seed(self.seed, epoch, index)):
            return self.dataset[index]
