"""Helpers shared by the benchmark scripts (run as ``python benchmarks/bench_*.py``; this directory is on sys.path)."""

from __future__ import annotations

import os


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (so the next read is cold); False where that is not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
