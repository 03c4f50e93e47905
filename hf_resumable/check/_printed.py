"""PURE: a printed line or log message -> its template and the numbers in it, without the ones that measure time.

A training script's own output is compared number by number: ``"step 5 | loss 0.4123 | 31.2 ms/step"`` becomes the
template ``"step # | loss # | ~ ms/step"`` and the values ``("5", "0.4123")``. Lines are matched by template (the
n-th line of a template in an optimizer step), so a line only one run prints ("resuming from step 4") is never
compared. Numbers that measure time, speed or memory (by the word before them or the unit after them), timestamps
and object addresses are not training values: they become ``~`` in the template.

Example:

```python
>>> split_numbers("step 5 | loss 0.4123 | 31.2 ms/step | train_runtime: 3.5")
('step # | loss # | ~ ms/step | train_runtime: ~', ('5', '0.4123'))
```
"""

from __future__ import annotations

import re

__all__ = ["split_numbers"]

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b(?:nan|inf)\b")
_CLOCK = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?|\b\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b")
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+|\b0x[0-9a-fA-F]{8,}\b")
# a word just before a number that says it measures time, speed or memory
_TIMING_WORD = re.compile(r"(time|runtime|elapsed|eta|duration|took|speed|throughput|per_second|per_sec|/s|"
                          r"sec|secs|seconds|mfu|flops|mem|memory|alloc|pid|port)\W{0,3}$", re.IGNORECASE)
# a unit just after a number that says the same
_TIMING_UNIT = re.compile(r"^\s?(s|ms|us|µs|ns|sec|secs|seconds|min|mins|minutes|h|hours|it/s|s/it|/s|"
                          r"[a-z]+/s|kb|mb|gb|kib|mib|gib|tflops|%\s*mfu)\b", re.IGNORECASE)
_CONTEXT = 24  # characters before a number searched for a timing word


def _is_timing(text: str, start: int, end: int, previous_end: int) -> bool:
    before = text[max(previous_end, start - _CONTEXT):start]
    return bool(_TIMING_WORD.search(before.rstrip(" =:'\"\t"))) or bool(_TIMING_UNIT.match(text[end:end + 12]))


def split_numbers(text: str) -> tuple[str, tuple[str, ...]]:
    """``(template, values)`` of a printed line or log message: each compared number becomes ``#``, each timing number
    ``~``. The values are the numbers as printed (compared as text, so ``0.41230`` and ``0.4123`` differ, as a
    script that prints more digits would show)."""
    text = _ADDRESS.sub("<address>", _CLOCK.sub("<clock>", text))
    template, values, last, previous_end = [], [], 0, 0
    for match in _NUMBER.finditer(text):
        start, end = match.span()
        template.append(text[last:start])
        if _is_timing(text, start, end, previous_end):
            template.append("~")
        else:
            template.append("#")
            values.append(match.group())
        last = previous_end = end
    template.append(text[last:])
    return "".join(template), tuple(values)
