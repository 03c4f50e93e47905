"""Resumable data position and position-derived randomness for training data loaders.

Exact resume needs two things from the data pipeline:

1. **A cursor instead of a history.** The order of samples is a pure function of ``(seed, epoch)``
   (map-style data) or lives in the data set's own ``state_dict`` (streaming data), so resuming at
   batch ``n`` never fetches, transforms or collates the ``n`` batches before it.
2. **Randomness keyed by position.** Every batch is fetched, transformed *and* collated inside a
   random context seeded from ``(seed, epoch, rank, batch)`` (plus the worker id for streaming data),
   so masking in ``DataCollatorForLanguageModeling``, augmentation in a ``set_transform`` or a
   ``Dataset.__getitem__`` draws the same numbers whether the run was interrupted or not, with any
   number of workers. In the main process the caller's generators (the ones dropout draws from) are
   put back afterwards, so data randomness never shifts model randomness.
3. **State for every buffer.** A ``datasets`` shuffle buffer (``ds.shuffle(seed, buffer_size=N)``) is
   replaced by a :class:`ResumableShuffleBuffer` whose content and generator are part of the saved
   position (``datasets`` saves neither); the resulting order differs from ``datasets``' own shuffle.
4. **Private generators keyed by position too.** Collators and data sets that keep their own generator
   (``DataCollatorForLanguageModeling(seed=...)``, ``self.rng = np.random.default_rng(0)``) would restart
   from their seed after a resume. :class:`GeneratorSlots` finds every ``torch.Generator``,
   ``numpy.random.Generator``, ``numpy.random.RandomState`` and ``random.Random`` reachable from the
   collator (and from a torch data set or a ``datasets`` transform) through attributes, dataclass fields,
   ``functools.partial`` arguments, closures and small lists/dicts (up to 4 levels), plus the generator
   transformers' collators create lazily from their ``seed``, and reseeds each one before every batch
   from the batch's seed and the generator's path (and the object's own ``seed`` attribute), in the main
   process and in workers alike. Generators reached any other way (module globals, objects created
   inside the call, containers of more than 64 items, CUDA generators) are not covered.
5. **Length-grouped batches.** ``group_by_length`` (the seq2seq/ASR habit) orders each epoch as a pure
   function of ``(seed, epoch, lengths)`` (:func:`length_grouped_order`), so it resumes exactly too.
6. **Custom samplers.** An index sampler of the user's (a ``Trainer`` subclass's ``_get_train_sampler``,
   TRL's ``RepeatSampler``) is replayed per epoch under a seed derived from ``(seed, epoch)``
   (:func:`sampler_epoch_order`), which makes its order a function of the epoch, and resumed by cursor.

The pieces are framework-agnostic (no ``transformers`` import); :mod:`hf_resumable.integrations.trainer`
assembles them for the ``Trainer``. Modules: ``_position`` (record keys, batch key, the seeded random context),
``_order`` (sample
orders), ``_generators`` (private generators), ``_seeded`` (seeded data sets), ``_loaders`` (the loaders and
their builders), ``_shuffle_buffer``, ``_fingerprint``, and ``elastic`` (global-sample-space
sampling that survives a world-size change).

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
