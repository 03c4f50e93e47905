"""Sample orders as pure functions of (seed, epoch): the resumable batch sampler, custom samplers replayed per
epoch, and length-grouped batches."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ..errors import InexactResumeError
from ..format.rng import derive_seed, seeded_rng
from ._generators import GeneratorSlots
from ._position import _TAG_PERMUTATION, _TAG_SAMPLER, BatchKey
from .elastic import split_global_step

logger = logging.getLogger(__name__)


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
        global_batch (`int`, *optional*): the elastic layout (``elastic=True`` of both front doors; samples per
            optimizer step, kept when the world size changes): rank ``r``'s batch ``j`` is chunk
            ``j * world_size + r`` of ``batch_size`` positions, so step ``k`` trains on positions
            ``[k * global_batch, (k + 1) * global_batch)`` at any world size; a rank without a chunk in the epoch's
            last, shorter step gets a ``padding`` key (:meth:`elastic_weight`; docs/trainer.md#elastic). A multiple
            of ``batch_size * world_size``; not with ``order``.

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
                 order: Callable[[int], Sequence[int]] | None = None, global_batch: int | None = None) -> None:
        if num_samples < 0 or batch_size < 1:
            raise ValueError(f"num_samples must be >= 0 and batch_size >= 1, got {num_samples} and {batch_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        if lengths is not None and (len(lengths) != num_samples or not shuffle):
            raise ValueError(f"lengths must have one entry per sample ({num_samples}, got {len(lengths)}) and "
                             "length grouping needs shuffle=True.")
        if global_batch is not None and (order is not None or global_batch < 1
                                         or global_batch % (batch_size * world_size)):
            raise ValueError(f"global_batch must be a positive multiple of batch_size * world_size "
                             f"({batch_size} * {world_size}), got {global_batch}, and cannot be combined with order.")
        self.global_batch = global_batch
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
        if self.global_batch is not None:
            return self._elastic_len()
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
        """This rank's sample order for ``epoch`` (the elastic layout: the global order, cut by :meth:`__iter__`)."""
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
        if self.global_batch is not None:  # the global order: this rank's batches are cut from it by position
            return order
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

    # ------------------------------------------------------------------ the elastic layout (global_batch)
    def _elastic_end(self) -> int:
        """Positions of an epoch's global order that train: all, or whole global batches with ``drop_last``."""
        return self.num_samples - self.num_samples % self.global_batch if self.drop_last else self.num_samples

    def _elastic_len(self) -> int:
        full, tail = divmod(self._elastic_end(), self.global_batch)
        tail_chunks = -(-tail // self.batch_size)
        return full * self._batches_per_step() + -(-tail_chunks // self.world_size)

    def _batches_per_step(self) -> int:
        return self.global_batch // (self.batch_size * self.world_size)

    def _elastic_span(self, step: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of the global order in this rank's batch ``step`` (``lo == hi``: padding)."""
        end = self._elastic_end()
        lo, hi = split_global_step((step * self.world_size) * self.batch_size, self.batch_size * self.world_size,
                                   world_size=self.world_size, batch_size=self.batch_size, rank=self.rank)
        return min(lo, end), min(hi, end)

    def elastic_weight(self, step: int) -> tuple[int, int]:
        """Elastic layout: ``(samples, step_samples)`` of this rank's batch ``step``: how many of its samples train
        (0 for a padding batch) and how many the optimizer step it belongs to trains over all ranks (``global_batch``,
        or fewer in the epoch's last step). A batch's loss, as a mean over its samples, weighs ``samples /
        step_samples`` in the step's mean (pure).

        Example:

        ```python
        >>> sampler = ResumableBatchSampler(10, 2, seed=0, rank=1, world_size=2, global_batch=8)
        >>> [sampler.elastic_weight(step) for step in range(len(sampler))]
        [(2, 8), (2, 8), (0, 2)]
        ```
        """
        lo, hi = self._elastic_span(step)
        first = (step // self._batches_per_step()) * self.global_batch
        return hi - lo, min(self.global_batch, self._elastic_end() - first)

    def _elastic_keys(self, order: list[int]) -> Iterator[BatchKey]:
        for step in range(self.start_step, len(self)):
            lo, hi = self._elastic_span(step)
            padding = lo == hi
            if padding:  # the step's first chunk stands in (weight zero): the rank joins the step's collectives
                lo = (step // self._batches_per_step()) * self.global_batch
                hi = min(lo + self.batch_size, self._elastic_end())
            yield BatchKey(self.epoch, self.rank, step, tuple(order[lo:hi]), step * self.world_size + self.rank,
                           padding)

    def __iter__(self) -> Iterator[BatchKey]:
        order = self.epoch_indices(self.epoch)
        if self.global_batch is not None:
            yield from self._elastic_keys(order)
            return
        for step in range(self.start_step, len(self)):
            indices = tuple(order[step * self.batch_size : (step + 1) * self.batch_size])
            yield BatchKey(self.epoch, self.rank, step, indices)


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
