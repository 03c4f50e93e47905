"""Data sets that fetch every example inside the random context of its batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ..errors import InexactResumeError
from ..format.rng import derive_seed
from ._generators import GeneratorSlots, _dataset_generator_root
from ._position import _TAG_ELASTIC_BATCH, _TAG_MAP_BATCH, _TAG_STREAM_BATCH, BatchKey, data_rng
from .elastic import sample_seed

logger = logging.getLogger(__name__)

STREAM_SAMPLES = "samples"  # elastic streams: examples of the pass read by all ranks together (the position)
_END = object()  # end of a stream


class SeededMapDataset(Dataset):
    """Fetch and collate a whole :class:`BatchKey` inside a random context seeded by the batch's position.

    Used with :class:`ResumableBatchSampler` as ``batch_sampler``: the ``DataLoader`` hands each key to
    :meth:`__getitems__`, which runs the user's data set (including a ``datasets`` ``set_transform``)
    and collator under ``data_rng(derive_seed(seed, epoch, rank, step))``. A key of the elastic layout (with a
    ``chunk``) is keyed by the sample (:func:`~hf_resumable.data.elastic.sample_seed`) and, for the collator, by
    ``(epoch, chunk)``, so a batch is built identically whichever rank and world size trains on it.

    Args:
        dataset (`torch.utils.data.Dataset`): any map-style data set (``datasets.Dataset`` included).
        collate_fn (`Callable`): the collator, e.g. ``DataCollatorForLanguageModeling``.
        seed (`int`): run seed.
        padding_fn (`Callable`, *optional*): the elastic layout: applied to a padding batch once collated (see
            :class:`BatchKey`), e.g. :func:`ignore_labels`, so that a loss normalised by its items counts none of it.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], *, seed: int,
                 padding_fn: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.collate_fn, self.seed, self.padding_fn = dataset, collate_fn, seed, padding_fn
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
            batch = self.collate_fn(items)
        return self.padding_fn(batch) if key.padding and self.padding_fn is not None else batch

    __getitem__ = __getitems__


class SeededIterableDataset(IterableDataset):
    """Batch a streaming data set, one seeded random context per batch, and expose its position.

    Each batch (``batch_size`` examples pulled from the wrapped iterator, so lazy ``.map`` transforms
    run here, then collated) is built under ``data_rng(derive_seed(seed, epoch, rank, worker, batch))``.
    :meth:`state_dict` returns the wrapped data set's own ``state_dict()`` plus the batch counter, so
    ``torchdata``'s ``StatefulDataLoader`` can snapshot it per yielded batch and resume without replay.

    With ``global_batch`` (the elastic layout) the stream is not split by rank: every rank reads all of it, one
    global batch per optimizer step, example ``i`` under its own :func:`~hf_resumable.data.elastic.sample_seed`,
    chunk ``c`` (of ``batch_size`` examples) going to rank ``c % world_size`` under a seed of ``(epoch, c)``; the
    position (the data set's state at a global-batch boundary plus ``samples``, the examples read) does not depend on
    the world size. The layout and its cost: docs/trainer.md#elastic.

    Args:
        dataset: a ``datasets.IterableDataset`` (or any iterable data set with ``state_dict`` /
            ``load_state_dict``).
        collate_fn (`Callable`): the collator.
        batch_size (`int`): examples per batch.
        seed (`int`): run seed.
        drop_last (`bool`, *optional*, defaults to `False`): drop a final incomplete batch.
        rank (`int`, *optional*, defaults to 0): data-parallel rank (part of the seed).
        world_size (`int`, *optional*, defaults to 1) / global_batch (`int`, *optional*): the elastic layout
            (``global_batch``: examples per optimizer step over all ranks, a multiple of
            ``batch_size * world_size``). The pass's last, shorter global batch trains too (unless ``drop_last``),
            with padding batches for ranks without a chunk in it.
        padding_fn (`Callable`, *optional*): the elastic layout: applied to a padding batch once collated.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], *, batch_size: int, seed: int,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 global_batch: int | None = None, padding_fn: Callable[[Any], Any] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if global_batch is not None and (global_batch < 1 or global_batch % (batch_size * world_size)):
            raise ValueError(f"global_batch must be a positive multiple of batch_size * world_size "
                             f"({batch_size} * {world_size}), got {global_batch}.")
        self.dataset, self.collate_fn, self.batch_size, self.seed = dataset, collate_fn, batch_size, seed
        self.drop_last, self.rank, self.world_size, self.global_batch = drop_last, rank, world_size, global_batch
        self.epoch, self._step, self._start_step = 0, 0, 0
        self._samples, self._start_samples = 0, 0  # elastic layout: examples of the pass read (all ranks')
        self.padding_fn = padding_fn
        # elastic layout: (samples, step_samples) of the batch yielded last (see ResumableBatchSampler.elastic_weight)
        self.last_weight: tuple[int, int] | None = None
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
        self._samples, self._start_samples = self._start_samples, 0
        if self.global_batch is not None:
            yield from self._elastic_batches(iterator)
            return
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

    def _elastic_batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The elastic layout: read a whole global batch (each example under its sample seed), yield this rank's
        chunks of it. The global batch the stream ends in (unless ``drop_last``) is trained too, as a whole step: each
        rank's batches past its samples are padding batches (the step's first chunk, weighing zero, see
        :attr:`last_weight`), so that a loop that learns where the pass ends only when it ends (the ``Trainer``'s
        accumulation on a stream) still steps at the end of the window."""
        while True:
            first, items = self._samples, []
            for index in range(first, first + self.global_batch):
                with data_rng(sample_seed(self.seed, self.epoch, index)):
                    item = next(iterator, _END)
                if item is _END:
                    break
                items.append(item)
            if not items or (self.drop_last and len(items) < self.global_batch):
                return
            self._samples += len(items)
            chunks = -(-len(items) // self.batch_size)
            for offset in range(self.rank, self.global_batch // self.batch_size, self.world_size):
                yield self._elastic_chunk(items, first // self.batch_size, offset, padding=offset >= chunks)
            if len(items) < self.global_batch:
                return

    def _elastic_chunk(self, items: list, first_chunk: int, offset: int, *, padding: bool) -> Any:
        """Collate chunk ``first_chunk + offset`` of a global batch's ``items`` under the chunk's seed (a padding
        batch: the first chunk's items, through ``padding_fn``)."""
        part = items[:self.batch_size] if padding else items[offset * self.batch_size:(offset + 1) * self.batch_size]
        seed = derive_seed(self.seed, _TAG_ELASTIC_BATCH, self.epoch, first_chunk + offset)
        self._collate_generators.reseed(self.collate_fn, seed=seed)
        with data_rng(seed):
            batch = self.collate_fn(part)
        self._step += 1
        self.last_weight = (0 if padding else len(part), len(items))
        return self.padding_fn(batch) if padding and self.padding_fn is not None else batch

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch this copy produced: the data set's state and the batch counter (elastic
        layout: also the examples read, ``samples``; the data set's state is then that after the current global
        batch, identical on every rank)."""
        if not self.is_stateful:
            raise InexactResumeError(
                f"{type(self.dataset).__name__} has no state_dict()/load_state_dict(), so its position cannot be "
                "saved. Use a datasets.IterableDataset, or implement both methods on your data set.")
        state = {"dataset": self.dataset.state_dict(), "step": self._step, "epoch": self.epoch}
        if self.global_batch is not None:
            state[STREAM_SAMPLES] = self._samples
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position :meth:`state_dict` returned (takes effect at the next ``iter``).

        Raises:
            InexactResumeError: the elastic layout and a position that is not on an optimizer-step boundary of this
                world size, or one without ``samples`` (not of the elastic layout).
        """
        step = int(state["step"])
        if self.global_batch is not None:
            step = elastic_stream_batches(state, batch_size=self.batch_size, world_size=self.world_size,
                                          global_batch=self.global_batch)
            self._start_samples = int(state[STREAM_SAMPLES])
        self.dataset.load_state_dict(state["dataset"])
        self._start_step = step
        self.set_epoch(int(state["epoch"]))


def ignore_labels(batch: Any, *, names: Sequence[str] = ("labels",), ignore_index: int = -100) -> Any:
    """``batch`` (a mapping) with its label tensors ``names`` set to ``ignore_index``: a padding batch of the elastic
    layout that a loss normalised by its items (``num_items_in_batch``) weighs zero (pure: a new mapping).

    Raises:
        KeyError: a batch without one of ``names`` (its loss could not be made to count nothing).

    Example:

    ```python
    >>> import torch
    >>> ignore_labels({"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[5, 6]])})["labels"]
    tensor([[-100, -100]])
    ```
    """
    missing = [name for name in names if name not in batch]
    if missing:
        raise KeyError(f"The padding batch of the elastic layout has no {missing} (keys {sorted(batch)}), so its "
                       "loss cannot be made to count nothing. Give the collator's batches labels, or set label_names.")
    return {**batch, **{name: torch.full_like(batch[name], ignore_index) for name in names}}


def elastic_stream_batches(state: Mapping[str, Any], *, batch_size: int, world_size: int,
                           global_batch: int | None = None) -> int:
    """The batches each of ``world_size`` ranks has trained on at the elastic stream position ``state`` (a
    :meth:`SeededIterableDataset.state_dict`), pure. With ``global_batch``, a position after the pass's last, shorter
    global batch (``samples`` not a whole number of global batches: the stream ended there) counts that step as a
    whole one (its padding batches included).

    Example:

    ```python
    >>> elastic_stream_batches({"samples": 20}, batch_size=2, world_size=2, global_batch=8)  # 2 steps + 4 samples
    6
    ```

    Raises:
        InexactResumeError: ``state`` has no ``samples`` (not written in the elastic layout), or they do not split
            into whole batches of ``world_size`` ranks (not an optimizer-step boundary).
    """
    samples = state.get(STREAM_SAMPLES)
    if not isinstance(samples, int) or samples < 0:
        raise InexactResumeError(f"The streaming position {dict(state)} does not record the examples read over all "
                                 "ranks (it was not written with elastic=True); resume with the settings it was "
                                 "written with.")
    if global_batch is not None and samples % global_batch:  # after the stream's last, shorter step
        return -(-samples // global_batch) * (global_batch // (batch_size * world_size))
    if samples % (batch_size * world_size):
        raise InexactResumeError(f"The streaming position ({samples} examples read) is not a whole number of "
                                 f"batches of {batch_size} on {world_size} rank(s); resume from a checkpoint on an "
                                 "optimizer-step boundary.")
    return samples // (batch_size * world_size)
