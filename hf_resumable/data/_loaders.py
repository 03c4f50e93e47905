"""The resumable data loaders (map-style and streaming) and their builders."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import trace
from ..checkpoint.state import NUM_YIELDED as _NUM_YIELDED
from ..checkpoint.state import batches_yielded
from ..errors import InexactResumeError
from ..format.rng import derive_seed
from ._order import ResumableBatchSampler
from ._position import _TAG_LOADER, DATA_EPOCH, DATA_KIND, DATA_LOADER, DATA_NUM_BATCHES, DATA_STEP, _identity
from ._seeded import SeededIterableDataset, SeededMapDataset, elastic_stream_batches
from ._shuffle_buffer import has_shuffle_buffer, resumable_shuffle_buffer

logger = logging.getLogger(__name__)

_SAMPLER_YIELDED = "_sampler_iter_yielded"  # StatefulDataLoader: items its sampler iterator yielded


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over :class:`SeededMapDataset` + :class:`ResumableBatchSampler` with ``set_epoch``/``skip``.

    Build it with :func:`build_map_dataloader`. ``skip(n)`` returns a loader for the rest of the current
    epoch starting at batch ``n``; the skipped batches are neither fetched nor collated. The loader has
    its own ``torch.Generator``, so ``iter()`` never draws worker seeds from the global generator.
    """

    def __init__(self, dataset: SeededMapDataset, *, batch_sampler: ResumableBatchSampler,
                 **kwargs: Any) -> None:
        self._init_kwargs = dict(kwargs)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        return trace.traced_batches(super().__iter__())  # hf-resumable check: each batch's digests

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (permutation and seeds) of the next iteration."""
        self.batch_sampler.set_epoch(epoch)

    def skip(self, num_batches: int) -> "ResumableDataLoader":
        """A loader over the current epoch from batch ``num_batches`` on, without producing the earlier ones."""
        return ResumableDataLoader(self.dataset, batch_sampler=self.batch_sampler.skip(num_batches),
                                   **self._init_kwargs)

    def position(self, *, epoch: int, step: int) -> dict[str, Any]:
        """The JSON data-position record for "``step`` batches of ``epoch`` consumed"."""
        return {DATA_KIND: "map", DATA_EPOCH: epoch, DATA_STEP: step, DATA_NUM_BATCHES: len(self.batch_sampler)}


class StepPosition:
    """:class:`~hf_resumable.data._position.LoaderPosition` of a resumable ``loader`` (a :class:`ResumableDataLoader`
    or :func:`build_stream_dataloader`'s) iterated by a loop that alone knows where it stands: the ``Trainer``, whose
    optimizer steps (``steps_done()``) of ``batches_per_step`` batches each say which batch comes next (its
    ``skip_first_batches`` moves a map-style loader's cursor on resume)."""

    def __init__(self, loader: Any, *, steps_done: Callable[[], int], batches_per_step: int) -> None:
        self.loader, self.steps_done, self.batches_per_step = loader, steps_done, batches_per_step
        self.kind = "map" if isinstance(loader, ResumableDataLoader) else "stream"

    def position(self) -> dict[str, Any]:
        steps, per_step = self.steps_done(), self.batches_per_step
        if self.kind == "stream":
            return self.loader.position(epoch=0, step=steps * per_step)
        per_epoch = max(-(-len(self.loader) // per_step), 1)  # optimizer steps per epoch (a short last one counts)
        epoch, step = divmod(steps, per_epoch)
        return self.loader.position(epoch=epoch, step=min(step * per_step, len(self.loader)))

    def fits(self, record: Mapping[str, Any]) -> bool:
        return record.get(DATA_KIND) == self.kind

    def load_position(self, record: Mapping[str, Any], *, restart_epoch: bool = False) -> None:
        if self.kind == "stream" and not restart_epoch:  # map-style: the loop's own skip moves the cursor
            self.loader.load_position(record)

    def settings(self) -> dict[str, Any]:
        return {}  # the Trainer compares its RunConfig instead


def _loader_kwargs(seed: int, num_workers: int, *, pin_memory: bool, persistent_workers: bool,
                   prefetch_factor: int | None, multiprocessing_context: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "collate_fn": _identity,
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "generator": torch.Generator().manual_seed(derive_seed(seed, _TAG_LOADER)),
    }
    if num_workers > 0:
        kwargs.update(persistent_workers=persistent_workers,
                      prefetch_factor=prefetch_factor, multiprocessing_context=multiprocessing_context)
    return kwargs


def build_map_dataloader(dataset: Any, *, collate_fn: Callable[[list], Any], batch_size: int, seed: int,
                         shuffle: bool = True, drop_last: bool = False, rank: int = 0, world_size: int = 1,
                         num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                         prefetch_factor: int | None = None, multiprocessing_context: Any = None,
                         lengths: Sequence[int] | None = None, group_size: int | None = None,
                         order: Callable[[int], Sequence[int]] | None = None,
                         num_samples: int | None = None, global_batch: int | None = None,
                         padding_fn: Callable[[Any], Any] | None = None) -> ResumableDataLoader:
    """A :class:`ResumableDataLoader` for a map-style data set.

    Args:
        dataset: map-style data set (has ``__len__`` and ``__getitem__``).
        collate_fn (`Callable`): collator, run in the same seeded context as the fetch.
        batch_size (`int`): per-rank batch size.
        seed (`int`): run seed (permutation, per-batch randomness, worker base seed).
        shuffle, drop_last, rank, world_size, lengths, group_size, order, global_batch: see
            :class:`ResumableBatchSampler` (``global_batch``: the elastic layout).
        num_samples (`int`, *optional*): indices per epoch of ``order`` (default: ``len(dataset)``).
        padding_fn (`Callable`, *optional*): the elastic layout's padding batches go through it once collated (see
            :class:`SeededMapDataset`).
        num_workers, pin_memory, persistent_workers, prefetch_factor, multiprocessing_context:
            forwarded to ``torch.utils.data.DataLoader``.

    Returns:
        [`ResumableDataLoader`]
    """
    count = len(dataset) if num_samples is None else num_samples
    sampler = ResumableBatchSampler(count, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                                    world_size=world_size, lengths=lengths, group_size=group_size, order=order,
                                    global_batch=global_batch)
    kwargs = _loader_kwargs(seed, num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
                            prefetch_factor=prefetch_factor, multiprocessing_context=multiprocessing_context)
    return ResumableDataLoader(SeededMapDataset(dataset, collate_fn, seed=seed, padding_fn=padding_fn),
                               batch_sampler=sampler, **kwargs)


def build_stream_dataloader(dataset: Any, *, collate_fn: Callable[[list], Any], batch_size: int, seed: int,
                            drop_last: bool = False, rank: int = 0, num_workers: int = 0,
                            pin_memory: bool = False, persistent_workers: bool = False,
                            prefetch_factor: int | None = None, multiprocessing_context: Any = None,
                            world_size: int = 1, global_batch: int | None = None,
                            padding_fn: Callable[[Any], Any] | None = None) -> Any:
    """A :class:`ResumableStreamLoader` (``torchdata`` ``StatefulDataLoader``) over a streaming data set.

    Args: as :func:`build_map_dataloader`; ``dataset`` is a ``datasets.IterableDataset`` already split for
    this rank (``datasets.distributed.split_dataset_by_node``) when training data-parallel, except in the elastic
    layout (``global_batch`` and ``world_size``, see :class:`SeededIterableDataset`), where every rank reads the
    whole stream (``num_workers=0`` only: workers would split the stream's order by worker), the pass's last, shorter
    global batch included (``padding_fn``: what a padding batch goes through).

    A ``datasets`` shuffle buffer is replaced by a :class:`ResumableShuffleBuffer` of the same size
    (:func:`resumable_shuffle_buffer`), so the stream resumes bit for bit; one that cannot be replaced (inside
    ``interleave_datasets``/``concatenate_datasets`` sources, or several buffers) is kept, with a WARNING.

    Raises:
        ImportError: if ``torchdata`` is not installed.
        ValueError: the elastic layout with ``num_workers > 0``.
    """
    if global_batch is not None and num_workers:
        raise ValueError(f"The elastic layout of a stream reads it in one order on every rank; num_workers="
                         f"{num_workers} would split it by worker. Use num_workers=0.")
    # elastic: every rank reads the same stream, so its shuffle buffer is seeded as rank 0's
    source = _resumable_source(dataset, rank if global_batch is None else 0)
    wrapper = SeededIterableDataset(source, collate_fn, batch_size=batch_size, seed=seed, drop_last=drop_last,
                                    rank=rank, world_size=world_size, global_batch=global_batch,
                                    padding_fn=padding_fn)
    kwargs = _loader_kwargs(seed, num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
                            prefetch_factor=prefetch_factor, multiprocessing_context=multiprocessing_context)
    return _stream_loader_class()(wrapper, batch_size=None, **kwargs)


def split_stream_for_rank(dataset: Any, *, rank: int, world_size: int) -> Any:
    """This rank's share of a streaming data set for data-parallel training outside the elastic layout (each rank
    reads its own part, ``datasets.distributed.split_dataset_by_node``); the data set itself with one process.

    Raises:
        InexactResumeError: several processes and a stream that is not a ``datasets.IterableDataset``.
    """
    if world_size <= 1:
        return dataset
    from datasets import IterableDataset as HfIterableDataset
    from datasets.distributed import split_dataset_by_node

    if not isinstance(dataset, HfIterableDataset):
        raise InexactResumeError("Data-parallel training on a torch IterableDataset needs per-rank splitting; "
                                 "use a datasets.IterableDataset (split with split_dataset_by_node).")
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size)


def _resumable_source(dataset: Any, rank: int) -> Any:
    """``dataset`` with its ``datasets`` shuffle buffer replaced by a :class:`ResumableShuffleBuffer` when possible."""
    if not has_shuffle_buffer(dataset):
        return dataset
    try:
        return resumable_shuffle_buffer(dataset, rank=rank)
    except InexactResumeError as error:
        logger.warning("%s Keeping datasets' own shuffle buffer: resuming this stream will NOT be bit-exact.", error)
        return dataset


def elastic_loader_state(state: Mapping[str, Any], *, batch_size: int, world_size: int,
                         global_batch: int | None = None) -> dict[str, Any]:
    """A single-process ``StatefulDataLoader`` state of an elastic stream (saved at any world size) with its batch
    counters set for a rank of ``world_size`` (pure): the examples read over all ranks are the position.

    Raises:
        InexactResumeError: a multi-worker state, or one not on an optimizer-step boundary of ``world_size``.
    """
    dataset_state = state.get("dataset_state")
    if _NUM_YIELDED not in state or not isinstance(dataset_state, Mapping):
        raise InexactResumeError(f"The streaming position (keys {sorted(state)}) is not that of a single-process "
                                 "loader of the elastic layout; resume with the settings it was written with.")
    batches = elastic_stream_batches(dataset_state, batch_size=batch_size, world_size=world_size,
                                     global_batch=global_batch)
    return {**state, _NUM_YIELDED: batches, _SAMPLER_YIELDED: batches, "dataset_state": {**dataset_state,
                                                                                          "step": batches}}


_STREAM_LOADER_CLASS: type | None = None


class _ReplaySkip:
    """A stream loader read from its start with the first ``num_batches`` batches dropped (no saved position)."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        self.loader, self.num_batches = loader, num_batches

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.loader), self.num_batches, None)


def _batches_yielded(state: Mapping[str, Any]) -> int:
    """Batches a ``StatefulDataLoader`` had yielded when ``state`` was taken (single- or multi-process form)."""
    count = batches_yielded(state, source="the streaming loader's saved position")
    if count is None:
        raise InexactResumeError(f"Unrecognised StatefulDataLoader state (keys {sorted(state)}); this torchdata "
                                 "version is not supported.")
    return count


def _stream_loader_class() -> type:
    """Define :class:`ResumableStreamLoader` on first use, so ``torchdata`` stays an optional import."""
    global _STREAM_LOADER_CLASS
    if _STREAM_LOADER_CLASS is None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        class ResumableStreamLoader(StatefulDataLoader):
            """``StatefulDataLoader`` over a :class:`SeededIterableDataset`, with ``set_epoch``, ``skip``, position."""

            _resumed_batches: int | None = None

            def __iter__(self) -> Iterator[Any]:
                return trace.traced_batches(super().__iter__())  # hf-resumable check: each batch's digests

            def set_epoch(self, epoch: int) -> None:
                self.dataset.set_epoch(epoch)

            def load_position(self, record: Mapping[str, Any]) -> int:
                """Continue at ``record``'s loader state (elastic layout: converted for this world size); returns
                the batches of the pass this rank has already trained on."""
                state = record[DATA_LOADER]
                if self.dataset.global_batch is not None:  # elastic: the counters of this world size
                    state = elastic_loader_state(state, batch_size=self.dataset.batch_size,
                                                 world_size=self.dataset.world_size,
                                                 global_batch=self.dataset.global_batch)
                self.load_state_dict(state)
                self._resumed_batches = _batches_yielded(state)
                return self._resumed_batches

            def skip(self, num_batches: int) -> Any:
                if num_batches and self._resumed_batches is None:  # only reached when an inexact resume is allowed
                    logger.warning("No streaming position was restored: the first %d batches are read again and "
                                   "dropped (the stock Trainer's skipping; NOT bit-exact).", num_batches)
                    return _ReplaySkip(self, num_batches)
                if num_batches and self._resumed_batches != num_batches:
                    raise InexactResumeError(
                        f"The trainer resumes after {num_batches} batches but the streaming loader's restored "
                        f"position is {self._resumed_batches} batches; the checkpoint's data state does not match "
                        "its step. Resume from another checkpoint.")
                return self

            def position(self, *, epoch: int, step: int, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
                """The position record after ``step`` batches of ``epoch``: ``state`` (a ``state_dict()`` taken
                then, by a reader that has read further since), else the loader's state now."""
                return {DATA_KIND: "stream", DATA_EPOCH: epoch, DATA_STEP: step,
                        DATA_LOADER: self.state_dict() if state is None else state}

        _STREAM_LOADER_CLASS = ResumableStreamLoader
    return _STREAM_LOADER_CLASS
