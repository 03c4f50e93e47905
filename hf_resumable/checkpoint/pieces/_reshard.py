"""Rewrite a committed checkpoint with every tensor whole, in the regular layout: ``consolidate_checkpoint`` of
per-rank pieces and ``reshard_checkpoint``'s new shard size are this one rewrite. The tensors are read through the
piece reader (a regular checkpoint's files are whole pieces) and re-planned in the order the checkpoint lists them;
every other file is carried as bytes, committed by the writer ``save_checkpoint`` uses.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ...constants import (
    LAYOUT_FILE,
    MODEL_INDEX_FILE,
    OPTIMIZER_FILE_PATTERN,
    OPTIMIZER_INDEX_FILE,
    SHARDED_DIR,
    STATE_KEY_OPTIMIZER,
    TRAINING_STATE_FILE,
)
from ...format._jsonio import json_bytes
from .._types import Payload
from ..commit._writer import save_payload
from ..commit.manifest import Manifest
from ._frozen import base_not_stored
from ._payload import add_model_weights, add_sharded
from ._piece_layout import LAYOUT_KEY_MODEL, LAYOUT_KEY_OPTIMIZER, LAYOUT_KEY_OPTIMIZER_DOC, LAYOUT_KEY_WORLD_SIZE
from ._piece_reader import read_section
from ._pieces import read_layout, section_reader

if TYPE_CHECKING:
    from .._reader import OpenedCheckpoint

logger = logging.getLogger(__name__)


def write_whole(opened: OpenedCheckpoint, target: Path, *, max_shard_size: int | str, include_optimizer: bool,
                overwrite: bool) -> Manifest:
    """Write the checkpoint ``opened`` (verified in full) to ``target`` in the regular layout: its model weights as
    ``save_pretrained`` lays them out (one ``model.safetensors`` when they fit in one shard), its optimizer tensors
    (with ``include_optimizer``) as HF-style shards, both in the order the checkpoint lists them (the saving rank's
    state-dict order for pieces; a regular checkpoint's shard by shard, as its index or header lists them); the
    optimizer document in ``training_state.json``. A trainable part (PEFT) and every other file are carried as is.

    Raises:
        BaseNotStoredError: a checkpoint of pieces that records its frozen base instead of storing it.
    """
    files, pieces = opened.manifest.files, LAYOUT_FILE in opened.manifest.files
    if pieces and (error := base_not_stored(opened.path, wanted="writing it whole needs every weight")) is not None:
        raise error
    layout, reader, payload = read_layout(opened), opened._reader, Payload()
    consumed = {LAYOUT_FILE, MODEL_INDEX_FILE, OPTIMIZER_INDEX_FILE}
    for key in (LAYOUT_KEY_MODEL, LAYOUT_KEY_OPTIMIZER):
        if layout.get(key) is None or (key == LAYOUT_KEY_MODEL and opened._trainable is not None):
            continue  # a trainable part's files name PEFT's adapters: carried as they are
        section = read_section(reader, layout, key)
        consumed |= {file for stored in section.pieces.values() for file in stored}
        if key == LAYOUT_KEY_OPTIMIZER and not include_optimizer:
            continue
        with section_reader(reader, layout, section) as readable:
            tensors = readable.read_all()
        if key == LAYOUT_KEY_MODEL:  # tied aliases recorded so load_checkpoint re-ties and transformers ties itself
            add_model_weights(payload, tensors, tied=section.tied, max_shard_size=max_shard_size)
        else:
            add_sharded(payload, tensors, pattern=OPTIMIZER_FILE_PATTERN, index=OPTIMIZER_INDEX_FILE,
                        max_shard_size=max_shard_size, metadata={})
    document = layout[LAYOUT_KEY_OPTIMIZER_DOC] if include_optimizer and layout.get(LAYOUT_KEY_OPTIMIZER) else None
    if document != opened._document.get(STATE_KEY_OPTIMIZER):  # a checkpoint of pieces keeps it in its layout
        payload.blobs[TRAINING_STATE_FILE] = json_bytes({**opened._document, STATE_KEY_OPTIMIZER: document})
    for relpath in files:
        if relpath not in consumed and relpath not in payload.blobs and not relpath.startswith(f"{SHARDED_DIR}/"):
            payload.blobs[relpath] = (opened.path / relpath).read_bytes()
    manifest = save_payload(Path(target), payload, step=opened.manifest.step, metrics=dict(opened.manifest.metrics),
                            overwrite=overwrite)
    logger.info("Wrote %s (saved by %d rank(s)) whole into %s", opened.path, layout[LAYOUT_KEY_WORLD_SIZE], target)
    return manifest
