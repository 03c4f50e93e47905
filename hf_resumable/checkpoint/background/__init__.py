"""Background saves: the step gate, staging copies of the state, then the commit off the training loop.

The names below are this room's door for the rest of the library; everything else here is private to
``hf_resumable.checkpoint``.
"""

from ._staging import equal_bytes

__all__ = ["equal_bytes"]
