"""Conversions between hf_resumable checkpoints and other tools' layouts, reading and writing files only.

``switch`` picks the converter (``hf-resumable convert``); ``stock``, ``deepspeed``, ``dcp`` and ``hf_storage`` read
a stock Trainer, DeepSpeed ZeRO-1/2, accelerate FSDP and transformers distributed checkpoint; ``export`` writes a
``from_pretrained`` directory; ``_pickle`` holds the library's only pickle reads. See docs/multi-gpu.md and the
conversions/ entry of docs/architecture.md.
"""
