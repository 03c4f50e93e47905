"""Object-store checkpoints (moved to :mod:`hf_resumable.remote`; this import path keeps working)."""

from .remote.object_store import *  # noqa: F401,F403 - the public names, re-exported
from .remote.object_store import (
    __all__,  # noqa: F401
    resolve_checkpoint,  # noqa: F401 - used by earlier releases' callers
)
