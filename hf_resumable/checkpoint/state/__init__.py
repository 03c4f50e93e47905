"""The training state's own rules: a model's state dict (ties, aliases, key matching), its Hugging Face weight files,
the optimizer's tensors, and the checks on a loaded state. The names below are this room's door for the rest of the
library; everything else here is private to ``hf_resumable.checkpoint``.
"""

from ._model import KeyMatch, Mismatch, dedupe_tied, find_aliases, match_keys, mismatch_message
from ._model_files import has_model_weights
from ._optimizer import PARAM_SHAPED_STATE
from ._validate import _NUM_YIELDED as NUM_YIELDED
from ._validate import batches_yielded

__all__ = [
    "NUM_YIELDED",
    "PARAM_SHAPED_STATE",
    "KeyMatch",
    "Mismatch",
    "batches_yielded",
    "dedupe_tied",
    "find_aliases",
    "has_model_weights",
    "match_keys",
    "mismatch_message",
]
