"""Data-position record keys, the one data-position interface (:class:`LoaderPosition`), the batch key and the
position-seeded random context."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

from torch.utils.data import get_worker_info

from ..format.rng import seeded_rng

logger = logging.getLogger(__name__)


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
_TAG_ELASTIC_BATCH = "elastic-batch"

# Keys of the JSON data-position records written into checkpoints (data/rank-0000R.json).
DATA_KIND = "kind"  # "map" or "stream"
DATA_EPOCH = "epoch"  # epoch of the next batch to train on
DATA_STEP = "step"  # batches of that epoch already consumed (map-style)
DATA_NUM_BATCHES = "num_batches"  # batches per epoch on this rank (map-style)
DATA_LOADER = "loader"  # StatefulDataLoader.state_dict() (streaming)


@runtime_checkable
class LoaderPosition(Protocol):
    """A loader's data position, whatever the loader: captured as a JSON record of the ``DATA_*`` keys, restored
    without fetching. Both front doors save and restore their loaders through it;
    ``checkpoint.state._validate.check_data_position`` checks the records on load."""

    def position(self) -> dict[str, Any]:
        """The JSON record of where the next batch comes from."""

    def fits(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` is a position of a loader like this one (same kind, as many batches per epoch)."""

    def load_position(self, record: Mapping[str, Any], *, restart_epoch: bool = False) -> None:
        """Continue at ``record`` without fetching anything (``restart_epoch``: keep only its epoch)."""

    def settings(self) -> dict[str, Any]:
        """What decides this loader's batches (compared with the checkpoint's at resume)."""


class BatchKey(NamedTuple):
    """Everything that identifies one map-style batch: the seed of its randomness and its samples.

    Args:
        epoch (`int`): epoch the batch belongs to.
        rank (`int`): data-parallel rank that trains on it.
        step (`int`): number of the batch within this rank's epoch (0-based).
        indices (`tuple[int, ...]`): dataset indices of its samples, in order.
        chunk (`int`, *optional*): in the elastic layout, the batch's number in the epoch's *global* order (batch
            ``chunk`` holds positions ``[chunk * batch_size, (chunk + 1) * batch_size)`` whatever the world size);
            its randomness is then keyed by ``(epoch, chunk)`` and each sample's by its index, never by the rank.
        padding (`bool`, *optional*, defaults to `False`): in the elastic layout, a stand-in for a chunk past the
            epoch's end: a rank without a chunk in the epoch's last, shorter optimizer step trains on the step's
            first chunk with weight zero, so that it still takes part in the step's collectives.
    """

    epoch: int
    rank: int
    step: int
    indices: tuple[int, ...]
    chunk: int | None = None
    padding: bool = False


def data_rng(seed: int) -> contextlib.AbstractContextManager[None]:
    """Seed python ``random``, numpy's global generator and torch's CPU generator for a data operation.

    :func:`hf_resumable.format.rng.seeded_rng`, except that in a ``DataLoader`` worker the generators are only
    reseeded (nothing else in a worker draws from them); in the main process they are saved first and restored on
    exit, so the stream dropout draws from is untouched. Transforms that draw from CUDA generators are not
    covered.

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
