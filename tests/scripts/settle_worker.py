"""One rank of a 2-rank gloo group: after each of ROUNDS all-reduces, ``settle`` must leave gloo holding none of
the tensor (its use count back to the caller's one).

Usage: ``settle_worker.py OUT ROUNDS`` with the torchrun environment set. Writes ``OUT/rank{R}.json``: for each
round the tensor's use count right after ``all_reduce`` returned and after ``settle``. Its last act is
``all_gather_json``, then it exits: a process that aborts at exit (SIGABRT) fails the test by its exit code.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_resumable.distributed import all_gather_json, settle


def main() -> None:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    counts = []
    for step in range(rounds):
        flag = torch.tensor([rank + step])
        dist.all_reduce(flag)
        before = flag._use_count()
        settle(flag)
        counts.append([before, flag._use_count()])
    (out / f"rank{rank}.json").write_text(json.dumps({"counts": counts, "ranks": all_gather_json(rank)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
