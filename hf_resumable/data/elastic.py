"""Elastic data position: resume on a different number of ranks with exactly the samples not yet seen.

:class:`ElasticSampler` keeps one *global* cursor over an order fixed by ``(seed, epoch)``, so a run saved on 2 ranks
and resumed on 1 continues with the next unseen positions, none skipped, none repeated;
:class:`ElasticSeededDataset` keys a sample's randomness by the sample. See docs/multi-gpu.md (elastic data).

Example:

```python
>>> two = [ElasticSampler(10, seed=0, rank=r, world_size=2, batch_size=2) for r in range(2)]
>>> seen = [i for s in two for i in next(iter(s))]   # both ranks train one step, then the run stops
>>> state = two[0].state_dict()                       # global cursor: 4 samples consumed
>>> state["consumed"]
4
>>> one = ElasticSampler(10, seed=0, rank=0, world_size=1, batch_size=2)
>>> one.load_state_dict(state)                        # resume on a single rank
>>> rest = [i for batch in one for i in batch]
>>> sorted(seen + rest) == list(range(10))            # none skipped, none repeated
True
```
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, Sampler

from ..errors import ConfigDriftError, CorruptCheckpointError
from ..format.rng import derive_seed
from ._position import data_rng

logger = logging.getLogger(__name__)

__all__ = ["SampleKey", "ElasticSampler", "ElasticSeededDataset", "sample_seed", "split_global_step"]

# Domain-separation tag of the permutation seed (per-sample seeds use derive_seed(seed, epoch, index)).
_TAG_PERMUTATION = "elastic-permutation"
# Version of the state_dict layout; load_state_dict refuses newer ones.
STATE_VERSION = 1

# Keys of ElasticSampler.state_dict() (JSON).
KEY_VERSION = "version"  # int, STATE_VERSION
KEY_EPOCH = "epoch"  # epoch of the next sample
KEY_CONSUMED = "consumed"  # samples of that epoch's global order consumed by all ranks together
KEY_SEED = "seed"  # run seed (must match on load)
KEY_DATASET_LEN = "dataset_len"  # data set length (must match on load)
KEY_SHUFFLE = "shuffle"  # whether the order is shuffled (must match on load)
KEY_WORLD_SIZE = "world_size"  # world size of the run that saved (informational)
KEY_BATCH_SIZE = "batch_size"  # per-rank batch size of the run that saved (informational)


class SampleKey(NamedTuple):
    """One sample of one epoch: what :class:`ElasticSeededDataset` needs to seed its randomness.

    Args:
        epoch (`int`): the epoch the sample is drawn in.
        index (`int`): its index in the data set.
    """

    epoch: int
    index: int


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in ``epoch``: ``derive_seed(seed, epoch, index)``, independent of ranks.

    Example:

    ```python
    >>> sample_seed(0, 1, 7) == sample_seed(0, 1, 7) != sample_seed(0, 1, 8)
    True
    ```
    """
    return derive_seed(seed, epoch, index)


def split_global_step(start: int, count: int, *, world_size: int, batch_size: int, rank: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of the global order that ``rank`` takes in the global step ``[start, start + count)``.

    A full step (``count == world_size * batch_size``) gives every rank ``batch_size`` contiguous positions;
    a short last step is split as evenly as possible (sizes differ by at most one; a rank may get none).

    Example:

    ```python
    >>> [split_global_step(8, 8, world_size=2, batch_size=4, rank=r) for r in range(2)]
    [(8, 12), (12, 16)]
    >>> [split_global_step(8, 3, world_size=2, batch_size=4, rank=r) for r in range(2)]
    [(8, 10), (10, 11)]
    ```
    """
    if count >= world_size * batch_size:
        return start + rank * batch_size, start + (rank + 1) * batch_size
    base, extra = divmod(count, world_size)
    lo = start + rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ElasticSampler(Sampler[list]):
    """Batches of a global order fixed by ``(seed, epoch)``, with a global cursor that survives a world-size change.

    Use it as a ``batch_sampler``. Every rank yields the same number of batches per epoch, so ranks stay
    in lockstep. The cursor advances by one *global* step (``world_size * batch_size`` samples, the short
    last step included) each time a batch is yielded, so ``state_dict()`` taken after training on a batch
    includes it. With ``num_workers > 0`` the ``DataLoader`` prefetches batches; take the state from a
    sampler that yields in step with training (``num_workers=0``), or rebuild the cursor from the number of
    optimizer steps with :meth:`state_dict_at`.

    Args:
        dataset_len (`int`): number of samples in the data set.
        seed (`int`): run seed; the order of epoch ``e`` depends only on ``(seed, e)``.
        rank (`int`, *optional*, defaults to 0), world_size (`int`, *optional*, defaults to 1): data-parallel position.
        batch_size (`int`): samples per batch on each rank.
        shuffle (`bool`, *optional*, defaults to `True`): shuffle each epoch.
        drop_last (`bool`, *optional*, defaults to `False`): drop an epoch's last global step when it is shorter
            than ``world_size * batch_size``; otherwise it is split as evenly as possible and a rank can get an
            empty batch (skip its forward pass, keep joining collectives).
        keys (`bool`, *optional*, defaults to `False`): yield lists of :class:`SampleKey` (for
            :class:`ElasticSeededDataset`) instead of lists of data set indices.

    Example:

    ```python
    >>> sampler = ElasticSampler(10, seed=0, rank=1, world_size=2, batch_size=2)
    >>> [len(batch) for batch in sampler]
    [2, 2, 1]
    >>> sampler.state_dict()["consumed"]
    10
    ```
    """

    def __init__(self, dataset_len: int, *, seed: int, rank: int = 0, world_size: int = 1, batch_size: int,
                 shuffle: bool = True, drop_last: bool = False, keys: bool = False) -> None:
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}.")
        if batch_size < 1 or world_size < 1:
            raise ValueError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        self.dataset_len, self.seed, self.rank, self.world_size = dataset_len, seed, rank, world_size
        self.batch_size, self.shuffle, self.drop_last, self.keys = batch_size, shuffle, drop_last, keys
        self.epoch = 0
        self.consumed = 0

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by all ranks together in one full step."""
        return self.world_size * self.batch_size

    def _epoch_end(self) -> int:
        """Cursor value at which the epoch is over (the dropped tail excluded)."""
        if self.drop_last:
            return self.dataset_len - self.dataset_len % self.global_batch_size
        return self.dataset_len

    def global_order(self, epoch: int) -> list[int]:
        """The data set indices of ``epoch`` in global order (the same at every world size)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator().manual_seed(derive_seed(self.seed, _TAG_PERMUTATION, epoch))
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``; a *different* epoch starts at its beginning, the current one keeps its cursor."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def __len__(self) -> int:
        """Batches left in the current epoch (the same on every rank)."""
        remaining = max(0, self._epoch_end() - self.consumed)
        full, rest = divmod(remaining, self.global_batch_size)
        return full + (1 if rest else 0)

    def __iter__(self) -> Iterator[list]:
        order = self.global_order(self.epoch)
        end = self._epoch_end()
        while self.consumed < end:
            count = min(self.global_batch_size, end - self.consumed)
            lo, hi = split_global_step(self.consumed, count, world_size=self.world_size,
                                       batch_size=self.batch_size, rank=self.rank)
            # Advance before yielding, so a state_dict() taken after training on this batch includes it.
            self.consumed += count
            indices = order[lo:hi]
            yield [SampleKey(self.epoch, i) for i in indices] if self.keys else indices

    def state_dict(self) -> dict[str, Any]:
        """The global position as JSON-able data (identical on every rank; save it once, e.g. from rank 0)."""
        return self.state_dict_at(epoch=self.epoch, consumed=self.consumed)

    def state_dict_at(self, *, epoch: int, consumed: int) -> dict[str, Any]:
        """The state for an explicit position, e.g. ``consumed = steps * global_batch_size`` when workers prefetch."""
        return {KEY_VERSION: STATE_VERSION, KEY_EPOCH: epoch, KEY_CONSUMED: min(consumed, self.dataset_len),
                KEY_SEED: self.seed, KEY_DATASET_LEN: self.dataset_len, KEY_SHUFFLE: self.shuffle,
                KEY_WORLD_SIZE: self.world_size, KEY_BATCH_SIZE: self.batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved global position, at this sampler's (possibly different) world size.

        Raises:
            ConfigDriftError: if the seed, data set length or shuffling differ from the saved run.
            CorruptCheckpointError: if the state is malformed or from a newer hf_resumable.
        """
        epoch, consumed = self._parse_position(state)
        now = {KEY_SEED: self.seed, KEY_DATASET_LEN: self.dataset_len, KEY_SHUFFLE: self.shuffle}
        drift = [f"{k}: saved {state[k]!r}, now {now[k]!r}" for k in now if state[k] != now[k]]
        if drift:
            raise ConfigDriftError("The data order cannot continue: " + "; ".join(drift) +
                                   ". Build the ElasticSampler with the saved values.")
        if state.get(KEY_WORLD_SIZE) != self.world_size:
            logger.info("ElasticSampler: resuming a %s-rank position on %d rank(s) at epoch %d, sample %d.",
                        state.get(KEY_WORLD_SIZE), self.world_size, epoch, consumed)
        self.epoch, self.consumed = epoch, consumed

    def _parse_position(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """``(epoch, consumed)`` of a state dict, checked for shape, version and range."""
        try:
            version, epoch, consumed = int(state[KEY_VERSION]), int(state[KEY_EPOCH]), int(state[KEY_CONSUMED])
            missing = [k for k in (KEY_SEED, KEY_DATASET_LEN, KEY_SHUFFLE) if k not in state]
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(
                f"Not an ElasticSampler state ({type(err).__name__}: {err}): {state!r}") from None
        if missing or version > STATE_VERSION or not 0 <= consumed <= self.dataset_len:
            raise CorruptCheckpointError(
                f"Invalid ElasticSampler state (version {version}, consumed {consumed} of {self.dataset_len}, "
                f"missing {missing}); upgrade hf_resumable or resume from another checkpoint.")
        return epoch, consumed


class ElasticSeededDataset(Dataset):
    """``dataset[index]`` fetched with generators seeded from ``(seed, epoch, index)``: the same at any world size.

    Indexed by :class:`SampleKey` (use ``ElasticSampler(..., keys=True)``). In ``DataLoader`` workers the
    generators are reseeded per sample; in the main process the caller's streams are restored afterwards
    (see :func:`hf_resumable.data.data_rng`). Randomness in ``collate_fn`` depends on the batch, which
    changes with the world size; keep random transforms per sample.

    Args:
        dataset (`Dataset`): any map-style data set.
        seed (`int`): run seed.

    Example:

    ```python
    >>> import random
    >>> class Jitter:
    ...     def __len__(self):
    ...         return 3
    ...     def __getitem__(self, index):
    ...         return index + random.random()
    >>> data = ElasticSeededDataset(Jitter(), seed=0)
    >>> data[SampleKey(epoch=0, index=1)] == data[SampleKey(epoch=0, index=1)] != data[SampleKey(epoch=1, index=1)]
    True
    ```
    """

    def __init__(self, dataset: Any, *, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: SampleKey) -> Any:
        epoch, index = key
        with data_rng(sample_seed(self.seed, epoch, index)):
            return self.dataset[index]
