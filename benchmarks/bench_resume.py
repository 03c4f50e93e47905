"""Resume cost and steady-state overhead of ResumableTrainer vs the stock transformers.Trainer.

(a) Time from process start to the first resumed optimizer step after 10, 100 and 1000 trained steps,
    on a streaming datasets.IterableDataset whose .map costs ~1 ms per example. The stock Trainer
    replays (fetches, maps, collates) every skipped batch; ResumableTrainer restores the stream's
    state_dict, so its resume time stays flat.
(b) Steady-state optimizer-step time of both trainers on the same map-style run: one process trains
    alternately with each trainer (rounds of 40 steps, so machine noise hits both alike); median
    step time over all steps after a 5-step warm-up of each round.
(d) CPU time per optimizer step in lockstep: the two trainers run in two threads of one process and take strict
    turns, one optimizer step each (ResumableTrainer, Trainer, ResumableTrainer, ...), so consecutive steps of the
    pair see the same machine state; a step's cost is the process CPU time (``time.process_time``, one torch
    thread) from the moment it gets its turn to its ``on_step_end``, the other trainer being blocked meanwhile.
    The same for a plain accelerate loop with ``accelerate.Accelerator`` against ``ResumableAccelerator`` (two
    generators stepped alternately). This runs in ``--lockstep-runs`` separate processes; in every other one the
    upstream side is built first and takes the first turn. The overhead is the median of the per-pair ratios
    (ours / upstream - 1) of all processes, with a 95 % interval from a two-stage bootstrap (processes resampled,
    then pairs within each): the same code measured against itself in two fresh processes differs by up to
    about 1.5 % for the whole process (where its tensors land in memory, which side was built first), which a
    bootstrap of the pairs of one process would report as a measured overhead. ``--lockstep-shared-model`` has
    the two Trainers train one model object (each its own optimizer), which takes the weights' and gradients'
    place in memory out of that spread.
(c) End to end, a large map-style run: process start -> first resumed optimizer step of a Llama-shaped model
    whose checkpoint (weights + AdamW state) is about 1 GiB, ResumableTrainer (open, verify, hash-checked
    load) against the stock Trainer (``model.safetensors`` + ``torch.load`` of its optimizer/scheduler/RNG
    pickles). The page cache is dropped before every resume (when permitted); the "load" column sums the
    time spent in the trainers' checkpoint methods (resolve, open, weights, optimizer and scheduler, RNG)
    and is compared with a raw cold read of the same checkpoint directory, measured just before. Libraries are
    imported once after the drop, so both processes start with them cached and the checkpoint cold.

Usage:
    python benchmarks/bench_resume.py [--repeats 3] [--steps 10 100 1000] [--out bench_out/resume]
    python benchmarks/bench_resume.py --only e2e --repeats 5 [--throttle-read-mibps 400]
    python benchmarks/bench_resume.py --only lockstep --lockstep-steps 150 --lockstep-runs 12 --lockstep-shared-model

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

from _bench_common import drop_caches, raw_read, throttle_reads

MAP_COST_S = 0.001  # per-example cost of the streaming .map
BATCH = 4


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _expensive_map(example: dict) -> dict:
    _busy_wait(MAP_COST_S)
    return example


def _build(kind: str, data: str, output_dir: str, *, max_steps: int, save_steps: int, callbacks: list, shared=None):
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
    if shared is not None:  # another trainer's model: the same parameter memory for both
        model = shared
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
    if options.mode == "lockstep":
        _lockstep(options)
        return
    probe = Probe()
    data = "big" if options.data == "big" else "stream"
    trainer = _build(options.kind, data, options.output_dir, max_steps=2000, save_steps=options.stop_at,
                     callbacks=[probe])
    if options.mode == "resume":
        _time_checkpoint_methods(type(trainer), Path(options.report).with_suffix(".load.json"))
    trainer.train(resume_from_checkpoint=True if options.mode == "resume" else None)


# The trainers' methods that find, verify and read a checkpoint (those a class does not have are skipped), and the
# functions ResumableTrainer calls for it from its module (finding and verifying, opening once).
_LOAD_METHODS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
_LOAD_FUNCTIONS = ("resolve_checkpoint", "open_for_resume")


def _time_checkpoint_methods(cls: type, report: Path) -> None:
    """Wrap the checkpoint methods of ``cls``: their total time (and each one's) is written to ``report`` after
    each call."""
    import sys

    from hf_resumable.integrations.trainer import ResumableTrainer

    total = {"load_s": 0.0}
    targets = [(cls, name) for name in _LOAD_METHODS if getattr(cls, name, None) is not None]
    if issubclass(cls, ResumableTrainer):  # a missing function fails here, not silently as a faster load
        module = sys.modules[ResumableTrainer.__module__]
        targets += [(module, name) for name in _LOAD_FUNCTIONS if getattr(module, name)]
    for owner, name in targets:
        function = getattr(owner, name)

        def timed(*args, _function=function, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                total["load_s"] += elapsed
                total[_name] = total.get(_name, 0.0) + elapsed
                report.write_text(json.dumps(total))

        setattr(owner, name, timed)


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
    marks = [time.process_time() for _ in _accelerate_steps(kind, output_dir, steps=steps)]
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


class _Turns:
    """Strict turn-taking between named threads: exactly one of them runs at a time."""

    def __init__(self, names: list[str]) -> None:
        import threading

        self.names, self.turn, self.finished = names, names[0], set()
        self.condition = threading.Condition()

    def wait(self, name: str) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == name)

    def hand_over(self, name: str, *, finished: bool = False) -> None:
        with self.condition:
            if finished:
                self.finished.add(name)
            others = [n for n in self.names if n != name and n not in self.finished]
            if others:
                self.turn = others[0]
            self.condition.notify_all()


def _lockstep_trainers(output_dir: str, steps: int, *, ours_first: bool = True, shared_model: bool = False
                       ) -> dict[str, list[float]]:
    """CPU time of every optimizer step of both trainers, run in two threads that take strict turns.

    ``ours_first``: ResumableTrainer is built first and takes the first turn of every pair (else transformers.Trainer).
    ``shared_model``: both trainers train the one model object (each with its own optimizer), so that where the
    weights and gradients land in memory is the same for both sides.
    """
    import threading

    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(1)
    names = ["resumable", "stock"] if ours_first else ["stock", "resumable"]
    turns = _Turns(names)
    costs: dict[str, list[float]] = {name: [] for name in names}

    class Turn(TrainerCallback):
        def __init__(self, name: str) -> None:
            self.name, self.start = name, 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            turns.wait(self.name)
            self.start = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            costs[self.name].append(time.process_time() - self.start)
            turns.hand_over(self.name)
            turns.wait(self.name)
            self.start = time.process_time()

    trainers: dict = {}
    for name in names:
        shared = next(iter(trainers.values())).model if shared_model and trainers else None
        trainers[name] = _build(name, "map", f"{output_dir}/{name}-lockstep", max_steps=steps, save_steps=0,
                                callbacks=[Turn(name)], shared=shared)
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            trainers[name].train()
        except BaseException as error:  # reported by the main thread
            errors.append(error)
        finally:
            turns.hand_over(name, finished=True)

    threads = [threading.Thread(target=run, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return costs


def _accelerate_steps(kind: str, output_dir: str, *, steps: int):
    """A plain accelerate loop as a generator: yields after every optimizer step."""
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
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        yield
    accelerator.free_memory()


def _lockstep_accelerators(output_dir: str, steps: int, *, ours_first: bool = True) -> dict[str, list[float]]:
    """CPU time of every optimizer step of both accelerate loops, stepped alternately (``ours_first`` as above)."""
    import torch

    torch.set_num_threads(1)
    kinds = ("resumable_accelerate", "accelerate") if ours_first else ("accelerate", "resumable_accelerate")
    loops = {kind: _accelerate_steps(kind, f"{output_dir}/{kind}-lockstep", steps=steps) for kind in kinds}
    costs: dict[str, list[float]] = {kind: [] for kind in loops}
    for _ in range(steps):
        for kind, loop in loops.items():
            start = time.process_time()
            next(loop)
            costs[kind].append(time.process_time() - start)
    return costs


def _lockstep(options: argparse.Namespace) -> None:
    # In lockstep mode --kind says whose model is built first and who takes the first turn of each pair.
    ours_first = options.kind != "stock"
    costs = _lockstep_trainers(options.output_dir, options.stop_at, ours_first=ours_first,
                               shared_model=options.lockstep_shared_model)
    costs.update(_lockstep_accelerators(options.output_dir, options.stop_at, ours_first=ours_first))
    Path(options.report).write_text(json.dumps(costs))


def _pair_ratios(ours: list[float], theirs: list[float], warmup: int = 10) -> list[float]:
    """Per-pair overheads (%) of one run, warm-up steps dropped."""
    return [(a / b - 1) * 100 for a, b in zip(ours[warmup:], theirs[warmup:]) if b > 0]


def _paired_overhead(runs: list[tuple[list[float], list[float]]], *, warmup: int = 10, resamples: int = 2000,
                     seed: int = 0) -> dict[str, object]:
    """Median per-step cost of each, the median of the paired overheads (%) pooled over runs, and its 95 % interval.

    The interval is a two-stage bootstrap: runs are resampled, then pairs within each drawn run, so a difference
    that holds for a whole process (where its tensors landed in memory, which model was built first) widens the
    interval instead of passing for a measured overhead.
    """
    import random

    per_run = [_pair_ratios(ours, theirs, warmup) for ours, theirs in runs]
    rng = random.Random(seed)
    medians = []
    for _ in range(resamples):
        pooled: list[float] = []
        for ratios in rng.choices(per_run, k=len(per_run)):
            pooled += rng.choices(ratios, k=len(ratios))
        medians.append(statistics.median(pooled))
    medians.sort()
    return {"ours": statistics.median(a for ours, _ in runs for a in ours[warmup:]),
            "theirs": statistics.median(b for _, theirs in runs for b in theirs[warmup:]),
            "median": statistics.median([r for ratios in per_run for r in ratios]),
            "low": medians[int(0.025 * resamples)], "high": medians[int(0.975 * resamples) - 1],
            "pairs": sum(len(r) for r in per_run), "run_medians": [statistics.median(r) for r in per_run]}


def measure_lockstep(out: Path, steps: int, runs: int) -> list[dict[str, list[float]]]:
    """``runs`` lockstep processes; ours is built first and moves first in even runs, upstream in odd ones."""
    results = []
    for run in range(runs):
        report = out / f"lockstep-{run}.json"
        _spawn("resumable" if run % 2 == 0 else "stock", "lockstep", out / f"lockstep-{run}", steps, report)
        results.append(json.loads(report.read_text()))
        print(f"  lockstep run {run + 1}/{runs} done", file=sys.stderr)
    return results


def _print_lockstep(runs: list[dict[str, list[float]]]) -> None:
    steps = len(runs[0]["stock"])
    print(f"\n### (d) CPU time per optimizer step, lockstep pairs ({len(runs)} processes x {steps} steps each, "
          "first 10 dropped, 1 torch thread; who goes first alternates between processes"
          f"{'; the two Trainers share one model' if SHARED_MODEL else ''})\n")
    print("| pair | ours | upstream | overhead (median of pairs) | 95 % interval (runs and pairs resampled) | pairs "
          "| per-process medians |\n|---|---|---|---|---|---|---|")
    for label, ours, theirs in (("ResumableTrainer vs transformers.Trainer", "resumable", "stock"),
                                ("ResumableAccelerator vs accelerate.Accelerator", "resumable_accelerate",
                                 "accelerate")):
        r = _paired_overhead([(run[ours], run[theirs]) for run in runs])
        per_process = ", ".join(f"{m:+.2f}" for m in r["run_medians"])
        print(f"| {label} | {r['ours'] * 1e3:.2f} ms | {r['theirs'] * 1e3:.2f} ms | {r['median']:+.2f} % | "
              f"{r['low']:+.2f} % .. {r['high']:+.2f} % | {r['pairs']} | {per_process} |")
    print("\nTarget: <= 1 %.")


SHARED_MODEL = False  # --lockstep-shared-model, passed on to the children


def _spawn(kind: str, mode: str, output_dir: Path, stop_at: int, report: Path, data: str = "stream") -> float:
    command = [sys.executable, __file__, "--child", "--kind", kind, "--mode", mode, "--output-dir", str(output_dir),
               "--stop-at", str(stop_at), "--report", str(report), "--data", data] + (
                   ["--lockstep-shared-model"] if SHARED_MODEL else [])
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


def _warm_imports() -> None:
    subprocess.run([sys.executable, "-c", "import datasets, torch, transformers, hf_resumable.integrations.trainer"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure_e2e(out: Path, repeats: int) -> dict[str, dict[str, float]]:
    """(c): each trainer trains 1 step of the large model and saves it, then resumes ``repeats`` times."""
    results: dict[str, dict[str, list[float]]] = {}
    runs = {}
    print(f"  e2e: load average (1 min) {os.getloadavg()[0]:.2f} at the start ({os.cpu_count()} cores)",
          file=sys.stderr)
    for kind in ("resumable", "stock"):
        runs[kind] = out / f"e2e-{kind}"
        _spawn(kind, "train", runs[kind], 1, out / "ignore.json", data="big")
    buffer = bytearray(16 << 20)  # the raw reads' destination, reused
    for _ in range(repeats):
        for kind in ("resumable", "stock"):  # alternating, so machine noise hits both alike
            checkpoint = runs[kind] / "checkpoint-1"
            drop_caches()
            raw_before = raw_read(checkpoint, buffer)
            drop_caches()
            direct_before = raw_read(checkpoint, direct=True)
            drop_caches()
            _warm_imports()  # libraries back in the page cache, the checkpoint not
            report = out / f"e2e-{kind}-resume.json"
            start = _spawn(kind, "resume", runs[kind], 1, report, data="big")
            drop_caches()
            raw_after = raw_read(checkpoint, buffer)
            drop_caches()
            direct_after = raw_read(checkpoint, direct=True)
            first = json.loads(report.read_text())
            if first["step"] != 2:
                raise RuntimeError(f"{kind}: resumed at step {first['step']}, expected 2")
            methods = json.loads(report.with_suffix(".load.json").read_text())
            load = methods.pop("load_s")
            record = results.setdefault(kind, {"total": [], "load": [], "raw": [], "load_ratio": [], "raw_direct": [],
                                               "load_ratio_direct": []})
            record["total"].append(first["first_step_unix"] - start)
            record["load"].append(load)
            # The faster of the raw reads of the same files just before and just after this process, the paired
            # baseline: this disk's speed drifts by up to 2x within a minute.
            record["raw"].append(min(raw_before, raw_after))
            record["load_ratio"].append(load / record["raw"][-1])
            # And against what the disk itself delivers to one stream with no page cache (O_DIRECT), which a
            # buffered read's page-cache work does not slow down.
            record["raw_direct"].append(min(direct_before, direct_after))
            record["load_ratio_direct"].append(load / record["raw_direct"][-1])
            parts = ", ".join(f"{name.strip('_')} {t:.3f}" for name, t in methods.items() if t >= 5e-4)
            print(f"  e2e {kind:9s}: first step after {record['total'][-1]:.2f} s, load {load:.3f} s ({parts}), raw "
                  f"read {raw_before:.3f} s before, {raw_after:.3f} s after (O_DIRECT {direct_before:.3f}, "
                  f"{direct_after:.3f})", file=sys.stderr)
        pair = results.setdefault("_pairs", {"total_ratio": []})
        pair["total_ratio"].append(results["resumable"]["total"][-1] / results["stock"]["total"][-1])
    size = sum(p.stat().st_size for p in (runs["resumable"] / "checkpoint-1").rglob("*") if p.is_file())
    print(f"  e2e: load average (1 min) {os.getloadavg()[0]:.2f} at the end", file=sys.stderr)
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
    parser.add_argument("--mode", choices=["train", "resume", "steady", "lockstep"])
    parser.add_argument("--output-dir")
    parser.add_argument("--stop-at", type=int, default=10)
    parser.add_argument("--report")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--data", choices=["stream", "big"], default="stream", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["resume", "steady", "e2e", "lockstep"], default=None)
    parser.add_argument("--lockstep-steps", type=int, default=400, help="steps per trainer in each lockstep run (d)")
    parser.add_argument("--lockstep-shared-model", action="store_true",
                        help="(d): both trainers train one model object (the same weight memory for both sides)")
    parser.add_argument("--lockstep-runs", type=int, default=4,
                        help="lockstep processes (d); who goes first alternates, so an even number")
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--throttle-read-mibps", type=int, default=None,
                        help="cap reads from the disk at this many MiB/s, for this process and its children (a disk "
                             "of steady speed; cgroup v1, root)")
    options = parser.parse_args()
    global SHARED_MODEL
    SHARED_MODEL = options.lockstep_shared_model
    if options.child:
        _child(options)
        return
    out = Path(options.out or tempfile.mkdtemp(prefix="bench_resume_"))
    out.mkdir(parents=True, exist_ok=True)
    if options.throttle_read_mibps:
        rule = throttle_reads(str(out), options.throttle_read_mibps)
        print(f"reads throttled to {options.throttle_read_mibps} MiB/s (blkio rule {rule}; writes not throttled)")
    if options.only in (None, "resume"):
        _print_resume(measure_resume(out, options.steps, options.repeats), options)
    if options.only in (None, "steady"):
        _print_steady(measure_steady(out, 4 * max(options.repeats, 3)))
    if options.only in (None, "lockstep"):
        _print_lockstep(measure_lockstep(out, options.lockstep_steps, options.lockstep_runs))
    if options.only in (None, "e2e"):
        _print_e2e(measure_e2e(out, options.repeats), options.repeats)


def _print_e2e(e2e: dict[str, dict[str, float]], repeats: int) -> None:
    sizes = e2e["_bytes"]
    print(f"\n### (c) Process start -> first resumed optimizer step, Llama-shaped model + AdamW (checkpoint "
          f"{sizes['resumable'] / 2**30:.2f} GiB ours, {sizes['stock'] / 2**30:.2f} GiB stock; median of {repeats}, "
          "page cache dropped)\n")
    print("| trainer | start -> first resumed step | checkpoint load | raw cold read (faster of before and after) "
          "| load / raw read (median of pairs) | raw O_DIRECT read | load / raw O_DIRECT read |")
    print("|---|---|---|---|---|---|---|")
    for kind, label in (("resumable", "ResumableTrainer"), ("stock", "transformers.Trainer")):
        r = e2e[kind]
        print(f"| {label} | {r['total']:.2f} s | {r['load']:.3f} s | {r['raw']:.3f} s | {r['load_ratio']:.2f}x "
              f"| {r['raw_direct']:.3f} s | {r['load_ratio_direct']:.2f}x |")
    print(f"\nResumableTrainer / stock, end to end: {e2e['_pairs']['total_ratio']:.2f}x (median of the ratios of "
          "each round, the two trainers back to back; target <= 1.00x); load / raw cold read target <= 1.2x.")


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
    print(f"\n### (b) CPU time per optimizer step, alternating rounds (process_time, 1 torch thread, {rounds} "
          "rounds of 35 measured steps; see (d) for the lockstep measurement)\n")
    print("| pair | ours | upstream | overhead (median of rounds) | interquartile range |\n|---|---|---|---|---|")
    for label, ours, theirs in (("ResumableTrainer vs transformers.Trainer", "resumable", "stock"),
                                ("ResumableAccelerator vs accelerate.Accelerator", "resumable_accelerate",
                                 "accelerate")):
        a, b, median, spread = _overhead(cpu[ours], cpu[theirs])
        print(f"| {label} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {median:+.2f} % | {spread:.2f} points |")
    print("\nTarget: <= 1 %.")


if __name__ == "__main__":
    main()
