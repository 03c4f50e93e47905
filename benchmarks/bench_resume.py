"""Resume cost and steady-state overhead of ResumableTrainer vs the stock transformers.Trainer.

(a) Time from process start to the first resumed optimizer step after 10, 100 and 1000 trained steps,
    on a streaming datasets.IterableDataset whose .map costs ~1 ms per example. The stock Trainer
    replays (fetches, maps, collates) every skipped batch; ResumableTrainer restores the stream's
    state_dict, so its resume time stays flat.
(b) Steady-state optimizer-step time of both trainers on the same map-style run: one process trains
    alternately with each trainer (rounds of 40 steps, so machine noise hits both alike); median
    step time over all steps after a 5-step warm-up of each round.

Usage:
    python benchmarks/bench_resume.py [--repeats 3] [--steps 10 100 1000] [--out bench_out/resume]

Prints a markdown table. Each measured run is its own process, started by this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAP_COST_S = 0.001  # per-example cost of the streaming .map
BATCH = 4


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _expensive_map(example: dict) -> dict:
    _busy_wait(MAP_COST_S)
    return example


def _build(kind: str, data: str, output_dir: str, *, max_steps: int, save_steps: int, callbacks: list):
    import datasets
    import numpy as np
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, default_data_collator

    from hf_resumable.integrations.trainer import ResumableTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if data == "stream":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
        ids = rng.integers(0, 128, size=(50_000, 16)).tolist()
        train = datasets.Dataset.from_dict({"input_ids": ids}).to_iterable_dataset(num_shards=8).map(_expensive_map)
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64))
        ids = rng.integers(0, 512, size=(4096, 64)).tolist()
        train = datasets.Dataset.from_dict({"input_ids": ids})
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.tensor([r["input_ids"] for r in rows])}
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=BATCH if data == "stream" else 8,
                             max_steps=max_steps, save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, logging_steps=10_000, report_to=[], disable_tqdm=True,
                             use_cpu=True, learning_rate=1e-3)
    cls = ResumableTrainer if kind == "resumable" else transformers.Trainer
    del default_data_collator
    return cls(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=callbacks)


def _child(options: argparse.Namespace) -> None:
    """One measured process: 'train' to step N (then stop), 'resume' to the first resumed step, or 'steady'."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())
            if options.mode == "train" and state.global_step >= options.stop_at:
                control.should_training_stop = True
            if options.mode == "resume":
                record = {"first_step_unix": time.time(), "step": state.global_step}
                Path(options.report).write_text(json.dumps(record))
                os._exit(0)

    if options.mode == "steady":
        _steady(options, Probe)
        return
    probe = Probe()
    trainer = _build(options.kind, "stream", options.output_dir, max_steps=2000, save_steps=options.stop_at,
                     callbacks=[probe])
    trainer.train(resume_from_checkpoint=True if options.mode == "resume" else None)


def _steady(options: argparse.Namespace, probe_class: type) -> None:
    gaps: dict[str, list[float]] = {"resumable": [], "stock": []}
    for round_index in range(options.stop_at):
        for kind in ("resumable", "stock") if round_index % 2 == 0 else ("stock", "resumable"):
            probe = probe_class()
            _build(kind, "map", f"{options.output_dir}/{kind}-{round_index}", max_steps=40, save_steps=0,
                   callbacks=[probe]).train()
            gaps[kind] += [b - a for a, b in zip(probe.times, probe.times[1:])][5:]
    result = {kind: statistics.median(v) for kind, v in gaps.items()}
    result.update({f"{kind}_loader": _loader_batch_time(kind, options.output_dir) for kind in gaps})
    Path(options.report).write_text(json.dumps(result))


def _loader_batch_time(kind: str, output_dir: str, batches: int = 200) -> float:
    """Median time to produce one training batch (the only per-step code path that differs), main process."""
    trainer = _build(kind, "map", f"{output_dir}/{kind}-loader", max_steps=batches, save_steps=0, callbacks=[])
    iterator = iter(trainer.get_train_dataloader())
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        next(iterator)
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:])


def _spawn(kind: str, mode: str, output_dir: Path, stop_at: int, report: Path) -> float:
    command = [sys.executable, __file__, "--child", "--kind", kind, "--mode", mode, "--output-dir", str(output_dir),
               "--stop-at", str(stop_at), "--report", str(report)]
    start = time.time()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return start


def measure_resume(out: Path, steps: list[int], repeats: int) -> dict[tuple[str, int], float]:
    results = {}
    for n in steps:
        for kind in ("resumable", "stock"):
            run_dir = out / f"{kind}-{n}"
            _spawn(kind, "train", run_dir, n, out / "ignore.json")
            samples = []
            for _ in range(repeats):
                report = out / f"{kind}-{n}-resume.json"
                start = _spawn(kind, "resume", run_dir, n, report)
                first = json.loads(report.read_text())
                if first["step"] != n + 1:
                    raise RuntimeError(f"{kind}: resumed at step {first['step']}, expected {n + 1}")
                samples.append(first["first_step_unix"] - start)
            results[(kind, n)] = statistics.median(samples)
            print(f"  resume {kind:9s} after {n:5d} steps: {results[(kind, n)]:.2f} s  {samples}", file=sys.stderr)
    return results


def measure_steady(out: Path, rounds: int) -> dict[str, float]:
    report = out / "steady.json"
    _spawn("resumable", "steady", out / "steady", rounds, report)
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["resumable", "stock"])
    parser.add_argument("--mode", choices=["train", "resume", "steady"])
    parser.add_argument("--output-dir")
    parser.add_argument("--stop-at", type=int, default=10)
    parser.add_argument("--report")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--only", choices=["resume", "steady"], default=None)
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    options = parser.parse_args()
    if options.child:
        _child(options)
        return
    out = Path(options.out or tempfile.mkdtemp(prefix="bench_resume_"))
    out.mkdir(parents=True, exist_ok=True)
    if options.only != "steady":
        _print_resume(measure_resume(out, options.steps, options.repeats), options)
    if options.only != "resume":
        _print_steady(measure_steady(out, 4 * max(options.repeats, 3)))


def _print_resume(resume: dict[tuple[str, int], float], options: argparse.Namespace) -> None:
    first, last = options.steps[0], options.steps[-1]
    print(f"\n### (a) Process start -> first resumed optimizer step (streaming, .map {MAP_COST_S * 1e3:.0f} "
          f"ms/example, batch {BATCH}, median of {options.repeats})\n")
    print("| trained steps | " + " | ".join(str(n) for n in options.steps) + f" | ratio {last}/{first} |")
    print("|---|" + "---|" * (len(options.steps) + 1))
    for kind, label in (("resumable", "ResumableTrainer"), ("stock", "transformers.Trainer")):
        cells = " | ".join(f"{resume[(kind, n)]:.2f} s" for n in options.steps)
        print(f"| {label} | {cells} | {resume[(kind, last)] / resume[(kind, first)]:.2f}x |")


def _print_steady(steady: dict[str, float]) -> None:
    overhead = steady["resumable"] / steady["stock"] - 1
    print("\n### (b) Steady-state optimizer step (map-style, GPT-2 4x128, batch 8, interleaved rounds, median)\n")
    print("| trainer | step time | overhead vs stock |\n|---|---|---|")
    print(f"| transformers.Trainer | {steady['stock'] * 1e3:.2f} ms | - |")
    print(f"| ResumableTrainer | {steady['resumable'] * 1e3:.2f} ms | {overhead * 100:+.2f} % |")
    extra = steady["resumable_loader"] - steady["stock_loader"]
    print(f"\nData path alone (median time to produce one batch): stock {steady['stock_loader'] * 1e3:.3f} ms, "
          f"ResumableTrainer {steady['resumable_loader'] * 1e3:.3f} ms: {extra * 1e3:+.3f} ms per micro-batch = "
          f"{extra / steady['stock'] * 100:+.2f} % of the stock step time.")


if __name__ == "__main__":
    main()
