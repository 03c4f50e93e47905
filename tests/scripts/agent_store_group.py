"""One worker of a 2-rank gloo group that meets in an outside TCPStore, as a torchrun worker meets in its agent's.

Usage: ``agent_store_group.py DELAY`` with torchelastic's worker environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of the store, ``TORCHELASTIC_USE_AGENT_STORE=True``). Sleeps ``DELAY`` seconds,
initialises the group through plain ``torch.distributed.init_process_group`` (after ``import hf_resumable``), does
one all-reduce and prints ``sum <value>``.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist

import hf_resumable  # noqa: F401  (installs the per-attempt rendezvous)
from hf_resumable.distributed import settle

time.sleep(float(sys.argv[1]))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[2]) if len(sys.argv) > 2 else 300))
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
settle(total)  # the process exits right after: gloo must not still hold the tensor then
print(f"sum {total.item()}", flush=True)
dist.destroy_process_group()
