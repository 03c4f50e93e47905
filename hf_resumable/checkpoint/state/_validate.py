"""PURE checks of a checkpoint's decoded documents (a checkpoint whose hashes match may still not fit), run before
anything is written into a live object; each raises one typed error naming the file, the field and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ...constants import (
    FORMAT_VERSION,
    STATE_KEY_EXTRA,
    STATE_KEY_FORMAT_VERSION,
    STATE_KEY_OPTIMIZER,
    STATE_KEY_PROGRESS,
    STATE_KEY_SCALER,
    STATE_KEY_SCHEDULER,
)
from ...errors import CheckpointMismatchError, CorruptCheckpointError, FormatVersionError
from ...format._jsonio import field_error

__all__ = ["check_training_state", "check_optimizer_document", "check_data_position", "check_counters",
           "check_like_live", "check_hyperparameters", "check_step_value", "batches_yielded", "is_count"]

# Keys of the data-position records the integrations write (data/rank-0000R.json); the same spelling as
# hf_resumable.data.DATA_* (a test asserts it), kept here so the checkpoint core imports nothing above it.
DATA_KIND, DATA_EPOCH, DATA_STEP, DATA_NUM_BATCHES, DATA_LOADER = "kind", "epoch", "step", "num_batches", "loader"
DATA_LOADERS = "loaders"  # ResumableAccelerator: one record per prepared loader
# torchdata StatefulDataLoader's private counters inside DATA_LOADER (read by batches_yielded only): batches yielded
# without workers; with workers, the last snapshot's step and the steps since it.
_NUM_YIELDED, _SNAPSHOT, _SNAPSHOT_STEP, _STEPS_SINCE = ("_num_yielded", "_snapshot", "_snapshot_step",
                                                        "_steps_since_snapshot")
# Counters of torch schedulers and GradScaler that load_state_dict assigns as attributes: ints, never floats.
_INT_COUNTERS = {"last_epoch": -1, "_step_count": 0, "_growth_tracker": 0, "growth_interval": 1}


def is_count(value: Any, *, minimum: int = 0) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) of at least ``minimum``."""
    return type(value) is int and value >= minimum


def check_training_state(document: Any, *, source: str) -> dict[str, Any]:
    """Check the structure of ``training_state.json`` (before any of it is decoded or applied).

    Raises:
        CorruptCheckpointError: if it is not an object, or a part has the wrong JSON type.
        FormatVersionError: if it was written by a newer hf_resumable.
    """
    if not isinstance(document, dict):
        raise field_error(source, "<root>", type(document).__name__, "a JSON object")
    version = document.get(STATE_KEY_FORMAT_VERSION, FORMAT_VERSION)
    if not is_count(version, minimum=1):
        raise field_error(source, STATE_KEY_FORMAT_VERSION, version, "a positive int")
    if version > FORMAT_VERSION:
        raise FormatVersionError(f"{source}: format_version {version}; this hf_resumable reads up to "
                                 f"{FORMAT_VERSION}. Upgrade hf_resumable to load it.")
    for key in (STATE_KEY_PROGRESS, STATE_KEY_EXTRA):
        if not isinstance(document.get(key) or {}, dict):
            raise field_error(source, key, document[key], "a JSON object")
    for key in (STATE_KEY_SCHEDULER, STATE_KEY_SCALER, STATE_KEY_OPTIMIZER):
        if document.get(key) is not None and not isinstance(document[key], dict):
            raise field_error(source, key, document[key], "a JSON object or null")
    if document.get(STATE_KEY_OPTIMIZER) is not None:
        check_optimizer_document(document[STATE_KEY_OPTIMIZER], source=source)
    return document


def check_optimizer_document(document: Any, *, source: str) -> None:
    """Check the optimizer part (``{"class", "param_groups", "non_tensor_state"}``) of a training state or layout.

    Raises:
        CorruptCheckpointError: naming the field that has the wrong type or a duplicated parameter name.
    """
    where = STATE_KEY_OPTIMIZER
    if not isinstance(document, dict) or not isinstance(document.get("class"), str):
        raise field_error(source, f"{where}/class", document.get("class") if isinstance(document, dict) else document,
                       "an object with the optimizer's class name")
    groups = document.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise field_error(source, f"{where}/param_groups", groups, "a list of param-group objects")
    seen: set[str] = set()
    for i, group in enumerate(groups):
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise field_error(source, f"{where}/param_groups/{i}/params", params, "a list of parameter names")
        duplicated = seen.intersection(params) or (len(set(params)) != len(params))
        if duplicated:
            raise field_error(source, f"{where}/param_groups/{i}/params", params, "each parameter in one group only")
        seen.update(params)
    scalars = document.get("non_tensor_state", {})
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        raise field_error(source, f"{where}/non_tensor_state", scalars, "an object of per-parameter objects")
    unknown = sorted(set(scalars) - seen)
    if unknown:
        raise field_error(source, f"{where}/non_tensor_state", unknown[:5], "names of parameters in param_groups")


def check_data_position(record: Any, *, source: str) -> None:
    """Check a data-position record (``data/rank-0000R.json``): one record of our kinds (every counter present a
    non-negative int, a map-style ``step`` within its epoch), an object with a ``"loaders"`` list of them
    (ResumableAccelerator), or any other object (a user's own position, checked by its loader).

    Raises:
        CorruptCheckpointError: a counter that is negative or not an int, or a map-style position past the
            end of its epoch.
    """
    if not isinstance(record, dict):
        raise field_error(source, "<root>", type(record).__name__, "a JSON object")
    if DATA_LOADERS in record:
        loaders = record[DATA_LOADERS]
        if not isinstance(loaders, list):
            raise field_error(source, DATA_LOADERS, loaders, "a list of loader positions")
        for i, item in enumerate(loaders):
            if not isinstance(item, dict) or DATA_KIND not in item:
                raise field_error(source, f"{DATA_LOADERS}/{i}", item, "a loader position object")
            _check_record(item, source=source, prefix=f"{DATA_LOADERS}/{i}/")
    if DATA_KIND in record:
        _check_record(record, source=source, prefix="")


def _check_record(record: Mapping[str, Any], *, source: str, prefix: str) -> None:
    kind = record[DATA_KIND]
    if kind not in ("map", "stream"):
        return  # not a position our loaders wrote: the caller's own record, checked by its loader
    for key in (DATA_EPOCH, DATA_STEP, DATA_NUM_BATCHES):
        if key in record and not is_count(record[key]):
            raise field_error(source, f"{prefix}{key}", record[key], "a non-negative int")
    if kind == "map" and DATA_NUM_BATCHES in record and record.get(DATA_STEP, 0) > record[DATA_NUM_BATCHES]:
        raise CorruptCheckpointError(
            f"{source}: {prefix}{DATA_STEP}: {record[DATA_STEP]} is past the end of an epoch of "
            f"{record[DATA_NUM_BATCHES]} batches; expected 0..{record[DATA_NUM_BATCHES]}. Resume from another "
            "checkpoint.")
    if kind == "stream" and DATA_LOADER in record:
        loader = record[DATA_LOADER]
        if not isinstance(loader, dict):
            raise field_error(source, f"{prefix}{DATA_LOADER}", loader, "the loader's state_dict() object")
        batches_yielded(loader, source=source, prefix=f"{prefix}{DATA_LOADER}/")


def batches_yielded(state: Mapping[str, Any], *, source: str, prefix: str = "") -> int | None:
    """The one reader of torchdata ``StatefulDataLoader``'s private counters: the batches it had yielded when
    ``state`` (its ``state_dict()``) was taken, or ``None`` for a state of another form (another torchdata version).

    Raises:
        CorruptCheckpointError: a counter that is not a non-negative int (``prefix`` + its key names it).

    Example:

    ```python
    >>> batches_yielded({"_snapshot": {"_snapshot_step": 4}, "_steps_since_snapshot": 2}, source="data")
    6
    ```
    """
    if _NUM_YIELDED in state:
        counts = {_NUM_YIELDED: state[_NUM_YIELDED]}
    elif isinstance(state.get(_SNAPSHOT), Mapping) and _SNAPSHOT_STEP in state[_SNAPSHOT]:
        counts = {f"{_SNAPSHOT}/{_SNAPSHOT_STEP}": state[_SNAPSHOT][_SNAPSHOT_STEP],
                  _STEPS_SINCE: state.get(_STEPS_SINCE, 0)}
    else:
        return None
    for key, value in counts.items():
        if not is_count(value):
            raise field_error(source, f"{prefix}{key}", value, "a non-negative int")
    return sum(counts.values())


def check_counters(progress: Mapping[str, Any], paths: Iterable[str], *, source: str) -> None:
    """Each of ``paths`` (``"key"`` or ``"outer/inner"`` in the progress cursor) that is present is a non-negative int.

    Raises:
        CorruptCheckpointError: naming the counter and its value.
    """
    for path in paths:
        value: Any = progress
        for part in path.split("/"):
            value = value.get(part, None) if isinstance(value, Mapping) else None
        if value is not None and not is_count(value):
            raise field_error(source, f"{STATE_KEY_PROGRESS}/{path}", value, "a non-negative int step count")


def check_like_live(stored: Any, live: Any, *, source: str, what: str) -> None:
    """Check decoded ``stored`` state against the live object's ``state_dict()`` before ``load_state_dict``, which
    for schedulers and scalers assigns keys as attributes: unknown or missing keys, lists of another length and
    values of another kind are refused (an int counter such as ``last_epoch`` must be an int); a live ``None``
    accepts anything.

    Raises:
        CheckpointMismatchError: listing every difference (path, stored, expected).
    """
    problems: list[str] = []
    _like(stored, live, what, problems)
    if problems:
        raise CheckpointMismatchError(
            f"{source}: the saved {what} state does not fit the {what} being loaded ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:20]) + f"\nBuild the same {what} (class and arguments) as when saving.")


def _like(stored: Any, live: Any, path: str, problems: list[str]) -> None:
    key = path.rpartition("/")[2]
    if live is None:
        return
    if isinstance(live, bool) or key in _INT_COUNTERS:
        minimum = _INT_COUNTERS.get(key)
        ok = type(stored) is bool if isinstance(live, bool) else is_count(stored, minimum=minimum)
        if not ok:
            expected = "a bool" if isinstance(live, bool) else f"an int >= {minimum}"
            problems.append(f"{path}: saved {stored!r:.60}, expected {expected}")
    elif isinstance(live, (int, float)):
        if isinstance(stored, bool) or not isinstance(stored, (int, float)):
            problems.append(f"{path}: saved {stored!r:.60}, expected a number")
    elif isinstance(live, str):
        if not isinstance(stored, str):
            problems.append(f"{path}: saved {stored!r:.60}, expected a string")
    elif isinstance(live, torch.Tensor):
        if not isinstance(stored, torch.Tensor) or stored.shape != live.shape or stored.dtype != live.dtype:
            problems.append(f"{path}: saved {_describe(stored)}, expected a {live.dtype} tensor {list(live.shape)}")
    elif isinstance(live, (list, tuple)):
        if not isinstance(stored, (list, tuple)) or len(stored) != len(live):
            problems.append(f"{path}: saved {_describe(stored)}, expected a list of {len(live)}")
            return
        for i, (s, v) in enumerate(zip(stored, live)):
            _like(s, v, f"{path}/{i}", problems)
    elif isinstance(live, Mapping):
        if not isinstance(stored, Mapping):
            problems.append(f"{path}: saved {_describe(stored)}, expected an object")
            return
        problems += [f"{path}/{k}: in the checkpoint but not in the live state_dict()" for k in stored
                     if k not in live]
        problems += [f"{path}/{k}: in the live state_dict() but not in the checkpoint" for k in live
                     if k not in stored]
        for k in stored:
            if k in live:
                _like(stored[k], live[k], f"{path}/{k}", problems)


def check_hyperparameters(stored: Mapping[str, Any], live: Mapping[str, Any], *, path: str,
                          problems: list[str]) -> None:
    """Param-group values that both the saved and the live group have are of the same kind (``lr`` a number,
    ``betas`` two numbers, ``amsgrad`` a bool). Keys only one side has are accepted, as
    ``Optimizer.load_state_dict`` accepts them (a newer torch's option; ``initial_lr`` set by a scheduler)."""
    for key in stored:
        if key != "params" and key in live:
            _like(stored[key], live[key], f"{path}/{key}", problems)


def check_step_value(value: Any, *, field: str, source: str) -> None:
    """An optimizer's ``step`` (a number or a one-element tensor) is a finite, non-negative whole number.

    Raises:
        CorruptCheckpointError: naming the parameter's state field.
    """
    if isinstance(value, torch.Tensor):
        number = value.reshape(-1)[0].item() if value.numel() == 1 else None
    else:
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or number < 0 or number != int(number):
        raise field_error(source, field, _describe(value) if isinstance(value, torch.Tensor) else value,
                       "a non-negative whole number of steps")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {list(value.shape)}" + (f" = {value.item()!r}" if value.numel() == 1 else "")
    return f"{value!r:.60}"
