"""Rewrite the HF shards of a committed checkpoint with a new shard size (``convert``): a payload of the files on
disk, tensors re-planned (one ``model.safetensors`` when they fit in one shard) and every other file carried as
bytes, committed by the writer ``save_checkpoint`` uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...constants import OPTIMIZER_FILE_PATTERN, OPTIMIZER_INDEX_FILE, SHARDS_KEY, SINGLE_MODEL_FILE
from ...format.safetensors_io import read_header, read_safetensors
from ...format.sharding import ShardIndex, parse_index
from .._types import Payload
from ..commit._writer import save_payload
from ..commit.manifest import Manifest
from ..state._model import TIED_KEY, check_tied
from ..state._model_files import model_index, model_weights_file
from ._payload import add_model_weights, add_sharded


def _read_sharded(directory: Path, index: ShardIndex) -> dict[str, torch.Tensor]:
    """Every tensor of ``index``, in shard order and, inside a shard, in file order."""
    tensors: dict[str, torch.Tensor] = {}
    for filename in index.filenames:
        header = read_header(directory / filename)
        loaded = read_safetensors(directory / filename, header=header)
        for info in sorted(header.tensors.values(), key=lambda t: t.start):
            tensors[info.name] = loaded[info.name]
    return tensors


def _read_index(source: Path, relpath: str) -> ShardIndex:
    return parse_index(json.loads((source / relpath).read_bytes()), source=str(source / relpath))


def rewrite_shards(source: Path, target: Path, manifest: Manifest, *, max_shard_size: int | str) -> Manifest:
    """Re-shard the model weights (either layout) and the optimizer tensors from ``source`` into ``target``."""
    payload = Payload()
    consumed: set[str] = set()
    files = manifest.files
    headers = {SINGLE_MODEL_FILE: read_header(source / SINGLE_MODEL_FILE)} if SINGLE_MODEL_FILE in files else {}
    model = model_index(files, headers, read_index=lambda relpath: _read_index(source, relpath), source=str(source))
    if model is not None:
        tensors = _read_sharded(source, model)
        tied = check_tied(model.metadata.get(TIED_KEY) or {}, tensors, source=model.source)
        add_model_weights(payload, tensors, tied=tied, max_shard_size=max_shard_size)
        consumed |= {model_weights_file(files), *model.filenames}
    if OPTIMIZER_INDEX_FILE in files:
        index = _read_index(source, OPTIMIZER_INDEX_FILE)
        metadata = {k: v for k, v in index.metadata.items() if k not in ("total_size", SHARDS_KEY)}
        add_sharded(payload, _read_sharded(source, index), pattern=OPTIMIZER_FILE_PATTERN, index=OPTIMIZER_INDEX_FILE,
                    max_shard_size=max_shard_size, metadata=metadata)
        consumed |= {OPTIMIZER_INDEX_FILE, *index.filenames}
    for relpath in files:
        if relpath not in consumed:
            payload.blobs[relpath] = (source / relpath).read_bytes()
    return save_payload(target, payload, step=manifest.step, metrics=dict(manifest.metrics),
                        overwrite=target.resolve() == source.resolve())
