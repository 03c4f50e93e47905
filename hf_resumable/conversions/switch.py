"""Switching in: which stock layout a directory holds (:func:`detect_stock_kind`, pure over file names), and
:func:`convert_stock_checkpoint`, the one call behind ``hf-resumable convert``.

Example:

```python
>>> from hf_resumable.conversions.switch import convert_stock_checkpoint
>>> convert_stock_checkpoint("stock/checkpoint-300", "ours/checkpoint-300")  # doctest: +SKIP
```
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..checkpoint import CheckpointInfo

logger = logging.getLogger(__name__)

__all__ = ["detect_stock_kind", "pickle_warning", "convert_stock_checkpoint"]


def detect_stock_kind(directory: str | os.PathLike) -> str:
    """``"accelerate-fsdp"``, ``"transformers-dcp"``, ``"deepspeed"`` or ``"trainer"``: the layout ``directory``
    holds.

    Example:

    ```python
    >>> detect_stock_kind("out/checkpoint-300")  # doctest: +SKIP
    'deepspeed'
    ```
    """
    from .dcp import is_accelerate_fsdp_checkpoint
    from .deepspeed import is_deepspeed_checkpoint
    from .hf_storage import is_transformers_distributed_checkpoint

    if is_accelerate_fsdp_checkpoint(directory):
        return "accelerate-fsdp"
    if is_transformers_distributed_checkpoint(directory):
        return "transformers-dcp"
    if is_deepspeed_checkpoint(directory):
        return "deepspeed"
    return "trainer"


def pickle_warning(kind: str) -> str:
    """The WARNING the converter of ``kind`` logs before it reads pickles."""
    from .dcp import DCP_PICKLE_WARNING
    from .deepspeed import DEEPSPEED_PICKLE_WARNING
    from .hf_storage import HF_STORAGE_PICKLE_WARNING
    from .stock import PICKLE_WARNING

    return {"accelerate-fsdp": DCP_PICKLE_WARNING, "deepspeed": DEEPSPEED_PICKLE_WARNING,
            "transformers-dcp": HF_STORAGE_PICKLE_WARNING}.get(kind, PICKLE_WARNING)


def convert_stock_checkpoint(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    optimizer: str | None = None,
    max_shard_size: int | str = "2GB",
    step: int | None = None,
    optimizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> CheckpointInfo:
    """Convert a stock checkpoint of any kind :func:`detect_stock_kind` knows into an hf_resumable checkpoint.

    Args:
        source (`str` or `os.PathLike`): the stock checkpoint directory.
        output (`str` or `os.PathLike`): the new checkpoint directory.
        optimizer (`str`, *optional*): the optimizer class name (default: inferred from its state).
        max_shard_size (`int` or `str`, *optional*, defaults to `"2GB"`): shard size (stock Trainer checkpoints;
            per-rank checkpoints keep one piece file per rank).
        step (`int`, *optional*): the optimizer step (accelerate FSDP and transformers distributed checkpoints, when
            the state does not tell it).
        optimizer_dir (`str` or `os.PathLike`, *optional*): the optimizer directory of a transformers distributed
            checkpoint (``save_optimizer_distributed``'s); by default looked for beside the model's files.
        overwrite (`bool`, *optional*, defaults to `False`): replace an existing ``output`` atomically.

    Returns:
        [`CheckpointInfo`]

    Raises:
        As the converter of the kind: :func:`~hf_resumable.conversions.dcp.convert_accelerate_fsdp_checkpoint`,
        :func:`~hf_resumable.conversions.hf_storage.convert_transformers_distributed_checkpoint`,
        :func:`~hf_resumable.conversions.deepspeed.convert_deepspeed_checkpoint`,
        :func:`~hf_resumable.conversions.stock.convert_trainer_checkpoint`.

    Example:

    ```python
    >>> convert_stock_checkpoint("stock/checkpoint_3", "ours/checkpoint-3", step=3)  # doctest: +SKIP
    ```
    """
    kind = detect_stock_kind(source)
    logger.info("%s holds a stock %s checkpoint.", source, kind)
    if kind == "accelerate-fsdp":
        from .dcp import convert_accelerate_fsdp_checkpoint

        return convert_accelerate_fsdp_checkpoint(source, output, step=step, optimizer=optimizer, overwrite=overwrite)
    if kind == "transformers-dcp":
        from .hf_storage import convert_transformers_distributed_checkpoint

        return convert_transformers_distributed_checkpoint(source, output, optimizer_dir=optimizer_dir, step=step,
                                                           optimizer=optimizer, overwrite=overwrite)
    if kind == "deepspeed":
        from .deepspeed import convert_deepspeed_checkpoint

        return convert_deepspeed_checkpoint(source, output, optimizer=optimizer, overwrite=overwrite)
    from .stock import convert_trainer_checkpoint

    return convert_trainer_checkpoint(Path(source), output, optimizer=optimizer, max_shard_size=max_shard_size,
                                      overwrite=overwrite)
