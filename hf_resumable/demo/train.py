"""The training process of ``hf-resumable demo``: fine-tune a tiny causal LM, checkpoint, resume exactly.

Run as ``python -m hf_resumable.demo.train --output DIR --max-steps N`` for a fresh start and for a restart alike: it
resumes from the newest valid checkpoint under ``DIR/checkpoints``. Data order is a pure function of
``(seed, epoch)``, checkpoints land on optimizer-step boundaries, and losses go to ``DIR/losses.jsonl`` (exact, as
``float.hex``; the lines past the checkpoint are dropped on resume). See docs/cli.md (``demo``).

Example:

```bash
python -m hf_resumable.demo.train --output /tmp/run --max-steps 30 --kill-at 17   # dies at step 17
python -m hf_resumable.demo.train --output /tmp/run --max-steps 30                # resumes, finishes
```
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ..checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
from ._common import (
    CHECKPOINTS_DIR,
    FINAL_FILE,
    LOSSES_FILE,
    RESUMES_FILE,
    DemoConfig,
    append_json,
    build_model,
    load_corpus,
    truncate_log,
    weights_sha256,
)

logger = logging.getLogger(__name__)

__all__ = ["DemoConfig", "train", "train_loop", "resolve_backend", "weights_sha256", "append_json", "truncate_log",
           "BACKENDS", "LOSSES_FILE", "FINAL_FILE", "RESUMES_FILE", "CHECKPOINTS_DIR"]

# "trainer": ResumableTrainer (hf_resumable.integrations.trainer); "loop": the plain torch loop below;
# "auto": the trainer when its integration imports, else the loop.
BACKENDS = ("auto", "trainer", "loop")
# Progress keys stored in training_state.json["progress"].
_EPOCH, _POSITION, _STEP, _SAMPLES, _RESUMES = "epoch", "position", "global_step", "samples_seen", "resumes"


def _lr_factor(max_steps: int):
    warmup = max(1, max_steps // 10)

    def factor(step: int) -> float:  # linear warm-up, then linear decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return max(0.1, 1.0 - (step - warmup) / max(1, max_steps - warmup))

    return factor


def micro_batches(samples: torch.Tensor, *, seed: int, epoch: int, position: int,
                  batch_size: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(epoch, next_position, batch)`` forever, starting at ``(epoch, position)``.

    Each epoch's order is ``randperm`` from a generator seeded with ``(seed, epoch)``, so the stream is a
    pure function of the cursor; the last incomplete batch of an epoch is dropped.
    """
    while True:
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        while position + batch_size <= len(samples):
            position += batch_size
            yield epoch, position, samples[order[position - batch_size:position]]
        epoch, position = epoch + 1, 0


class _Run:
    """The state of one training process: objects, cursor and log files."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.samples = load_corpus(config.block_size)
        self.model = build_model(config.seed, config.block_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_factor(config.max_steps))
        self.progress = {_EPOCH: 0, _POSITION: 0, _STEP: 0, _SAMPLES: 0, _RESUMES: 0}
        self.checkpoints = config.output / CHECKPOINTS_DIR
        self.last_loss = float("nan")

    def resume_if_possible(self) -> None:
        latest = find_latest_checkpoint(self.checkpoints)
        if latest is None:
            truncate_log(self.config.output / LOSSES_FILE, 0)
            return
        # RNG is restored last, inside load_checkpoint; nothing below draws random numbers.
        loaded = load_checkpoint(latest, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.progress.update(loaded.training_state)
        self.progress[_RESUMES] += 1
        truncate_log(self.config.output / LOSSES_FILE, self.progress[_STEP])
        append_json(self.config.output / RESUMES_FILE, {"from_step": self.progress[_STEP], "checkpoint": latest.name})
        logger.info("resumed from %s (step %d)", latest, self.progress[_STEP])

    def save(self) -> None:
        step = self.progress[_STEP]
        save_checkpoint(self.checkpoints / f"checkpoint-{step}", model=self.model, optimizer=self.optimizer,
                        scheduler=self.scheduler, step=step, training_state=dict(self.progress), keep_last=2,
                        extra={"per_device_train_batch_size": self.config.batch_size,
                               "gradient_accumulation_steps": self.config.accumulation, "world_size": 1},
                        metrics={"loss": self.last_loss}, overwrite=True)

    def step(self, batches: Iterator[tuple[int, int, torch.Tensor]]) -> float:
        total = 0.0
        for _ in range(self.config.accumulation):
            epoch, position, batch = next(batches)
            loss = self.model(input_ids=batch, labels=batch).loss / self.config.accumulation
            loss.backward()
            total += loss.item()
            self.progress.update({_EPOCH: epoch, _POSITION: position})
            self.progress[_SAMPLES] += len(batch)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress[_STEP] += 1
        self.last_loss = total
        return total


def resolve_backend(backend: str) -> str:
    """``"trainer"`` or ``"loop"`` for ``backend`` (``"auto"``: the trainer when its integration imports).

    Raises:
        ValueError: for an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend != "auto":
        return backend
    try:
        from ..integrations.trainer import ResumableTrainer  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means: use the loop, and say why
        logger.warning("ResumableTrainer is not usable (%s: %s); the demo uses the plain torch loop.",
                       type(err).__name__, err)
        return "loop"
    return "trainer"


def train(config: DemoConfig, *, backend: str = "auto") -> str:
    """Train with ``backend`` (resuming if a checkpoint exists); return the final weights' sha256."""
    if resolve_backend(backend) == "trainer":
        from .trainer_backend import train_with_trainer

        return train_with_trainer(config)
    return train_loop(config)


def train_loop(config: DemoConfig) -> str:
    """Train with the plain torch loop (resuming if a checkpoint exists); return the final weights' sha256.

    Raises:
        CorruptCheckpointError / CheckpointMismatchError: if the newest valid checkpoint cannot be loaded.
    """
    config.output.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # identical reduction order in every process
    run = _Run(config)
    run.resume_if_possible()
    run.model.train()
    batches = micro_batches(run.samples, seed=config.seed, epoch=run.progress[_EPOCH],
                            position=run.progress[_POSITION], batch_size=config.batch_size)
    while run.progress[_STEP] < config.max_steps:
        loss = run.step(batches)
        step = run.progress[_STEP]
        append_json(config.output / LOSSES_FILE, {"step": step, "loss": loss, "loss_hex": float.hex(loss),
                                                   "lr": run.scheduler.get_last_lr()[0]})
        if step % config.save_every == 0 or step == config.max_steps:
            run.save()
        if config.kill_at is not None and step == config.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    digest = weights_sha256(run.model)
    (config.output / FINAL_FILE).write_text(json.dumps({"steps": config.max_steps, "weights_sha256": digest}) + "\n")
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_resumable.demo.train", description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="run directory (resumed if it has checkpoints)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL itself right after this step")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="ResumableTrainer or the plain loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = DemoConfig(output=args.output, max_steps=args.max_steps, seed=args.seed, save_every=args.save_every,
                        kill_at=args.kill_at)
    train(config, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
