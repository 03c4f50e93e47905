"""The training process of ``hf-resumable demo``: fine-tune a tiny causal LM, checkpoint, resume exactly.

Run it as ``python -m hf_resumable.demo_train --output DIR --max-steps N``. The same command line is
used for a fresh start and for a restart after a crash: it resumes from the newest valid checkpoint
under ``DIR/checkpoints`` (:func:`~hf_resumable.find_latest_checkpoint`) when there is one.

Everything is built locally: a GPT-2 with two layers from a config, a byte-level vocabulary (no
tokenizer download) and the corpus shipped in the package (``hf_resumable/resources/tiny_corpus.txt``).
The loop is exact by construction:

* data order is a pure function of ``(seed, epoch)`` (a private ``torch.Generator``), and the cursor
  ``(epoch, position)`` is saved in the checkpoint's training state;
* checkpoints land on optimizer-step boundaries only, with the RNG state captured at the boundary
  (dropout is on, so a wrong RNG would show in the losses);
* restoring happens in the order model, optimizer, scheduler, RNG last (``load_checkpoint``).

Per-step losses go to ``DIR/losses.jsonl`` (exact values as ``float.hex``); on resume the lines past
the checkpoint are dropped, since those steps are re-run. At the end ``DIR/final.json`` holds the
sha256 of the final weights.

Example:

```bash
python -m hf_resumable.demo_train --output /tmp/run --max-steps 30 --kill-at 17   # dies at step 17
python -m hf_resumable.demo_train --output /tmp/run --max-steps 30                # resumes, finishes
```
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["DemoConfig", "train", "train_loop", "resolve_backend", "weights_sha256", "append_json", "truncate_log",
           "BACKENDS", "LOSSES_FILE", "FINAL_FILE", "RESUMES_FILE", "CHECKPOINTS_DIR"]

# Files of a demo run directory.
LOSSES_FILE = "losses.jsonl"  # one {"step", "loss", "loss_hex", "lr"} line per optimizer step
FINAL_FILE = "final.json"  # {"steps", "weights_sha256"} written after the last step
RESUMES_FILE = "resumes.jsonl"  # one {"from_step", "checkpoint"} line per resume
CHECKPOINTS_DIR = "checkpoints"
CORPUS = "tiny_corpus.txt"
# "trainer": ResumableTrainer (hf_resumable.integrations.trainer); "loop": the plain torch loop below;
# "auto": the trainer when its integration imports, else the loop.
BACKENDS = ("auto", "trainer", "loop")
# Progress keys stored in training_state.json["progress"].
_EPOCH, _POSITION, _STEP, _SAMPLES, _RESUMES = "epoch", "position", "global_step", "samples_seen", "resumes"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of one demo training run (identical for the reference run and the interrupted one).

    Args:
        output (`Path`): run directory.
        max_steps (`int`): optimizer steps to train.
        seed (`int`): seed of model init, data order and dropout.
        save_every (`int`): checkpoint every this many optimizer steps (and at the last step).
        batch_size (`int`): samples per micro-batch.
        accumulation (`int`): micro-batches per optimizer step.
        block_size (`int`): tokens per sample.
        kill_at (`int`, *optional*): SIGKILL this process right after optimizer step ``kill_at`` is logged.
    """

    output: Path
    max_steps: int = 40
    seed: int = 1234
    save_every: int = 5
    batch_size: int = 8
    accumulation: int = 2
    block_size: int = 64
    kill_at: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "save_every", "batch_size", "accumulation", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)}.")


def load_corpus(block_size: int) -> torch.Tensor:
    """The packaged corpus as byte-level samples of ``block_size`` tokens (stride ``block_size // 2``)."""
    text = resources.files("hf_resumable").joinpath("resources", CORPUS).read_text(encoding="utf-8")
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    starts = range(0, len(ids) - block_size, block_size // 2)
    return torch.stack([ids[s:s + block_size] for s in starts])


def build_model(seed: int, block_size: int) -> torch.nn.Module:
    """A two-layer GPT-2 over bytes, initialized from ``seed`` (nothing is downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=block_size, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(config)


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


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every state-dict tensor (name, dtype, shape and bytes), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


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


def append_json(path: Path, document: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(document) + "\n")
        f.flush()  # in the kernel before the next step: a SIGKILL cannot lose it


def _step_of(line: str) -> int | None:
    """The step of a log line, or None for a blank or torn line (a kill can land mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def truncate_log(path: Path, last_step: int) -> None:
    """Keep only the lines of steps ``<= last_step`` (the rest are re-run after a resume), atomically."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if (_step_of(line) or last_step + 1) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


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
        from .integrations.trainer import ResumableTrainer  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means: use the loop, and say why
        logger.warning("ResumableTrainer is not usable (%s: %s); the demo uses the plain torch loop.",
                       type(err).__name__, err)
        return "loop"
    return "trainer"


def train(config: DemoConfig, *, backend: str = "auto") -> str:
    """Train with ``backend`` (resuming if a checkpoint exists); return the final weights' sha256."""
    if resolve_backend(backend) == "trainer":
        from .demo_trainer import train_with_trainer

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
    parser = argparse.ArgumentParser(prog="python -m hf_resumable.demo_train", description=__doc__.split("\n")[0])
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
