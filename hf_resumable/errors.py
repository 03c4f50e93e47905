"""Typed exceptions raised by hf_resumable.

Every error says what failed, where (a path, a key, a step) and how to fix it. Each class also
inherits the builtin a caller would naturally catch (``FileNotFoundError``, ``ValueError``, ...), so
existing ``except`` clauses keep working.

Example:

```python
>>> from hf_resumable.errors import HfResumableError, CorruptCheckpointError
>>> issubclass(CorruptCheckpointError, HfResumableError)
True
```
"""

from __future__ import annotations

import pickle

from huggingface_hub.errors import EntryNotFoundError as _HubEntryNotFound

__all__ = [
    "HfResumableError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CorruptOnAnotherRankError",
    "ReadFailedOnAnotherRankError",
    "UnsafeIndexError",
    "UnsafePickleError",
    "CheckpointMismatchError",
    "BaseMismatchError",
    "BaseNotStoredError",
    "CheckpointExistsError",
    "UnsupportedStateError",
    "UnsupportedEngineError",
    "FormatVersionError",
    "InexactResumeError",
    "ConfigDriftError",
    "DoubleSkipError",
    "CheckLaunchError",
    "AsyncSaveError",
    "HubError",
    "HubEntryNotFoundError",
    "HubServerError",
    "HubFormatError",
    "StorageError",
    "UploadTimeoutError",
    "MemoryBudgetError",
    "SaveIntervalError",
]


class HfResumableError(Exception):
    """Base class of every error raised by hf_resumable."""


class CheckpointNotFoundError(HfResumableError, FileNotFoundError):
    """No checkpoint (or no valid checkpoint) exists where one was asked for."""


class IncompleteCheckpointError(HfResumableError, FileNotFoundError):
    """A checkpoint directory has no manifest or misses files the manifest lists (what a save killed part-way leaves
    behind; it is never loaded)."""


class CorruptCheckpointError(HfResumableError, ValueError):
    """A checkpoint file exists but its bytes are wrong: truncated, bad header, or hash mismatch."""


class _FromAnotherRank(HfResumableError):
    """An error another rank of a distributed load reported: ``rank`` is that rank, ``report`` its error (type and
    message)."""

    def __init__(self, message: str, *, rank: int, report: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.report = report


class CorruptOnAnotherRankError(_FromAnotherRank, CorruptCheckpointError):
    """Another rank found a corrupt file while it read its part of a distributed load; this rank applied nothing
    either. The report names the file."""


class ReadFailedOnAnotherRankError(_FromAnotherRank, RuntimeError):
    """Another rank's reads of its part of a distributed load raised an error other than corruption (an ``OSError``
    of its node's disk, a ``MemoryError``, a layout mismatch only its pieces show); this rank stopped there too.
    Not a `CorruptCheckpointError`: a resume does not fall back to an earlier checkpoint for it."""


class UnsafeIndexError(CorruptCheckpointError):
    """An index or manifest names a file outside the checkpoint, or a file of an unexpected kind."""


class UnsafePickleError(CorruptCheckpointError, pickle.UnpicklingError):
    """A stock checkpoint's pickle holds objects outside the allow-list of :mod:`hf_resumable.conversions` (the only
    pickle reads: tensors, plain containers and inert stand-ins), so the file, possibly malicious, is refused."""


class CheckpointMismatchError(HfResumableError, ValueError):
    """The checkpoint does not fit the model or optimizer it is loaded into (keys, shapes, dtypes)."""


class BaseMismatchError(CheckpointMismatchError):
    """The live model's frozen parameters are not the ones the checkpoint was trained with (another base model,
    revision, dtype or quantization): the checkpoint stores only the trainable part, so it cannot resume this run."""


class BaseNotStoredError(HfResumableError, FileNotFoundError):
    """The checkpoint holds only the trainable part of the model; its frozen base is referenced, not stored.

    Raised where a whole model is expected (lazy loading, pushing as a model repo, resharded loading). Load it with
    ``load_checkpoint`` into a model built from its base, or make a full model directory with
    ``hf-resumable export``.
    """


class CheckpointExistsError(HfResumableError, FileExistsError):
    """A committed checkpoint already exists at the target path and overwriting was not asked for."""


class UnsupportedStateError(HfResumableError, TypeError):
    """A state object holds a value that cannot be stored without pickle."""


class UnsupportedEngineError(HfResumableError, NotImplementedError):
    """The run uses a distributed engine whose state hf_resumable cannot checkpoint and resume exactly.

    Raised when ``ResumableAccelerator`` is built or prepares, or ``ResumableTrainer`` is built or ``train`` starts,
    before any training step (DeepSpeed ZeRO-Offload, FSDP1 hybrid sharding, Megatron-LM, XLA FSDP, parallel layouts
    that cannot train as they say): never at the first save, after training up to it. The message names the engine
    and what to use instead (ZeRO-1/2/3 without offload, FSDP2, FSDP1 with FULL_SHARD, or the stock
    ``Trainer``/``Accelerator`` for that run). Also a ``NotImplementedError``.
    """


class FormatVersionError(CorruptCheckpointError):
    """The checkpoint was written in a format this version of hf_resumable cannot read."""


class InexactResumeError(HfResumableError, RuntimeError):
    """Resuming would not continue the run exactly (missing RNG, data position, ...)."""


class ConfigDriftError(InexactResumeError, ValueError):
    """The run is resumed with a configuration that differs from the one that wrote the checkpoint."""


class DoubleSkipError(InexactResumeError):
    """The training script skips batches that the resumed loader has already skipped.

    ``load_state`` puts a prepared loader back at its saved batch; a script written for stock accelerate (which
    restarts loaders at their first batch) then skips the trained batches again, by hand (``if step < resume_step:
    continue``) and those batches would never be trained. Raised at the first backward after the resume, before any
    optimizer step; the message names the loop to change. Also an ``InexactResumeError`` and a ``RuntimeError``.
    """


class CheckLaunchError(HfResumableError, RuntimeError):
    """``hf-resumable check``: the checked command could not be run (it failed without a kill, timed out, or wrote
    no trace); the message ends with its last output."""


class AsyncSaveError(HfResumableError, RuntimeError):
    """A background save failed; raised at the next save, load or wait, never lost."""


class HubError(HfResumableError, OSError):
    """A Hub operation failed (after retries) or the Hub returned something unusable; the message names the repo, the
    revision (commit) and the file. An ``OSError``, as ``huggingface_hub``'s own HTTP errors are."""


class HubEntryNotFoundError(HubError, IncompleteCheckpointError, _HubEntryNotFound):
    """The repo at that revision has no file that an index or manifest names (HTTP 404); also the
    ``EntryNotFoundError`` that ``hf_hub_download`` raises for it."""


class HubServerError(HubError):
    """The Hub answered with a server error (HTTP 5xx) or not at all, after retries."""


class HubFormatError(HubError):
    """A file from the Hub is unusable: a malformed shard record, an unknown dtype, a bad header."""


class StorageError(HfResumableError, OSError):
    """An object-store or remote-storage operation failed."""


class UploadTimeoutError(HfResumableError, TimeoutError):
    """Waiting for background uploads timed out; they continue in the background (nothing was dropped)."""


class MemoryBudgetError(HfResumableError, ValueError):
    """A memory budget (``max_memory``) is too small to run the model at all; the message names the smallest one
    that works."""


class SaveIntervalError(HfResumableError, ValueError):
    """The automatic save interval (``mean_time_between_failures``) was given an invalid value or a setup it cannot
    drive; the message says what to pass instead."""
