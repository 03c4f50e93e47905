"""A cheap fingerprint of a data set, recorded in the run configuration to catch changed data on resume."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sized
from typing import Any

from ..format.rng import derive_seed
from ._position import _TAG_FINGERPRINT, data_rng

logger = logging.getLogger(__name__)


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
