"""hf_resumable: crash-safe, bit-exact resumable training for the Hugging Face stack.

Example:

```python
>>> from hf_resumable import save_checkpoint, load_checkpoint, find_latest_checkpoint
>>> save_checkpoint("out/checkpoint-10", model=model, optimizer=optimizer, step=10)  # doctest: +SKIP
>>> load_checkpoint(find_latest_checkpoint("out"), model=model, optimizer=optimizer)  # doctest: +SKIP
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Every public name is loaded on first use, so that `import hf_resumable` (and the `hf-resumable` command line, whose
# supervisor for `hf-resumable run` needs neither torch nor transformers) stays light: importing torch is a large
# part of a restart's start-up.
_LAZY = {
    "apply_retention": "hf_resumable.checkpoint",
    "save_checkpoint": "hf_resumable.checkpoint",
    "verify_checkpoint": "hf_resumable.checkpoint",
    "wait_for_pending_saves": "hf_resumable.checkpoint",
    "ElasticSampler": "hf_resumable.data.elastic",
    "find_latest_checkpoint": "hf_resumable.locations",  # any location: local, hf://, s3://
    "load_checkpoint": "hf_resumable.locations",
    "open_checkpoint": "hf_resumable.locations",
    "PREEMPTION_EXIT_CODE": "hf_resumable.preemption",
    "ResumableTrainer": "hf_resumable.integrations.trainer",
    "ResumableAccelerator": "hf_resumable.integrations.accelerate",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from .checkpoint import apply_retention, save_checkpoint, verify_checkpoint, wait_for_pending_saves
    from .data.elastic import ElasticSampler
    from .integrations.accelerate import ResumableAccelerator
    from .integrations.trainer import ResumableTrainer
    from .locations import find_latest_checkpoint, load_checkpoint, open_checkpoint
    from .preemption import PREEMPTION_EXIT_CODE


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    raise AttributeError(f"module 'hf_resumable' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "__version__",
    "PREEMPTION_EXIT_CODE",
    "ElasticSampler",
    "ResumableAccelerator",
    "ResumableTrainer",
    "apply_retention",
    "find_latest_checkpoint",
    "load_checkpoint",
    "open_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_saves",
]
