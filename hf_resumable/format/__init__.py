"""The on-disk format's building blocks, pure or IO at the edge, importing nothing above them.

- :mod:`~hf_resumable.format.safetensors_io`: safetensors headers, bounded reads, hashing of files.
- :mod:`~hf_resumable.format.sharding`: shard planning and ``*.safetensors.index.json`` parsing (pure).
- :mod:`~hf_resumable.format.state_codec`: optimizer/scheduler/extra state as JSON + tensors (no pickle).
- :mod:`~hf_resumable.format.rng`: RNG capture/restore and position-derived seeds.
- :mod:`~hf_resumable.format.state`: the run configuration recorded in a checkpoint, and drift checks.
- ``_jsonio`` (the one JSON writer and bounded parser), ``_safefile`` (regular-file reads that refuse links) and
  ``_bytes`` (a tensor's bytes as flat ``uint8``).
"""
