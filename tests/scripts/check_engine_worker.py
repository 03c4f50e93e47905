"""One rank of tests/scripts/fsdp_accelerate_worker.py (ResumableAccelerator under DeepSpeed or FSDP, 2 gloo ranks
on CPU through the test-only engine shim), for tests/test_check.py, optionally broken:

    torchrun --nproc-per-node 2 check_engine_worker.py --output-dir {out} --engine deepspeed --zero-stage 2
    torchrun --nproc-per-node 2 check_engine_worker.py --output-dir {out} --engine fsdp [--forget-scheduler]

``--forget-scheduler``: after ``load_state()`` the learning-rate scheduler is put back to its fresh state, as a
script that rebuilds its scheduler after loading would, so the schedule starts over after a restart.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FORGET = "--forget-scheduler" in sys.argv
if FORGET:
    sys.argv.remove("--forget-scheduler")

import fsdp_accelerate_worker as worker  # noqa: E402  (installs the CPU engine shim on import)

from hf_resumable.integrations.accelerate import ResumableAccelerator  # noqa: E402


def _forgetting_load_state(original):
    def load_state(self, *args, **kwargs):
        fresh = [scheduler.scheduler.state_dict() for scheduler in self._schedulers]
        loaded = original(self, *args, **kwargs)
        for scheduler, state in zip(self._schedulers, fresh):
            scheduler.scheduler.load_state_dict(state)
        return loaded

    return load_state


if __name__ == "__main__":
    if FORGET:
        ResumableAccelerator.load_state = _forgetting_load_state(ResumableAccelerator.load_state)
    sys.exit(worker.main())
