"""Pieces: a rank's part of each tensor (a box of the whole), the engine adapters that plan them, their layout and
reader, and resharding. The names below are this room's door for the rest of the library (the converters and the
engine integrations); everything else here is private to ``hf_resumable.checkpoint``.
"""

from .._types import Box, intersect_boxes
from ..state._optimizer import flatten_optimizer_state
from ._dtensor import is_dtensor
from ._frozen import base_not_stored
from ._partitioned import (
    ENGINE_CLASS_PREFIX,
    MAP_FLAT,
    MAP_STRIDED,
    MASTER_KEY,
    PARTITION_KEY,
    PartitionMap,
    held_partition,
    partition_piece,
    read_master_weights,
)
from ._payload import add_sharded, capture_payload
from ._piece_layout import (
    LocalState,
    check_storable,
    layout_document,
    piece_file,
    piece_report,
    piece_tensor_file,
    section_from_reports,
)
from ._reshard import write_whole

__all__ = [
    "ENGINE_CLASS_PREFIX",
    "MAP_FLAT",
    "MAP_STRIDED",
    "MASTER_KEY",
    "PARTITION_KEY",
    "Box",
    "LocalState",
    "PartitionMap",
    "add_sharded",
    "base_not_stored",
    "capture_payload",
    "check_storable",
    "flatten_optimizer_state",
    "held_partition",
    "intersect_boxes",
    "is_dtensor",
    "layout_document",
    "partition_piece",
    "piece_file",
    "piece_report",
    "piece_tensor_file",
    "read_master_weights",
    "section_from_reports",
    "write_whole",
]
