"""Resumable data position and position-derived randomness for training data loaders.

The sample order is a pure function of ``(seed, epoch)`` (or the stream's own ``state_dict``), so a resume moves a
cursor instead of replaying batches; every batch is fetched, transformed and collated under randomness keyed by its
position, private generators included. Framework-agnostic (no ``transformers`` import); what is covered and what is
not: docs/trainer.md#what-else-it-does, the modules: docs/architecture.md.

Example:

```python
>>> from hf_resumable.data import ResumableBatchSampler, SeededMapDataset, build_map_dataloader
>>> data = [{"x": i} for i in range(10)]
>>> loader = build_map_dataloader(data, collate_fn=lambda items: [d["x"] for d in items], batch_size=4, seed=0)
>>> first_epoch = [batch for batch in loader]
>>> resumed = loader.skip(1)  # start at batch 1 without touching batch 0
>>> [batch for batch in resumed] == first_epoch[1:]
True
```
"""

from __future__ import annotations

from ._fingerprint import dataset_fingerprint
from ._generators import GeneratorSlots
from ._loaders import ResumableDataLoader, build_map_dataloader, build_stream_dataloader, split_stream_for_rank
from ._order import ResumableBatchSampler, length_grouped_order, sampler_epoch_order
from ._position import DATA_EPOCH, DATA_KIND, DATA_LOADER, DATA_NUM_BATCHES, DATA_STEP, BatchKey, data_rng
from ._seeded import SeededIterableDataset, SeededMapDataset, ignore_labels
from ._shuffle_buffer import ResumableShuffleBuffer, has_shuffle_buffer, resumable_shuffle_buffer

__all__ = [
    "BatchKey",
    "data_rng",
    "ResumableBatchSampler",
    "SeededMapDataset",
    "SeededIterableDataset",
    "ignore_labels",
    "ResumableDataLoader",
    "build_map_dataloader",
    "build_stream_dataloader",
    "split_stream_for_rank",
    "dataset_fingerprint",
    "has_shuffle_buffer",
    "ResumableShuffleBuffer",
    "resumable_shuffle_buffer",
    "GeneratorSlots",
    "length_grouped_order",
    "sampler_epoch_order",
    # keys of the JSON data-position records in checkpoints (data/rank-0000R.json)
    "DATA_KIND",
    "DATA_EPOCH",
    "DATA_STEP",
    "DATA_NUM_BATCHES",
    "DATA_LOADER",
]
