"""FSDP2 / DTensor sharded checkpoints (moved to :mod:`hf_resumable.checkpoint.sharded`; this import path keeps
working)."""

from .checkpoint.sharded import *  # noqa: F401,F403 - the public names, re-exported
from .checkpoint.sharded import __all__  # noqa: F401
