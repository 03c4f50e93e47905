"""accelerate's checkpointing example loop (``examples/by_feature/checkpointing.py``), with one line changed.

The loop is the shape of accelerate's own example: ``prepare`` a model, optimizer, plain ``DataLoader``\\ s
and a scheduler; no ``accumulate()``; ``save_state("step_<n>")`` every ``--checkpointing_steps`` steps (or
``"epoch_<n>"`` at the end of every epoch); on ``--resume_from_checkpoint`` call ``load_state`` and
``skip_first_batches`` with the step count taken from the folder name; evaluate with ``gather_for_metrics``.
The only change for hf_resumable is the import of ``Accelerator``.

To keep it self-contained (no download), the model is a tiny BERT for sequence classification built from a
config, trained on a synthetic sentence-pair task held in a ``datasets.Dataset``, with a padding collator
that also masks random tokens (so every batch draws random numbers, as ``DataCollatorForLanguageModeling``
does). Dropout is on.

Usage (run the same command again after a crash; ``latest`` resumes from the newest checkpoint folder)::

    python examples/accelerate_checkpointing.py --output_dir out --checkpointing_steps 3 \\
        --resume_from_checkpoint latest
    torchrun --nproc-per-node 2 examples/accelerate_checkpointing.py --output_dir out --checkpointing_steps 3 \\
        --resume_from_checkpoint latest

Per-step losses (mean over processes, ``float.hex``) are appended to ``<output_dir>/losses.jsonl``. Test hook:
``HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP=k`` makes the process SIGKILL itself right after step ``k``
(``HF_RESUMABLE_EXAMPLE_SIGNAL_RANK`` limits that to one rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal

import torch
from accelerate.utils import set_seed
from datasets import Dataset
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from hf_resumable import ResumableAccelerator as Accelerator  # was: from accelerate import Accelerator

VOCAB, PAD, MASK = 96, 0, 1


def make_dataset(num_samples: int, seed: int) -> Dataset:
    """Pairs of random token sequences; the label says whether the first one starts with the larger token."""
    generator = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "labels": []}
    for _ in range(num_samples):
        first = torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator)
        second = torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator)
        rows["input_ids"].append([*first.tolist(), 2, *second.tolist()])
        rows["labels"].append(int(first[0] > second[0]))
    return Dataset.from_dict(rows)


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence, and mask 10% of the tokens at random."""
    width = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, example in enumerate(examples):
        input_ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
        attention_mask[row, : len(example["input_ids"])] = 1
    input_ids = input_ids.masked_fill((torch.rand(input_ids.shape) < 0.1) & (attention_mask == 1), MASK)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": torch.tensor([example["labels"] for example in examples])}


def get_dataloaders(batch_size: int, num_workers: int) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(make_dataset(64, 0), shuffle=True, collate_fn=collate, batch_size=batch_size,
                       num_workers=num_workers)
    evaluation = DataLoader(make_dataset(20, 1), shuffle=False, collate_fn=collate, batch_size=batch_size)
    return train, evaluation


def build_model() -> BertForSequenceClassification:
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    return BertForSequenceClassification(config)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest ``step_<n>``/``epoch_<n>`` folder, by the time it appeared (as accelerate's example sorts)."""
    if not os.path.isdir(output_dir):
        return None
    folders = [entry.path for entry in os.scandir(output_dir)
               if entry.is_dir() and entry.name.startswith(("step_", "epoch_"))]
    return max(folders, key=os.path.getctime) if folders else None


def maybe_kill(step: int, rank: int) -> None:
    after = os.environ.get("HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP")
    only_rank = os.environ.get("HF_RESUMABLE_EXAMPLE_SIGNAL_RANK")
    if after is not None and int(after) == step and (only_rank is None or int(only_rank) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def training_function(args: argparse.Namespace) -> None:
    accelerator = Accelerator(cpu=args.cpu)
    if args.checkpointing_steps == "epoch" or args.checkpointing_steps is None:
        checkpointing_steps = args.checkpointing_steps
    elif args.checkpointing_steps.isdigit():
        checkpointing_steps = int(args.checkpointing_steps)
    else:
        raise ValueError(f"--checkpointing_steps must be a number or 'epoch', got {args.checkpointing_steps!r}.")
    set_seed(args.seed)
    train_dataloader, eval_dataloader = get_dataloaders(args.batch_size, args.num_workers)
    model = build_model().to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=args.lr)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=2,
                                                   num_training_steps=len(train_dataloader) * args.num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    overall_step = 0
    starting_epoch = 0
    resume_step = None
    resume_from = args.resume_from_checkpoint
    if resume_from == "latest":
        resume_from = latest_checkpoint(args.output_dir)
    if resume_from:
        accelerator.print(f"Resumed from checkpoint: {resume_from}")
        accelerator.load_state(resume_from)
        training_difference = os.path.splitext(os.path.basename(resume_from))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            overall_step = starting_epoch * len(train_dataloader)
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
            overall_step = starting_epoch * len(train_dataloader)

    losses = os.path.join(args.output_dir, "losses.jsonl")
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        if resume_from and epoch == starting_epoch and resume_step is not None:
            # We need to skip steps until we reach the resumed step
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            mean_loss = accelerator.gather(loss.detach()[None]).double().mean().item()
            if accelerator.is_main_process:
                with open(losses, "a") as handle:
                    handle.write(json.dumps({"step": overall_step, "epoch": epoch, "loss": mean_loss.hex()}) + "\n")
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
            maybe_kill(overall_step, accelerator.process_index)

        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} on {total} samples")
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    accelerator.wait_for_everyone()
    accelerator.save_model(model, os.path.join(args.output_dir, "final_model"))
    accelerator.end_training()
    # Under torch.distributed: release the DDP-wrapped model, then the process group (a gloo group left to
    # interpreter exit can abort the process there; destroyed while a DDP model holds it, it can hang).
    del model, optimizer, lr_scheduler, train_dataloader, eval_dataloader
    accelerator.free_memory()
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="accelerate's checkpointing example with ResumableAccelerator.")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is available")
    parser.add_argument("--output_dir", default=".", help="where step_<n>/epoch_<n> checkpoints go")
    parser.add_argument("--checkpointing_steps", default=None,
                        help="save every n steps (a number), or at the end of every epoch ('epoch')")
    parser.add_argument("--resume_from_checkpoint", default=None,
                        help="a checkpoint folder to resume from, or 'latest' (the newest one, if any)")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    training_function(args)


if __name__ == "__main__":
    main()
