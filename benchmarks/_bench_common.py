"""Helpers shared by the benchmark scripts (run as ``python benchmarks/bench_*.py``; this directory is on sys.path)."""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import time
from pathlib import Path


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (so the next read is cold); False where that is not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_read(directory: Path, buffer: bytearray | None = None, *, direct: bool = False) -> float:
    """Seconds to read every file under ``directory`` with one stream of 16 MiB reads: into ``buffer`` (reused,
    its pages already touched), or with ``buffer=None`` into new memory the size of each file (untouched
    anonymous pages, so the first touch of every page is part of the read, as in a fresh process's load).

    ``direct=True``: with ``O_DIRECT`` into one reused, page-aligned 16 MiB buffer (no page cache), what the disk
    itself delivers to one stream."""
    if direct:
        aligned = mmap.mmap(-1, 16 << 20)
        aligned[:] = bytes(16 << 20)
    start = time.perf_counter()
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        if direct:
            fd, offset = os.open(path, os.O_RDONLY | os.O_DIRECT), 0
            try:
                while n := os.preadv(fd, [aligned], offset):
                    offset += n
            finally:
                os.close(fd)
            continue
        with open(path, "rb", buffering=0) as f:
            if buffer is not None:
                view = memoryview(buffer)[: 16 << 20]
                while f.readinto(view):
                    pass
            else:
                view, done = memoryview(mmap.mmap(-1, max(path.stat().st_size, 1))), 0
                while n := f.readinto(view[done : done + (16 << 20)]):
                    done += n
    return time.perf_counter() - start


def resident_pages(fd: int, size: int) -> bytes | None:
    """Which pages of the file behind ``fd`` are in the page cache (``mincore``: one byte per page, bit 0 set when
    resident); ``None`` where that cannot be asked. Maps the file without touching it, so nothing is read."""
    if size <= 0 or not hasattr(os, "O_DIRECT"):  # Linux only
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        return None
    try:
        vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        return bytes(vector) if libc.mincore(address, size, vector) == 0 else None
    finally:
        libc.munmap(address, size)


def throttle_reads(directory: str, mib_per_s: int) -> str:
    """Cap this process's (and its children's) reads from the disk under ``directory`` at ``mib_per_s`` MiB/s.

    A disk of known, steady speed: a VM's virtual disk is served partly from its host's cache, so its speed drifts
    by 2x within a minute and a ratio against a raw read measured seconds earlier means little. Uses the cgroup
    v1 ``blkio`` throttle (needs root); raises ``RuntimeError`` saying why where that is not possible. Returns the
    device rule written (``major:minor bytes_per_s``).
    """
    root = "/sys/fs/cgroup/blkio"
    if not os.path.isdir(root):
        raise RuntimeError(f"--throttle-read-mibps needs the cgroup v1 blkio controller at {root}")
    device = os.stat(directory).st_dev
    major, minor = os.major(device), os.minor(device)
    sys_dev = f"/sys/dev/block/{major}:{minor}"
    if os.path.exists(f"{sys_dev}/partition"):  # the throttle applies to whole disks: use the partition's disk
        with open(f"{os.path.realpath(sys_dev)}/../dev") as f:
            major, minor = (int(x) for x in f.read().split(":"))
    group = f"{root}/hf_resumable_bench_{os.getpid()}"
    os.makedirs(group, exist_ok=True)
    rule = f"{major}:{minor} {mib_per_s << 20}"
    with open(f"{group}/blkio.throttle.read_bps_device", "w") as f:
        f.write(rule)
    with open(f"{group}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    atexit.register(_leave_group, root, group)
    return rule


def _leave_group(root: str, group: str) -> None:
    try:
        with open(f"{root}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
    except OSError:
        pass
