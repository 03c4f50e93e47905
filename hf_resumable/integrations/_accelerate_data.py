"""Plain ``DataLoader``\\ s prepared by ``ResumableAccelerator``: the drop-in path is also the exact path.

accelerate's ``prepare_data_loader`` runs as upstream; its result is rebuilt as a :class:`ResumableDataLoaderShard`
(or :class:`ResumableDataLoaderDispatcher`), a subclass of accelerate's own class, adding a saved position, a
``(seed, epoch)`` order and per-batch randomness keyed by position (docs/accelerate.md, "Prepared loaders resume
exactly"). A loader that cannot be rebuilt is prepared by accelerate alone (:func:`plan_loader` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from accelerate.data_loader import (
    _PYTORCH_DATALOADER_KWARGS,
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    SkipBatchSampler,
)
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .. import trace
from ..checkpoint.state import batches_yielded
from ..data import DATA_EPOCH, DATA_KIND, DATA_LOADER, DATA_NUM_BATCHES, DATA_STEP, data_rng
from ..distributed import broadcast_json
from ..format.rng import derive_seed
from ..format.state_codec import decode_state, encode_state
from ._accelerate_loop import ResumablePreparedLoader, ResumablePreparedStream

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

logger = logging.getLogger(__name__)

__all__ = [
    "LoaderPlan",
    "ResumableDataLoaderDispatcher",
    "ResumableDataLoaderShard",
    "StatefulLoaderPosition",
    "plan_loader",
    "prepare_positioned_loader",
    "rebuild_prepared_loader",
    "skip_restored_batches",
    "SOURCE_ACCELERATE",
    "SOURCE_STATEFUL",
]

# Position records use hf_resumable.data's record kinds ("map": epoch, step, num_batches; "stream": epoch, step and
# the loader's state_dict()), which the checkpoint core validates on load; DATA_SOURCE tells whose record it is.
KIND_MAP, KIND_STREAM = "map", "stream"
DATA_SOURCE = "source"
SOURCE_ACCELERATE = "accelerate"  # a ResumableDataLoaderShard/Dispatcher position (also carries DATA_SEED)
SOURCE_STATEFUL = "accelerate-stateful"  # a torchdata StatefulDataLoader state (StatefulLoaderPosition)
DATA_SEED = "seed"  # the loader's seed, part of its position record
DATA_SAVED = "saved"  # False when a StatefulDataLoader state could not be stored as JSON
_TAG_ORDER = "accelerate-order"
_TAG_LOADER = "accelerate-loader"
_TAG_BATCH = "accelerate-batch"
# Samplers whose order is a function of their generator and/or the epoch (set_epoch) only.
_KNOWN_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler,
                   SeedableRandomSampler, BatchSampler, BatchSamplerShard, SkipBatchSampler)
_IGNORED_KWARGS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class BatchPosition(NamedTuple):
    """What the batch sampler hands the data set: the batch's indices and where it is (its seed's inputs)."""

    seed: int
    epoch: int
    rank: int
    step: int
    indices: tuple


@dataclass(frozen=True)
class LoaderPlan:
    """Whether a DataLoader can be rebuilt as a resumable one, and (``note``) why not, or what is not guaranteed."""

    resumable: bool
    note: str | None = None


def _children(sampler: Any) -> list[Any]:
    found = []
    for attribute in ("batch_sampler", "sampler"):
        child = sampler.__dict__.get(attribute) if hasattr(sampler, "__dict__") else None
        if child is not None:
            found.append(child)
    return found


def samplers_below(root: Any) -> list[Any]:
    """``root`` and every (batch) sampler it wraps (through ``.batch_sampler`` / ``.sampler``), top first."""
    found, stack, seen = [], [root], set()
    while stack:
        sampler = stack.pop(0)
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        found.append(sampler)
        stack.extend(_children(sampler))
    return found


def plan_loader(dataloader: Any) -> LoaderPlan:
    """Whether ``dataloader`` (accelerate-prepared or plain) can be rebuilt resumable (pure, looks at attributes)."""
    if isinstance(dataloader.dataset, IterableDataset):
        return LoaderPlan(False, "it reads an IterableDataset, whose position lives in the data set (use "
                                 "hf_resumable.data.build_stream_dataloader, or DataLoaderConfiguration("
                                 "use_stateful_dataloader=True) with a data set that has state_dict())")
    if dataloader.batch_sampler is None:
        return LoaderPlan(False, "it has batch_size=None (no batch sampler to position)")
    if isinstance(dataloader.sampler, BatchSampler):
        return LoaderPlan(False, "it has a BatchSampler passed as sampler= (batch_size=None)")
    unknown = sorted({type(s).__qualname__ for s in samplers_below(dataloader.batch_sampler)
                      if not isinstance(s, _KNOWN_SAMPLERS)})
    if unknown:
        return LoaderPlan(True, f"its order comes from {', '.join(unknown)}: the position is saved and restored, "
                                "and the order is exact only if it depends on nothing but the epoch (set_epoch) and "
                                "the sampler's `generator` (reseeded every epoch)")
    return LoaderPlan(True)


class _PositionedBatchSampler(Sampler):
    """Yields :class:`BatchPosition` keys for the batches of ``inner``, from batch ``start`` of the pass on."""

    def __init__(self, inner: Any, *, rank: int, seed: int) -> None:
        self.inner, self.rank, self.seed = inner, rank, seed
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[BatchPosition]:
        seed, epoch, start = self.seed, self.epoch, self.start
        for step, indices in enumerate(self.inner):
            if step >= start:  # skipped batches are index lists only: nothing is fetched for them
                yield BatchPosition(seed, epoch, self.rank, step, tuple(indices))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for sampler in samplers_below(self.inner):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, num_processes, split_batches... as accelerate reads them from its batch sampler.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _PositionedDataset(Dataset):
    """Fetches and collates a :class:`BatchPosition` inside a random context seeded by the batch's position; other
    attribute lookups go to the wrapped data set."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, BatchPosition):
            return self.__getitems__(index)
        return self.dataset[index]

    def __getitems__(self, key: Any) -> Any:
        if not isinstance(key, BatchPosition):
            return [self.dataset[index] for index in key]
        with data_rng(derive_seed(key.seed, _TAG_BATCH, key.epoch, key.rank, key.step)):
            getitems = getattr(self.dataset, "__getitems__", None)
            indices = list(key.indices)
            items = list(getitems(indices)) if getitems is not None else [self.dataset[i] for i in indices]
            return self.collate_fn(items)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "collate_fn"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _identity(batch: Any) -> Any:
    return batch


def _new_instance(cls: type) -> Any:
    return cls.__new__(cls)


class _PositionMixin:
    """Position, reseeding and state of the resumable loaders (mixed into accelerate's loader classes)."""

    _keyed: _PositionedBatchSampler
    _base_per_batch: int  # batches of the batch sampler behind one yielded batch

    def _init_position(self, keyed: _PositionedBatchSampler, *, seed: int, base_per_batch: int,
                       generator: torch.Generator) -> None:
        self._keyed, self._base_per_batch, self._generator = keyed, base_per_batch, generator
        self._random_samplers = [s for s in samplers_below(keyed.inner) if getattr(s, "generator", None) is not None
                                 and not isinstance(s, SeedableRandomSampler)]
        self.seed = seed
        self._consumed, self._pending, self._live = 0, 0, False

    @property
    def seed(self) -> int:
        """The loader's seed: order and per-batch randomness of every epoch derive from it."""
        return self._keyed.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._keyed.seed = int(value)

    def _reseed(self, epoch: int) -> None:
        for number, sampler in enumerate(self._random_samplers):
            sampler.generator.manual_seed(derive_seed(self.seed, _TAG_ORDER, epoch, number))
        self._generator.manual_seed(derive_seed(self.seed, _TAG_LOADER, epoch))

    def __iter__(self) -> Iterator[Any]:
        start, self._pending = self._pending, 0
        self._keyed.epoch, self._keyed.start = self.iteration, start * self._base_per_batch
        self._reseed(self.iteration)
        self._consumed, self._live = start, True
        try:
            if len(self) and start >= len(self):  # restored at the very end of a pass: the pass is over
                self.iteration += 1
                return
            for batch in trace.traced_batches(super().__iter__()):  # hf-resumable check: each batch's digests
                self._consumed += 1
                yield batch
        finally:
            self._live = False
            self._keyed.start = 0

    def set_epoch(self, epoch: int) -> None:
        """accelerate's ``set_epoch``; selecting the current epoch keeps a restored position."""
        if epoch != self.iteration:
            self._pending = 0
        super().set_epoch(epoch)

    def skip(self, num_batches: int) -> None:
        """Start the next pass at batch ``num_batches`` (what ``skip_first_batches`` asks for)."""
        if not 0 <= num_batches <= len(self):
            raise ValueError(f"Cannot skip {num_batches} batches of a loader with {len(self)} batches per epoch.")
        self._pending = num_batches

    @property
    def restored_batches(self) -> int:
        """Batches of the current epoch the next pass skips (restored by ``load_state`` or asked by ``skip``)."""
        return self._pending

    @property
    def is_iterating(self) -> bool:
        return self._live

    def position(self) -> dict[str, Any]:
        """JSON record of where the next batch comes from (a finished pass is recorded as the next epoch)."""
        step = self._consumed if self._live else self._pending
        epoch = self.iteration
        if len(self) and step >= len(self):
            epoch, step = epoch + 1, 0
        return {DATA_KIND: KIND_MAP, DATA_SOURCE: SOURCE_ACCELERATE, DATA_EPOCH: epoch, DATA_STEP: step,
                DATA_NUM_BATCHES: len(self), DATA_SEED: self.seed}

    def fits(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` is a position of a loader with as many batches per epoch as this one."""
        return (record.get(DATA_SOURCE) == SOURCE_ACCELERATE and record.get(DATA_KIND) == KIND_MAP
                and int(record.get(DATA_NUM_BATCHES, -1)) == len(self))

    def load_position(self, record: Mapping[str, Any], *, restart_epoch: bool = False) -> None:
        """Continue at ``record`` (from :meth:`position`): the next pass starts there, nothing is fetched now."""
        if self._live:
            raise RuntimeError("load_state() was called while this loader is being iterated; call it before the loop.")
        self.iteration = int(record.get(DATA_EPOCH, 0))
        self._pending = 0 if restart_epoch else int(record.get(DATA_STEP, 0))
        if DATA_SEED in record:
            self.seed = int(record[DATA_SEED])

    def settings(self) -> dict[str, Any]:
        """What decides this loader's batches (compared at resume time)."""
        return {DATA_SOURCE: SOURCE_ACCELERATE, DATA_NUM_BATCHES: len(self), "dataset_length": len(self.dataset)}

    def state_dict(self) -> dict[str, Any]:
        """The position record (torchdata's ``StatefulDataLoader`` API, with hf_resumable's exact position)."""
        return self.position()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue at a record from :meth:`state_dict`.

        Raises:
            ValueError: for a state of another kind (e.g. a torchdata ``StatefulDataLoader`` state).
        """
        if state_dict.get(DATA_SOURCE) != SOURCE_ACCELERATE:
            raise ValueError(f"Not a position of this loader (keys {sorted(state_dict)[:6]}); pass what its "
                             "state_dict() returned.")
        self.load_position(state_dict)

    def __reduce__(self) -> tuple:
        return (_new_instance, (type(self),), self.__dict__)


class ResumableDataLoaderShard(_PositionMixin, DataLoaderShard):
    """accelerate's ``DataLoaderShard`` whose position, order and per-batch randomness resume exactly."""


class ResumableDataLoaderDispatcher(_PositionMixin, DataLoaderDispatcher):
    """accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``) with the same resumable position (its
    epoch's last, padded batch after a mid-epoch resume may differ: docs/limits.md)."""


def _dataloader_kwargs(loader: Any) -> dict[str, Any]:
    return {k: getattr(loader, k, default) for k, default in _PYTORCH_DATALOADER_KWARGS.items()
            if k not in _IGNORED_KWARGS}


def rebuild_prepared_loader(prepared: Any, *, seed: int, process_index: int, num_processes: int) -> Any:
    """Rebuild an accelerate-prepared ``DataLoaderShard``/``DataLoaderDispatcher`` as its resumable subclass (another
    kind of loader, e.g. XLA's, is returned as is). accelerate's batch sampler is kept and wrapped; the data set and
    collator are wrapped so that every batch is fetched and collated in its own seeded random context."""
    if type(prepared) not in (DataLoaderShard, DataLoaderDispatcher):
        return prepared
    base = prepared.base_dataloader
    kwargs = _dataloader_kwargs(base)
    collate_fn = kwargs.pop("collate_fn")
    generator = kwargs.get("generator")
    if generator is None:
        generator = kwargs["generator"] = torch.Generator()
    dispatcher = type(prepared) is DataLoaderDispatcher
    keyed = _PositionedBatchSampler(base.batch_sampler, rank=0 if dispatcher else process_index, seed=seed)
    for sampler in samplers_below(base.batch_sampler):
        if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)) and \
                not isinstance(sampler, SeedableRandomSampler) and sampler.generator is None:
            sampler.generator = torch.Generator()
    dataset = _PositionedDataset(base.dataset, collate_fn)
    common = dict(use_stateful_dataloader=prepared.use_stateful_dataloader, _drop_last=prepared._drop_last,
                  _non_blocking=prepared._non_blocking, batch_sampler=keyed,
                  collate_fn=_identity, **kwargs)
    if dispatcher:
        loader = ResumableDataLoaderDispatcher(dataset, split_batches=prepared.split_batches,
                                               slice_fn=prepared.slice_fn,
                                               torch_device_mesh=prepared.torch_device_mesh, **common)
        per_batch = 1 if prepared.split_batches else num_processes
    else:
        loader = ResumableDataLoaderShard(dataset, device=prepared.device, rng_types=prepared.rng_types,
                                          synchronized_generator=prepared.synchronized_generator, **common)
        per_batch = 1
    # Set after construction: accelerate < 1.15 has no ``iteration`` argument (its loaders start at 0).
    loader.iteration = prepared.iteration
    loader._init_position(keyed, seed=seed, base_per_batch=per_batch, generator=generator)
    return loader


def prepare_positioned_loader(accelerator: ResumableAccelerator, data_loader: Any,
                              prepare: Callable[[Any], Any]) -> Any:
    """accelerate's preparation of a plain ``DataLoader`` (``prepare``), rebuilt with a saved position where its
    sampler allows (:func:`plan_loader`) and registered with the accelerator's saved loaders; otherwise accelerate's
    loader with a WARNING saying what of it resumes."""
    plan = plan_loader(data_loader)
    # Drawn on every process (the same generator stream as without hf_resumable), process 0's value is used.
    seed = broadcast_json(int(torch.empty((), dtype=torch.int64).random_().item())) if plan.resumable else None
    prepared = prepare(data_loader)
    rank, world_size = accelerator._data_rank()
    rebuilt = (rebuild_prepared_loader(prepared, seed=seed, process_index=rank,
                                       num_processes=world_size) if plan.resumable else prepared)
    if rebuilt is prepared and getattr(prepared, "use_stateful_dataloader", False):
        logger.warning("%s is prepared by accelerate only (%s); its torchdata StatefulDataLoader state is saved "
                       "and restored as stock accelerate does, so it resumes mid-epoch, but randomness inside "
                       "its pipeline is not keyed by position.", type(data_loader).__name__, plan.note)
        accelerator._resumable_loaders.append(StatefulLoaderPosition(prepared))
        return prepared
    if rebuilt is prepared:
        logger.warning("%s is prepared by accelerate only: its position is not saved and a resumed run restarts "
                       "it from its beginning (%s).", type(data_loader).__name__,
                       plan.note or f"accelerate returned a {type(prepared).__name__}")
        return prepared
    accelerator._dataloaders = [rebuilt if loader is prepared else loader for loader in accelerator._dataloaders]
    accelerator._resumable_loaders.append(rebuilt)
    if plan.note is not None:
        logger.warning("%s: %s.", type(data_loader).__name__, plan.note)
    return rebuilt


def skip_restored_batches(accelerator: ResumableAccelerator, dataloader: Any, num_batches: int, *,
                          fallback: Callable[[Any, int], Any]) -> Any:
    """``skip_first_batches`` of a loader prepared by the accelerator: the loader itself, positioned, never skipping
    twice (docs/accelerate.md); without a restored position the next pass starts at ``num_batches``, nothing
    fetched. Any other loader goes to ``fallback`` (accelerate's own).

    Raises:
        ValueError: ``num_batches`` differs from the position ``load_state`` restored, or the loader is being iterated.
    """
    if accelerator._resume_watch.is_repeated_skip(dataloader, num_batches):
        accelerator._resume_watch.warn_repeated_skip(dataloader, num_batches)
        return dataloader
    if isinstance(dataloader, (ResumablePreparedLoader, ResumablePreparedStream)):
        if num_batches != dataloader.consumed:
            raise ValueError("load_state() already restored this loader's position (epoch "
                             f"{dataloader.epoch}, batch {dataloader.consumed}); do not skip batches yourself.")
        return dataloader
    if isinstance(dataloader, (ResumableDataLoaderShard, ResumableDataLoaderDispatcher)):
        if dataloader.is_iterating:
            raise ValueError("skip_first_batches() was called on a loader that is being iterated.")
        restored = dataloader.restored_batches
        if restored and num_batches != restored:
            raise ValueError(f"load_state() restored this loader at batch {restored} of epoch "
                             f"{dataloader.iteration}, but skip_first_batches() was asked to skip {num_batches}: "
                             "the script's step count and the checkpoint disagree. Skip exactly the restored "
                             "number (or do not skip: the loader already continues there).")
        if not restored:
            dataloader.skip(num_batches)
        return dataloader
    return fallback(dataloader, num_batches)



class StatefulLoaderPosition:
    """The position of a loader accelerate prepared with ``use_stateful_dataloader=True`` that could not be rebuilt
    resumable (an ``IterableDataset``): torchdata's own ``state_dict()``, saved as JSON as stock accelerate saves it.
    Randomness inside the pipeline is not keyed by position here."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        try:
            return len(self.loader)
        except TypeError:
            return 0

    def position(self) -> dict[str, Any]:
        """The JSON record (marked not saved, with a WARNING, if the state holds tensors: per-process JSON cannot)."""
        state = self.loader.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        encoded = encode_state(state, tensors, prefix="loader")
        record = {DATA_KIND: KIND_STREAM, DATA_SOURCE: SOURCE_STATEFUL, DATA_EPOCH: int(getattr(self.loader,
                                                                                              "iteration", 0)),
                  DATA_STEP: batches_yielded(state, source="StatefulDataLoader state") or 0, DATA_LOADER: encoded}
        if tensors:
            logger.warning("The StatefulDataLoader state of %s holds tensors (%s); its position is not saved and a "
                           "resumed run restarts it.", type(self.loader.dataset).__name__, sorted(tensors)[:3])
            record.update({DATA_LOADER: {}, DATA_SAVED: False})
        return record

    def fits(self, record: Mapping[str, Any]) -> bool:
        return record.get(DATA_SOURCE) == SOURCE_STATEFUL and record.get(DATA_SAVED, True) is not False

    def load_position(self, record: Mapping[str, Any], *, restart_epoch: bool = False) -> None:
        if not restart_epoch and self.fits(record):
            self.loader.load_state_dict(decode_state(record[DATA_LOADER], {}, source="StatefulDataLoader state"))

    def settings(self) -> dict[str, Any]:
        return {DATA_SOURCE: SOURCE_STATEFUL}
