"""``python stream_accumulate_worker.py CHECKPOINT_DIR SAVE_AFTER MARKS_JSON``: the direct ``accumulate`` loop over a
prepared stream of ``helpers.accelerate_runs.stream_accumulate_run``, saved after ``SAVE_AFTER`` batches; its
per-batch marks go to ``MARKS_JSON``, then the process SIGKILLs itself (tests/test_accelerate_loaders.py resumes
it)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers.accelerate_runs import stream_accelerator, stream_accumulate_run  # noqa: E402

if __name__ == "__main__":
    checkpoints, save_after, marks_file = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    marks, _ = stream_accumulate_run(stream_accelerator(checkpoints), save_after=save_after)
    marks_file.write_text(json.dumps(marks))
    os.kill(os.getpid(), signal.SIGKILL)
