"""Where a checkpoint's model weights are: one ``model.safetensors`` (as ``save_pretrained`` writes it, the tied
record in its header) when they fit in one shard, else the HF index and its shards. :func:`model_index` is the one
answer to "which tensors are the model, in which file", for every reader. See docs/format.md#a-regular-checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ...constants import MODEL_FILE_PATTERN, MODEL_INDEX_FILE, SINGLE_MODEL_FILE, TIED_KEY, TRAINABLE_INDEX_FILE
from ...errors import CorruptCheckpointError
from ...format._jsonio import parse_json
from ...format.safetensors_io import SafetensorsHeader
from ...format.sharding import ShardIndex, ShardPlan, plan_shards

__all__ = ["plan_model_files", "single_file_metadata", "model_weights_file", "has_model_weights", "single_file_index",
           "model_index"]


def plan_model_files(sizes: Mapping[str, int], *, max_shard_size: int | str) -> ShardPlan:
    """The model's weight files (pure): ``model.safetensors`` if everything fits in one shard, else HF shards.

    Raises:
        ValueError: as :func:`hf_resumable.format.sharding.plan_shards`.
    """
    return plan_shards(sizes, max_shard_size=max_shard_size, filename_pattern=MODEL_FILE_PATTERN,
                       single_filename=SINGLE_MODEL_FILE)


def single_file_metadata(tied: Mapping[str, str]) -> dict[str, str]:
    """The header ``__metadata__`` of a single ``model.safetensors``: save_pretrained's, plus the tied record."""
    return {"format": "pt", TIED_KEY: json.dumps(dict(tied), sort_keys=True)}


def model_weights_file(files: Collection[str]) -> str | None:
    """The file that describes the model weights among ``files``: the index (it wins), else ``model.safetensors``
    (unless the checkpoint stores only its trainable part: one there is a save hook's file), else ``None``."""
    if MODEL_INDEX_FILE in files:
        return MODEL_INDEX_FILE
    if SINGLE_MODEL_FILE in files and TRAINABLE_INDEX_FILE not in files:
        return SINGLE_MODEL_FILE
    return None


def has_model_weights(files: Collection[str]) -> bool:
    """Whether ``files`` (a manifest's) hold the whole model's weights, in either layout."""
    return model_weights_file(files) is not None


def single_file_index(header: SafetensorsHeader, *, source: str) -> ShardIndex:
    """The index a single ``model.safetensors`` implies (pure): every tensor in that file; metadata with
    ``total_size`` and the tied record read from the header (absent in a ``save_pretrained`` file: no aliases).

    Raises:
        CorruptCheckpointError: the tied record is not valid JSON mapping alias names to stored names.
    """
    raw = header.metadata.get(TIED_KEY)
    tied: Any = {} if raw is None else parse_json(raw, source=f"{source}: __metadata__ {TIED_KEY}")
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise CorruptCheckpointError(f"{source}: __metadata__ {TIED_KEY} is {raw!r:.120}, expected a JSON object "
                                     "mapping each alias to the stored tensor it shares. Resume from another "
                                     "checkpoint.")
    total = sum(info.nbytes for info in header.tensors.values())
    metadata = {"total_size": total, TIED_KEY: tied, "format": header.metadata.get("format")}
    return ShardIndex(weight_map={name: SINGLE_MODEL_FILE for name in header.tensors}, metadata=metadata,
                      source=source)


def model_index(files: Collection[str], headers: Mapping[str, SafetensorsHeader], *,
                read_index: Callable[[str], ShardIndex], source: str) -> ShardIndex | None:
    """The model index of a checkpoint (``files``: its manifest's; ``headers``: the verified ones; ``read_index``
    reads and checks ``model.safetensors.index.json``), whatever its layout; ``None`` when it stores no whole model.

    Raises:
        CorruptCheckpointError / UnsafeIndexError / IncompleteCheckpointError: a bad index or header.
    """
    which = model_weights_file(files)
    if which == MODEL_INDEX_FILE:
        return read_index(MODEL_INDEX_FILE)
    if which == SINGLE_MODEL_FILE:
        header = headers.get(SINGLE_MODEL_FILE)
        if header is None:
            raise CorruptCheckpointError(f"{source}/{SINGLE_MODEL_FILE}: its header was not read; verify the "
                                         "checkpoint first.")
        return single_file_index(header, source=f"{source}/{SINGLE_MODEL_FILE}")
    return None
