"""Checkpoint save/load speed as ratios against this machine's raw disk limits, measured in the same run.

For a Llama-shaped model + AdamW state of about 1 GiB, each repetition measures:

- raw write+fsync of the same byte count (the durable-write limit),
- our blocking save (``save_checkpoint``), until its files are durable (the call commits them and returns; their
  fsyncs follow on the saver's thread, ``durability="deferred"``) and until the call returns,
- our async save's stall: the time the training loop loses to it. The save call (until
  ``save_checkpoint(blocking=False)`` returns) plus the wait of the next optimizer step at the step gate (a
  background save copies the parameters and optimizer state while the next forward and backward run, and holds
  that step until the copy is over): the loop really runs that next step (forward, backward, AdamW step on one
  batch) after the call. That step's time is also reported against a step with no save in flight (its inflation:
  on CPU the copy and the background write share the cores and the memory bandwidth with training),
- the stock pattern (``save_pretrained`` + ``torch.save(optimizer.state_dict())``, fsynced),
- raw cold read of the checkpoint's bytes (one stream, and for reference four threads reading the files in
  parallel),
- the headline load: a fresh-process resume. A new process builds the model (randomly initialized), an
  AdamW without state and its scheduler, as a restarted job does, then times ``load_checkpoint`` (weights,
  optimizer, scheduler, RNG; hashes checked on the fly). The optimizer state is new memory, allocated and
  first touched by the load (faulted in ahead of the reads on a helper thread, ``HF_RESUMABLE_PREFAULT``). It
  reads with the default number of streams; the same load with one stream and with four
  (``HF_RESUMABLE_READ_STREAMS``), and with the prefault helper off, runs right next to it, the four in rotating
  order, so the table shows whether the defaults are right here,
- the same load into a model and optimizer that exist with state (in place, into memory already there).

Every load is paired: the same process reads the same files raw (one stream, into a reused 16 MiB buffer) just
before and just after it, and its ratio is the faster of those two raw reads over the load (the demanding
choice: a raw read right after a load is often the slower one here); the table reports the median of these
per-load ratios, with their range. (This VM's disk drifts by up to 2x within a minute, so a
ratio of medians taken minutes apart compares two different disks.) A raw read into new memory (the first touch
of its pages included, which a fresh process's load cannot avoid) is paired the same way, for reference.

Caches are dropped before every write and cold read when the process may write ``/proc/sys/vm/drop_caches``.
Prints a markdown table of medians and the ratios the targets are stated in.

Usage:
    python benchmarks/bench_checkpoint.py --repeats 7 [--dir /path/on/the/disk/to/test] [--throttle-read-mibps 400]
    python benchmarks/bench_checkpoint.py --stall --repeats 5   # only the blocking save and the async stall rows
    python benchmarks/bench_checkpoint.py --repeats 3 --layout pieces   # the per-rank piece layout (one process)
    python benchmarks/bench_checkpoint.py --device cuda --repeats 3   # saves from a model on the GPU
    python benchmarks/bench_checkpoint.py --alternate 8 [--throttle-read-mibps 1500]   # resume vs raw read, A/B

``--alternate N`` measures only the headline ratio, as N pairs of fresh processes: one times a raw cold read of the
checkpoint (one stream into a reused 16 MiB buffer), the other a resume, each after building the same model and
AdamW, the two in alternating order. Every measured process follows an untimed resume of the same checkpoint in its
own process, so both sides start from the same machine state (on this VM, a read right after a process freed its
memory is slower: the memory goes back to the host and is backed again on first use). The ratio is the median of the
per-pair ratios (raw read time over resume time).

``--device cuda`` trains and saves a model on the GPU (a save copies every tensor to the host: the async save into
pinned buffers on a side stream); the fresh-process resume loads on the CPU, as a restarted job reads before it
moves anything. ``--hidden`` and ``--layers`` size the model (benchmarks/gpu_check.py's dry run makes it tiny), and
``--fresh-variants default`` runs the default fresh-process load alone in each repeat (the dry run's).

``--throttle-read-mibps`` caps the disk's read speed (a cgroup v1 blkio throttle, root only) so that it is
steady: a VM's virtual disk is partly served from its host's cache and drifts by 2x within a minute; against a
disk of known speed, the ratios say whether a load keeps the disk busy.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _bench_common import drop_caches, raw_read, throttle_reads
from transformers import LlamaConfig, LlamaForCausalLM

from hf_resumable._tuning import PREFAULT_ENV, READ_STREAMS_ENV, READ_WORKERS, read_streams
from hf_resumable.checkpoint import load_checkpoint, save_checkpoint, wait_for_pending_saves


def model_config(hidden: int = 1024, layers: int = 4) -> LlamaConfig:
    """The Llama shape measured (the defaults: about 1 GiB with its AdamW state)."""
    return LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                       vocab_size=16000, tie_word_embeddings=False)


def build(seed: int = 0, *, hidden: int = 1024, layers: int = 4,
          device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(hidden, layers)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One training step (forward, backward, AdamW step); its seconds."""
    start = time.perf_counter()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if batch.is_cuda:  # the step is over when the device has run it
        torch.cuda.synchronize(batch.device)
    return time.perf_counter() - start


def gate_waited() -> float:
    """Seconds optimizer steps have waited so far for background copies (the library's step gates)."""
    try:
        from hf_resumable.checkpoint.background._step_gate import _GATES
    except ImportError:  # a library without the step gate: the save call itself copies every tensor
        return 0.0
    return sum(gate.waited for gate in list(_GATES.values()))


def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=100)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(path: Path, buffer: memoryview) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for offset in range(0, len(buffer), 16 << 20):
        os.write(fd, buffer[offset : offset + (16 << 20)])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def stock_save(model, optimizer, directory: Path) -> float:
    start = time.perf_counter()
    model.save_pretrained(directory)
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - start


def raw_read_parallel(directory: Path, workers: int = 4) -> float:
    """Cold read of every file by ``workers`` threads taking 8 MiB ranges in turn (a parallel disk's limit)."""
    jobs = [(path, offset) for path in sorted(directory.rglob("*")) if path.is_file()
            for offset in range(0, path.stat().st_size, 8 << 20)]
    cursor, lock = iter(jobs), threading.Lock()

    def work() -> None:
        buffer = bytearray(8 << 20)
        while True:
            with lock:
                job = next(cursor, None)
            if job is None:
                return
            with open(job[0], "rb", buffering=0) as f:
                os.preadv(f.fileno(), [buffer], job[1])

    start = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def fresh_process_load(directory: Path, settings: dict[str, str], shape: list[str]) -> dict[str, float]:
    """``load_checkpoint`` timed inside a new process that first builds the model and an AdamW without state
    (with the reader's environment ``settings``; none: the defaults for this disk), between two raw cold reads of
    the same files in the same process (the paired baseline), and raw reads into new memory and with ``O_DIRECT``
    after it; with ``--only`` in ``shape``, the one operation it names (``--alternate``)."""
    drop_caches()
    env = dict(os.environ)
    env.pop(READ_STREAMS_ENV, None)
    env.pop(PREFAULT_ENV, None)
    env.update(settings)
    streams = settings.get(READ_STREAMS_ENV, "default")
    out = subprocess.run([sys.executable, __file__, "--fresh-load", str(directory), *shape], check=True,
                         capture_output=True, text=True, env=env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    for message in result.pop("probe"):
        print(f"  fresh-process load ({streams} streams): {message}", file=sys.stderr)
    return result


def _fresh_load_child(directory: str, hidden: int, layers: int, only: str | None = None) -> None:
    torch.manual_seed(1)
    model = LlamaForCausalLM(model_config(hidden, layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if only is not None:  # --alternate: one timed operation, nothing else
        drop_caches()
        start = time.perf_counter()
        if only == "raw":
            raw_read(Path(directory), bytearray(16 << 20))
        else:
            load_checkpoint(directory, model=model, optimizer=optimizer, scheduler=schedule(optimizer))
        print(json.dumps({"seconds": time.perf_counter() - start, "probe": []}))
        return
    probe = _ProbeLog()
    logging.getLogger("hf_resumable.checkpoint.commit._parallel_read").addHandler(probe)
    logging.getLogger("hf_resumable.checkpoint.commit._parallel_read").setLevel(logging.DEBUG)
    buffer = bytearray(16 << 20)
    drop_caches()
    raw_before = raw_read(Path(directory), buffer)
    drop_caches()
    start = time.perf_counter()
    load_checkpoint(directory, model=model, optimizer=optimizer, scheduler=schedule(optimizer))
    elapsed = time.perf_counter() - start
    assert optimizer.state, "the optimizer state was not loaded"
    drop_caches()
    raw_after = raw_read(Path(directory), buffer)
    drop_caches()
    raw_new = raw_read(Path(directory))  # into new memory
    drop_caches()
    raw_direct = raw_read(Path(directory), direct=True)
    print(json.dumps({"load_s": elapsed, "raw_before": raw_before, "raw_after": raw_after, "raw_new": raw_new,
                      "raw_direct": raw_direct, "probe": probe.messages}))


class _ProbeLog(logging.Handler):
    """Collects what the reader's stream probe decided (its DEBUG message), for the benchmark's report."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--throttle-read-mibps", type=int, default=None,
                        help="cap reads from the disk at this many MiB/s (a disk of steady speed; cgroup v1, root)")
    parser.add_argument("--stall", action="store_true", help="only the blocking save and the async stall rows")
    parser.add_argument("--layout", choices=("regular", "pieces"), default="regular",
                        help="save_checkpoint's HF layout, or its per-rank pieces from one process (layout='pieces', "
                             "read by the piece reader)")
    parser.add_argument("--device", default="cpu", help="where the model trains and is saved from (cpu, cuda)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the Llama-shaped model")
    parser.add_argument("--layers", type=int, default=4, help="blocks of the Llama-shaped model")
    parser.add_argument("--alternate", type=int, default=None, metavar="N",
                        help="only the resume against a raw cold read: N pairs of fresh processes, alternating")
    parser.add_argument("--fresh-variants", choices=("all", "default"), default="all",
                        help="the fresh-process loads of each repeat: the default settings and their variants (1 and "
                             "N read streams, prefault off), or the default alone (benchmarks/gpu_check.py's dry run)")
    parser.add_argument("--fresh-load", default=None, help=argparse.SUPPRESS)  # the child of fresh_process_load
    parser.add_argument("--only", choices=("raw", "load"), default=None, help=argparse.SUPPRESS)  # --alternate's child
    args = parser.parse_args()
    save = functools.partial(save_checkpoint, layout="pieces" if args.layout == "pieces" else "auto")
    if args.fresh_load is not None:
        _fresh_load_child(args.fresh_load, args.hidden, args.layers, only=args.only)
        return
    shape = {"hidden": args.hidden, "layers": args.layers}
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    throttled = throttle_reads(str(root), args.throttle_read_mibps) if args.throttle_read_mibps else None
    if args.alternate:
        alternate(root, args.alternate, shape, throttled)
        return
    load_before = os.getloadavg()[0]
    model, optimizer = build(**shape, device=args.device)
    fresh_model, fresh_optimizer = build(seed=1, **shape, device=args.device)
    can_drop = drop_caches()
    results: dict[str, list[float]] = {k: [] for k in ("raw_write", "save", "save_returns", "async_call",
                                                       "async_gate", "async_stall", "step", "step_overlapped",
                                                       "async_total", "stock",
                                                       "raw_read", "raw_read_parallel", "load_fresh",
                                                       "load_fresh_1", "load_fresh_n", "load_fresh_nopf",
                                                       "load", "raw_read_new", "raw_read_direct")}
    # Each load's ratio to the raw cold reads of the same files just before and after it, in the same process:
    # this disk's speed drifts by up to 2x within a minute, so unpaired medians compare different disks.
    paired: dict[str, list[float]] = {k: [] for k in ("load_fresh", "load_fresh_1", "load_fresh_n",
                                                      "load_fresh_nopf", "load",
                                                      "raw_read_new", "raw_read_direct")}
    streams = read_streams()
    fixed = {"load_fresh": {}, "load_fresh_1": {READ_STREAMS_ENV: "1"}, "load_fresh_n": {READ_STREAMS_ENV:
             str(READ_WORKERS)}, "load_fresh_nopf": {PREFAULT_ENV: "0"}}
    if args.fresh_variants == "default":
        fixed = {"load_fresh": fixed["load_fresh"]}
    # Warm-up: allocate the async staging buffers once (they are reused afterwards, as in training).
    save_checkpoint(root / "warm", model=model, optimizer=optimizer, blocking=False)
    wait_for_pending_saves()
    nbytes = dir_bytes(root / "warm")
    shutil.rmtree(root / "warm")
    payload = memoryview(os.urandom(nbytes))
    read_buffer = bytearray(16 << 20)
    batch = torch.randint(0, 16000, (1, 32), generator=torch.Generator().manual_seed(0)).to(args.device)
    train_step(model, optimizer, batch)  # warm-up (first allocation of the gradients)
    for rep in range(args.repeats):
        drop_caches()
        results["raw_write"].append(raw_write(root / "raw.bin", payload))
        (root / "raw.bin").unlink()
        drop_caches()
        start = time.perf_counter()
        save(root / f"checkpoint-{rep}", model=model, optimizer=optimizer, scheduler=schedule(optimizer), step=rep)
        results["save_returns"].append(time.perf_counter() - start)  # committed; its fsyncs follow (deferred)
        wait_for_pending_saves()  # durable, as the raw write it is compared with
        results["save"].append(time.perf_counter() - start)
        drop_caches()
        results["step"].append(train_step(model, optimizer, batch))  # no save in flight
        start, waited = time.perf_counter(), gate_waited()
        save(root / f"async-{rep}", model=model, optimizer=optimizer, step=rep, blocking=False)
        results["async_call"].append(time.perf_counter() - start)
        results["step_overlapped"].append(train_step(model, optimizer, batch))  # its optimizer step may wait
        results["async_gate"].append(gate_waited() - waited)
        results["async_stall"].append(results["async_call"][-1] + results["async_gate"][-1])
        wait_for_pending_saves()
        results["async_total"].append(time.perf_counter() - start)
        shutil.rmtree(root / f"async-{rep}")
        if args.stall:
            shutil.rmtree(root / f"checkpoint-{rep}")
            print(f"  repeat {rep}: " + ", ".join(f"{key} {values[-1]:.3f}" for key, values in results.items()
                                                  if values), file=sys.stderr)
            continue
        drop_caches()
        results["stock"].append(stock_save(model, optimizer, root / f"stock-{rep}"))
        shutil.rmtree(root / f"stock-{rep}")
        drop_caches()
        results["raw_read"].append(raw_read(root / f"checkpoint-{rep}", read_buffer))
        drop_caches()
        results["raw_read_parallel"].append(raw_read_parallel(root / f"checkpoint-{rep}"))
        turn = rep % len(fixed)
        order = list(fixed)[turn:] + list(fixed)[:turn]  # each variant first, second, ... in turn
        for key in order:
            run = fresh_process_load(root / f"checkpoint-{rep}", fixed[key],
                                     ["--hidden", str(args.hidden), "--layers", str(args.layers)])
            baseline = min(run["raw_before"], run["raw_after"])
            results[key].append(run["load_s"])
            paired[key].append(baseline / run["load_s"])
            if key == "load_fresh":
                for raw in ("new", "direct"):
                    results[f"raw_read_{raw}"].append(run[f"raw_{raw}"])
                    paired[f"raw_read_{raw}"].append(baseline / run[f"raw_{raw}"])
        drop_caches()
        before = raw_read(root / f"checkpoint-{rep}", read_buffer)
        drop_caches()
        start = time.perf_counter()
        load_checkpoint(root / f"checkpoint-{rep}", model=fresh_model, optimizer=fresh_optimizer,
                        scheduler=schedule(fresh_optimizer))
        results["load"].append(time.perf_counter() - start)
        drop_caches()
        paired["load"].append(min(before, raw_read(root / f"checkpoint-{rep}", read_buffer)) / results["load"][-1])
        shutil.rmtree(root / f"checkpoint-{rep}")
        print(f"  repeat {rep}: " + ", ".join(f"{key} {values[-1]:.3f}" for key, values in results.items() if values),
              file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    if args.stall:
        stall_report(results, nbytes, args.repeats, can_drop)
    else:
        report(results, paired, nbytes, args.repeats, can_drop, f"{streams} ({READ_STREAMS_ENV} or the default)")
    if throttled:
        print(f"\nreads throttled to {args.throttle_read_mibps} MiB/s (blkio rule {throttled}; writes not throttled)")
    print(f"\nload average (1 min) of the machine: {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
          f"end ({os.cpu_count()} cores)")
    if args.device != "cpu":
        print(f"model trained and saved from {args.device} ({torch.cuda.get_device_name(args.device)})")


def alternate(root: Path, pairs: int, shape: dict[str, int], throttled: str | None) -> None:
    """``--alternate``: a resume against a raw cold read, as ``pairs`` pairs of fresh processes (module docstring)."""
    model, optimizer = build(**shape)
    save_checkpoint(root / "checkpoint", model=model, optimizer=optimizer, scheduler=schedule(optimizer))
    wait_for_pending_saves()
    del model, optimizer
    nbytes = dir_bytes(root / "checkpoint")
    args = ["--hidden", str(shape["hidden"]), "--layers", str(shape["layers"])]

    def child(only: str) -> float:  # the reader's defaults, as in the headline row
        return fresh_process_load(root / "checkpoint", {}, [*args, "--only", only])["seconds"]

    times: dict[str, list[float]] = {"raw": [], "load": []}
    for pair in range(pairs):
        for only in ("raw", "load") if pair % 2 == 0 else ("load", "raw"):
            child("load")  # untimed: every measured process follows the same kind of process
            times[only].append(child(only))
        print(f"  pair {pair}: raw read {times['raw'][-1]:.3f} s, resume {times['load'][-1]:.3f} s", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    ratios = [raw / load for raw, load in zip(times["raw"], times["load"])]
    print(f"\nCheckpoint of {nbytes / 2**30:.2f} GiB (model + AdamW), {pairs} pairs of fresh processes, "
          f"page cache dropped: {drop_caches()}\n")
    print("| operation | median s | GB/s | ratio (median of pairs, range) | target |")
    print("|---|---|---|---|---|")
    raw, load = statistics.median(times["raw"]), statistics.median(times["load"])
    print(f"| raw cold read (limit) | {raw:.3f} | {nbytes / raw / 1e9:.2f} | 1.00x |  |")
    print(f"| hf_resumable resume in a fresh process | {load:.3f} | {nbytes / load / 1e9:.2f} | "
          f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) | >= 0.9x |")
    if throttled:
        print(f"\nreads throttled (blkio rule {throttled}; writes not throttled)")


def _stall_rows(med: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """The async save's rows: its stall (the call plus the next step's wait at the gate) and that step's time."""
    lost = med["async_call"] + med["step_overlapped"] - med["step"]
    return [
        ("hf_resumable async save: stall (call + next step's wait at the step gate)", "async_stall",
         f"{med['async_stall'] / med['save']:.3f}x blocking save", "<= 0.1x"),
        ("... of which the call", "async_call", f"{med['async_call'] / med['save']:.3f}x blocking save", ""),
        ("... of which the wait at the step gate", "async_gate", f"{med['async_gate'] / med['save']:.3f}x blocking "
         "save", ""),
        ("training step (forward, backward, AdamW step), no save in flight", "step", "1.00x", ""),
        ("the step right after the async save (its copy and write in the background)", "step_overlapped",
         f"{med['step_overlapped'] / med['step']:.2f}x a step (inflation); loop time lost (call + this step - a "
         f"step): {lost:.3f} s = {lost / med['save']:.3f}x blocking save", ""),
    ]


def stall_report(results: dict[str, list[float]], nbytes: int, repeats: int, can_drop: bool) -> None:
    med = {k: statistics.median(v) for k, v in results.items() if v}

    print(f"\nCheckpoint of {nbytes / 2**30:.2f} GiB (model + AdamW), median of {repeats} runs, "
          f"page cache dropped: {can_drop}\n")
    print("| operation | median s | ratio | target |")
    print("|---|---|---|---|")
    for label, key, ratio, target in [("hf_resumable blocking save, until durable", "save", "1.00x", ""),
                                      ("hf_resumable blocking save, until it returns (fsyncs deferred)",
                                       "save_returns", f"{med['save_returns'] / med['save']:.2f}x", ""),
                                      *_stall_rows(med),
                                      ("hf_resumable async save: until committed", "async_total", "", "")]:
        print(f"| {label} | {med[key]:.3f} | {ratio} | {target} |")


def report(results: dict[str, list[float]], paired: dict[str, list[float]], nbytes: int, repeats: int,
           can_drop: bool, streams: str) -> None:
    med = {k: statistics.median(v) for k, v in results.items() if v}  # a variant left out has no rows
    pair = {k: f"{statistics.median(v):.2f}x raw read (paired; {min(v):.2f}..{max(v):.2f})" for k, v in paired.items()
            if v}
    gbps = {k: nbytes / v / 1e9 if v > 0 else float('inf') for k, v in med.items()}  # the gate wait may be 0

    print(f"\nCheckpoint of {nbytes / 2**30:.2f} GiB (model + AdamW), median of {repeats} runs, "
          f"page cache dropped: {can_drop}\n")
    print("| operation | median s | GB/s | ratio | target |")
    print("|---|---|---|---|---|")
    rows = [
        ("raw write + fsync (limit)", "raw_write", "1.00x", ""),
        ("hf_resumable blocking save, until durable", "save", f"{med['raw_write'] / med['save']:.2f}x raw write",
         ">= 0.9x"),
        ("hf_resumable blocking save, until it returns (fsyncs deferred)", "save_returns",
         f"{med['raw_write'] / med['save_returns']:.2f}x raw write", ""),
        *_stall_rows(med),
        ("hf_resumable async save: until committed", "async_total", f"{med['raw_write'] / med['async_total']:.2f}x "
         "raw write", ""),
        ("stock: save_pretrained + torch.save(optimizer)", "stock", f"{med['raw_write'] / med['stock']:.2f}x raw "
         "write", ""),
        ("raw cold read (limit)", "raw_read", "1.00x", ""),
        ("raw cold read, 4 threads (parallel limit)", "raw_read_parallel",
         f"{med['raw_read'] / med['raw_read_parallel']:.2f}x raw read", ""),
        ("raw cold read into new memory (first touch of the pages included)", "raw_read_new",
         pair["raw_read_new"], ""),
        ("raw cold read with O_DIRECT (no page cache; reused aligned buffer)", "raw_read_direct",
         pair["raw_read_direct"], ""),
        (f"hf_resumable resume in a fresh process (model + new AdamW state, hash-checked; read streams: {streams})",
         "load_fresh", pair["load_fresh"], ">= 0.9x"),
        ("the same, 1 read stream (HF_RESUMABLE_READ_STREAMS=1)", "load_fresh_1", pair.get("load_fresh_1"), ""),
        (f"the same, {READ_WORKERS} read streams (HF_RESUMABLE_READ_STREAMS={READ_WORKERS})", "load_fresh_n",
         pair.get("load_fresh_n"), ""),
        ("the same, new memory not prefaulted (HF_RESUMABLE_PREFAULT=0)", "load_fresh_nopf",
         pair.get("load_fresh_nopf"), ""),
        ("hf_resumable load in place (model + existing AdamW state, hash-checked)", "load", pair["load"],
         ">= 0.9x"),
    ]
    for label, key, ratio, target in rows:
        if key in med:
            print(f"| {label} | {med[key]:.3f} | {gbps[key]:.2f} | {ratio} | {target} |")
    print(f"\nspeed-up over the stock pattern: {med['stock'] / med['save']:.2f}x (blocking), "
          f"{med['stock'] / med['async_stall']:.1f}x (async stall)")


if __name__ == "__main__":
    main()
