"""Integrations with training loops of the Hugging Face stack (the only code that touches their internals).

Both are imported on first use: importing them imports ``transformers.Trainer`` / ``accelerate``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ResumableTrainer", "ResumableAccelerator", "ElasticWorldSizeError"]

_LAZY = {"ResumableTrainer": ".trainer", "ResumableAccelerator": ".accelerate", "ElasticWorldSizeError": "._elastic"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
