"""Doctests of the package read HF-style docstrings: examples sit in markdown ```python fences.

As transformers' own doctest runner does, the fence lines are dropped before the examples are parsed, so a
closing fence is not taken for expected output. (Fixtures for the test suite live in tests/conftest.py.)
"""

from __future__ import annotations

import doctest
import re

_FENCE = re.compile(r"^[ \t]*```[\w-]*[ \t]*$", re.MULTILINE)
_parse = doctest.DocTestParser.parse


def _parse_without_fences(self, string, name="<string>"):
    return _parse(self, _FENCE.sub("", string), name)


doctest.DocTestParser.parse = _parse_without_fences
