"""Each performance mechanism of the load's reader, on and off, on this VM's disk and on tmpfs.

A fresh-process resume (a Llama-shaped model of 0.31 GiB plus new AdamW state, 0.94 GiB in all, every hash checked)
is timed once per variant and round. Every variant changes ONE thing against the reference (``ref``: a fixed
number of read streams, ``READ_WORKERS``, over all files' chunks interleaved, everything else as the library does
it), so each row says what that one mechanism is worth here:

- ``probe``: the library's default, which on a disk reporting itself rotational measures 1 against N streams on the
  first bytes (the probe is forced on tmpfs, which reports nothing);
- ``two``, ``one``: 2 streams, 1 stream (before the probe was deleted, one stream read the files front to back and
  hashed them on a thread of its own); ``one_inline_hash``: one stream hashed by the reading thread itself (in the
  version with the hash thread);
- ``no_direct``: no ``O_DIRECT`` (every byte buffered); ``no_align``: new tensors allocated by plain
  ``torch.empty`` (not aligned like their file offset, so ``O_DIRECT`` goes through the bounce buffer);
- ``no_prefault``: no thread faulting in new memory ahead of the readers;
- ``no_interleave``: the N streams take the files' chunks file after file instead of interleaved.

Variants whose mechanism this version of the library does not have any more are skipped (named in the output); to
measure them, run this script against the commit that still had them (c073833, before the stream probe, the hash
thread, interleaving and ``O_DIRECT`` were deleted), e.g. from ``git worktree add /tmp/base c073833`` with
``PYTHONPATH=/tmp/base``.
Each run is a child forked from a parent that imported torch and hf_resumable but ran no torch op (so the child's
allocations and page faults are a fresh process's; ``fork`` saves the 5-10 s import per run). The child builds the
model and an AdamW without state, makes the page cache cold (``--evict drop``: ``echo 3 >
/proc/sys/vm/drop_caches``, the default where permitted; ``--evict fadvise``: ``POSIX_FADV_DONTNEED`` on the
checkpoint's files), reads the files raw (one stream, buffered, into a reused 16 MiB buffer), evicts again, loads,
evicts, reads raw again. Its ratio is the faster raw read over the load (as in ``bench_checkpoint.py``). The rounds
run the variants in rotating order (round r starts with variant r), so the machine's load and the disk's drift hit
every variant alike. ``--warm`` runs a second set with the page cache warm (nothing evicted, the files read once
before): the ``O_DIRECT`` decision there is ``mincore``'s.

Usage:
    python benchmarks/bench_read_paths.py --repeats 5 --dir <disk dir> --dir /dev/shm [--warm] [--staging]

``--staging`` also times the async save's staging copy (``checkpoint.background._staging.copy_into``) of the AdamW
state into reused buffers, with ``torch``'s ``copy_`` per tensor as the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _bench_common import drop_caches, raw_read, resident_pages

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
from hf_resumable.checkpoint.commit import _parallel_read
from hf_resumable.checkpoint.state import _optimizer

READ_WORKERS = getattr(_parallel_read, "READ_WORKERS", 4)


def build(seed: int):
    """A Llama-shaped stack (hidden 1024, MLP 2816, 4 layers, vocab 16000, untied) of plain torch modules, and an
    AdamW without state."""
    import torch

    torch.manual_seed(seed)
    layers: dict[str, torch.nn.Module] = {"embed": torch.nn.Embedding(16000, 1024)}
    for i in range(4):
        for name, shape in (("q", (1024, 1024)), ("k", (1024, 1024)), ("v", (1024, 1024)), ("o", (1024, 1024)),
                            ("gate", (1024, 2816)), ("up", (1024, 2816)), ("down", (2816, 1024))):
            layers[f"l{i}_{name}"] = torch.nn.Linear(*shape, bias=False)
        layers[f"l{i}_norm"] = torch.nn.LayerNorm(1024)
    layers["head"] = torch.nn.Linear(1024, 16000, bias=False)
    model = torch.nn.ModuleDict(layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def setup(directory: Path) -> None:
    """Save the checkpoint the children load (one AdamW step taken, so the state exists)."""
    import torch

    model, optimizer = build(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    save_checkpoint(directory, model=model, optimizer=optimizer, step=1, rng=False, overwrite=True)


# ---------------------------------------------------------------------------------------------------- variants
# Each variant: (what it changes, the reader's environment, a patch of the library applied in the child, or None).
# A patch returns False where this version of the library has no such mechanism (the variant is skipped).


class _InlineQueue:
    """Stands in for the one-stream hash queue: hashes each chunk on the reading thread, and ends the hash thread."""

    def put(self, item) -> None:
        if item is not None:
            item[0].completed(item[1])

    def get(self):
        return None


def _patch_inline_hash() -> bool:
    if not hasattr(_parallel_read, "_hash_in_order"):
        return False
    _parallel_read._queue = type("queue", (), {"SimpleQueue": _InlineQueue})
    return True


def _patch_no_prefault() -> bool:
    if not hasattr(_parallel_read, "PREFAULT_MIN_BYTES"):
        return False
    _parallel_read.PREFAULT_MIN_BYTES = 1 << 62
    return True


def _patch_no_interleave() -> bool:
    if not hasattr(_parallel_read, "interleave"):
        return False
    _parallel_read.interleave = lambda files: [chunk for chunks in files for chunk in chunks]
    return True


def _patch_no_align() -> bool:
    if not hasattr(_parallel_read, "empty_aligned"):
        return False
    import torch

    plain = lambda shape, dtype, file_offset: torch.empty(shape, dtype=dtype)  # noqa: E731
    _parallel_read.empty_aligned = _optimizer.empty_aligned = plain
    return True


def _patch_probe_everywhere() -> bool:
    if not hasattr(_parallel_read, "_probe"):
        return False
    _parallel_read._rotational = lambda device: True
    return True


def _needs(name: str) -> Callable[[], bool]:
    return lambda: hasattr(_parallel_read, name)


STREAMS = getattr(_parallel_read, "READ_STREAMS_ENV", "HF_RESUMABLE_READ_STREAMS")
DIRECT = getattr(_parallel_read, "DIRECT_READS_ENV", "HF_RESUMABLE_DIRECT_READS")
VARIANTS: dict[str, tuple[str, dict[str, str], Callable[[], bool] | None]] = {
    "ref": (f"{READ_WORKERS} streams (reference)", {STREAMS: str(READ_WORKERS)}, None),
    "probe": ("streams measured on the first bytes (1 vs N)", {}, _patch_probe_everywhere),
    "two": ("2 streams", {STREAMS: "2"}, None),
    "one": ("1 stream", {STREAMS: "1"}, None),
    "one_inline_hash": ("1 stream, hashed by the reading thread", {STREAMS: "1"}, _patch_inline_hash),
    "no_direct": ("no O_DIRECT (buffered reads only)", {STREAMS: str(READ_WORKERS), DIRECT: "0"},
                  _needs("_Direct")),
    "no_align": ("new tensors not aligned for O_DIRECT", {STREAMS: str(READ_WORKERS)}, _patch_no_align),
    "no_prefault": ("no prefault thread", {STREAMS: str(READ_WORKERS)}, _patch_no_prefault),
    "no_interleave": ("chunks file after file, not interleaved", {STREAMS: str(READ_WORKERS)}, _patch_no_interleave),
}
WARM_VARIANTS: dict[str, tuple[str, dict[str, str], Callable[[], bool] | None]] = {
    "ref": ("warm cache: O_DIRECT for what mincore says is not cached (auto)", {STREAMS: str(READ_WORKERS)}, None),
    "always_direct": ("warm cache: O_DIRECT for every byte (no mincore)", {STREAMS: str(READ_WORKERS), DIRECT: "1"},
                      _needs("_Direct")),
    "no_direct": ("warm cache: buffered reads only", {STREAMS: str(READ_WORKERS), DIRECT: "0"}, _needs("_Direct")),
}


# ---------------------------------------------------------------------------------------------------- measuring


def evict(directory: Path, how: str) -> str:
    """Make the page cache cold for ``directory``'s files; returns the method used (tmpfs: nothing to do, its files
    live in the page cache)."""
    if how == "none":
        return "tmpfs: always in memory"
    if how == "drop" and drop_caches():
        return "drop_caches"
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def resident_fraction(directory: Path) -> float:
    """Share of ``directory``'s file pages in the page cache (``mincore``), to confirm that an eviction worked."""
    resident = total = 0
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            pages = resident_pages(fd, os.fstat(fd).st_size) or b""
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in pages)
        total += len(pages)
    return resident / max(total, 1)


def child(directory: Path, variant: tuple[str, dict[str, str], Callable[[], bool] | None], *, warm: bool,
          how: str) -> dict:
    """One run (in a forked child): build, evict (or warm), raw read, load, raw read."""
    _, env, patch = variant
    for key in (STREAMS, DIRECT):
        os.environ.pop(key, None)
    os.environ.update(env)
    if patch is not None and not patch():
        return {"skipped": True}
    model, optimizer = build(1)
    buffer = bytearray(16 << 20)
    method = "warm"
    if warm:
        raw_read(directory, buffer)
    else:
        method = evict(directory, how)
    raw_before = raw_read(directory, buffer)
    cold_share = None
    if not warm and how != "none":
        evict(directory, how)
        cold_share = resident_fraction(directory)
    start, cpu = time.perf_counter(), time.process_time()
    load_checkpoint(directory, model=model, optimizer=optimizer, restore_rng=False)
    load_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    if not optimizer.state:
        raise RuntimeError("the optimizer state was not loaded")
    if not warm:
        evict(directory, how)
    raw_after = raw_read(directory, buffer)
    return {"load": load_s, "cpu": cpu_s, "raw_before": raw_before, "raw_after": raw_after, "evict": method,
            "resident_before_load": cold_share}


def forked(fn: Callable[[], dict]) -> dict:
    """``fn()`` in a forked child (its result as JSON through a pipe)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        code = 0
        try:
            payload = json.dumps(fn())
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            payload, code = json.dumps({"error": repr(err)}), 1
        sys.stdout.flush()
        sys.stderr.flush()
        with os.fdopen(write_end, "w") as out:
            out.write(payload)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as source:
        data = source.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    if "error" in result:
        raise RuntimeError(f"child failed: {result['error']}")
    return result


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    real = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fstype = line.split()[:3]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def run_set(directory: Path, variants: dict, repeats: int, *, warm: bool, how: str) -> dict[str, list[dict]]:
    names = list(variants)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rnd in range(repeats):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:  # rotating order: ABAB... for every pair
            result = forked(lambda: child(directory, variants[name], warm=warm, how=how))
            runs[name].append(result)
            if not result.get("skipped"):
                print(f"  {directory} {'warm' if warm else 'cold'} round {rnd} {name}: load {result['load']:.3f} s "
                      f"(CPU {result['cpu']:.2f} s), "
                      f"raw {result['raw_before']:.3f}/{result['raw_after']:.3f} s", file=sys.stderr)
    return runs


def report(title: str, variants: dict, runs: dict[str, list[dict]], nbytes: int) -> None:
    print(f"\n{title}\n")
    print("| variant | load median s | GB/s | CPU s (all threads) | raw read median s | load vs raw read (median of "
          "pairs; range) | ref vs this (median of per-round ratios; range) |")
    print("|---|---|---|---|---|---|---|")
    ref = runs["ref"]
    for name, results in runs.items():
        if any(r.get("skipped") for r in results):
            print(f"| {name}: {variants[name][0]} | not in this version | | | | | |")
            continue
        loads = [r["load"] for r in results]
        raws = [min(r["raw_before"], r["raw_after"]) for r in results]
        pairs = [raw / load for raw, load in zip(raws, loads)]
        vs_ref = [a["load"] / b["load"] for a, b in zip(ref, results)]
        print(f"| {name}: {variants[name][0]} | {statistics.median(loads):.3f} | "
              f"{nbytes / statistics.median(loads) / 1e9:.2f} | {statistics.median(r['cpu'] for r in results):.2f} | "
              f"{statistics.median(raws):.3f} | "
              f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}..{max(pairs):.2f}) | "
              f"{statistics.median(vs_ref):.2f}x ({min(vs_ref):.2f}..{max(vs_ref):.2f}) |")
    evictions = {r.get("evict") for rs in runs.values() for r in rs if not r.get("skipped")}
    shares = [r["resident_before_load"] for rs in runs.values() for r in rs
              if r.get("resident_before_load") is not None]
    line = f"\ncache: {', '.join(sorted(evictions))}"
    if shares:
        line += f"; share of the files' pages cached when a load started: at most {max(shares):.1%}"
    print(line)


# ---------------------------------------------------------------------------------------------------- staging


def staging(repeats: int) -> None:
    """The async save's staging copy of AdamW-state-sized tensors into reused buffers."""
    import torch

    from hf_resumable.checkpoint.background import _staging

    model, _ = build(0)
    sources = [p.detach().clone() for p in model.parameters()] * 2  # exp_avg and exp_avg_sq sized
    buffers = [torch.empty_like(s) for s in sources]
    pairs = list(zip(buffers, sources))
    nbytes = sum(s.nbytes for s in sources)
    kinds: dict[str, Callable[[], None]] = {
        "torch copy_ per tensor (baseline)": lambda: [d.copy_(s) for d, s in pairs],
        "copy_into (memmove, one thread)": lambda: _staging.copy_into(pairs),
    }
    for fn in kinds.values():  # warm-up: every buffer touched, threads started
        fn()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for rnd in range(repeats):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            start = time.perf_counter()
            kinds[name]()
            times[name].append(time.perf_counter() - start)
    base = times[names[0]]
    print(f"\nStaging copy of {nbytes / 2**30:.2f} GiB into reused buffers, median of {repeats}, rotating order\n")
    print("| copy | median s | GB/s | baseline vs this (median of per-round ratios; range) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        ratios = [a / b for a, b in zip(base, values)]
        print(f"| {name} | {statistics.median(values):.4f} | {nbytes / statistics.median(values) / 1e9:.2f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", action="append", default=None,
                        help="a directory on the storage to measure (repeatable; default: a temp dir and /dev/shm)")
    parser.add_argument("--evict", choices=("drop", "fadvise"), default="drop",
                        help="how to make the cache cold: drop_caches (where permitted, else fadvise) or fadvise")
    parser.add_argument("--warm", action="store_true", help="also measure the O_DIRECT choice with a warm cache")
    parser.add_argument("--staging", action="store_true", help="also time the async save's staging copy")
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--setup", default=None, help=argparse.SUPPRESS)  # the setup subprocess
    args = parser.parse_args()
    if args.setup is not None:
        setup(Path(args.setup))
        return
    variants = {k: v for k, v in VARIANTS.items() if args.only is None or k in args.only.split(",") or k == "ref"}
    load = os.getloadavg()[0]
    for base in args.dir or [None, "/dev/shm"]:
        root = Path(__import__("tempfile").mkdtemp(prefix="bench_read_", dir=base))
        try:
            # Saved by a separate process: this one runs no torch op before it forks (a fork after torch's thread
            # pools started is unsafe).
            subprocess.run([sys.executable, __file__, "--setup", str(root / "ckpt")], check=True)
            directory = root / "ckpt"
            nbytes = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
            kind = fs_type(directory)
            how = "none" if kind == "tmpfs" else args.evict
            runs = run_set(directory, variants, args.repeats, warm=False, how=how)
            report(f"Fresh-process resume from {kind} ({root.parent}), {nbytes / 2**30:.2f} GiB, cold cache, "
                   f"median of {args.repeats}", variants, runs, nbytes)
            if args.warm and kind != "tmpfs":
                warm = run_set(directory, WARM_VARIANTS, args.repeats, warm=True, how=args.evict)
                report(f"The same on {kind}, warm cache (files read just before), median of {args.repeats}",
                       WARM_VARIANTS, warm, nbytes)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.staging:
        forked(lambda: staging(max(args.repeats, 7)) or {})
    print(f"\nload average (1 min): {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
          f"({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
