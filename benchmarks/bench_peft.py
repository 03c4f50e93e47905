"""LoRA checkpoints that cost what changed: bytes and save time against the stock Trainer, and the resume check of
the frozen base against loading that base, measured in one run.

A Llama-shaped base of about 0.67 GB (fp32) is written once with ``save_pretrained`` and loaded with
``from_pretrained``; LoRA (r=16 on q/k/v/o, dropout 0.05) goes on top. Each trainer trains ``--saves`` + 1
optimizer steps and saves after every one (the time inside its ``_save_checkpoint`` is measured; caches are dropped
before each save when the process may write ``/proc/sys/vm/drop_caches``):

- ``transformers.Trainer`` (stock: adapter files, ``optimizer.pt``, ``scheduler.pt``, RNG and trainer state),
- ``ResumableTrainer`` (the default: the trainable part, the frozen base recorded; its first save of a process also
  fingerprints the base once, reported on its own row),
- ``ResumableTrainer(standalone_checkpoints=True)`` (the whole model in every checkpoint: what every save cost
  before frozen parameters were recorded instead of stored).

Then, ``--repeats`` times, interleaved:

- *load the base*: ``from_pretrained`` plus one read of every page of every tensor. ``from_pretrained`` alone maps
  the safetensors file and returns before reading the weights (that time is shown too, but it is not a load: the
  first forward pass pays for the reads); touching every page is the cheapest way to have the base in memory, so
  the baseline is the smallest honest one.
- *the resume check* (``check_frozen_base``, nothing cached: names, dtypes, shapes and the sampled fingerprint by
  default, every byte with ``verify="full"``): its own time on a base already in memory, and what it adds to a
  cold resume (``from_pretrained``, the check, then every page read, against the same without the check: the
  sampled pages come from disk, but training reads them anyway).

Prints markdown tables of medians.

Usage:
    python benchmarks/bench_peft.py --repeats 5 [--saves 5] [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers
from _bench_common import drop_caches
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from hf_resumable.checkpoint import wait_for_pending_saves
from hf_resumable.checkpoint.pieces import _frozen
from hf_resumable.constants import FROZEN_RECORD_FILE
from hf_resumable.integrations.trainer import ResumableTrainer


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_base(directory: Path) -> int:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def lora_model(base: Path) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


class _DropCaches(TrainerCallback):
    """Drops the page cache right before each save (on_step_end runs before the step's save)."""

    def on_step_end(self, args, state, control, **kwargs):
        drop_caches()


def train_and_time_saves(kind: str, base: Path, output_dir: Path, *, saves: int) -> dict[str, object]:
    """Train ``saves + 1`` steps saving after each: seconds inside each ``_save_checkpoint``, the last one's bytes."""
    model = lora_model(base)
    rows = torch.randint(3, 32000, (64, 32), generator=torch.Generator().manual_seed(1)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=1, max_steps=saves + 1,
                             save_strategy="steps", save_steps=1, save_total_limit=2, learning_rate=1e-4,
                             logging_steps=100, report_to=[], disable_tqdm=True, use_cpu=True, seed=0)
    common = dict(model=model, args=args, train_dataset=data, callbacks=[_DropCaches()])
    if kind == "stock":
        trainer = transformers.Trainer(**common)
    else:
        trainer = ResumableTrainer(standalone_checkpoints=kind == "standalone", **common)
    seconds: list[float] = []
    save = trainer._save_checkpoint

    def timed(*args, **kwargs):
        start = time.perf_counter()
        save(*args, **kwargs)
        wait_for_pending_saves()
        seconds.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed
    trainer.train()
    last = output_dir / f"checkpoint-{saves + 1}"
    result = {"seconds": seconds, "bytes": dir_bytes(last), "path": str(last)}
    del trainer, model
    return result


def touch_every_page(model: torch.nn.Module) -> int:
    """Read one byte of every page of every tensor (what makes a mapped base resident); returns a checksum."""
    total = 0
    for tensor in model.state_dict().values():
        data = tensor.detach().reshape(-1).view(torch.uint8).numpy()
        total += int(data[::4096].sum()) + int(data[-1:].sum())
    return total


def time_base_load(base: Path) -> dict[str, float]:
    """``from_pretrained`` from a cold cache, returning mapped; then with every page of the base read."""
    drop_caches()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    mapped = time.perf_counter() - start
    touch_every_page(model)
    loaded = time.perf_counter() - start
    del model
    return {"mapped": mapped, "loaded": loaded}


def _record(checkpoint: Path) -> "_frozen.FrozenRecord":
    return _frozen.FrozenRecord.from_json(json.loads((checkpoint / FROZEN_RECORD_FILE).read_text()), source="")


def _check(record, model: torch.nn.Module, checkpoint: Path, *, full: bool) -> None:
    _frozen._CACHE.clear()  # nothing fingerprinted yet, as in a new process
    covered = _frozen.check_frozen_base(record, model.state_dict(keep_vars=True), full=full, strict=True,
                                        source=str(checkpoint))
    assert len(covered) == len(record.tensors) + len(record.tied)


def time_check(base: Path, checkpoint: Path, *, full: bool) -> float:
    """The resume check alone, on a freshly built model whose base is in memory (every page read)."""
    record = _record(checkpoint)
    model = lora_model(base)
    touch_every_page(model)
    start = time.perf_counter()
    _check(record, model, checkpoint, full=full)
    elapsed = time.perf_counter() - start
    del model
    return elapsed


def time_cold_resume(base: Path, checkpoint: Path, *, check: bool) -> float:
    """Cold cache: build the LoRA model, check its base (or not), then read every page of it."""
    record = _record(checkpoint)
    drop_caches()
    start = time.perf_counter()
    model = lora_model(base)
    if check:
        _check(record, model, checkpoint, full=False)
    touch_every_page(model)
    elapsed = time.perf_counter() - start
    del model
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of the base load and the checks")
    parser.add_argument("--saves", type=int, default=5, help="saves per trainer (after the first one)")
    parser.add_argument("--dir", help="work directory (default: a temporary directory)")
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = Path(options.dir or tempfile.mkdtemp(prefix="bench-peft-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run(work, options)
    finally:
        if not options.dir:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path, options: argparse.Namespace) -> None:
    base = work / "base"
    base_bytes = write_base(base)
    can_drop = drop_caches()
    runs = {kind: train_and_time_saves(kind, base, work / kind, saves=options.saves)
            for kind in ("stock", "ours", "standalone")}
    ours = Path(runs["ours"]["path"])
    loads, quick, full, cold = [], [], [], {True: [], False: []}
    for _ in range(options.repeats):  # interleaved, so that a change in the machine's load hits every variant
        loads.append(time_base_load(base))
        quick.append(time_check(base, ours, full=False))
        full.append(time_check(base, ours, full=True))
        for check in (False, True):
            cold[check].append(time_cold_resume(base, ours, check=check))
    report(runs, loads, quick, full, cold, base_bytes=base_bytes, options=options, can_drop=can_drop)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report(runs, loads, quick, full, cold, *, base_bytes: int, options, can_drop: bool) -> None:
    stock = runs["stock"]
    stock_save = _median(stock["seconds"][1:])
    print(f"\nBase: Llama-shaped, {base_bytes / 1e9:.2f} GB (fp32), LoRA r=16 on q/k/v/o; {options.saves} saves per "
          f"trainer after the first, medians; page cache {'dropped' if can_drop else 'NOT dropped (not root)'} "
          "before every save and base load.\n")
    print("| checkpoint of one step | bytes | bytes vs stock | save s | save vs stock | target |")
    print("|---|---|---|---|---|---|")
    rows = [("transformers.Trainer (stock)", stock, stock["seconds"][1:], ""),
            ("ResumableTrainer (base recorded, not stored)", runs["ours"], runs["ours"]["seconds"][1:],
             "bytes <= 1.2x"),
            ("ResumableTrainer, first save of a process (fingerprints the base once)", runs["ours"],
             runs["ours"]["seconds"][:1], ""),
            ("ResumableTrainer(standalone_checkpoints=True) (whole model: the previous default)", runs["standalone"],
             runs["standalone"]["seconds"][1:], "")]
    for label, result, seconds, target in rows:
        saved = _median(seconds)
        print(f"| {label} | {result['bytes'] / 1e6:.2f} MB | {result['bytes'] / stock['bytes']:.2f}x | {saved:.3f} | "
              f"{saved / stock_save:.2f}x | {target} |")
    load = _median([t["loaded"] for t in loads])
    mapped = _median([t["mapped"] for t in loads])
    added = _median(cold[True]) - _median(cold[False])
    print("\n| resume check of the frozen base | s | vs loading the base | target |")
    print("|---|---|---|---|")
    print(f"| load the base: from_pretrained + every page read, cold cache ({base_bytes / 1e9:.2f} GB) | {load:.3f} "
          "| 1.00x | |")
    print(f"| (from_pretrained alone: maps the file, reads no weights) | {mapped:.3f} | {mapped / load:.2f}x | |")
    print(f"| check: names, dtypes, shapes, sampled bytes (default), base in memory | {_median(quick):.4f} | "
          f"{_median(quick) / load:.3f}x | <= 0.1x |")
    print(f"| check (default) added to a cold resume: {_median(cold[True]):.3f} s with it, "
          f"{_median(cold[False]):.3f} s without | {added:.3f} | {added / load:.3f}x | |")
    print(f"| check: every byte (verify=\"full\"), base in memory | {_median(full):.3f} | {_median(full) / load:.3f}x "
          "| |")

if __name__ == "__main__":
    main()
