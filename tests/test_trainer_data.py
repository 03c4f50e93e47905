"""Data-side pieces ResumableTrainer relies on: private generators of collators and data sets follow the
position-derived seeding, and ``group_by_length`` orders are a pure function of (seed, epoch, lengths)."""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import DataCollatorForLanguageModeling
from transformers.trainer_pt_utils import get_length_grouped_indices
from transformers.trainer_utils import RemoveColumnsCollator

from hf_resumable.data import GeneratorSlots, ResumableBatchSampler, length_grouped_order

sys.path.insert(0, str(Path(__file__).parent / "trainer_scripts"))
import train_tiny  # noqa: E402


class _Holder:
    def __init__(self) -> None:
        self.torch_gen = torch.Generator().manual_seed(1)
        self.numpy_gen = np.random.default_rng(2)
        self.legacy = np.random.RandomState(3)
        self.python = random.Random(4)
        self.nested = {"inner": [np.random.default_rng(5)]}


def _draws(holder: _Holder) -> tuple:
    return (torch.rand(2, generator=holder.torch_gen).tolist(), holder.numpy_gen.random(), holder.legacy.rand(),
            holder.python.random(), holder.nested["inner"][0].random())


def test_every_kind_of_generator_is_found_and_reseeded_by_position() -> None:
    holder = _Holder()
    slots = GeneratorSlots(holder)
    assert sorted(slots.paths) == ["legacy", "nested.inner.0", "numpy_gen", "python", "torch_gen"]
    slots.reseed(holder, seed=11)
    first = _draws(holder)
    _draws(holder)  # the streams move on...
    slots.reseed(holder, seed=11)
    assert _draws(holder) == first  # ...and the same position gives the same numbers again
    slots.reseed(holder, seed=12)
    assert _draws(holder) != first


def test_generators_behind_partials_closures_and_the_trainers_column_wrapper() -> None:
    rng = np.random.default_rng(0)

    def collate(items, noise):
        return [noise.random() + rng.random() for _ in items]

    wrapped = RemoveColumnsCollator(functools.partial(collate, noise=np.random.default_rng(1)), signature_columns=[])
    slots = GeneratorSlots(wrapped)
    assert sorted(slots.paths) == ["data_collator.func.0", "data_collator.noise"]
    slots.reseed(wrapped, seed=3)
    first = wrapped.data_collator([{}])
    slots.reseed(wrapped, seed=3)
    assert wrapped.data_collator([{}]) == first


def test_a_seeded_transformers_collator_follows_the_batch_seed() -> None:
    """DataCollatorForLanguageModeling(seed=...) creates its generator on first use (and again per process)."""
    tokenizer = train_tiny.build_tokenizer()
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.5, seed=123)
    slots = GeneratorSlots(collator)
    assert slots.paths == ["generator"]
    features = [{"input_ids": row} for row in train_tiny.token_rows(4)]
    slots.reseed(collator, seed=7)
    first = collator(features)["labels"]
    assert not torch.equal(collator(features)["labels"], first)  # the generator moves on
    slots.reseed(collator, seed=7)
    assert torch.equal(collator(features)["labels"], first)
    other = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.5, seed=124)
    GeneratorSlots(other).reseed(other, seed=7)
    assert not torch.equal(other(features)["labels"], first)  # the collator's own seed still matters


def test_large_objects_are_not_searched() -> None:
    tokenizer = train_tiny.build_tokenizer()
    assert not GeneratorSlots(tokenizer)
    assert not GeneratorSlots({"rows": [np.random.default_rng(0)] * 100})  # containers above 64 items are skipped


def test_length_grouped_order_groups_like_the_stock_sampler_and_is_a_function_of_the_seed() -> None:
    lengths = [random.Random(i).randint(1, 100) for i in range(500)]
    ours = length_grouped_order(lengths, 8, generator=torch.Generator().manual_seed(3))
    assert ours == get_length_grouped_indices(lengths, 8, generator=torch.Generator().manual_seed(3))
    assert ours == length_grouped_order(lengths, 8, generator=torch.Generator().manual_seed(3))
    assert lengths[ours[0]] == max(lengths)  # the longest sample first


def test_a_length_grouped_sampler_resumes_at_any_batch() -> None:
    lengths = [3 + (i * 7) % 20 for i in range(400)]
    sampler = ResumableBatchSampler(400, 4, seed=0, lengths=lengths, group_size=4)
    sampler.set_epoch(1)
    full = [key.indices for key in sampler]
    plain = ResumableBatchSampler(400, 4, seed=0)
    plain.set_epoch(1)

    def spread(batches) -> int:
        return sum(max(lengths[i] for i in batch) - min(lengths[i] for i in batch) for batch in batches)

    assert spread(full) < spread(key.indices for key in plain) / 2  # grouped batches are far more uniform
    assert [key.indices for key in sampler.skip(57)] == full[57:]
    sampler.set_epoch(2)
    assert [key.indices for key in sampler] != full


def test_a_custom_sampler_order_is_sharded_by_whole_batches() -> None:
    """Consecutive indices of a custom sampler (TRL's repeated prompts) stay together on one rank, as with
    accelerate's BatchSamplerShard; one process keeps a short last batch, as a DataLoader does."""
    order = lambda epoch: [i // 2 for i in range(12)]  # noqa: E731 - each index twice, like num_generations=2
    ranks = [[key.indices for key in ResumableBatchSampler(12, 2, seed=0, rank=r, world_size=2, order=order)]
             for r in (0, 1)]
    assert ranks == [[(0, 0), (2, 2), (4, 4)], [(1, 1), (3, 3), (5, 5)]]
    single = ResumableBatchSampler(10, 4, seed=0, order=lambda epoch: list(range(10)))
    assert [key.indices for key in single] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
