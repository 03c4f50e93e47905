"""What the checksum costs a file write: ``write_safetensors`` (xxh3-128 inline, what saves do since format
version 2) against the same write with its xxh3-128 on a helper thread, and with the sha256 helper thread plus
xxh3-128 that saves ran before format version 2.

Each variant writes the same tensors to a new file (page-cache writes with each chunk's writeback started, then
fsync, as saves do; ``--no-fsync`` for tmpfs), in alternating order per round; medians of ``--rounds``. Prints one
table row per variant with its time relative to the current writer.

Usage: ``python benchmarks/bench_write_checksum.py --dir <disk dir> --mib 384 --rounds 7``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from hf_resumable.format import safetensors_io as st


class _Thread:
    """Hash chunks on a helper thread, in order (the pre-version-2 pipeline, with ``sha256=True``)."""

    def __init__(self, *, sha256: bool) -> None:
        self.digests = [st.fast_checksum()] + ([hashlib.sha256()] if sha256 else [])
        self.queue: queue.Queue = queue.Queue(maxsize=8)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.queue.get()) is not None:
            for digest in self.digests:
                digest.update(chunk)

    def finish(self) -> list[str]:
        self.queue.put(None)
        self.thread.join()
        return [digest.hexdigest() for digest in self.digests]


def _write_threaded(path: str, tensors: list[tuple[str, torch.Tensor]], *, fsync: bool, sha256: bool) -> None:
    """``write_safetensors`` with its checksum(s) on a helper thread instead of inline."""
    ordered = st.layout_tensors(tensors)
    hasher = _Thread(sha256=sha256)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    for chunk in st._chunks([memoryview(st.build_header(ordered))] + [st.byte_view(t) for _, t in ordered]):
        hasher.queue.put(chunk)
        st._write_all(fd, chunk)
    hasher.finish()
    if fsync:
        os.fsync(fd)
    os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory to write in (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=384, help="MiB written per file, in 6 fp32 tensors")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-fsync", action="store_true", help="no fsync (tmpfs)")
    args = parser.parse_args()
    fsync = not args.no_fsync
    tensors = [(f"t{i}", torch.randn(args.mib * 2**20 // 4 // 6)) for i in range(6)]
    variants: dict[str, Callable[[str], object]] = {
        "xxh3-128 inline (current)": lambda p: st.write_safetensors(p, tensors, fsync=fsync),
        "xxh3-128 on a helper thread": lambda p: _write_threaded(p, tensors, fsync=fsync, sha256=False),
        "sha256 + xxh3-128 on a helper thread (before format version 2)":
            lambda p: _write_threaded(p, tensors, fsync=fsync, sha256=True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for r in range(args.rounds):
            names = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
            for i, name in enumerate(names):
                path = os.path.join(root, f"{r}-{i}.safetensors")
                start = time.perf_counter()
                variants[name](path)
                times[name].append(time.perf_counter() - start)
                os.unlink(path)
    base = statistics.median(times["xxh3-128 inline (current)"])
    print(f"{args.mib} MiB per file, fsync={fsync}, median of {args.rounds} rounds, load {os.getloadavg()[0]:.2f}")
    print("| writer | median s | vs current |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
