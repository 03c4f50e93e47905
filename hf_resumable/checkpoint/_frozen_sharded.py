"""Frozen parameters of DTensor-sharded (FSDP2) checkpoints: recorded per piece, not stored, and checked on load.

:func:`split_frozen_sharded` (``save_sharded_checkpoint``) leaves the frozen parameters out of the pieces each rank
writes; every rank fingerprints the box of each frozen tensor it would have written (cached per process, as in a
regular save) and rank 0 gathers them (JSON) into ``frozen_base.json`` (record version 2: each tensor lists its
``pieces``). :func:`check_frozen_sharded` (``load_sharded_checkpoint``) checks the boxes the loading rank holds whole
(a same-world-size resume, or a plain model, holds every one), and the others on ``full_tensor()``; every rank raises
the same :class:`~hf_resumable.errors.BaseMismatchError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..constants import FROZEN_RECORD_FILE
from ..distributed import all_gather_json
from ..errors import CheckpointMismatchError
from ..format._jsonio import json_bytes
from ..format.safetensors_io import DTYPE_TO_STR
from ._frozen import (
    FrozenPiece,
    FrozenRecord,
    FrozenTensor,
    _fingerprints,
    base_provenance,
    fingerprint,
    frozen_names,
    raise_base_problems,
)
from ._sharded import _is_dtensor, _local_tensor, _writes_piece, local_box
from ._types import Box, intersect_boxes

logger = logging.getLogger(__name__)

__all__ = ["split_frozen_sharded", "check_frozen_sharded"]


def split_frozen_sharded(model: torch.nn.Module, state: Mapping[str, torch.Tensor], tied: Mapping[str, str], *,
                         rank: int) -> tuple[dict[str, torch.Tensor], dict[str, str], bytes | None]:
    """A sharded save's model state without its frozen parameters, and (rank 0) their record.

    Each rank fingerprints the pieces of the frozen tensors it would have written (once per process, cached as in
    a regular save); rank 0 gathers them and every rank's aliases (JSON) into a ``frozen_base.json`` whose tensors
    list their pieces. A collective under torch.distributed when something is frozen (every rank calls it with the
    same names; ``requires_grad`` is the same on every rank), so it runs on the training loop's thread.

    Args:
        model (`torch.nn.Module`): the model (FSDP2-wrapped or plain), for ``requires_grad`` and provenance.
        state (`Mapping[str, torch.Tensor]`): its FQN-keyed state (DTensor pieces or plain tensors).
        tied (`Mapping[str, str]`): the aliases this rank sees and leaves out (alias -> kept name; a rank whose
            piece is empty cannot see a tie, so the record unites every rank's).
        rank (`int`): this rank.

    Returns:
        `tuple`: the state to store, this rank's aliases of stored tensors, and the record's bytes on rank 0
        (``None`` on the other ranks, and on every rank when nothing is frozen).

    Example:

    ```python
    >>> stored, tied, record = split_frozen_sharded(model, weights, {}, rank=0)  # doctest: +SKIP
    ```
    """
    frozen = frozen_names(model, state)
    if not frozen:
        return dict(state), dict(tied), None
    mine: dict[str, tuple[Any, torch.Tensor]] = {}
    for name in sorted(frozen - set(tied)):
        tensor = state[name]
        if tensor.dtype not in DTYPE_TO_STR:
            raise CheckpointMismatchError(f"Frozen tensor {name!r} has dtype {tensor.dtype}, which the checkpoint "
                                          "format cannot describe; save with standalone=True.")
        box = local_box(tensor, name=name)
        if box.numel and _writes_piece(name, tensor, rank):
            mine[name] = (box, _local_tensor(tensor))
    prints = _fingerprints({name: local for name, (_, local) in mine.items()}, full=True)
    report = {name: FrozenPiece(box.offset, box.shape, prints[name].full, prints[name].sample).to_json()
              for name, (box, _) in mine.items()}
    gathered = all_gather_json({"pieces": report, "tied": dict(tied)})
    stored = {name: tensor for name, tensor in state.items() if name not in frozen}
    kept_tied = {alias: kept for alias, kept in tied.items() if kept not in frozen}
    if rank != 0:
        return stored, kept_tied, None
    tied = {alias: kept for ranks in gathered for alias, kept in ranks["tied"].items()}
    entries = {}
    for name in sorted(frozen - set(tied)):
        pieces = sorted((FrozenPiece(tuple(p["offset"]), tuple(p["shape"]), p["xxh3_128"], p["sample_xxh3_128"])
                         for ranks in gathered for n, p in ranks["pieces"].items() if n == name),
                        key=lambda p: p.offset)
        tensor = state[name]
        whole = len(pieces) == 1 and pieces[0].shape == tuple(tensor.shape)
        entries[name] = FrozenTensor(DTYPE_TO_STR[tensor.dtype], tuple(tensor.shape),
                                     pieces[0].xxh3_128 if whole else None,
                                     pieces[0].sample_xxh3_128 if whole else None, pieces=tuple(pieces))
    record = FrozenRecord(tensors=entries, tied={a: k for a, k in tied.items() if k in frozen},
                          source=base_provenance(model))
    logger.info("Frozen base not stored in the sharded checkpoint: %d tensor(s), %.1f MB (%s).", len(entries),
                record.total_bytes / 1e6, record.describe_source())
    return stored, kept_tied, json_bytes(record.to_json())


def check_frozen_sharded(reader: Any, current: Mapping[str, torch.Tensor], *, full: bool, strict: bool
                         ) -> set[str]:
    """A sharded load: check the live frozen tensors (DTensor pieces or plain) against the checkpoint's record.

    Each rank hashes the recorded boxes that lie inside the piece it holds (a same-world-size resume, or a plain
    model, covers them all); boxes no rank holds whole (another sharding) are checked on ``full_tensor()``, one
    tensor at a time. Every rank raises the same error. A collective under torch.distributed.

    Args:
        reader: the verified checkpoint's reader (``manifest``, ``json``, ``path``).
        current (`Mapping[str, torch.Tensor]`): the model's FQN-keyed state as this rank holds it.
        full (`bool`): compare every byte instead of the sample.
        strict (`bool`): recorded tensors the model lacks are an error.

    Returns:
        `set[str]`: the names the record covers (empty when the checkpoint stores every parameter).

    Raises:
        BaseMismatchError: a frozen tensor differs (the first ones named).
        CheckpointMismatchError: with ``strict``, recorded tensors the model does not have.
    """
    if FROZEN_RECORD_FILE not in reader.manifest.files:
        return set()
    source = str(reader.path / FROZEN_RECORD_FILE)
    record = FrozenRecord.from_json(reader.json(FROZEN_RECORD_FILE), source=source)
    wanted = {**{n: n for n in record.tensors}, **record.tied}
    present = {n: r for n, r in sorted(wanted.items()) if n in current}
    problems: list[str] = []
    checked: list[list[Any]] = []

    def compare(name: str, data: torch.Tensor, held: Box, index: int, piece: FrozenPiece) -> None:
        region = data[tuple(slice(o - h, o - h + n) for o, h, n in zip(piece.offset, held.offset, piece.shape))]
        got = fingerprint(region, full=full)
        got, expected = (got.full, piece.xxh3_128) if full else (got.sample, piece.sample_xxh3_128)
        if got != expected:
            problems.append(f"{name}: the bytes of its box at {list(piece.offset)} {list(piece.shape)} differ "
                            f"({'' if full else 'sampled '}xxh3-128 {got}, recorded {expected})")

    for name, recorded in present.items():
        live, entry = current[name], record.tensors[recorded]
        if DTYPE_TO_STR.get(live.dtype) != entry.dtype or tuple(live.shape) != entry.shape:
            problems.append(f"{name}: the checkpoint's base has {entry.dtype} {list(entry.shape)}, the model has "
                            f"{DTYPE_TO_STR.get(live.dtype, live.dtype)} {list(live.shape)}")
            checked += [[name, i] for i in range(len(entry.boxes()))]
            continue
        held, local = local_box(live), _local_tensor(live)
        for index, piece in enumerate(entry.boxes()):
            if intersect_boxes(held, Box(piece.offset, piece.shape)) == Box(piece.offset, piece.shape):
                compare(name, local, held, index, piece)
                checked.append([name, index])
    reports = all_gather_json({"problems": problems, "checked": checked})
    problems = sorted({line for r in reports for line in r["problems"]})
    done = {(name, index) for r in reports for name, index in r["checked"]}
    for name, recorded in present.items():  # the same order on every rank: full_tensor() is a collective
        entry = record.tensors[recorded]
        missing = [(i, p) for i, p in enumerate(entry.boxes()) if (name, i) not in done]
        if missing:
            live = current[name]
            whole = live.full_tensor() if _is_dtensor(live) else live.detach()
            for index, piece in missing:
                compare(name, whole, Box((0,) * whole.dim(), tuple(whole.shape)), index, piece)
            del whole
    raise_base_problems(record, problems, len(present), sorted(set(wanted) - set(current)), strict=strict,
                    source=str(reader.path))
    logger.info("%s: the model's %d frozen tensor(s) match the checkpoint's base record (%s).", reader.path,
                len(present), "every byte" if full else "names, dtypes, shapes and sampled bytes")
    return set(present)
