"""Per-rank piece files and ``sharded_layout.json`` of a converted checkpoint, built in one process.

The converters plan which rank held which box of which tensor; this module writes each rank's boxes into that rank's
piece file and returns the layout, exactly as the ranks of a live save would (each rank's :func:`piece_report`,
united by :func:`section_from_reports`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checkpoint.commit import Payload
from ..checkpoint.pieces import (
    Box,
    LocalState,
    check_storable,
    layout_document,
    piece_file,
    piece_report,
    piece_tensor_file,
    section_from_reports,
)
from ..constants import LAYOUT_FILE, LAYOUT_KEY_MODEL, LAYOUT_KEY_OPTIMIZER
from ..format._jsonio import json_bytes
from ..format.safetensors_io import DTYPE_TO_STR

logger = logging.getLogger(__name__)

__all__ = ["RankPiece", "add_layout", "add_rank_pieces"]

# (tensor name, this rank's piece, its box in the global tensor, the global shape)
RankPiece = tuple[str, torch.Tensor, Box, tuple[int, ...]]



def add_rank_pieces(payload: Payload, kind: str, pieces_by_rank: Sequence[Sequence[RankPiece]], *,
                    tied: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Add every rank's piece file of ``kind`` (``"model"`` or ``"optimizer"``) to ``payload``; return the section.

    ``pieces_by_rank`` holds, per rank, its ``(name, piece, box, global shape)``; ``tied`` the model aliases left out
    (``{alias: kept}``).

    Raises:
        UnsupportedStateError: a dtype safetensors cannot store.
    """
    world_size = len(pieces_by_rank)
    described: dict[str, dict[str, Any]] = {}
    reports = []
    for rank, pieces in enumerate(pieces_by_rank):
        check_storable({name: tensor for name, tensor, _, _ in pieces})
        for name, tensor, _, shape in pieces:
            described.setdefault(name, {"dtype": DTYPE_TO_STR[tensor.dtype], "shape": list(shape)})
        local = LocalState({name: described[name] for name, *_ in pieces},
                           [(name, tensor.contiguous(), box) for name, tensor, box, _ in pieces if box.numel],
                           dict(tied or {}))
        relpath = piece_file(kind, rank, world_size)
        tensor_file = piece_tensor_file(relpath, local)
        if tensor_file is not None:
            payload.tensor_files.append(tensor_file)
        reports.append(piece_report(relpath, local))
    return section_from_reports(described, reports)


def add_layout(payload: Payload, model: Sequence[Sequence[RankPiece]],
               optimizer: Sequence[Sequence[RankPiece]] | None, *, optimizer_document: Mapping[str, Any] | None,
               tied: Mapping[str, str] | None = None) -> None:
    """Add every rank's piece files of the model and of the optimizer (if any), and ``sharded_layout.json`` for
    ``len(model)`` ranks, to ``payload`` (arguments as :func:`add_rank_pieces`).

    Raises:
        UnsupportedStateError: a dtype safetensors cannot store.
    """
    model_section = add_rank_pieces(payload, LAYOUT_KEY_MODEL, model, tied=tied)
    optimizer_section = add_rank_pieces(payload, LAYOUT_KEY_OPTIMIZER, optimizer) if optimizer is not None else None
    layout = layout_document(world_size=len(model), model=model_section, optimizer=optimizer_section,
                             optimizer_document=optimizer_document)
    payload.blobs[LAYOUT_FILE] = json_bytes(layout, indent=None)  # compact, as a save writes it

