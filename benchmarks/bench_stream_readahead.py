"""Per-micro-batch cost of a prepared stream's read-ahead (``ResumableAccelerator.prepare_resumable_dataloader`` on a
``datasets`` stream): the loader takes its ``StatefulDataLoader`` state before reading the next batch, so that the
batch read ahead is not part of the saved position. The state holds the shuffle buffer's content, so its cost grows
with ``buffer_size``.

For each buffer size: the time to read one batch from the stream loader alone, the time of one ``state_dict()``
(what the read-ahead adds per micro-batch), and the time per batch through the prepared stream (median over
``--repeats``).

Usage:
    python benchmarks/bench_stream_readahead.py --buffers 100 1000 10000 --batches 200 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import datasets
from accelerate.state import AcceleratorState, GradientState

from hf_resumable import ResumableAccelerator
from hf_resumable.data import build_stream_dataloader


def _stream(buffer_size: int, rows: int) -> datasets.IterableDataset:
    data = datasets.Dataset.from_dict({"text": ["some text of a sample " * 20] * rows})
    return data.to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=buffer_size)


def _per_batch(iterator, batches: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def measure(buffer_size: int, batches: int) -> tuple[float, float, float]:
    """Seconds per batch read alone, per ``state_dict()``, per batch through the prepared stream."""
    rows = buffer_size + 10 * batches
    loader = build_stream_dataloader(_stream(buffer_size, rows), collate_fn=len, batch_size=8, seed=0)
    iterator = iter(loader)
    _per_batch(iterator, 5)
    read = _per_batch(iterator, batches)
    start = time.perf_counter()
    for _ in range(20):
        loader.state_dict()
    state = (time.perf_counter() - start) / 20
    with tempfile.TemporaryDirectory() as directory:
        accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=directory, handle_preemption=False)
        prepared = accelerator.prepare_resumable_dataloader(_stream(buffer_size, rows), collate_fn=len,
                                                            batch_size=8, seed=0)
        iterator = iter(prepared)
        _per_batch(iterator, 5)
        through = _per_batch(iterator, batches)
        iterator.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return read, state, through


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    print("| buffer_size | read a batch (ms) | state_dict() (ms) | prepared stream, per batch (ms) |")
    print("|---|---|---|---|")
    for buffer_size in options.buffers:
        runs = [measure(buffer_size, options.batches) for _ in range(options.repeats)]
        read, state, through = (statistics.median(values) * 1e3 for values in zip(*runs))
        print(f"| {buffer_size} | {read:.2f} | {state:.2f} | {through:.2f} |")


if __name__ == "__main__":
    main()
