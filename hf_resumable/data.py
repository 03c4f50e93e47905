"""Resumable data position and position-derived randomness for training data loaders.

Exact resume needs two things from the data pipeline:

1. **A cursor instead of a history.** The order of samples is a pure function of ``(seed, epoch)``
   (map-style data) or lives in the data set's own ``state_dict`` (streaming data), so resuming at
   batch ``n`` never fetches, transforms or collates the ``n`` batches before it.
2. **Randomness keyed by position.** Every batch is fetched, transformed *and* collated inside a
   random context seeded from ``(seed, epoch, rank, batch)`` (plus the worker id for streaming data),
   so masking in ``DataCollatorForLanguageModeling``, augmentation in a ``set_transform`` or a
   ``Dataset.__getitem__`` draws the same numbers whether the run was interrupted or not, with any
   number of workers. In the main process the caller's generators (the ones dropout draws from) are
   put back afterwards, so data randomness never shifts model randomness.
3. **State for every buffer.** A ``datasets`` shuffle buffer (``ds.shuffle(seed, buffer_size=N)``) is
   replaced by a :class:`ResumableShuffleBuffer` whose content and generator are part of the saved
   position (``datasets`` saves neither); the resulting order differs from ``datasets``' own shuffle.
4. **Private generators keyed by position too.** Collators and data sets that keep their own generator
   (``DataCollatorForLanguageModeling(seed=...)``, ``self.rng = np.random.default_rng(0)``) would restart
   from their seed after a resume. :class:`GeneratorSlots` finds every ``torch.Generator``,
   ``numpy.random.Generator``, ``numpy.random.RandomState`` and ``random.Random`` reachable from the
   collator (and from a torch data set or a ``datasets`` transform) through attributes, dataclass fields,
   ``functools.partial`` arguments, closures and small lists/dicts (up to 4 levels), plus the generator
   transformers' collators create lazily from their ``seed``, and reseeds each one before every batch
   from the batch's seed and the generator's path (and the object's own ``seed`` attribute), in the main
   process and in workers alike. Generators reached any other way (module globals, objects created
   inside the call, containers of more than 64 items, CUDA generators) are not covered.
5. **Length-grouped batches.** ``group_by_length`` (the seq2seq/ASR habit) orders each epoch as a pure
   function of ``(seed, epoch, lengths)`` (:func:`length_grouped_order`), so it resumes exactly too.
6. **Custom samplers.** An index sampler of the user's (a ``Trainer`` subclass's ``_get_train_sampler``,
   TRL's ``RepeatSampler``) is replayed per epoch under a seed derived from ``(seed, epoch)``
   (:func:`sampler_epoch_order`), which makes its order a function of the epoch, and resumed by cursor.

The pieces are framework-agnostic (no ``transformers`` import); :mod:`hf_resumable.integrations.trainer`
assembles them for the ``Trainer``.

Example:

```python
>>> from hf_resumable.data import ResumableBatchSampler, SeededMapDataset, build_map_dataloader
>>> data = [{"x": i} for i in range(10)]
>>> loader = build_map_dataloader(data, collate_fn=lambda items: [d["x"] for d in items], batch_size=4, seed=0)
>>> first_epoch = [batch for batch in loader]
>>> resumed = loader.skip(1)  # start at batch 1 without touching batch 0
>>> [batch for batch in resumed] == first_epoch[1:]
True
```
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import hashlib
import logging
import math
import os
import random
import types
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from .errors import InexactResumeError
from .rng import derive_seed, seeded_rng

logger = logging.getLogger(__name__)

__all__ = [
    "BatchKey",
    "data_rng",
    "ResumableBatchSampler",
    "SeededMapDataset",
    "SeededIterableDataset",
    "ResumableDataLoader",
    "build_map_dataloader",
    "build_stream_dataloader",
    "dataset_fingerprint",
    "has_shuffle_buffer",
    "ResumableShuffleBuffer",
    "resumable_shuffle_buffer",
    "GeneratorSlots",
    "length_grouped_order",
    "sampler_epoch_order",
]

# Domain-separation tags for derive_seed, so the permutation, map-style batches and streaming batches
# never share a seed even when their numbers coincide.
_TAG_PERMUTATION = "permutation"
_TAG_MAP_BATCH = "map-batch"
_TAG_STREAM_BATCH = "stream-batch"
_TAG_LOADER = "loader"
_TAG_FINGERPRINT = "fingerprint"
_TAG_SHUFFLE_BUFFER = "shuffle-buffer"
_TAG_GENERATOR = "private-generator"
_TAG_SAMPLER = "custom-sampler"
_BUFFER_NODE = "BufferShuffledExamplesIterable"  # datasets' shuffle buffer in an IterableDataset pipeline
_ARRAY = "__hfr_array__"  # marker of a tensor/ndarray encoded inside a shuffle buffer's JSON state

# Keys of the JSON data-position records written into checkpoints (data/rank-0000R.json).
DATA_KIND = "kind"  # "map" or "stream"
DATA_EPOCH = "epoch"  # epoch of the next batch to train on
DATA_STEP = "step"  # batches of that epoch already consumed (map-style)
DATA_NUM_BATCHES = "num_batches"  # batches per epoch on this rank (map-style)
DATA_LOADER = "loader"  # StatefulDataLoader.state_dict() (streaming)


class BatchKey(NamedTuple):
    """Everything that identifies one map-style batch: the seed of its randomness and its samples.

    Args:
        epoch (`int`): epoch the batch belongs to.
        rank (`int`): data-parallel rank that trains on it.
        step (`int`): number of the batch within this rank's epoch (0-based).
        indices (`tuple[int, ...]`): dataset indices of its samples, in order.
    """

    epoch: int
    rank: int
    step: int
    indices: tuple[int, ...]


def data_rng(seed: int) -> contextlib.AbstractContextManager[None]:
    """Seed python ``random``, numpy's global generator and torch's CPU generator for a data operation.

    :func:`hf_resumable.rng.seeded_rng`, except that in a ``DataLoader`` worker the generators are only
    reseeded (nothing else in a worker draws from them); in the main process they are saved first and
    restored on exit, so the stream dropout draws from is untouched. Transforms that draw from CUDA
    generators are not covered.

    Example:

    ```python
    >>> import random
    >>> with data_rng(7):
    ...     a = random.random()
    >>> with data_rng(7):
    ...     b = random.random()
    >>> a == b
    True
    ```
    """
    return seeded_rng(seed, restore=get_worker_info() is None)


def _identity(batch: Any) -> Any:
    """``collate_fn`` of our loaders: batches are already collated by the seeded dataset wrappers."""
    return batch


class ResumableBatchSampler(Sampler[BatchKey]):
    """Batches of a shuffled (or sequential) epoch as a pure function of ``(seed, epoch)``, with a cursor.

    The permutation comes from a private ``torch.Generator`` seeded with ``derive_seed(seed, epoch)``,
    never from the global generator. Under data parallelism the epoch is padded to a multiple of
    ``world_size`` (as ``DistributedSampler`` does) and rank ``r`` takes every ``world_size``-th sample.

    Args:
        num_samples (`int`): length of the data set.
        batch_size (`int`): samples per batch on this rank.
        seed (`int`): run seed; the permutation of epoch ``e`` depends only on ``(seed, e)``.
        shuffle (`bool`, *optional*, defaults to `True`): shuffle every epoch.
        drop_last (`bool`, *optional*, defaults to `False`): drop the last incomplete batch.
        rank (`int`, *optional*, defaults to 0), world_size (`int`, *optional*, defaults to 1): data-parallel position.
        start_step (`int`, *optional*, defaults to 0): first batch to yield in the current epoch.
        lengths (`Sequence[int]`, *optional*): per-sample lengths; each epoch is then ordered by
            :func:`length_grouped_order` (``group_by_length``) instead of a plain permutation.
        group_size (`int`, *optional*): samples that should have similar lengths (default: ``batch_size *
            world_size``; the Trainer passes its batch size times gradient accumulation times world size).
        order (`Callable[[int], Sequence[int]]`, *optional*): ``epoch -> indices`` of a custom sampler (see
            :func:`sampler_epoch_order`), ``num_samples`` long; replaces the built-in permutation. Under data
            parallelism it is sharded by whole batches (rank ``r`` takes batches ``r``, ``r + world_size``, ...,
            as accelerate's ``BatchSamplerShard`` does), not by sample.

    Example:

    ```python
    >>> sampler = ResumableBatchSampler(10, 4, seed=0)
    >>> [len(key.indices) for key in sampler]
    [4, 4, 2]
    >>> [key.step for key in sampler.skip(2)]
    [2]
    ```
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, start_step: int = 0,
                 lengths: Sequence[int] | None = None, group_size: int | None = None,
                 order: Callable[[int], Sequence[int]] | None = None) -> None:
        if num_samples < 0 or batch_size < 1:
            raise ValueError(f"num_samples must be >= 0 and batch_size >= 1, got {num_samples} and {batch_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        if lengths is not None and (len(lengths) != num_samples or not shuffle):
            raise ValueError(f"lengths must have one entry per sample ({num_samples}, got {len(lengths)}) and "
                             "length grouping needs shuffle=True.")
        self.lengths = list(lengths) if lengths is not None else None
        self.group_size = group_size or batch_size * world_size
        self.order = order
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.shuffle, self.drop_last, self.rank, self.world_size = shuffle, drop_last, rank, world_size
        self.epoch = 0
        if not 0 <= start_step <= len(self):
            raise ValueError(f"start_step must be in [0, {len(self)}] (batches per epoch), got {start_step}.")
        self.start_step = start_step

    def _samples_per_rank(self) -> int:
        if not self.num_samples:
            return 0
        if self.order is not None and self.world_size > 1:  # sharded by whole batches, padded to full rounds
            return math.ceil(self.num_samples / (self.batch_size * self.world_size)) * self.batch_size
        return math.ceil(self.num_samples / self.world_size)

    def __len__(self) -> int:
        per_rank = self._samples_per_rank()
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration yields."""
        self.epoch = epoch

    def skip(self, num_batches: int) -> "ResumableBatchSampler":
        """A copy that starts at batch ``num_batches`` of the current epoch (nothing before it is produced)."""
        clone = copy.copy(self)
        if not 0 <= num_batches <= len(self):
            raise ValueError(f"Cannot skip {num_batches} batches of an epoch of {len(self)} batches.")
        clone.start_step = num_batches
        return clone

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's sample order for ``epoch``."""
        if self.order is not None:
            order = [int(index) for index in self.order(epoch)]
            if len(order) != self.num_samples:
                raise InexactResumeError(f"The sampler yielded {len(order)} indices for epoch {epoch}, but its length "
                                         f"is {self.num_samples}; an epoch's order must have a fixed length.")
        elif self.shuffle:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, _TAG_PERMUTATION, epoch))
            if self.lengths is not None:
                order = length_grouped_order(self.lengths, self.group_size, generator=generator)
            else:
                order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        padded = self._samples_per_rank() * self.world_size
        if order and padded > len(order):
            order += (order * (padded // len(order) + 1))[: padded - len(order)]
        if self.order is not None:
            # a custom sampler's consecutive indices belong together (TRL's RepeatSampler repeats each prompt
            # num_generations times): rank r takes whole batches r, r + world_size, ... as accelerate does
            size = self.batch_size
            return [index for start in range(self.rank * size, len(order), size * self.world_size)
                    for index in order[start : start + size]]
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[BatchKey]:
        order = self.epoch_indices(self.epoch)
        for step in range(self.start_step, len(self)):
            chunk = tuple(order[step * self.batch_size : (step + 1) * self.batch_size])
            yield BatchKey(self.epoch, self.rank, step, chunk)


_GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_LEAF_TYPES = (str, bytes, int, float, complex, bool, type(None), torch.Tensor, np.ndarray, np.generic,
               torch.nn.Module, type, types.ModuleType, types.BuiltinFunctionType, torch.dtype, torch.device)
_SKIPPED_PACKAGES = ("tokenizers", "datasets", "torch", "numpy", "pyarrow", "pandas")
_MAX_DEPTH = 4
_MAX_ITEMS = 64


def _reseed(generator: Any, seed: int) -> None:
    if isinstance(generator, torch.Generator):
        generator.manual_seed(seed)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = type(generator.bit_generator)(seed).state
    elif isinstance(generator, np.random.RandomState):
        generator.seed(seed)
    else:
        generator.seed(seed)


def _is_lazy_collator(obj: Any) -> bool:
    """transformers' collators with ``seed=`` create ``self.generator`` on their first call (and per process)."""
    return (isinstance(getattr(obj, "seed", None), int) and hasattr(obj, "generator")
            and callable(getattr(obj, "get_generator", None)))


def _children(obj: Any) -> Iterator[tuple[tuple[str, Any], Any]]:
    """``((kind, key), child)`` for everything a generator may hide behind."""
    if isinstance(obj, functools.partial):
        yield ("attr", "func"), obj.func
        for index, value in enumerate(obj.args):
            yield ("arg", index), value
        for key, value in obj.keywords.items():
            yield ("kwarg", key), value
        return
    if isinstance(obj, types.MethodType):
        yield ("attr", "__self__"), obj.__self__
        yield ("attr", "__func__"), obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        for index, cell in enumerate(obj.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                yield ("cell", index), cell.cell_contents
        return
    if isinstance(obj, (list, tuple)):
        if len(obj) <= _MAX_ITEMS:
            yield from ((("item", index), value) for index, value in enumerate(obj))
        return
    if isinstance(obj, dict):
        if len(obj) <= _MAX_ITEMS:
            yield from ((("item", key), value) for key, value in obj.items() if isinstance(key, (str, int)))
        return
    if type(obj).__module__.split(".")[0] in _SKIPPED_PACKAGES or hasattr(obj, "convert_tokens_to_ids"):
        return  # tokenizers, data sets, arrays: large, and hold no private generator of the user's
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and len(attributes) <= _MAX_ITEMS:
        yield from ((("attr", key), value) for key, value in attributes.items() if not key.startswith("__"))


def _resolve(root: Any, path: tuple[tuple[str, Any], ...]) -> Any:
    obj = root
    for kind, key in path:
        if kind == "attr":
            obj = getattr(obj, key)
        elif kind == "arg":
            obj = obj.args[key]
        elif kind == "kwarg":
            obj = obj.keywords[key]
        elif kind == "cell":
            obj = obj.__closure__[key].cell_contents
        else:
            obj = obj[key]
    return obj


class GeneratorSlots:
    """The private random generators reachable from an object, found once and reseeded before every batch.

    ``root`` is searched (see the module docstring for what is covered); each generator found is remembered
    by its path from ``root``, so a copy of ``root`` in a ``DataLoader`` worker is reseeded the same way.

    Args:
        root: a collator, a data set, a transform function (``None``: nothing to reseed).

    Example:

    ```python
    >>> import numpy as np
    >>> class Noise:
    ...     def __init__(self):
    ...         self.rng = np.random.default_rng(0)
    ...     def __call__(self, items):
    ...         return [self.rng.integers(100) for _ in items]
    >>> noise = Noise()
    >>> slots = GeneratorSlots(noise)
    >>> slots.paths
    ['rng']
    >>> slots.reseed(noise, seed=7); first = noise([0, 0])
    >>> slots.reseed(noise, seed=7); first == noise([0, 0])
    True
    ```
    """

    def __init__(self, root: Any) -> None:
        self._slots: list[tuple[tuple[tuple[str, Any], ...], bool]] = []  # (path, lazily created by a collator)
        if root is not None:
            self._search(root, (), set())

    def _search(self, obj: Any, path: tuple, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, _GENERATOR_TYPES):
            self._slots.append((path, False))
            return
        if len(path) >= _MAX_DEPTH or isinstance(obj, _LEAF_TYPES):
            return
        lazy = _is_lazy_collator(obj)
        if lazy:
            self._slots.append((path, True))
        for step, child in _children(obj):
            if lazy and step == ("attr", "generator"):
                continue
            self._search(child, path + (step,), seen)

    @property
    def paths(self) -> list[str]:
        """Readable paths of the generators found (``"inner.generator"``, ``"rng"``...)."""
        return [".".join([str(key) for _, key in path] + (["generator"] if lazy else []))
                for path, lazy in self._slots]

    def __bool__(self) -> bool:
        return bool(self._slots)

    def reseed(self, root: Any, *, seed: int) -> None:
        """Reseed every generator under ``root`` from ``seed`` and its path (and its owner's ``seed``)."""
        for path, lazy in self._slots:
            try:
                obj = _resolve(root, path)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):
                continue  # the object changed shape since it was searched
            name = "/".join(str(key) for _, key in path)
            if lazy:
                if not isinstance(obj.generator, _GENERATOR_TYPES):
                    obj.generator = obj.get_generator(obj.seed)
                if hasattr(obj, "_generator_pid"):  # else the collator re-creates it from its seed in a worker
                    obj._generator_pid = os.getpid()
                _reseed(obj.generator, derive_seed(seed, _TAG_GENERATOR, name, "generator", obj.seed))
            else:
                _reseed(obj, derive_seed(seed, _TAG_GENERATOR, name))


def _dataset_generator_root(dataset: Any) -> Any:
    """What to search for private generators in a data set: a torch data set itself, or a ``datasets`` transform."""
    if type(dataset).__module__.split(".")[0] == "datasets":
        return (getattr(dataset, "_format_kwargs", None) or {}).get("transform")
    return dataset


def sampler_epoch_order(sampler: Any, *, seed: int) -> Callable[[int], list[int]]:
    """``epoch -> indices`` of an index sampler, as a pure function of ``(seed, epoch)``.

    For each epoch the sampler's ``set_epoch`` (if any) is called, its private generators (a ``generator``
    attribute...; see :class:`GeneratorSlots`) are reseeded from ``(seed, epoch)``, and it is iterated inside a
    random context seeded the same way (``RandomSampler``/``WeightedRandomSampler`` without a generator draw their
    seed from the global one), in the main process, with the caller's streams restored afterwards. A sampler whose
    order depends on anything else (the wall clock, a counter of how often it was iterated) is not made exact.

    Example:

    ```python
    >>> from torch.utils.data import RandomSampler
    >>> order = sampler_epoch_order(RandomSampler(range(6)), seed=0)
    >>> order(1) == order(1) != order(2)
    True
    ```
    """
    slots = GeneratorSlots(sampler)

    def order(epoch: int) -> list[int]:
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
        epoch_seed = derive_seed(seed, _TAG_SAMPLER, epoch)
        slots.reseed(sampler, seed=epoch_seed)
        with seeded_rng(epoch_seed):
            indices = list(sampler)
        if indices and not isinstance(indices[0], (int, np.integer, torch.Tensor)):
            raise InexactResumeError(f"{type(sampler).__name__} yields {type(indices[0]).__name__} items, not sample "
                                     "indices (a batch sampler?); only index samplers can be replayed by position.")
        return [int(index) for index in indices]

    return order


def length_grouped_order(lengths: Sequence[int], group_size: int, *, generator: torch.Generator) -> list[int]:
    """An epoch order in which every ``group_size`` consecutive samples have similar lengths (``group_by_length``).

    A random permutation (from ``generator`` only) is cut into mega-batches of ``k * group_size`` samples
    (``k = min(len // (4 * group_size), 50)``, at least 1), each sorted by decreasing length, and the longest
    sample overall is moved to the very first position so that an out-of-memory error shows at once. The
    order is a pure function of ``(generator state, lengths, group_size)``.

    Example:

    ```python
    >>> order = length_grouped_order([1, 9, 2, 8, 3, 7, 4, 6], 2, generator=torch.Generator().manual_seed(0))
    >>> sorted(order) == list(range(8)) and order[0] == 1  # sample 1 (length 9) comes first
    True
    ```
    """
    count = len(lengths)
    multiple = max(min(count // (group_size * 4), 50), 1)
    size = multiple * group_size
    permutation = torch.randperm(count, generator=generator).tolist()
    chunks = [sorted(permutation[i : i + size], key=lambda index: lengths[index], reverse=True)
              for i in range(0, count, size)]
    if chunks:
        longest = max(range(len(chunks)), key=lambda c: (lengths[chunks[c][0]], -c))
        chunks[0][0], chunks[longest][0] = chunks[longest][0], chunks[0][0]
    return [index for chunk in chunks for index in chunk]


class SeededMapDataset(Dataset):
    """Fetch and collate a whole :class:`BatchKey` inside a random context seeded by the batch's position.

    Used with :class:`ResumableBatchSampler` as ``batch_sampler``: the ``DataLoader`` hands each key to
    :meth:`__getitems__`, which runs the user's data set (including a ``datasets`` ``set_transform``)
    and collator under ``data_rng(derive_seed(seed, epoch, rank, step))``.

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
        seed = derive_seed(self.seed, _TAG_MAP_BATCH, key.epoch, key.rank, key.step)
        self._dataset_generators.reseed(_dataset_generator_root(self.dataset), seed=seed)
        self._collate_generators.reseed(self.collate_fn, seed=seed)
        with data_rng(seed):
            return self.collate_fn(self._fetch(list(key.indices)))

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
                         num_samples: int | None = None) -> ResumableDataLoader:
    """A :class:`ResumableDataLoader` for a map-style data set.

    Args:
        dataset: map-style data set (has ``__len__`` and ``__getitem__``).
        collate_fn (`Callable`): collator, run in the same seeded context as the fetch.
        batch_size (`int`): per-rank batch size.
        seed (`int`): run seed (permutation, per-batch randomness, worker base seed).
        shuffle, drop_last, rank, world_size, lengths, group_size, order: see :class:`ResumableBatchSampler`.
        num_samples (`int`, *optional*): indices per epoch of ``order`` (default: ``len(dataset)``).
        num_workers, pin_memory, persistent_workers, prefetch_factor, multiprocessing_context:
            forwarded to ``torch.utils.data.DataLoader``.

    Returns:
        [`ResumableDataLoader`]
    """
    count = len(dataset) if num_samples is None else num_samples
    sampler = ResumableBatchSampler(count, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                                    world_size=world_size, lengths=lengths, group_size=group_size, order=order)
    kwargs = _loader_kwargs(seed, num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
                            prefetch_factor=prefetch_factor, multiprocessing_context=multiprocessing_context)
    return ResumableDataLoader(SeededMapDataset(dataset, collate_fn, seed=seed), batch_sampler=sampler, **kwargs)


def build_stream_dataloader(dataset: Any, *, collate_fn: Callable[[list], Any], batch_size: int, seed: int,
                            drop_last: bool = False, rank: int = 0, num_workers: int = 0,
                            pin_memory: bool = False, persistent_workers: bool = False,
                            prefetch_factor: int | None = None,
                            multiprocessing_context: Any = None) -> Any:
    """A :class:`ResumableStreamLoader` (``torchdata`` ``StatefulDataLoader``) over a streaming data set.

    Args: as :func:`build_map_dataloader`; ``dataset`` is a ``datasets.IterableDataset`` already split for
    this rank (``datasets.distributed.split_dataset_by_node``) when training data-parallel.

    A ``datasets`` shuffle buffer (``ds.shuffle(seed=..., buffer_size=N)``) is replaced by a
    :class:`ResumableShuffleBuffer` of the same size (see :func:`resumable_shuffle_buffer`), whose content
    is part of the saved position, so the stream resumes bit for bit. The resulting sample order differs
    from the one ``datasets`` would produce with the same seed. A buffer that cannot be replaced (inside
    ``interleave_datasets``/``concatenate_datasets`` sources, or several buffers) is kept, with a WARNING.

    Raises:
        ImportError: if ``torchdata`` is not installed.
    """
    wrapper = SeededIterableDataset(_resumable_source(dataset, rank), collate_fn, batch_size=batch_size, seed=seed,
                                    drop_last=drop_last, rank=rank)
    kwargs = _loader_kwargs(seed, num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
                            prefetch_factor=prefetch_factor, multiprocessing_context=multiprocessing_context)
    return _stream_loader_class()(wrapper, batch_size=None, **kwargs)


def _resumable_source(dataset: Any, rank: int) -> Any:
    """``dataset`` with its ``datasets`` shuffle buffer replaced by a :class:`ResumableShuffleBuffer` when possible."""
    if not has_shuffle_buffer(dataset):
        return dataset
    try:
        return resumable_shuffle_buffer(dataset, rank=rank)
    except InexactResumeError as error:
        logger.warning("%s Keeping datasets' own shuffle buffer: resuming this stream will NOT be bit-exact.", error)
        return dataset


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
    if "_num_yielded" in state:
        return int(state["_num_yielded"])
    snapshot = state.get("_snapshot") or {}
    if "_snapshot_step" in snapshot:
        return int(snapshot["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))
    raise InexactResumeError(f"Unrecognised StatefulDataLoader state (keys {sorted(state)}); this torchdata "
                             "version is not supported.")


def _stream_loader_class() -> type:
    """Define :class:`ResumableStreamLoader` on first use, so ``torchdata`` stays an optional import."""
    global _STREAM_LOADER_CLASS
    if _STREAM_LOADER_CLASS is None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        class ResumableStreamLoader(StatefulDataLoader):
            """``StatefulDataLoader`` over a :class:`SeededIterableDataset`, with ``set_epoch``, ``skip``, position."""

            _resumed_batches: int | None = None

            def set_epoch(self, epoch: int) -> None:
                self.dataset.set_epoch(epoch)

            def load_position(self, record: Mapping[str, Any]) -> None:
                state = record[DATA_LOADER]
                self.load_state_dict(state)
                self._resumed_batches = _batches_yielded(state)

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

            def position(self, *, epoch: int, step: int) -> dict[str, Any]:
                return {DATA_KIND: "stream", DATA_EPOCH: epoch, DATA_STEP: step,
                        DATA_LOADER: self.state_dict()}

        _STREAM_LOADER_CLASS = ResumableStreamLoader
    return _STREAM_LOADER_CLASS


def dataset_fingerprint(dataset: Any, *, seed: int = 0) -> tuple[int | None, str]:
    """``(length, fingerprint)`` of a training data set, to detect that a resumed run trains on other data.

    ``datasets.Dataset`` uses its ``_fingerprint``; other map-style data sets hash their length and the
    repr of up to 3 samples (fetched under a fixed seed, so random transforms do not change it);
    streaming data sets hash their class, shard count and features (nothing is read from the stream).

    Example:

    ```python
    >>> dataset_fingerprint([1, 2, 3]) == dataset_fingerprint([1, 2, 3]) != dataset_fingerprint([1, 2, 4])
    True
    ```
    """
    own = getattr(dataset, "_fingerprint", None)
    length = len(dataset) if isinstance(dataset, Sized) else None
    if isinstance(own, str):
        return length, own
    if length is None:
        parts = [type(dataset).__qualname__, getattr(dataset, "n_shards", None), getattr(dataset, "features", None)]
    else:
        probe = sorted({0, length // 2, length - 1}) if length else []
        with data_rng(derive_seed(seed, _TAG_FINGERPRINT)):
            parts = [type(dataset).__qualname__, length] + [dataset[i] for i in probe]
    return length, hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def has_shuffle_buffer(dataset: Any) -> bool:
    """Whether a ``datasets.IterableDataset`` pipeline contains a ``.shuffle(buffer_size=...)`` buffer.

    ``datasets`` saves the position of the stream under a shuffle buffer but not the buffer's content
    (its ``load_state_dict`` refills the buffer from the resume point), so such a stream cannot be
    resumed bit for bit from its ``state_dict``; :func:`build_stream_dataloader` therefore replaces the
    buffer with a :class:`ResumableShuffleBuffer` (see :func:`resumable_shuffle_buffer`).
    """
    return _has_buffer_node(getattr(dataset, "_ex_iterable", None))


def _has_buffer_node(root: Any) -> bool:
    pending, seen = [root], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == _BUFFER_NODE:
            return True
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or [])
    return False


def _encode_example(value: Any) -> Any:
    """A JSON-safe deep copy of an example: tensors and arrays become exact base64 records."""
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        raw = array.view(torch.uint8) if array.dim() else array.reshape(1).view(torch.uint8)
        return {_ARRAY: "torch", "dtype": str(array.dtype).removeprefix("torch."), "shape": list(array.shape),
                "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {_ARRAY: "numpy", "dtype": array.dtype.str, "shape": list(array.shape),
                "data": base64.b64encode(array.tobytes()).decode("ascii")}
    if isinstance(value, Mapping):
        return {k: _encode_example(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode_example(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_encode_example(v) for v in value)
    return value


def _decode_example(value: Any) -> Any:
    """Invert :func:`_encode_example`."""
    if isinstance(value, Mapping):
        if value.get(_ARRAY) == "numpy":
            raw = base64.b64decode(value["data"])
            return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
        if value.get(_ARRAY) == "torch":
            dtype = getattr(torch, value["dtype"])
            raw = torch.frombuffer(bytearray(base64.b64decode(value["data"])), dtype=torch.uint8)
            return raw.view(dtype).reshape(value["shape"]).clone()
        return {k: _decode_example(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_example(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_decode_example(v) for v in value)
    return value


class ResumableShuffleBuffer(IterableDataset):
    """A shuffle buffer over a stream whose content is part of its ``state_dict``, so it resumes bit for bit.

    The buffer holds up to ``buffer_size`` examples; once full, every new example from ``source`` replaces a
    uniformly drawn slot, whose previous example is yielded. When the source ends, the remaining examples
    are yielded in random order. The draws come from a private numpy ``Generator`` seeded with
    ``(seed, epoch, rank, worker)``: in ``DataLoader`` workers each worker shuffles its own shards with its
    own buffer (as ``datasets`` does). :meth:`state_dict` holds the source's ``state_dict()``, the
    buffer's examples (JSON-safe; tensors and arrays are stored exactly as base64) and the generator
    state, so a restored buffer continues exactly where it was.

    The sample order is not the one ``datasets``' ``shuffle(buffer_size=...)`` produces with the same seed,
    only a shuffle of the same quality.

    Args:
        source: a stateful stream (``datasets.IterableDataset`` without a shuffle buffer, or any iterable
            data set with ``state_dict``/``load_state_dict``).
        buffer_size (`int`): number of examples held.
        seed (`int`): seed of the buffer's draws.
        rank (`int`, *optional*, defaults to 0): data-parallel rank (part of the seed).

    Example:

    ```python
    >>> import datasets
    >>> stream = datasets.Dataset.from_dict({"x": list(range(6))}).to_iterable_dataset()
    >>> buffer = ResumableShuffleBuffer(stream, buffer_size=3, seed=0)
    >>> sorted(example["x"] for example in buffer)
    [0, 1, 2, 3, 4, 5]
    ```
    """

    def __init__(self, source: Any, *, buffer_size: int, seed: int, rank: int = 0) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}.")
        self.source, self.buffer_size, self.seed, self.rank = source, buffer_size, seed, rank
        self.epoch = 0
        self._buffer: list[Any] = []
        self._rng: np.random.Generator | None = None
        self._pending: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (of the buffer's seed and of the source's own shuffling)."""
        self.epoch = epoch
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def _fresh_rng(self) -> np.random.Generator:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        seed = derive_seed(self.seed, _TAG_SHUFFLE_BUFFER, self.epoch, self.rank, worker)
        return np.random.Generator(np.random.PCG64(seed))

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        if pending is not None and int(pending["epoch"]) == self.epoch:
            buffer = [_decode_example(example) for example in pending["buffer"]]
            rng = np.random.Generator(np.random.PCG64())
            rng.bit_generator.state = _rng_state_from_json(pending["rng"])
        else:
            buffer, rng = [], self._fresh_rng()
        self._buffer, self._rng = buffer, rng
        # Invariant at every yield: source position, buffer content and generator state describe the rest
        # of the stream exactly (the yielded example is out of the buffer, the one replacing it is in).
        for example in self.source:
            if len(buffer) < self.buffer_size:
                buffer.append(example)
                continue
            slot = int(rng.integers(self.buffer_size))
            out, buffer[slot] = buffer[slot], example
            yield out
        while buffer:
            slot = int(rng.integers(len(buffer)))
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            yield buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        """Source position, buffer content and generator state after the last yielded example."""
        if self._pending is not None:  # restored but not iterated yet: the restored state is still current
            return copy.deepcopy(self._pending)
        rng = self._rng if self._rng is not None else self._fresh_rng()
        return {"source": self.source.state_dict(), "buffer": [_encode_example(e) for e in self._buffer],
                "rng": _rng_state_to_json(rng.bit_generator.state), "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (takes effect at the next ``iter``)."""
        self.source.load_state_dict(state["source"])
        self._pending = dict(state)


def _rng_state_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    # PCG64 state and increment are 128-bit integers: stored as decimal strings.
    return {"bit_generator": state["bit_generator"], "state": str(state["state"]["state"]),
            "inc": str(state["state"]["inc"]), "has_uint32": int(state["has_uint32"]),
            "uinteger": int(state["uinteger"])}


def _rng_state_from_json(state: Mapping[str, Any]) -> dict[str, Any]:
    return {"bit_generator": state["bit_generator"],
            "state": {"state": int(state["state"]), "inc": int(state["inc"])},
            "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}


def resumable_shuffle_buffer(dataset: Any, *, rank: int = 0) -> ResumableShuffleBuffer:
    """Replace the shuffle buffer of a ``datasets.IterableDataset`` pipeline by a :class:`ResumableShuffleBuffer`.

    The ``datasets`` buffer node is removed from the pipeline (shard shuffling and every ``.map`` /
    ``.filter`` are kept, so they now run before the buffer) and a :class:`ResumableShuffleBuffer` of the
    same size is put on top. Its seed is drawn from the ``datasets`` buffer's generator, so
    ``shuffle(seed=...)`` still selects the order. The order differs from the one ``datasets`` produces.

    Args:
        dataset (`datasets.IterableDataset`): a pipeline with one ``shuffle(buffer_size=...)``.
        rank (`int`, *optional*, defaults to 0): data-parallel rank (part of the buffer's seed).

    Raises:
        InexactResumeError: the pipeline has no shuffle buffer, several, or one below a multi-source node
            (``interleave_datasets``, ``concatenate_datasets``).
    """
    from datasets import IterableDataset as HfIterableDataset

    if not isinstance(dataset, HfIterableDataset):
        raise InexactResumeError(f"Expected a datasets.IterableDataset, got {type(dataset).__name__}.")
    path, node = [], dataset._ex_iterable
    while node is not None and type(node).__name__ != _BUFFER_NODE:
        path.append(node)
        node = getattr(node, "ex_iterable", None)
    if node is None:
        raise InexactResumeError("The stream's shuffle buffer is inside a multi-source pipeline "
                                 "(interleave/concatenate) "
                                 "or absent; hf_resumable can only replace a buffer of a single-source pipeline.")
    child = node.ex_iterable
    if type(child).__name__ == "InterleavedShardsExamplesIterable":
        # shuffle() reads several shards at once to feed its buffer; that node's state does not survive
        # DataLoader-worker sharding (datasets 5.2 fails to load it), so shards are read one after the other.
        child = child.ex_iterable
    if _has_buffer_node(child):
        raise InexactResumeError("The stream has several shuffle buffers; hf_resumable can replace only one.")
    for parent in reversed(path):  # rebuild the nodes above the buffer, leaving the caller's pipeline untouched
        parent = copy.copy(parent)
        parent.ex_iterable = child
        child = parent
    source = HfIterableDataset(child, info=dataset._info.copy(), split=dataset._split, formatting=dataset._formatting,
                               distributed=copy.deepcopy(dataset._distributed),
                               token_per_repo_id=dataset._token_per_repo_id)
    source.set_epoch(int(dataset.epoch))
    seed = int(copy.deepcopy(node.generator).integers(0, 1 << 62))
    buffer = ResumableShuffleBuffer(source, buffer_size=node.buffer_size, seed=seed, rank=rank)
    buffer.set_epoch(int(dataset.epoch))
    return buffer
