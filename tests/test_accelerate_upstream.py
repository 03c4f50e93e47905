"""accelerate's own checkpointing tests pass with ``from hf_resumable import ResumableAccelerator as Accelerator``.

Runs ``tests/upstream/run_accelerate_upstream.py --control auto`` (``make test-upstream`` runs it with the control
always): the installed accelerate version's sdist is downloaded from the package index,
``tests/test_state_checkpointing.py`` and the checkpoint-related tests of ``tests/test_accelerator.py`` run on CPU
with the one-line import change, and every case must pass, except the documented expected failures. Stock
accelerate (the control) runs too when a case does not pass, to tell a broken environment from ours.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from helpers import zygote

RUNNER = Path(__file__).parent / "upstream" / "run_accelerate_upstream.py"


@pytest.mark.slow
def test_accelerates_checkpointing_suite_passes_with_resumable_accelerator(tmp_path):
    done = zygote.run([sys.executable, str(RUNNER), "--control", "auto", "--work-dir", str(tmp_path)],
                      capture_output=True, text=True, timeout=1200)
    report = done.stdout[-20000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    counts = {suite: dict((outcome, int(n)) for n, outcome in re.findall(r"(\d+) (\w+)", line))
              for suite, line in re.findall(r"^\s+(control|resumable)\s*: (.*)$", done.stdout, re.M)}
    assert counts["resumable"]["passed"] >= 40, report  # the selection really ran
