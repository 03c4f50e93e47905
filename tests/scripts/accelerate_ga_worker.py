"""Token-exact gradient accumulation check for ``ResumableAccelerator`` (one rank; run alone or under gloo).

For every accumulation window of an epoch of variable-length, right-padded sequences, the gradient
accumulated over the window's micro-batches (on all ranks, averaged by DDP) is compared with the
gradient of ONE batch holding all the window's samples (padded to its own longest sequence), with the
token-mean loss. The last window of the epoch is short. For contrast the gradient accelerate's own
recipe gives (mean loss per micro-batch / gradient_accumulation_steps, averaged over ranks) is computed
too. Usage as a script: ``accelerate_ga_worker.py OUT_JSON`` with the torchrun environment set.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_resumable.data import ResumableBatchSampler
from hf_resumable.integrations.accelerate import ResumableAccelerator

IGNORE = -100
GA = 3
MICRO_BATCH = 4
RTOL, ATOL = 1e-5, 1e-6


def make_samples(world_size: int) -> list[list[int]]:
    """5 micro-batches per rank and epoch: windows of 3 and 2 (the short last one)."""
    generator = torch.Generator().manual_seed(7)
    count = 5 * MICRO_BATCH * world_size - 1  # not a multiple: the sampler pads, the last batch is short
    lengths = torch.randint(2, 21, (count,), generator=generator).tolist()
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


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


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE,
                                             reduction="sum")


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=1,
                        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[bool, float]:
    close = all(torch.allclose(got[n], want[n], rtol=RTOL, atol=ATOL) for n in want) and set(got) == set(want)
    return close, max(float((got[n] - want[n]).abs().max()) for n in want)


def window_batches(samples: list[list[int]], world_size: int, first_step: int, size: int) -> list[list[list[int]]]:
    """The micro-batches of one window on every rank, as the ranks' samplers produce them."""
    out = []
    for rank in range(world_size):
        sampler = ResumableBatchSampler(len(samples), MICRO_BATCH, seed=0, shuffle=False, rank=rank,
                                        world_size=world_size)
        order = sampler.epoch_indices(0)
        for step in range(first_step, first_step + size):
            out.append([samples[i] for i in order[step * MICRO_BATCH:(step + 1) * MICRO_BATCH]])
    return out


def reference_gradients(model: torch.nn.Module, micro: list[list[list[int]]], world_size: int
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """(one-batch token mean, accelerate's mean of means, token count) for the window's micro-batches."""
    full = collate([row for batch in micro for row in batch])
    model.zero_grad()
    (loss_sum(model, full) / count_tokens(full)).backward()
    exact = gradients(model)
    model.zero_grad()
    for rows in micro:
        batch = collate(rows)
        (loss_sum(model, batch) / count_tokens(batch) / GA / world_size).backward()
    return exact, gradients(model), int(count_tokens(full))


def run(*, cpu: bool = True) -> list[dict]:
    """One epoch of windows; returns per-window comparison records (identical on every rank)."""
    accelerator = ResumableAccelerator(gradient_accumulation_steps=GA, cpu=cpu, handle_preemption=False)
    world_size = accelerator.num_processes
    samples = make_samples(world_size)
    model = tiny_model()
    reference = copy.deepcopy(model)
    loader = accelerator.prepare_resumable_dataloader(samples, collate_fn=collate, batch_size=MICRO_BATCH, seed=0,
                                                      shuffle=False)
    prepared = accelerator.prepare(model)
    records, first_step = [], 0
    for window in accelerator.accumulation_windows(loader, count_items=count_tokens):
        syncs = []
        for batch in window:
            with accelerator.accumulate(prepared):
                accelerator.backward(loss_sum(prepared, batch), num_items_in_batch=window.num_items)
                syncs.append(accelerator.sync_gradients)
        got = gradients(accelerator.unwrap_model(prepared))
        exact, mean_of_means, tokens = reference_gradients(
            reference, window_batches(samples, world_size, first_step, len(window)), world_size)
        exact_ok, exact_diff = compare(got, exact)
        plain_ok, plain_diff = compare(mean_of_means, exact)
        records.append({"size": len(window), "num_items": window.num_items, "tokens": tokens, "syncs": syncs,
                        "exact_ok": exact_ok, "exact_diff": exact_diff, "plain_ok": plain_ok,
                        "plain_diff": plain_diff, "global_step": accelerator.global_step,
                        "world_size": world_size})
        prepared.zero_grad()
        first_step += len(window)
    accelerator.end_training()
    return records


if __name__ == "__main__":
    result = run()
    if os.environ.get("RANK", "0") == "0":
        with open(sys.argv[1], "w") as handle:
            json.dump(result, handle)
