"""The commit protocol: how a checkpoint's files become durable and committed (a temp sibling, every file fsynced,
the manifest last, the rename), who owns and pins a directory, and the verified reads.

The names below are this room's door for the rest of the library (conversions write through the same commit);
everything else here is private to ``hf_resumable.checkpoint``.
"""

from .._types import Payload
from ._fs import commit_dir, discard, write_bytes_durably
from ._writer import begin_save, index_document, save_refusal, stock_accelerate_files, write_payload

__all__ = [
    "Payload",
    "begin_save",
    "commit_dir",
    "discard",
    "index_document",
    "save_refusal",
    "stock_accelerate_files",
    "write_bytes_durably",
    "write_payload",
]
