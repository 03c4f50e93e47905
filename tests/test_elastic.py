"""ElasticSampler: a run interrupted at any step and resumed at any world size sees every sample once; the front
doors' elastic layout (``ResumableBatchSampler(global_batch=...)``) and plan (``plan_elastic_resume``).

Ranks are simulated in one process (the sampler is a pure function of seed, epoch, rank, world size and
cursor); tests/test_sharded.py runs the same continuation across real 2-rank gloo groups (2 -> 1, 1 -> 2)
through a sharded checkpoint.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from hf_resumable.data import ResumableBatchSampler, SeededMapDataset
from hf_resumable.data.elastic import ElasticSampler, ElasticSeededDataset, SampleKey, sample_seed, split_global_step
from hf_resumable.errors import ConfigDriftError, CorruptCheckpointError
from hf_resumable.integrations._accelerate_elastic import elastic_changes
from hf_resumable.integrations._core import ResumeOptions
from hf_resumable.integrations._elastic import ElasticWorldSizeError, plan_elastic_resume, working_world_sizes

SEED = 7


def ranks(n: int, world_size: int, *, batch_size: int = 2, **kwargs) -> list[ElasticSampler]:
    return [ElasticSampler(n, seed=SEED, rank=r, world_size=world_size, batch_size=batch_size, **kwargs)
            for r in range(world_size)]


def run_steps(samplers: list[ElasticSampler], steps: int | None) -> list[int]:
    """Iterate all ranks in lockstep for ``steps`` global steps (None: to the end of the epoch).

    Returns the samples in global order: each step's batches concatenated in rank order.
    """
    iterators = [iter(s) for s in samplers]
    consumed: list[int] = []
    lengths = {len(s) for s in samplers}
    assert len(lengths) == 1, "ranks must agree on the number of batches (lockstep)"
    for _ in range(lengths.pop() if steps is None else steps):
        for it in iterators:
            consumed += next(it)
    states = {json.dumps(s.state_dict() | {"world_size": 0}) for s in samplers}
    assert len(states) == 1, "every rank must hold the same global cursor"
    return consumed


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n", [22, 24, 5])
def test_resume_at_any_world_size_continues_the_global_order(n, shuffle, drop_last):
    order = ElasticSampler(n, seed=SEED, batch_size=1, shuffle=shuffle).global_order(0)
    for saved_world in (1, 2, 3):
        for resumed_world in (1, 2, 3):
            total = len(ranks(n, saved_world, shuffle=shuffle, drop_last=drop_last)[0])
            for steps in sorted({0, min(1, total), total // 2, total}):
                before = ranks(n, saved_world, shuffle=shuffle, drop_last=drop_last)
                seen = run_steps(before, steps)
                state = json.loads(json.dumps(before[0].state_dict()))  # survives JSON
                after = ranks(n, resumed_world, shuffle=shuffle, drop_last=drop_last)
                for sampler in after:
                    sampler.load_state_dict(state)
                seen += run_steps(after, None)
                case = (saved_world, resumed_world, steps)
                assert len(seen) == len(set(seen)), ("repeated", case)
                assert seen == order[: len(seen)], ("skipped or reordered", case)
                if not drop_last:
                    assert len(seen) == n, ("not every sample", case)
                else:
                    assert n - len(seen) < max(saved_world, resumed_world) * 2, ("dropped too much", case)


def test_order_depends_on_seed_and_epoch_only():
    one, two = ranks(50, 1)[0], ranks(50, 2)[1]
    assert one.global_order(3) == two.global_order(3) != one.global_order(4)
    assert sorted(one.global_order(3)) == list(range(50))
    assert ElasticSampler(50, seed=SEED + 1, batch_size=1).global_order(3) != one.global_order(3)


def test_short_last_step_keeps_ranks_in_lockstep():
    samplers = ranks(5, 3)  # one global step of 5 < 6: split 2, 2, 1
    assert [list(s) for s in samplers] == [[s.global_order(0)[0:2]] for s in samplers[:1]] + [
        [samplers[1].global_order(0)[2:4]], [samplers[2].global_order(0)[4:5]]]
    lonely = ranks(1, 2)
    assert [len(s) for s in lonely] == [1, 1]
    assert [list(s) for s in lonely] == [[[0]], [[]]]
    assert split_global_step(0, 1, world_size=2, batch_size=4, rank=1) == (1, 1)


def test_epochs_and_state_validation():
    sampler = ranks(10, 2)[0]
    list(sampler)
    assert sampler.state_dict()["consumed"] == 10 and len(sampler) == 0
    sampler.set_epoch(0)  # the current epoch keeps its cursor (a resumed loop calls set_epoch again)
    assert len(sampler) == 0
    sampler.set_epoch(1)
    assert len(sampler) == 3 and sampler.state_dict()["epoch"] == 1

    state = sampler.state_dict()
    with pytest.raises(ConfigDriftError, match="seed"):
        ElasticSampler(10, seed=SEED + 1, batch_size=2).load_state_dict(state)
    with pytest.raises(ConfigDriftError, match="dataset_len"):
        ElasticSampler(11, seed=SEED, batch_size=2).load_state_dict(state)
    with pytest.raises(CorruptCheckpointError, match="Not an ElasticSampler state"):
        ElasticSampler(10, seed=SEED, batch_size=2).load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="rank"):
        ElasticSampler(10, seed=SEED, rank=2, world_size=2, batch_size=2)


class Jitter:
    """A data set whose items carry their own randomness (python, numpy and torch draws)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        import numpy as np

        return torch.tensor([index, random.random(), float(np.random.rand()), torch.rand(()).item()],
                            dtype=torch.float64)


def items_by_index(world_size: int, *, num_workers: int) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for rank in range(world_size):
        sampler = ElasticSampler(12, seed=SEED, rank=rank, world_size=world_size, batch_size=2, keys=True)
        # The loader's own generator: a DataLoader otherwise draws its base seed from the global stream.
        loader = DataLoader(ElasticSeededDataset(Jitter(), seed=SEED), batch_sampler=sampler,
                            num_workers=num_workers, generator=torch.Generator().manual_seed(0))
        for batch in loader:
            out.update({int(row[0]): row.tolist() for row in batch})
    return out


def test_per_sample_randomness_is_the_same_at_any_world_size_and_worker_count():
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    one = items_by_index(1, num_workers=0)
    assert torch.equal(torch.rand(3), before), "fetching must not move the caller's torch stream"
    assert one == items_by_index(3, num_workers=0) == items_by_index(2, num_workers=2)
    assert len(one) == 12 and len({tuple(v[1:]) for v in one.values()}) == 12
    data = ElasticSeededDataset(Jitter(), seed=SEED)
    assert data[SampleKey(0, 3)].tolist() != data[SampleKey(1, 3)].tolist()  # a new epoch, new draws
    assert sample_seed(SEED, 0, 3) != sample_seed(SEED, 1, 3)


# ---- the elastic layout of the front doors (ResumableBatchSampler(global_batch=...), plan_elastic_resume) ----

def optimizer_steps(n: int, *, world_size: int, accumulation: int, batch_size: int = 2,
                    drop_last: bool = False) -> list[Counter]:
    """The samples of every optimizer step of one epoch (all ranks; padding batches left out), with each batch's
    ``elastic_weight`` checked against its samples."""
    samplers = [ResumableBatchSampler(n, batch_size, seed=SEED, rank=r, world_size=world_size, drop_last=drop_last,
                                      global_batch=batch_size * accumulation * world_size) for r in range(world_size)]
    keys = [list(sampler) for sampler in samplers]
    assert len({len(k) for k in keys}) == 1, "ranks must stay in lockstep"
    steps = []
    for s in range(-(-len(keys[0]) // accumulation)):
        window = [(sampler, key) for sampler, rank in zip(samplers, keys)
                  for key in rank[s * accumulation:(s + 1) * accumulation]]
        steps.append(Counter(i for _, key in window if not key.padding for i in key.indices))
        for sampler, key in window:
            samples, step_samples = sampler.elastic_weight(key.step)
            assert (samples, step_samples) == (0 if key.padding else len(key.indices), sum(steps[-1].values()))
    return steps


@pytest.mark.parametrize("n", [24, 29, 68])
def test_elastic_layout_gives_every_optimizer_step_the_same_samples_at_any_world_size(n):
    two = optimizer_steps(n, world_size=2, accumulation=2)
    assert len(two) == -(-n // 8) and sum(two, Counter()) == Counter(range(n))  # every sample once, the tail too
    assert optimizer_steps(n, world_size=1, accumulation=4) == two == optimizer_steps(n, world_size=4, accumulation=1)
    assert optimizer_steps(n, world_size=8, accumulation=1, batch_size=1) == two  # ranks without a sample: padding
    dropped = optimizer_steps(n, world_size=2, accumulation=2, drop_last=True)
    assert dropped == two[:n // 8] == optimizer_steps(n, world_size=4, accumulation=1, drop_last=True)


@pytest.mark.parametrize("n", [24, 29, 68])
def test_elastic_layout_trains_the_samples_and_optimizer_steps_of_the_layout_without_it(n):
    """68 samples, global batch 8: 9 optimizer steps per epoch (the last of 4 samples), as without elastic=True."""
    for world_size, accumulation in ((1, 4), (2, 2)):
        plain = [ResumableBatchSampler(n, 2, seed=SEED, rank=r, world_size=world_size) for r in range(world_size)]
        steps = optimizer_steps(n, world_size=world_size, accumulation=accumulation)
        assert len(steps) == -(-len(plain[0]) // accumulation)  # what accumulation_windows/Trainer make of it
        assert sum(map(sum, (s.values() for s in steps))) == n
        if world_size == 1:  # one rank: the very batches (and so steps) of the layout without elastic=True
            assert [key.indices for key in plain[0]] == [key.indices for key in
                                                         ResumableBatchSampler(n, 2, seed=SEED, global_batch=8)]


def test_elastic_chunks_are_the_same_batches_at_any_world_size():
    """Chunk c (a key's ``chunk``) is the same samples, so the same collated batch, whoever trains on it."""
    def chunks(world_size):
        return {key.chunk: key.indices for rank in range(world_size)
                for key in ResumableBatchSampler(24, 2, seed=SEED, rank=rank, world_size=world_size, global_batch=8)}

    assert chunks(1) == chunks(2) == chunks(4) and sorted(chunks(2)) == list(range(12))
    collate = lambda items: [x + random.random() for x in items]  # noqa: E731  a collator drawing from python random
    data = SeededMapDataset(list(range(24)), collate, seed=SEED)
    one = {key.chunk: data[key] for key in ResumableBatchSampler(24, 2, seed=SEED, global_batch=8)}
    two = {key.chunk: data[key] for rank in (0, 1)
           for key in ResumableBatchSampler(24, 2, seed=SEED, rank=rank, world_size=2, global_batch=8)}
    assert one == two


def test_elastic_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="multiple of batch_size"):
        ResumableBatchSampler(24, 2, seed=SEED, world_size=2, global_batch=6)


def test_elastic_plan_keeps_the_global_batch_and_refuses_a_world_size_that_does_not_divide():
    plan = plan_elastic_resume(saved_world_size=2, saved_accumulation=2, per_device_batch=2, world_size=1)
    assert (plan.global_batch, plan.gradient_accumulation_steps) == (8, 4)
    assert "gradient_accumulation_steps 2 -> 4" in plan.describe()
    assert plan_elastic_resume(saved_world_size=1, saved_accumulation=4, per_device_batch=2,
                               world_size=2).gradient_accumulation_steps == 2
    with pytest.raises(ElasticWorldSizeError, match=r"world sizes \[1, 2, 4\]") as error:
        plan_elastic_resume(saved_world_size=2, saved_accumulation=2, per_device_batch=2, world_size=3)
    assert isinstance(error.value, ConfigDriftError) and isinstance(error.value, ValueError)
    assert working_world_sizes(12, 2) == [1, 2, 3, 6]


def test_elastic_option_is_validated():
    assert ResumeOptions(elastic=True).elastic is True
    with pytest.raises(ValueError, match="elastic must be True or False"):
        ResumeOptions(elastic="yes")


def test_an_elastic_accelerate_resume_ignores_only_what_it_changes_on_purpose():
    loaders = ([{"batch_size": 2, "num_batches": 6}], [{"batch_size": 2, "num_batches": 12}])
    changed = {"world_size": (2, 1), "gradient_accumulation_steps": (2, 4), "loaders": loaders,
               "scheduler_steps_per_optimizer_step": (2, 1)}
    assert elastic_changes(changed, kept=True) == {}
    assert set(elastic_changes(changed, kept=False)) == {"world_size", "gradient_accumulation_steps"}
    other = ([{"batch_size": 2, "num_batches": 6}], [{"batch_size": 4, "num_batches": 6}])
    assert elastic_changes({"loaders": other}, kept=True) == {"loaders": other}  # another per-device batch
