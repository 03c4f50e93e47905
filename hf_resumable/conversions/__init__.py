"""Conversions between hf_resumable checkpoints and other tools' layouts.

- :mod:`~hf_resumable.conversions.switch`: which stock layout a directory holds, and ``convert_stock_checkpoint``,
  the one call behind ``hf-resumable convert``.
- :mod:`~hf_resumable.conversions.stock`: a stock ``transformers.Trainer`` checkpoint (its pickles read with
  ``weights_only=True``, never executed) into an hf_resumable checkpoint, and resharding of ours.
- :mod:`~hf_resumable.conversions.deepspeed`: a Trainer + DeepSpeed ZeRO-1/2 checkpoint (``global_step<N>/``) into a
  per-rank checkpoint ``ResumableTrainer(deepspeed=...)`` resumes.
- :mod:`~hf_resumable.conversions.dcp`: accelerate's FSDP ``SHARDED_STATE_DICT`` ``save_state`` (DCP ``.distcp`` +
  ``.metadata``) into a per-rank checkpoint ``ResumableAccelerator`` with FSDP2 resumes.
- :mod:`~hf_resumable.conversions.hf_storage`: transformers' ``save_pretrained(distributed_checkpoint=True)``
  (per-rank safetensors) and ``save_optimizer_distributed`` into a per-rank checkpoint ``load_checkpoint``
  loads at any layout.
- :mod:`~hf_resumable.conversions.export`: an hf_resumable checkpoint (regular, per-rank FSDP2 / ZeRO, or with a
  recorded frozen base) into a ``from_pretrained`` model directory, PEFT adapters merged or side by side.
- ``_pickle`` (the only pickle reads: allow-lists and inert stand-ins), ``_layout`` (per-rank piece files and the
  layout, built in one process), ``_commit`` (committing a checkpoint for N ranks from one process).
"""
