"""Conversions between hf_resumable checkpoints and other tools' layouts.

- :mod:`~hf_resumable.conversions.stock`: a stock ``transformers.Trainer`` checkpoint (its pickles read with
  ``weights_only=True``, never executed) into an hf_resumable checkpoint, and resharding of ours.
- :mod:`~hf_resumable.conversions.export`: an hf_resumable checkpoint plus its recorded (or given) frozen base into a
  ``from_pretrained`` model directory, PEFT adapters merged or side by side.
"""
