"""Reference custom training loop with ``ResumableAccelerator``: kill it at any moment, rerun the same command.

A tiny GPT-2 (dropout on) is trained on variable-length random token sequences with a collator that
draws random numbers (label dropping, token noise, random crops), token-exact gradient accumulation
and a checkpoint every ``--save-every`` optimizer steps. Rerunning the same command after a crash (or
SIGTERM: the step finishes, a checkpoint is committed, the process exits with 143) resumes from the
newest valid checkpoint and produces bit for bit the losses and weights of an uninterrupted run.

Usage:

    python examples/custom_loop.py --output-dir out                                  # 1 process
    torchrun --nproc-per-node 2 examples/custom_loop.py --output-dir out             # 2 processes (gloo)
    accelerate launch --multi_gpu --num_processes 2 examples/custom_loop.py --output-dir out   # same, on CPU

(``accelerate launch --cpu`` always starts a single process; ``--multi_gpu`` goes through torchrun, and the
script's ``ResumableAccelerator(cpu=True)`` then trains on CPU with gloo.)

On a GPU: ``--device cuda`` (NCCL under torchrun), ``--mixed-precision fp16`` or ``bf16``, and ``--deterministic``
for the settings under which a GPU run is bit for bit repeatable (docs/limits.md; set
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment too). ``--init-scale`` is the fp16 GradScaler's initial scale:
a huge one makes the first steps overflow, which the scaler skips (each line of ``losses.jsonl`` says whether its
step was skipped).

Per-step losses are appended to ``<output-dir>/losses.jsonl`` (``float.hex`` of the window's token-mean
loss over all processes). Test hooks: ``HF_RESUMABLE_EXAMPLE_KILL_AFTER_STEP=k`` makes the process SIGKILL
itself right after step ``k``, ``HF_RESUMABLE_EXAMPLE_TERM_AFTER_STEP=k`` sends it SIGTERM there;
``HF_RESUMABLE_EXAMPLE_SIGNAL_RANK`` limits either to one rank; with ``HF_RESUMABLE_EXAMPLE_AWAIT_COMMIT=1`` the
signal waits until this process's background save (if one is in flight) has committed, so a test's kill follows the
event it needs, not the machine's speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import GradScalerKwargs, set_seed
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from hf_resumable.checkpoint import wait_for_pending_saves
from hf_resumable.integrations.accelerate import ResumableAccelerator

logger = logging.getLogger("custom_loop")

VOCAB = 128
PAD = 0
IGNORE = -100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=44)
    parser.add_argument("--batch-size", type=int, default=4, help="per-process micro-batch size")
    parser.add_argument("--ga", type=int, default=3, help="gradient accumulation steps")
    parser.add_argument("--save-every", type=int, default=2, help="optimizer steps between checkpoints")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-async", action="store_true")
    parser.add_argument("--preemption-notice", type=float, default=None,
                        help="seconds from SIGTERM to SIGKILL: train on within them (ResumableAccelerator option)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default="no")
    parser.add_argument("--init-scale", type=float, default=2.0 ** 16, help="the fp16 GradScaler's initial scale")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True), cuDNN deterministic, no TF32, eager attention")
    return parser.parse_args(argv)


def make_dataset(num_samples: int, seed: int) -> list[dict[str, list[int]]]:
    """Variable-length random token sequences (a pure function of the seed)."""
    generator = torch.Generator().manual_seed(seed + 1234)
    lengths = torch.randint(6, 24, (num_samples,), generator=generator).tolist()
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=generator).tolist()} for n in lengths]


def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Random crop (numpy), token noise (python ``random``), label dropping (torch), then right padding."""
    rows = []
    for example in examples:
        ids = list(example["input_ids"])
        start = int(np.random.randint(0, 3))
        ids = ids[start:]
        ids = [random.randrange(3, VOCAB) if random.random() < 0.05 else token for token in ids]
        rows.append(ids)
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    labels = labels.masked_fill(torch.rand(labels.shape) < 0.1, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def count_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Items the loss is averaged over: predicted label tokens (labels are shifted by one)."""
    return (batch["labels"][:, 1:] != IGNORE).sum()


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of the next-token cross-entropy over the micro-batch's label tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE,
                                             reduction="sum")


def build_model(seed: int, *, attn_implementation: str | None = None) -> GPT2LMHeadModel:
    set_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
                        eos_token_id=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        attn_implementation=attn_implementation)
    return GPT2LMHeadModel(config)


def use_deterministic_settings() -> None:
    """What a bit-exact GPU run needs besides ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (docs/limits.md)."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def maybe_signal(step: int, rank: int, signum: signal.Signals) -> None:
    """Test hooks: send ``signum`` to this process after ``step`` (SIGKILL: a crash, no cleanup at all;
    SIGTERM: a preemption notice, handled by ``checkpoint_if_preempted``)."""
    after = os.environ.get(f"HF_RESUMABLE_EXAMPLE_{signum.name[3:]}_AFTER_STEP")
    only_rank = os.environ.get("HF_RESUMABLE_EXAMPLE_SIGNAL_RANK")
    if after is not None and int(after) == step and (only_rank is None or int(only_rank) == rank):
        if os.environ.get("HF_RESUMABLE_EXAMPLE_AWAIT_COMMIT") == "1":
            wait_for_pending_saves()  # returns once every rank knows the commit happened (or failed)
        os.kill(os.getpid(), signum)


def log_step(path: Path, step: int, epoch: int, loss: float, skipped: bool = False) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps({"step": step, "epoch": epoch, "loss": loss.hex(), "skipped": skipped}) + "\n")


def train(args: argparse.Namespace) -> ResumableAccelerator:
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    if args.deterministic:
        use_deterministic_settings()
    # A huge initial scale overflows at once; a fast backoff and growth after 3 good steps show skips and growth in a
    # few steps (accelerate passes these to torch.amp.GradScaler; they do nothing without fp16).
    scaling = GradScalerKwargs(init_scale=args.init_scale, backoff_factor=2.0 ** -8, growth_interval=3)
    accelerator = ResumableAccelerator(gradient_accumulation_steps=args.ga, checkpoint_dir=output / "checkpoints",
                                       keep_last=2, save_async=args.save_async,
                                       preemption_notice=args.preemption_notice, cpu=args.device == "cpu",
                                       mixed_precision=args.mixed_precision, kwargs_handlers=[scaling])
    model = build_model(args.seed, attn_implementation="eager" if args.deterministic else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = accelerator.prepare_resumable_dataloader(make_dataset(args.num_samples, args.seed), collate_fn=collate,
                                                      batch_size=args.batch_size, seed=args.seed,
                                                      num_workers=args.num_workers)
    steps_per_epoch = -(-len(loader) // args.ga)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, steps_per_epoch * args.epochs)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if torch.distributed.is_initialized():
        logger.info("torch.distributed backend %s, %d process(es)", torch.distributed.get_backend(),
                    accelerator.num_processes)
    accelerator.load_state()  # newest valid checkpoint, or nothing on a fresh start
    losses = output / "losses.jsonl"

    for epoch in range(loader.epoch, args.epochs):
        model.train()
        for window in accelerator.accumulation_windows(loader, count_items=count_tokens):
            total = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            for batch in window:
                with accelerator.accumulate(model):
                    loss = loss_sum(model, batch)
                    accelerator.backward(loss, num_items_in_batch=window.num_items)
                    total += loss.detach().double()
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            step_loss = float(accelerator.reduce(total, reduction="sum")) / window.num_items
            if accelerator.is_main_process:
                log_step(losses, accelerator.global_step, epoch, step_loss, accelerator.optimizer_step_was_skipped)
            if accelerator.global_step % args.save_every == 0:
                accelerator.save_state()
            maybe_signal(accelerator.global_step, accelerator.process_index, signal.SIGTERM)
            accelerator.checkpoint_if_preempted()  # SIGTERM received: save this step, exit with 143
            maybe_signal(accelerator.global_step, accelerator.process_index, signal.SIGKILL)
    accelerator.save_state()  # the final state (a no-op if the last step was just saved)
    accelerator.end_training()
    return accelerator


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    accelerator = train(args)
    if accelerator.is_main_process:
        logger.info("finished at step %d", accelerator.global_step)
    release_process_group(accelerator)


def release_process_group(accelerator) -> None:
    """Under torch.distributed: drop the prepared (DDP-wrapped) model, then destroy the process group.

    A gloo group left to interpreter exit can abort the process there (a known torch issue), and destroying
    it while a DDP model still holds it can hang when the model is released; so the model goes first.
    """
    import gc

    import torch.distributed as dist

    accelerator.free_memory()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
