"""Pieces shared by the demo's two training backends (the plain loop and ResumableTrainer): the run's files, its
configuration, the packaged corpus, the model, and the logs both backends write the same way."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

__all__ = ["DemoConfig", "load_corpus", "build_model", "weights_sha256", "append_json", "truncate_log",
           "LOSSES_FILE", "FINAL_FILE", "RESUMES_FILE", "CHECKPOINTS_DIR"]

# Files of a demo run directory.
LOSSES_FILE = "losses.jsonl"  # one {"step", "loss", "loss_hex", "lr"} line per optimizer step
FINAL_FILE = "final.json"  # {"steps", "weights_sha256"} written after the last step
RESUMES_FILE = "resumes.jsonl"  # one {"from_step", "checkpoint"} line per resume
CHECKPOINTS_DIR = "checkpoints"
CORPUS = "tiny_corpus.txt"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of one demo training run (identical for the reference run and the interrupted one)."""

    output: Path  # run directory
    max_steps: int = 40  # optimizer steps to train
    seed: int = 1234  # seed of model init, data order and dropout
    save_every: int = 5  # checkpoint every this many optimizer steps (and at the last step)
    batch_size: int = 8  # samples per micro-batch
    accumulation: int = 2  # micro-batches per optimizer step
    block_size: int = 64  # tokens per sample
    kill_at: int | None = None  # SIGKILL this process right after optimizer step ``kill_at`` is logged

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


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every state-dict tensor (name, dtype, shape and bytes), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


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
