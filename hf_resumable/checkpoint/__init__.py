"""The hf_resumable checkpoint engine: safetensors, no pickle, hashed, atomically committed; one save and one load for
every layout (a plain model's HF files, or per-rank pieces: FSDP, ZeRO, DTensor). The files of a checkpoint are
described in docs/format.md.
"""

from ._reader import LoadedCheckpoint, OpenedCheckpoint
from .api import (
    CheckpointInfo,
    consolidate_checkpoint,
    load_checkpoint,
    open_checkpoint,
    save_checkpoint,
    wait_for_pending_saves,
)
from .commit._writer import committed_directory
from .commit.manifest import Manifest, read_manifest
from .discovery import (
    apply_retention,
    cleanup_stale_temp_dirs,
    find_latest_checkpoint,
    find_latest_verified,
    list_checkpoints,
)
from .pieces._pieces import ShardedOptimizerState
from .verify import VerifyReport, verify_checkpoint

__all__ = [
    "CheckpointInfo",
    "LoadedCheckpoint",
    "Manifest",
    "OpenedCheckpoint",
    "ShardedOptimizerState",
    "VerifyReport",
    "apply_retention",
    "cleanup_stale_temp_dirs",
    "committed_directory",
    "consolidate_checkpoint",
    "find_latest_checkpoint",
    "find_latest_verified",
    "list_checkpoints",
    "load_checkpoint",
    "open_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_saves",
]
