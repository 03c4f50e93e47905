"""Resume cost and steady-state overhead of ResumableTrainer vs the stock transformers.Trainer.

(a) Time from process start to the first resumed optimizer step after 10, 100 and 1000 trained steps,
    on a streaming datasets.IterableDataset whose .map costs ~1 ms per example. The stock Trainer
    replays (fetches, maps, collates) every skipped batch; ResumableTrainer restores the stream's
    state_dict, so its resume time stays flat.
(b) Steady-state optimizer-step time of both trainers on the same map-style run: one process trains
    alternately with each trainer (rounds of 40 steps, so machine noise hits both alike); median
    step time over all steps after a 5-step warm-up of each round.
(d) In the same process and rounds, the CPU time per step (``time.process_time``, one torch thread), which
    other processes on the machine do not inflate as they do wall-clock time; plus the same for a plain
    accelerate loop with ``accelerate.Accelerator`` against ``ResumableAccelerator``. The overhead is the
    median over rounds of (ours / upstream - 1), with its interquartile range.
(c) End to end, a large map-style run: process start -> first resumed optimizer step of a Llama-shaped model
    whose checkpoint (weights + AdamW state) is about 1 GiB, ResumableTrainer (open, verify, hash-checked
    load) against the stock Trainer (``model.safetensors`` + ``torch.load`` of its optimizer/scheduler/RNG
    pickles). The page cache is dropped before every resume (when permitted); the "load" column sums the
    time spent in the trainers' checkpoint methods (resolve, open, weights, optimizer and scheduler, RNG)
    and is compared with a raw cold read of the same checkpoint directory, measured just before. Libraries are
    imported once after the drop, so both processes start with them cached and the checkpoint cold.

Usage:
    python benchmarks/bench_resume.py [--repeats 3] [--steps 10 100 1000] [--out bench_out/resume]
    python benchmarks/bench_resume.py --only e2e --repeats 5

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

from _bench_common import drop_caches

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
    elif data == "big":  # the model of bench_checkpoint.py: 0.31 GiB of weights, 0.63 GiB of AdamW state
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                             num_attention_heads=16, num_key_value_heads=16, vocab_size=16000,
                                             tie_word_embeddings=False))
        ids = rng.integers(0, 16000, size=(64, 16)).tolist()
        train = datasets.Dataset.from_dict({"input_ids": ids})
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64))
        ids = rng.integers(0, 512, size=(4096, 64)).tolist()
        train = datasets.Dataset.from_dict({"input_ids": ids})
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.tensor([r["input_ids"] for r in rows])}
    batch = {"stream": BATCH, "big": 1}.get(data, 8)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch,
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
            self.cpu: list[float] = []

        def on_save(self, args, state, control, **kwargs):
            # Killed right after the checkpoint at stop_at committed (not stopped by a callback, which a
            # ResumableTrainer would rightly treat as a finished run): the resume must continue it.
            if options.mode == "train" and state.global_step >= options.stop_at:
                os._exit(0)

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())
            if options.mode == "resume":
                record = {"first_step_unix": time.time(), "step": state.global_step}
                Path(options.report).write_text(json.dumps(record))
                os._exit(0)

    if options.mode == "steady":
        _steady(options, Probe)
        return
    probe = Probe()
    data = "big" if options.data == "big" else "stream"
    trainer = _build(options.kind, data, options.output_dir, max_steps=2000, save_steps=options.stop_at,
                     callbacks=[probe])
    if options.mode == "resume":
        _time_checkpoint_methods(type(trainer), Path(options.report).with_suffix(".load.json"))
    trainer.train(resume_from_checkpoint=True if options.mode == "resume" else None)


# The trainers' methods that find, verify and read a checkpoint (those a class does not have are skipped).
_LOAD_METHODS = ("_resolve_checkpoint", "_open_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
                 "_load_scaler", "_load_rng_state")


def _time_checkpoint_methods(cls: type, report: Path) -> None:
    """Wrap the checkpoint methods of ``cls``: their total time is written to ``report`` after each call."""
    total = {"load_s": 0.0}
    for name in _LOAD_METHODS:
        method = getattr(cls, name, None)
        if method is None:
            continue

        def timed(self, *args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(self, *args, **kwargs)
            finally:
                total["load_s"] += time.perf_counter() - start
                report.write_text(json.dumps(total))

        setattr(cls, name, timed)


def _steady(options: argparse.Namespace, probe_class: type) -> None:
    """Both trainers (and both accelerators) alternating in this one process, rounds of 40 steps.

    Per step: wall time and CPU time of the whole process (``time.process_time``, every thread), the first 5
    steps of each round dropped. One torch thread, so CPU time is the work done, not OpenMP spinning.
    """
    import torch

    torch.set_num_threads(1)
    wall: dict[str, list[float]] = {"resumable": [], "stock": []}
    cpu: dict[str, list[list[float]]] = {"resumable": [], "stock": [], "resumable_accelerate": [], "accelerate": []}
    for round_index in range(options.stop_at):
        for kind in ("resumable", "stock") if round_index % 2 == 0 else ("stock", "resumable"):
            probe = probe_class()
            _build(kind, "map", f"{options.output_dir}/{kind}-{round_index}", max_steps=40, save_steps=0,
                   callbacks=[probe]).train()
            wall[kind] += [b - a for a, b in zip(probe.times, probe.times[1:])][5:]
            cpu[kind].append([b - a for a, b in zip(probe.cpu, probe.cpu[1:])][5:])
        for kind in ("resumable_accelerate", "accelerate") if round_index % 2 == 0 else ("accelerate",
                                                                                       "resumable_accelerate"):
            cpu[kind].append(_accelerate_round(kind, f"{options.output_dir}/{kind}-{round_index}", steps=40)[5:])
    result: dict[str, object] = {kind: statistics.median(v) for kind, v in wall.items()}
    result["cpu"] = cpu
    result.update({f"{kind}_loader": _loader_batch_time(kind, options.output_dir) for kind in wall})
    Path(options.report).write_text(json.dumps(result))


def _accelerate_round(kind: str, output_dir: str, *, steps: int) -> list[float]:
    """CPU time per optimizer step of a plain accelerate loop, with ``Accelerator`` or ``ResumableAccelerator``."""
    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_resumable.integrations.accelerate import ResumableAccelerator

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (steps * 8, 64), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    accelerator = (ResumableAccelerator(cpu=True, checkpoint_dir=output_dir, handle_preemption=False)
                   if kind == "resumable_accelerate" else Accelerator(cpu=True))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    marks = []
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        marks.append(time.process_time())
    accelerator.free_memory()
    return [b - a for a, b in zip(marks, marks[1:])]


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


def _spawn(kind: str, mode: str, output_dir: Path, stop_at: int, report: Path, data: str = "stream") -> float:
    command = [sys.executable, __file__, "--child", "--kind", kind, "--mode", mode, "--output-dir", str(output_dir),
               "--stop-at", str(stop_at), "--report", str(report), "--data", data]
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


def _raw_read(directory: Path) -> float:
    buffer = memoryview(bytearray(16 << 20))
    start = time.perf_counter()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
    return time.perf_counter() - start


def _warm_imports() -> None:
    subprocess.run([sys.executable, "-c", "import datasets, torch, transformers, hf_resumable.integrations.trainer"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure_e2e(out: Path, repeats: int) -> dict[str, dict[str, float]]:
    """(c): each trainer trains 1 step of the large model and saves it, then resumes ``repeats`` times."""
    results: dict[str, dict[str, list[float]]] = {}
    runs = {}
    for kind in ("resumable", "stock"):
        runs[kind] = out / f"e2e-{kind}"
        _spawn(kind, "train", runs[kind], 1, out / "ignore.json", data="big")
    for _ in range(repeats):
        for kind in ("resumable", "stock"):  # alternating, so machine noise hits both alike
            checkpoint = runs[kind] / "checkpoint-1"
            drop_caches()
            raw = _raw_read(checkpoint)
            drop_caches()
            _warm_imports()  # libraries back in the page cache, the checkpoint not
            report = out / f"e2e-{kind}-resume.json"
            start = _spawn(kind, "resume", runs[kind], 1, report, data="big")
            first = json.loads(report.read_text())
            if first["step"] != 2:
                raise RuntimeError(f"{kind}: resumed at step {first['step']}, expected 2")
            load = json.loads(report.with_suffix(".load.json").read_text())["load_s"]
            record = results.setdefault(kind, {"total": [], "load": [], "raw": []})
            record["total"].append(first["first_step_unix"] - start)
            record["load"].append(load)
            record["raw"].append(raw)
            print(f"  e2e {kind:9s}: first step after {record['total'][-1]:.2f} s, load {load:.3f} s, raw read "
                  f"{raw:.3f} s", file=sys.stderr)
    size = sum(p.stat().st_size for p in (runs["resumable"] / "checkpoint-1").rglob("*") if p.is_file())
    medians = {kind: {k: statistics.median(v) for k, v in r.items()} for kind, r in results.items()}
    medians["_bytes"] = {"resumable": size,
                         "stock": sum(p.stat().st_size for p in (runs["stock"] / "checkpoint-1").rglob("*")
                                      if p.is_file())}
    return medians


def measure_steady(out: Path, rounds: int) -> dict[str, object]:
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
    parser.add_argument("--data", choices=["stream", "big"], default="stream", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["resume", "steady", "e2e"], default=None)
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    options = parser.parse_args()
    if options.child:
        _child(options)
        return
    out = Path(options.out or tempfile.mkdtemp(prefix="bench_resume_"))
    out.mkdir(parents=True, exist_ok=True)
    if options.only in (None, "resume"):
        _print_resume(measure_resume(out, options.steps, options.repeats), options)
    if options.only in (None, "steady"):
        _print_steady(measure_steady(out, 4 * max(options.repeats, 3)))
    if options.only in (None, "e2e"):
        _print_e2e(measure_e2e(out, options.repeats), options.repeats)


def _print_e2e(e2e: dict[str, dict[str, float]], repeats: int) -> None:
    sizes = e2e["_bytes"]
    print(f"\n### (c) Process start -> first resumed optimizer step, Llama-shaped model + AdamW (checkpoint "
          f"{sizes['resumable'] / 2**30:.2f} GiB ours, {sizes['stock'] / 2**30:.2f} GiB stock; median of {repeats}, "
          "page cache dropped)\n")
    print("| trainer | start -> first resumed step | checkpoint load | raw cold read | load / raw read |")
    print("|---|---|---|---|---|")
    for kind, label in (("resumable", "ResumableTrainer"), ("stock", "transformers.Trainer")):
        r = e2e[kind]
        print(f"| {label} | {r['total']:.2f} s | {r['load']:.3f} s | {r['raw']:.3f} s | {r['load'] / r['raw']:.2f}x |")
    print(f"\nResumableTrainer / stock, end to end: {e2e['resumable']['total'] / e2e['stock']['total']:.2f}x "
          "(target <= 1.00x); load / raw cold read target <= 1.2x.")


def _print_resume(resume: dict[tuple[str, int], float], options: argparse.Namespace) -> None:
    first, last = options.steps[0], options.steps[-1]
    print(f"\n### (a) Process start -> first resumed optimizer step (streaming, .map {MAP_COST_S * 1e3:.0f} "
          f"ms/example, batch {BATCH}, median of {options.repeats})\n")
    print("| trained steps | " + " | ".join(str(n) for n in options.steps) + f" | ratio {last}/{first} |")
    print("|---|" + "---|" * (len(options.steps) + 1))
    for kind, label in (("resumable", "ResumableTrainer"), ("stock", "transformers.Trainer")):
        cells = " | ".join(f"{resume[(kind, n)]:.2f} s" for n in options.steps)
        print(f"| {label} | {cells} | {resume[(kind, last)] / resume[(kind, first)]:.2f}x |")


def _overhead(ours: list[list[float]], theirs: list[list[float]]) -> tuple[float, float, float, float]:
    """Median per-step CPU time of each, and the median and quartiles of the per-round overheads (%)."""
    rounds = sorted((statistics.median(a) / statistics.median(b) - 1) * 100 for a, b in zip(ours, theirs))
    quartiles = statistics.quantiles(rounds, n=4) if len(rounds) > 1 else [rounds[0]] * 3
    return (statistics.median([x for r in ours for x in r]), statistics.median([x for r in theirs for x in r]),
            quartiles[1], quartiles[2] - quartiles[0])


def _print_steady(steady: dict[str, object]) -> None:
    overhead = steady["resumable"] / steady["stock"] - 1
    print("\n### (b) Steady-state optimizer step (map-style, GPT-2 4x128, batch 8, interleaved rounds, median)\n")
    print("| trainer | step time | overhead vs stock |\n|---|---|---|")
    print(f"| transformers.Trainer | {steady['stock'] * 1e3:.2f} ms | - |")
    print(f"| ResumableTrainer | {steady['resumable'] * 1e3:.2f} ms | {overhead * 100:+.2f} % |")
    extra = steady["resumable_loader"] - steady["stock_loader"]
    print(f"\nData path alone (median time to produce one batch): stock {steady['stock_loader'] * 1e3:.3f} ms, "
          f"ResumableTrainer {steady['resumable_loader'] * 1e3:.3f} ms: {extra * 1e3:+.3f} ms per micro-batch = "
          f"{extra / steady['stock'] * 100:+.2f} % of the stock step time.")
    cpu = steady["cpu"]
    rounds = len(cpu["stock"])
    print(f"\n### (d) CPU time per optimizer step (process_time of the whole process, 1 torch thread, {rounds} "
          "alternating rounds of 35 measured steps)\n")
    print("| pair | ours | upstream | overhead (median of rounds) | interquartile range |\n|---|---|---|---|---|")
    for label, ours, theirs in (("ResumableTrainer vs transformers.Trainer", "resumable", "stock"),
                                ("ResumableAccelerator vs accelerate.Accelerator", "resumable_accelerate",
                                 "accelerate")):
        a, b, median, spread = _overhead(cpu[ours], cpu[theirs])
        print(f"| {label} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {median:+.2f} % | {spread:.2f} points |")
    print("\nTarget: <= 1 %.")


if __name__ == "__main__":
    main()
