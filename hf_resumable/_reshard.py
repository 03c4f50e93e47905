"""Rewrite the sharded tensor files of a committed checkpoint with a new shard size (helper of ``convert``).

Builds a checkpoint :class:`~hf_resumable.checkpoint._payload.Payload` from the files on disk (sharded
tensors re-planned, every other file carried as bytes) and commits it with the same writer
``save_checkpoint`` uses: temp directory, manifest last, atomic rename.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from .checkpoint._payload import SHARDS_KEY, IndexSpec, Payload, TensorFile
from .checkpoint._writer import save_payload
from .checkpoint.manifest import Manifest
from .safetensors_io import read_header, read_safetensors
from .sharding import ShardIndex, parse_index, plan_shards


def _read_sharded(directory: Path, index: ShardIndex) -> dict[str, torch.Tensor]:
    """Every tensor of ``index``, in shard order and, inside a shard, in file order."""
    tensors: dict[str, torch.Tensor] = {}
    for filename in index.filenames:
        header = read_header(directory / filename)
        loaded = read_safetensors(directory / filename, header=header)
        for info in sorted(header.tensors.values(), key=lambda t: t.start):
            tensors[info.name] = loaded[info.name]
    return tensors


def _replan(payload: Payload, tensors: Mapping[str, torch.Tensor], index: ShardIndex, *, relpath: str,
            pattern: str, max_shard_size: int | str) -> None:
    plan = plan_shards({k: v.numel() * v.element_size() for k, v in tensors.items()}, max_shard_size=max_shard_size,
                       filename_pattern=pattern)
    for filename, names in plan.filename_to_names.items():
        payload.tensor_files.append(TensorFile(filename, [(n, tensors[n]) for n in names]))
    metadata = {k: v for k, v in index.metadata.items() if k not in ("total_size", SHARDS_KEY)}
    payload.indexes.append(IndexSpec(relpath, dict(sorted(plan.name_to_filename.items())),
                                     {"total_size": plan.total_size, **metadata}))


def rewrite_shards(source: Path, target: Path, manifest: Manifest, *, max_shard_size: int | str,
                   patterns: Mapping[str, str]) -> Manifest:
    """Re-shard every index in ``patterns`` (index file -> shard filename pattern) from ``source`` into ``target``."""
    payload = Payload()
    consumed: set[str] = set()
    for relpath, pattern in patterns.items():
        if relpath not in manifest.files:
            continue
        index = parse_index(json.loads((source / relpath).read_bytes()), source=str(source / relpath))
        _replan(payload, _read_sharded(source, index), index, relpath=relpath, pattern=pattern,
                max_shard_size=max_shard_size)
        consumed |= {relpath, *index.filenames}
    for relpath in manifest.files:
        if relpath not in consumed:
            payload.blobs[relpath] = (source / relpath).read_bytes()
    return save_payload(target, payload, step=manifest.step, metrics=dict(manifest.metrics),
                        overwrite=target.resolve() == source.resolve())
