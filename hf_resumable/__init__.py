"""hf_resumable: crash-safe, bit-exact resumable training for the Hugging Face stack.

Example:

```python
>>> from hf_resumable import save_checkpoint, load_checkpoint, find_latest_checkpoint
>>> save_checkpoint("out/checkpoint-10", model=model, optimizer=optimizer, step=10)  # doctest: +SKIP
>>> load_checkpoint(find_latest_checkpoint("out"), model=model, optimizer=optimizer)  # doctest: +SKIP
```
"""

from __future__ import annotations

from ._version import __version__
from .checkpoint import apply_retention, save_checkpoint, verify_checkpoint, wait_for_pending_saves
from .checkpoint.sharded import consolidate_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from .data.elastic import ElasticSampler
from .locations import find_latest_checkpoint, load_checkpoint, open_checkpoint  # any location: local, hf://, s3://
from .preemption import PREEMPTION_EXIT_CODE

# Integrations import transformers / accelerate; load them on first use so `import hf_resumable` stays light.
_LAZY = {
    "ResumableTrainer": "hf_resumable.integrations.trainer",
    "ResumableAccelerator": "hf_resumable.integrations.accelerate",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_resumable' has no attribute {name!r}")


__all__ = [
    "__version__",
    "PREEMPTION_EXIT_CODE",
    "ElasticSampler",
    "ResumableAccelerator",
    "ResumableTrainer",
    "apply_retention",
    "consolidate_sharded_checkpoint",
    "find_latest_checkpoint",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "open_checkpoint",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_saves",
]
