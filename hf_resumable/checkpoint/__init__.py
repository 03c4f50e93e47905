"""The hf_resumable checkpoint engine: safetensors, no pickle, hashed, atomically committed; one save and one load for
every layout (a plain model's HF files, or per-rank pieces: FSDP, ZeRO, DTensor; see ``pieces/_pieces.py``).

Layout of ``checkpoint-<step>/``::

    model.safetensors                   one shard: as save_pretrained writes it (tied record in its header)
    model.safetensors.index.json        or, for more: HF-compatible (from_pretrained works), + per-shard xxh3-128
    model-00001-of-0000N.safetensors
    config.json, generation_config.json, tokenizer files
    optimizer.safetensors.index.json    optimizer tensors keyed by parameter name
    optimizer-00001-of-0000N.safetensors
    training_state.json                 progress cursor, scheduler, scaler, param groups, extra
    rng/rank-00000.safetensors          RNG states as byte tensors
    data/rank-00000.json                data-loader position (integrations)
    manifest.json                       written last: every file, size, xxh3-128, versions
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
from .commit._fs import write_bytes_durably as write_file_durably
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
    "write_file_durably",
]
