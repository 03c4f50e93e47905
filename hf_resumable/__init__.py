"""hf_resumable: crash-safe, bit-exact resumable training for the Hugging Face stack.

Example:

```python
>>> from hf_resumable import save_checkpoint, load_checkpoint, find_latest_checkpoint
>>> save_checkpoint("out/checkpoint-10", model=model, optimizer=optimizer, step=10)  # doctest: +SKIP
>>> load_checkpoint(find_latest_checkpoint("out"), model=model, optimizer=optimizer)  # doctest: +SKIP
```
"""

from __future__ import annotations

__version__ = "0.1.0"

from .checkpoint import (
    apply_retention,
    find_latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)

__all__ = [
    "__version__",
    "apply_retention",
    "find_latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_saves",
]
