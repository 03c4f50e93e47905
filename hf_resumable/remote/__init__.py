"""Everything that leaves the machine except the Hub's own API: object stores (through fsspec) and the one
background uploader that the Hub tier (``hf_resumable.hub.CheckpointUploader``) and object stores
(:class:`CheckpointMirror`) share.

The checkpoint core never imports this package; ``hf_resumable.locations`` is the front that turns
``hf://`` and ``s3://`` locations into local directories and uploaders.
"""

from .object_store import (
    CheckpointMirror,
    apply_remote_retention,
    default_cache_dir,
    download_checkpoint,
    find_latest_remote_checkpoint,
    is_committed_remote,
    list_remote_checkpoints,
    read_remote_manifest,
    resolve_checkpoint,
    upload_checkpoint,
)
from .uploader import BackgroundUploader

__all__ = [
    "BackgroundUploader",
    "CheckpointMirror",
    "apply_remote_retention",
    "default_cache_dir",
    "download_checkpoint",
    "find_latest_remote_checkpoint",
    "is_committed_remote",
    "list_remote_checkpoints",
    "read_remote_manifest",
    "resolve_checkpoint",
    "upload_checkpoint",
]
