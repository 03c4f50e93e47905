"""Conversion of stock Trainer checkpoints (moved to :mod:`hf_resumable.conversions.stock`; this import path keeps
working)."""

from .conversions.stock import *  # noqa: F401,F403 - the public names, re-exported
from .conversions.stock import PICKLE_WARNING, TrainerCheckpointFiles, __all__  # noqa: F401
