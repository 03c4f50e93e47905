"""Integrations with training loops of the Hugging Face stack (the only code that touches their internals)."""

from __future__ import annotations

__all__ = ["ResumableTrainer"]


def __getattr__(name: str):  # lazy: importing hf_resumable.integrations must not import transformers' Trainer
    if name == "ResumableTrainer":
        from .trainer import ResumableTrainer

        return ResumableTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
