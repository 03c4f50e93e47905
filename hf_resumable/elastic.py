"""Elastic sampling (moved to :mod:`hf_resumable.data.elastic`; this import path keeps working)."""

from .data.elastic import *  # noqa: F401,F403 - the public names, re-exported
from .data.elastic import __all__  # noqa: F401
