"""Model cards (moved to :mod:`hf_resumable.hub.cards`; this import path keeps working)."""

from .hub.cards import *  # noqa: F401,F403 - the public names, re-exported
from .hub.cards import __all__  # noqa: F401
