"""Data sets that fetch every example inside the random context of its batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from typing import Any

from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ..errors import InexactResumeError
from ..format.rng import derive_seed
from ._generators import GeneratorSlots, _dataset_generator_root
from ._position import _TAG_ELASTIC_BATCH, _TAG_MAP_BATCH, _TAG_STREAM_BATCH, BatchKey, data_rng
from .elastic import sample_seed

logger = logging.getLogger(__name__)


class SeededMapDataset(Dataset):
    """Fetch and collate a whole :class:`BatchKey` inside a random context seeded by the batch's position.

    Used with :class:`ResumableBatchSampler` as ``batch_sampler``: the ``DataLoader`` hands each key to
    :meth:`__getitems__`, which runs the user's data set (including a ``datasets`` ``set_transform``)
    and collator under ``data_rng(derive_seed(seed, epoch, rank, step))``. A key of the elastic layout (with a
    ``chunk``, see :class:`ResumableBatchSampler`'s ``global_batch``) is keyed by the layout-free identities instead:
    each sample is fetched under its own :func:`~hf_resumable.data.elastic.sample_seed` (the idea of
    :class:`~hf_resumable.data.elastic.ElasticSeededDataset`) and the collator runs under a seed of
    ``(epoch, chunk)``, so a batch is built identically whichever rank and world size trains on it.

    Args:
        dataset (`torch.utils.data.Dataset`): any map-style data set (``datasets.Dataset`` included).
        collate_fn (`Callable`): the collator, e.g. ``DataCollatorForLanguageModeling``.
        seed (`int`): run seed.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], *, seed: int) -> None:
        self.dataset, self.collate_fn, self.seed = dataset, collate_fn, seed
        self._collate_generators = GeneratorSlots(collate_fn)
        self._dataset_generators = GeneratorSlots(_dataset_generator_root(dataset))

    def __len__(self) -> int:
        return len(self.dataset)

    def _fetch(self, indices: list[int]) -> list:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices))
        return [self.dataset[index] for index in indices]

    def __getitems__(self, key: BatchKey) -> Any:
        if key.chunk is not None:
            return self._elastic_batch(key)
        seed = derive_seed(self.seed, _TAG_MAP_BATCH, key.epoch, key.rank, key.step)
        self._dataset_generators.reseed(_dataset_generator_root(self.dataset), seed=seed)
        self._collate_generators.reseed(self.collate_fn, seed=seed)
        with data_rng(seed):
            return self.collate_fn(self._fetch(list(key.indices)))

    def _elastic_batch(self, key: BatchKey) -> Any:
        """One sample at a time under its own seed, then the collator under the chunk's seed (no rank involved)."""
        items = []
        for index in key.indices:
            seed = sample_seed(self.seed, key.epoch, index)
            self._dataset_generators.reseed(_dataset_generator_root(self.dataset), seed=seed)
            with data_rng(seed):
                items.append(self.dataset[index])
        seed = derive_seed(self.seed, _TAG_ELASTIC_BATCH, key.epoch, key.chunk)
        self._collate_generators.reseed(self.collate_fn, seed=seed)
        with data_rng(seed):
            return self.collate_fn(items)

    __getitem__ = __getitems__


class SeededIterableDataset(IterableDataset):
    """Batch a streaming data set, one seeded random context per batch, and expose its position.

    Each batch (``batch_size`` examples pulled from the wrapped iterator, so lazy ``.map`` transforms
    run here, then collated) is built under ``data_rng(derive_seed(seed, epoch, rank, worker, batch))``.
    :meth:`state_dict` returns the wrapped data set's own ``state_dict()`` plus the batch counter, so
    ``torchdata``'s ``StatefulDataLoader`` can snapshot it per yielded batch and resume without replay.

    Args:
        dataset: a ``datasets.IterableDataset`` (or any iterable data set with ``state_dict`` /
            ``load_state_dict``).
        collate_fn (`Callable`): the collator.
        batch_size (`int`): examples per batch.
        seed (`int`): run seed.
        drop_last (`bool`, *optional*, defaults to `False`): drop a final incomplete batch.
        rank (`int`, *optional*, defaults to 0): data-parallel rank (part of the seed).
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], *, batch_size: int, seed: int,
                 drop_last: bool = False, rank: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.dataset, self.collate_fn, self.batch_size, self.seed = dataset, collate_fn, batch_size, seed
        self.drop_last, self.rank = drop_last, rank
        self.epoch, self._step, self._start_step = 0, 0, 0
        self._collate_generators = GeneratorSlots(collate_fn)

    @property
    def is_stateful(self) -> bool:
        """Whether the wrapped data set can save and restore its position."""
        return callable(getattr(self.dataset, "state_dict", None)) and callable(
            getattr(self.dataset, "load_state_dict", None))

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped data set (``datasets`` reshuffles per epoch) and to the seeds."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        iterator = iter(self.dataset)
        self._step, self._start_step = self._start_step, 0
        while True:
            seed = derive_seed(self.seed, _TAG_STREAM_BATCH, self.epoch, self.rank, worker, self._step)
            self._collate_generators.reseed(self.collate_fn, seed=seed)
            with data_rng(seed):
                items = list(islice(iterator, self.batch_size))
                if not items or (self.drop_last and len(items) < self.batch_size):
                    return
                batch = self.collate_fn(items)
            self._step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch this copy produced: the data set's state and the batch counter."""
        if not self.is_stateful:
            raise InexactResumeError(
                f"{type(self.dataset).__name__} has no state_dict()/load_state_dict(), so its position cannot be "
                "saved. Use a datasets.IterableDataset, or implement both methods on your data set.")
        return {"dataset": self.dataset.state_dict(), "step": self._step, "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position :meth:`state_dict` returned (takes effect at the next ``iter``)."""
        self.dataset.load_state_dict(state["dataset"])
        self._start_step = int(state["step"])
        self.set_epoch(int(state["epoch"]))
