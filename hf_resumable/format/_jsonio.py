"""The one JSON writer, the one bounded JSON parser and the one field error for every file hf_resumable writes or
reads.

Files in a checkpoint may have been crafted, so before ``json.loads`` sees one the parser bounds nesting depth and
integer length (what could exhaust the stack or the CPU) and raises
:class:`~hf_resumable.errors.CorruptCheckpointError` naming the source. ``NaN``/``Infinity`` are accepted, as Python
writes them (a scheduler's ``best`` starts at ``inf``). Checks of parsed fields report through :func:`field_error` /
:func:`require_field`, in one wording.

Example:

```python
>>> parse_json(json_bytes({"step": 3}), source="state.json")
{'step': 3}
>>> parse_json(b"[" * 100 + b"]" * 100, source="x.json")
Traceback (most recent call last):
...
hf_resumable.errors.CorruptCheckpointError: x.json: JSON nested deeper than 64 levels; the file is corrupt or crafted.

```
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = ["MAX_JSON_DEPTH", "MAX_INT_DIGITS", "field_error", "json_bytes", "parse_json", "require_field"]

# Deepest nesting accepted (our own files nest at most ~8 levels: state codec markers inside state dicts).
MAX_JSON_DEPTH = 64
# Longest integer literal accepted (128 digits is ~425 bits; seeds and RNG words are far shorter).
MAX_INT_DIGITS = 128

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_bytes(document: Any, *, indent: int | None = 2) -> bytes:
    """Serialize ``document`` the one way hf_resumable writes JSON files: sorted keys, trailing newline."""
    if indent is None:
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    return (json.dumps(document, indent=indent, sort_keys=True) + "\n").encode()


def parse_json(raw: bytes | str, *, source: str) -> Any:
    """Parse ``raw`` with depth and integer-length bounds checked first.

    Raises:
        CorruptCheckpointError: invalid UTF-8 or JSON, too deep, or an oversized integer, naming ``source``.
    """
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    _check_depth(data, source)
    try:
        text = data.decode("utf-8")
        return json.loads(text, parse_int=lambda literal: _parse_int(literal, source))
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{source}: not valid UTF-8; the file is corrupt.") from None
    except json.JSONDecodeError as err:
        raise CorruptCheckpointError(f"{source}: invalid JSON ({err}); the file is corrupt or truncated.") from None
    except RecursionError:  # unreachable after _check_depth; kept so no raw RecursionError can ever escape
        raise CorruptCheckpointError(f"{source}: JSON nested too deeply.") from None


def field_error(source: str, field: str, value: Any, expected: str) -> CorruptCheckpointError:
    """The one error for a field of an untrusted JSON document that fails its check.

    Example:

    ```python
    >>> str(field_error("manifest.json", "step", -1, "null or an integer >= 0"))[:60]
    'manifest.json: step: -1 is invalid, expected null or an inte'
    ```
    """
    return CorruptCheckpointError(f"{source}: {field or '<root>'}: {value!r:.120} is invalid, expected {expected}. "
                                  "The file was not written by hf_resumable or was modified; resume from another "
                                  "checkpoint.")


def require_field(ok: bool, source: str, field: str, value: Any, expected: str) -> None:
    """Raise :func:`field_error` unless ``ok``."""
    if not ok:
        raise field_error(source, field, value, expected)


def _parse_int(literal: str, source: str) -> int:
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise CorruptCheckpointError(
            f"{source}: an integer of {digits} digits (more than {MAX_INT_DIGITS}); the file is corrupt or crafted.")
    return int(literal)


def _check_depth(data: bytes, source: str) -> None:
    """Reject nesting deeper than ``MAX_JSON_DEPTH`` in linear time, without parsing."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return  # cannot nest deeper than the number of openers
    # Drop escaped backslashes, then escaped quotes: every quote left delimits a string, so every other
    # piece between quotes is outside strings (exact for valid JSON; invalid JSON fails to parse anyway).
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    codes = np.frombuffer(outside.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
    if steps.size and int(np.cumsum(steps).max()) > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(
            f"{source}: JSON nested deeper than {MAX_JSON_DEPTH} levels; the file is corrupt or crafted.")
