"""Optimizer-step time of token-exact accumulation (``ResumableAccelerator``) vs plain accelerate vs one big batch.

All three variants train the same small GPT-2 on the same variable-length, right-padded sequences, with
the same samples in the same order (no shuffling) per optimizer step (``--ga`` micro-batches of ``--micro-batch``):

- ``resumable``: ``ResumableAccelerator.accumulation_windows`` (the window is fetched first and its label
  tokens counted) + ``backward(loss_sum, num_items_in_batch=window.num_items)``: token-exact;
- ``accelerate``: ``accelerate.Accelerator.accumulate`` + ``backward(mean_loss)``: mean of means;
- ``one_batch``: a single batch of ``ga * micro_batch`` samples (padded to its longest sequence), no accumulation.

Each repetition times ``--steps`` optimizer steps after one warm-up step; the table shows the median
over ``--repeats`` repetitions (variants interleaved, so machine load hits them alike) and the ratio
to plain accelerate.

Usage:
    python benchmarks/bench_accumulation.py --repeats 5 --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from transformers import GPT2Config, GPT2LMHeadModel

from hf_resumable.data import build_map_dataloader
from hf_resumable.integrations.accelerate import ResumableAccelerator

IGNORE = -100
VOCAB = 512


def make_samples(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 129, (count,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def count_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != IGNORE).sum()


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor], reduction: str) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE,
                                             reduction=reduction)


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=256, bos_token_id=1,
                        eos_token_id=2)
    model = GPT2LMHeadModel(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def time_resumable(samples: list, args: argparse.Namespace) -> float:
    reset_accelerate()
    accelerator = ResumableAccelerator(gradient_accumulation_steps=args.ga, cpu=True, handle_preemption=False)
    model, optimizer = build_model()
    loader = accelerator.prepare_resumable_dataloader(samples, collate_fn=collate, batch_size=args.micro_batch,
                                                      seed=0, shuffle=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    windows = accelerator.accumulation_windows(loader, count_items=count_tokens)

    def step() -> None:
        window = next(windows)
        for batch in window:
            with accelerator.accumulate(model):
                accelerator.backward(token_losses(model, batch, "sum"), num_items_in_batch=window.num_items)
                optimizer.step()
                optimizer.zero_grad()

    return timed(step, args.steps)


def time_accelerate(samples: list, args: argparse.Namespace) -> float:
    reset_accelerate()
    accelerator = Accelerator(gradient_accumulation_steps=args.ga, cpu=True)
    model, optimizer = build_model()
    loader = torch.utils.data.DataLoader(samples, batch_size=args.micro_batch, shuffle=False, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)

    def step() -> None:
        for _ in range(args.ga):
            with accelerator.accumulate(model):
                accelerator.backward(token_losses(model, next(batches), "mean"))
                optimizer.step()
                optimizer.zero_grad()

    return timed(step, args.steps)


def time_one_batch(samples: list, args: argparse.Namespace) -> float:
    model, optimizer = build_model()
    loader = build_map_dataloader(samples, collate_fn=collate, batch_size=args.micro_batch * args.ga, seed=0,
                                  shuffle=False)
    batches = iter(loader)

    def step() -> None:
        batch = next(batches)
        (token_losses(model, batch, "sum") / count_tokens(batch)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return timed(step, args.steps)


def timed(step: Callable[[], None], steps: int) -> float:
    """Seconds per optimizer step over ``steps`` steps, after one warm-up step."""
    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps


VARIANTS = {"resumable": time_resumable, "accelerate": time_accelerate, "one_batch": time_one_batch}


def report(results: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = statistics.median(results["accelerate"])
    print(f"\nGPT-2 (4 layers, d=128), {args.ga} x {args.micro_batch} samples of 16-128 tokens per optimizer step, "
          f"CPU, {torch.get_num_threads()} threads, median of {args.repeats} x {args.steps} steps\n")
    print("| variant | ms / optimizer step (median) | min | max | ratio vs plain accelerate |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} | {min(values) * 1e3:.1f} | {max(values) * 1e3:.1f} | "
              f"{median / base:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ga", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noisy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples = make_samples(args.ga * args.micro_batch * (args.steps + 1))
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, run in VARIANTS.items():
            results[name].append(run(samples, args))
    report(results, args)


if __name__ == "__main__":
    main()
