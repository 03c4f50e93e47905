"""Summarize a checkpoint without loading a model: progress, batch geometry, shards, verification. What
``hf-resumable inspect`` and the model cards (:mod:`hf_resumable.hub.cards`) show."""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..constants import (
    FROZEN_RECORD_FILE,
    MANIFEST_FILE,
    MAX_JSON_SIZE,
    OPTIMIZER_INDEX_FILE,
    STATE_KEY_EXTRA,
    STATE_KEY_OPTIMIZER,
    STATE_KEY_PROGRESS,
    TRAINABLE_INDEX_FILE,
    TRAINER_STATE_FILE,
    TRAINING_STATE_FILE,
)
from ..errors import CheckpointNotFoundError, HfResumableError
from ..format._jsonio import parse_json
from ..format._safefile import read_regular_file
from .pieces._frozen import FrozenRecord, describe_source
from .state._model_files import has_model_weights
from .verify import verify_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["ShardSummary", "CheckpointSummary", "summarize_checkpoint", "format_size"]

# Names under which progress and batch geometry are recorded by our integrations, the stock Trainer
# (trainer_state.json / TrainingArguments) and hand-written loops. The first one found wins.
_STEP_KEYS = ("global_step", "step")
_EPOCH_KEYS = ("epoch",)
_SAMPLES_KEYS = ("samples_seen", "num_samples_seen", "num_input_samples", "samples", "consumed_samples")
_PER_DEVICE_KEYS = ("per_device_train_batch_size", "per_device_batch_size", "micro_batch_size", "batch_size",
                    "train_batch_size")
_ACCUMULATION_KEYS = ("gradient_accumulation_steps", "grad_accum_steps", "accumulation_steps")
_WORLD_SIZE_KEYS = ("world_size", "num_processes")
_RESUMES_KEYS = ("resumes", "num_resumes", "resume_count")


def format_size(num_bytes: int) -> str:
    """Human-readable decimal size, as the Hub shows it: ``format_size(2_500_000) == "2.50 MB"``."""
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{value:.2f} TB"


@dataclass(frozen=True)
class ShardSummary:
    """One tensor file of a checkpoint (``file`` relative to it; ``kind``: ``"model"``, ``"optimizer"``, ``"rng"`` or
    ``"other"``; ``size`` and hashes from the manifest, ``sha256`` only before format version 2; ``dtypes``: dtype ->
    number of tensors, empty if the header is unreadable)."""

    file: str
    kind: str
    size: int
    sha256: str | None
    dtypes: dict[str, int] = field(default_factory=dict)
    num_tensors: int = 0
    num_elements: int = 0
    xxh3_128: str | None = None

    @property
    def checksum(self) -> str:
        """The file's recorded hash as ``"xxh3-128:<hex>"``, or ``"sha256:<hex>"`` for an older record without one."""
        return f"xxh3-128:{self.xxh3_128}" if self.xxh3_128 is not None else f"sha256:{self.sha256}"


@dataclass
class CheckpointSummary:
    """What ``hf-resumable inspect`` shows. Fields are ``None`` when the checkpoint does not record them.

    ``effective_batch_size`` is the product of the batch geometry when all three parts are known;
    ``parameter_count`` counts the stored model tensors' elements (tied weights once); ``frozen_parameter_count``,
    ``frozen_size`` and ``frozen_base`` describe the frozen parameters a checkpoint records but does not store;
    ``problems`` holds ``(file, reason)`` for every problem verification found.
    """

    path: str
    step: int | None = None
    epoch: float | None = None
    samples_seen: int | None = None
    per_device_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    world_size: int | None = None
    effective_batch_size: int | None = None
    resumes: int | None = None
    parameter_count: int | None = None
    frozen_parameter_count: int | None = None
    frozen_size: int | None = None
    frozen_base: str | None = None
    optimizer_class: str | None = None
    shards: list[ShardSummary] = field(default_factory=list)
    verified: bool = False
    verification: str = "quick"
    problems: list[tuple[str, str]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def total_size(self) -> int:
        """Bytes over all tensor files."""
        return sum(shard.size for shard in self.shards)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the ``--json`` output of ``hf-resumable inspect``)."""
        document = asdict(self)
        document["problems"] = [{"file": f, "reason": why} for f, why in self.problems]
        document["total_size"] = self.total_size
        return document

    def format_table(self) -> str:
        """A readable two-part table: overview, then one line per shard."""
        status = "OK" if self.verified else f"FAILED ({len(self.problems)} problem(s))"
        batch = "-" if self.effective_batch_size is None else (
            f"{self.effective_batch_size} (= {self.per_device_batch_size} per device x "
            f"{self.gradient_accumulation_steps} accumulation x {self.world_size} ranks)")
        rows = [
            ("checkpoint", self.path),
            ("step", _or_dash(self.step)),
            ("epoch", _or_dash(None if self.epoch is None else f"{self.epoch:g}")),
            ("samples seen", _or_dash(self.samples_seen)),
            ("effective batch", batch),
            ("resumes", _or_dash(self.resumes)),
            ("parameters", _or_dash(None if self.parameter_count is None else f"{self.parameter_count:,}")),
            *([("frozen base", f"{self.frozen_parameter_count:,} parameters, {format_size(self.frozen_size or 0)}, "
                               f"not stored; from {self.frozen_base}")] if self.frozen_parameter_count is not None
              else []),
            ("optimizer", _or_dash(self.optimizer_class)),
            ("tensor files", f"{len(self.shards)} ({format_size(self.total_size)})"),
            ("verification", f"{status} [{self.verification}]"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"  ! {f}: {why}" for f, why in self.problems]
        if self.shards:
            lines += ["", _shard_table(self.shards)]
        return "\n".join(lines)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _shard_table(shards: Iterable[ShardSummary]) -> str:
    header = ("file", "kind", "size", "tensors", "dtypes")
    rows = [(s.file, s.kind, format_size(s.size), str(s.num_tensors),
             ", ".join(f"{d}x{n}" for d, n in sorted(s.dtypes.items())) or "?") for s in shards]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _find(keys: tuple[str, ...], *documents: Any, depth: int = 4) -> Any:
    """First value of any of ``keys`` in the first of ``documents`` (nested mappings) that records one, breadth first
    inside each (top-level keys win)."""
    for document in documents:
        level = [document]
        for _ in range(depth):
            nested = []
            for mapping in level:
                if not isinstance(mapping, Mapping):
                    continue
                for key in keys:
                    value = mapping.get(key)
                    if value is not None and not isinstance(value, (Mapping, list)):
                        return value
                nested += [v for v in mapping.values() if isinstance(v, Mapping)]
            level = nested
    return None


def _as_int(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _as_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or ``None`` if it is missing, not a regular file, oversized or malformed."""
    try:
        document = parse_json(read_regular_file(path, limit=MAX_JSON_SIZE), source=str(path))
    except (OSError, HfResumableError):
        return None
    return document if isinstance(document, dict) else None


def _fill_progress(summary: CheckpointSummary, state: Mapping[str, Any], trainer_state: Mapping[str, Any]) -> None:
    """Progress and batch geometry from the progress cursor and the extra state, and from ``trainer_state.json``
    (written by the Trainer integrations and the stock Trainer) only for a field that those two do not record."""
    both = {"progress": state.get(STATE_KEY_PROGRESS) or {}, "extra": state.get(STATE_KEY_EXTRA) or {}}
    if summary.step is None:
        summary.step = _as_int(_find(_STEP_KEYS, both, trainer_state))
    summary.epoch = _as_float(_find(_EPOCH_KEYS, both, trainer_state))
    summary.samples_seen = _as_int(_find(_SAMPLES_KEYS, both, trainer_state))
    summary.resumes = _as_int(_find(_RESUMES_KEYS, both, trainer_state))
    summary.per_device_batch_size = _as_int(_find(_PER_DEVICE_KEYS, both, trainer_state))
    summary.gradient_accumulation_steps = _as_int(_find(_ACCUMULATION_KEYS, both, trainer_state))
    summary.world_size = _as_int(_find(_WORLD_SIZE_KEYS, both, trainer_state)) or summary.world_size
    geometry = (summary.per_device_batch_size, summary.gradient_accumulation_steps, summary.world_size)
    if all(isinstance(v, int) and v > 0 for v in geometry):
        summary.effective_batch_size = math.prod(geometry)
    optimizer = state.get(STATE_KEY_OPTIMIZER)
    if isinstance(optimizer, Mapping):
        summary.optimizer_class = _optimizer_name(optimizer)


# Optimizer wrappers whose class name hides the real optimizer (accelerate, Lightning).
_WRAPPERS = ("AcceleratedOptimizer", "LightningOptimizer", "OptimizerWrapper")


def _optimizer_name(document: Mapping[str, Any]) -> str | None:
    """Class name of the optimizer, looking through known wrappers by the hyper-parameters they carry."""
    name = document.get("class")
    if not isinstance(name, str) or name not in _WRAPPERS:
        return name if isinstance(name, str) else None
    groups = document.get("param_groups") or [{}]
    keys = set(groups[0]) if isinstance(groups[0], Mapping) else set()
    inner = None
    if "betas" in keys:
        inner = "AdamW" if groups[0].get("decoupled_weight_decay", True) else "Adam"
    elif {"momentum", "dampening"} <= keys:
        inner = "SGD"
    elif "lr_decay" in keys:
        inner = "Adagrad"
    elif {"alpha", "centered"} <= keys:
        inner = "RMSprop"
    return f"{inner} (in {name})" if inner else name


def _shard_kind(relpath: str) -> str:
    name = relpath.rsplit("/", 1)[-1]
    if relpath.startswith("rng/"):
        return "rng"
    for kind in ("model", "optimizer"):
        if name == f"{kind}.safetensors" or name.startswith(f"{kind}-"):
            return kind
    if name.startswith("trainable-"):  # the trainable part of a checkpoint that references its frozen base
        return "model"
    return "other"


def _fill_shards(summary: CheckpointSummary, report: Any) -> None:
    model_elements = 0
    for relpath, record in sorted(report.manifest.files.items()):
        if not relpath.endswith(".safetensors"):
            continue
        header = report.headers.get(relpath)
        infos = list(header.tensors.values()) if header is not None else []
        elements = sum(math.prod(info.shape) for info in infos)
        shard = ShardSummary(relpath, _shard_kind(relpath), record.size, record.sha256,
                             dict(Counter(info.dtype for info in infos)), len(infos), elements, record.xxh3_128)
        summary.shards.append(shard)
        if shard.kind == "model":
            model_elements += elements
    has_model = has_model_weights(report.manifest.files) or any(s.kind == "model" for s in summary.shards)
    summary.parameter_count = model_elements if has_model else None
    if TRAINABLE_INDEX_FILE in report.manifest.files:
        _fill_frozen(summary, report)


def _fill_frozen(summary: CheckpointSummary, report: Any) -> None:
    """A checkpoint that references its base: trainable elements from its index, the frozen base from its record."""
    index = _read_json(Path(report.path) / TRAINABLE_INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if isinstance(weight_map, dict):
        elements = 0
        for name, filename in weight_map.items():
            header = report.headers.get(filename) if isinstance(filename, str) else None
            info = header.tensors.get(name) if header is not None else None
            if info is not None:
                elements += math.prod(info.shape)
        summary.parameter_count = elements
    try:
        record = FrozenRecord.from_json(_read_json(Path(report.path) / FROZEN_RECORD_FILE),
                                        source=FROZEN_RECORD_FILE)
    except HfResumableError:
        return
    summary.frozen_parameter_count, summary.frozen_size = record.numel, record.total_bytes
    summary.frozen_base = describe_source(record.source)


def summarize_checkpoint(directory: str | os.PathLike, *, full: bool = False) -> CheckpointSummary:
    """Summarize the checkpoint at ``directory`` from its manifest, state file and safetensors headers.

    Nothing is read beyond the manifest, the JSON state files and the safetensors headers. A damaged checkpoint is
    summarized as far as it can be read; ``verified`` is then False and ``problems`` names each bad file.

    Args:
        directory (`str` or `os.PathLike`): a checkpoint directory (``checkpoint-N``).
        full (`bool`, *optional*, defaults to `False`): verify every hash (reads every byte) instead of
            the quick check (sizes, headers, small files' hashes, index consistency).

    Returns:
        [`CheckpointSummary`]

    Raises:
        CheckpointNotFoundError: if ``directory`` does not exist or is not a directory.

    Example:

    ```python
    >>> print(summarize_checkpoint("out/checkpoint-120").format_table())  # doctest: +SKIP
    checkpoint       out/checkpoint-120
    step             120
    ...
    ```
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory.")
    report = verify_checkpoint(path, full=full)
    summary = CheckpointSummary(path=str(path), verified=report.ok, verification="full" if full else "quick",
                                problems=list(report.problems))
    if report.manifest is not None:
        summary.step = report.manifest.step
        summary.world_size = report.manifest.world_size
        summary.metrics = dict(report.manifest.metrics)
        summary.versions = dict(report.manifest.versions)
        _fill_shards(summary, report)
    elif not (path / MANIFEST_FILE).exists():
        logger.debug("%s has no manifest; summarizing what is there", path)
    _fill_progress(summary, _read_json(path / TRAINING_STATE_FILE) or {}, _read_json(path / TRAINER_STATE_FILE) or {})
    if summary.optimizer_class is None and OPTIMIZER_INDEX_FILE in (report.manifest.files if report.manifest else {}):
        summary.optimizer_class = "unknown"
    return summary
