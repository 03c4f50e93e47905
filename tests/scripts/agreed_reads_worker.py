"""One rank of a gloo group where rank 1's reads fail inside ``agreed_reads`` (see test_resume_fallback).

Usage: ``agreed_reads_worker.py MODE OUT [ROOT]`` with the torchrun environment set.

* ``eio``: rank 1 raises ``OSError(EIO)`` inside ``agreed_reads``; rank 0 reads nothing wrong.
* ``corrupt``: rank 1 raises ``CorruptCheckpointError`` there instead.
* ``mixed``: rank 0 raises ``CorruptCheckpointError`` and rank 1 ``OSError(EIO)``.
* ``resume``: ``resume_newest`` over ``ROOT/rank{R}`` (two checkpoints) with a load that raises ``OSError(EIO)``
  on rank 1 inside ``agreed_load``.

Each rank writes ``OUT/rank{R}.json``: the type, message and ``rank`` attribute of what it raised, and the
seconds it spent in the agreement; then both ranks meet one more collective, which proves the group still pairs.
"""

from __future__ import annotations

import datetime
import errno
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from hf_resumable.checkpoint import find_latest_verified
from hf_resumable.constants import CHECKPOINT_DIR_RE
from hf_resumable.distributed import agreed_reads, all_gather_json
from hf_resumable.errors import CorruptCheckpointError
from hf_resumable.integrations._fallback import agreed_load, resume_newest

SOURCE = "out/checkpoint-8"


def fail(mode: str, rank: int) -> None:
    """Raise what ``mode`` has this rank meet while it reads, or nothing."""
    if mode in ("eio", "mixed", "resume") and rank == 1:
        raise OSError(errno.EIO, "Input/output error", "model-00002-of-00002.safetensors")
    if mode == "corrupt" and rank == 1 or mode == "mixed" and rank == 0:
        raise CorruptCheckpointError("model-00002-of-00002.safetensors: sha256 mismatch")


def run(mode: str, rank: int, root: Path | None) -> None:
    if mode != "resume":
        with agreed_reads(SOURCE):
            fail(mode, rank)
        return

    def load(report):
        with agreed_load(report.path):
            fail(mode, rank)

    resume_newest(root, load, pattern=CHECKPOINT_DIR_RE, owner="test",
                  first=find_latest_verified(root, pattern=CHECKPOINT_DIR_RE))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    # a hang must end in the test's own timeout, never in the group's
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    root = Path(sys.argv[3]) / f"rank{rank}" if mode == "resume" else None
    started = time.monotonic()
    try:
        run(mode, rank, root)
        raised = None
    except Exception as err:  # what this rank raised, for the test to check
        raised = {"type": type(err).__name__, "message": str(err), "rank": getattr(err, "rank", None),
                  "mro": [cls.__name__ for cls in type(err).__mro__]}
    seconds = time.monotonic() - started
    after = all_gather_json(rank)  # the group still pairs its collectives after the agreement
    (out / f"rank{rank}.json").write_text(json.dumps({"raised": raised, "seconds": seconds, "after": after}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
