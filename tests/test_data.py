"""hf_resumable.data: cursor-based positions, position-keyed randomness, streaming state without replay."""

from __future__ import annotations

import json
import random

import datasets
import numpy as np
import pytest
import torch

from hf_resumable.data import (
    ResumableBatchSampler,
    ResumableShuffleBuffer,
    SeededIterableDataset,
    build_map_dataloader,
    build_stream_dataloader,
    data_rng,
    dataset_fingerprint,
    has_shuffle_buffer,
    resumable_shuffle_buffer,
)
from hf_resumable.errors import InexactResumeError


class CountingRandomDataset(torch.utils.data.Dataset):
    """Counts fetches; every item draws from python, numpy and torch global generators."""

    def __init__(self, n: int) -> None:
        self.n, self.fetched = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        self.fetched.append(index)
        return {"x": index, "noise": (random.random(), float(np.random.rand()), float(torch.rand(())))}


def collate_with_noise(items: list[dict]) -> dict:
    return {"x": torch.tensor([i["x"] for i in items]), "noise": torch.tensor([i["noise"] for i in items]),
            "collate_noise": torch.rand(len(items))}


def _batches(loader) -> list[dict]:
    return [batch for batch in loader]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_sampler_is_a_pure_function_of_seed_and_epoch() -> None:
    sampler = ResumableBatchSampler(10, 3, seed=1)
    first = [key.indices for key in sampler]
    assert [len(i) for i in first] == [3, 3, 3, 1] and sorted(sum(first, ())) == list(range(10))
    assert [key.indices for key in ResumableBatchSampler(10, 3, seed=1)] == first
    sampler.set_epoch(1)
    assert [key.indices for key in sampler] != first
    sampler.set_epoch(0)
    assert [key.indices for key in sampler.skip(2)] == first[2:]


def test_sampler_shards_ranks_like_distributed_sampler() -> None:
    ranks = [ResumableBatchSampler(7, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2
    seen = [i for r in ranks for key in r for i in key.indices]
    assert len(seen) == 8 and set(seen) == set(range(7))  # padded to a multiple of the world size


def test_sampler_does_not_touch_the_global_rng() -> None:
    before = torch.get_rng_state()
    list(ResumableBatchSampler(100, 8, seed=3))
    assert torch.equal(before, torch.get_rng_state())


def test_data_rng_keeps_the_callers_streams() -> None:
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with data_rng(5):
        random.random(), np.random.rand(), torch.rand(3)
    assert random.getstate() == state[0]
    assert np.array_equal(np.random.get_state()[1], state[1])
    assert torch.equal(torch.get_rng_state(), state[2])


def _full_numpy_state() -> tuple:
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return name, key.tolist(), pos, has_gauss, gauss


@pytest.mark.parametrize("cached_gauss", [False, True], ids=["no-cached-normal", "cached-normal"])
@pytest.mark.parametrize("inner_normals", [0, 1, 2])
def test_data_rng_restores_numpy_exactly_and_draws_what_seeded_rng_draws(
        cached_gauss: bool, inner_normals: int) -> None:
    from hf_resumable.format.rng import seeded_rng

    np.random.seed(11)
    if cached_gauss:  # legacy RandomState keeps the second normal of a pair: part of the caller's stream
        np.random.standard_normal()
    before = _full_numpy_state()
    assert before[3] == int(cached_gauss)

    def draws() -> list:
        return [np.random.rand(2).tolist(), np.random.standard_normal(inner_normals).tolist(), random.random(),
                torch.rand(2).tolist()]

    with data_rng(5):
        ours = draws()
    assert _full_numpy_state() == before
    continued = np.random.standard_normal(3).tolist()
    np.random.set_state(before[:1] + (np.array(before[1], dtype=np.uint32),) + before[2:])
    assert np.random.standard_normal(3).tolist() == continued
    with seeded_rng(5):
        assert draws() == ours


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_resumes_without_fetching_and_with_the_same_randomness(workers: int) -> None:
    reference = _batches(build_map_dataloader(CountingRandomDataset(22), collate_fn=collate_with_noise,
                                              batch_size=4, seed=9, num_workers=workers))
    dataset = CountingRandomDataset(22)
    loader = build_map_dataloader(dataset, collate_fn=collate_with_noise, batch_size=4, seed=9, num_workers=0)
    random.random(), torch.rand(5)  # whatever the main process drew before must not matter
    resumed = _batches(loader.skip(3))
    assert _equal(resumed, reference[3:])
    skipped = set(torch.cat([b["x"] for b in reference[:3]]).tolist())
    assert not skipped & set(dataset.fetched), "skipped samples were fetched"


def test_loader_iteration_does_not_consume_the_global_rng() -> None:
    loader = build_map_dataloader(CountingRandomDataset(12), collate_fn=collate_with_noise, batch_size=4, seed=0)
    before = torch.get_rng_state()
    _batches(loader)
    assert torch.equal(before, torch.get_rng_state())


def test_datasets_set_transform_randomness_is_position_keyed() -> None:
    ds = datasets.Dataset.from_dict({"x": list(range(16))})
    ds.set_transform(lambda batch: {"x": [v * 100 + random.randint(0, 99) for v in batch["x"]]})
    collate = lambda items: torch.tensor([i["x"] for i in items])  # noqa: E731
    full = _batches(build_map_dataloader(ds, collate_fn=collate, batch_size=4, seed=2))
    again = _batches(build_map_dataloader(ds, collate_fn=collate, batch_size=4, seed=2).skip(2))
    assert all(torch.equal(a, b) for a, b in zip(full[2:], again)) and len(again) == 2
    assert not all(torch.equal(a, b) for a, b in zip(full, _batches(build_map_dataloader(
        ds, collate_fn=collate, batch_size=4, seed=3))))


class CountingStream(torch.utils.data.IterableDataset):
    """A stateful stream that counts the examples it produces (to prove there is no replay)."""

    def __init__(self, n: int) -> None:
        self.n, self.start, self.position, self.produced = n, 0, 0, 0

    def __iter__(self):
        self.position, self.start = self.start, 0
        while self.position < self.n:
            self.position += 1
            self.produced += 1
            yield {"x": self.position - 1, "r": random.random()}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["position"]


def _stream_collate(items: list[dict]) -> dict:
    return {"x": torch.tensor([i["x"] for i in items]), "r": torch.tensor([i["r"] for i in items]),
            "c": torch.rand(1)}


def test_stream_resumes_from_state_without_replay() -> None:
    reference = _batches(build_stream_dataloader(CountingStream(30), collate_fn=_stream_collate, batch_size=4,
                                                 seed=1))
    loader = build_stream_dataloader(CountingStream(30), collate_fn=_stream_collate, batch_size=4, seed=1)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    record = loader.position(epoch=0, step=5)
    stream = CountingStream(30)
    resumed_loader = build_stream_dataloader(stream, collate_fn=_stream_collate, batch_size=4, seed=1)
    resumed_loader.load_position(record)
    tail = _batches(resumed_loader.skip(5))
    assert _equal(head + tail, reference)
    assert stream.produced == 30 - 20, "examples before the resume point were produced again"
    with pytest.raises(InexactResumeError, match="restored position is 5"):
        resumed_loader.skip(4)


@pytest.mark.parametrize("workers", [0, 2])
def test_hf_streaming_dataset_with_map_resumes_exactly(workers: int) -> None:
    def make():
        ds = datasets.Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=4)
        ds = ds.map(lambda e: {"x": e["x"] * 10 + random.randint(0, 9)})
        return build_stream_dataloader(ds, collate_fn=_stream_collate_hf, batch_size=3, seed=4, num_workers=workers)

    reference = _batches(make())
    loader = make()
    iterator = iter(loader)
    head = [next(iterator) for _ in range(7)]
    record = loader.position(epoch=0, step=7)
    del iterator
    resumed = make()
    resumed.load_position(record)
    assert _equal(head + _batches(resumed.skip(7)), reference)


def _stream_collate_hf(items: list[dict]) -> dict:
    return {"x": torch.tensor([i["x"] for i in items]), "c": torch.randint(0, 1000, (1,))}


def test_stateless_stream_cannot_be_checkpointed() -> None:
    wrapper = SeededIterableDataset(range(10), list, batch_size=2, seed=0)
    with pytest.raises(InexactResumeError, match="state_dict"):
        wrapper.state_dict()


def test_fingerprint_and_shuffle_buffer_detection() -> None:
    ds = datasets.Dataset.from_dict({"x": list(range(8))})
    assert dataset_fingerprint(ds) == (8, ds._fingerprint)
    assert dataset_fingerprint(list(range(8)))[1] != dataset_fingerprint(list(range(1, 9)))[1]
    stream = ds.to_iterable_dataset(num_shards=2)
    assert dataset_fingerprint(stream)[0] is None
    assert not has_shuffle_buffer(stream.map(lambda e: e))
    assert has_shuffle_buffer(stream.shuffle(seed=0, buffer_size=4).map(lambda e: e))


def _shuffled_stream(seed: int = 3) -> datasets.IterableDataset:
    ds = datasets.Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=4)
    return ds.shuffle(seed=seed, buffer_size=8).map(lambda e: {"x": e["x"] * 10 + random.randint(0, 9)})


@pytest.mark.parametrize("workers", [0, 2])
def test_hf_stream_with_a_shuffle_buffer_resumes_exactly(workers: int) -> None:
    """datasets' buffer is replaced by ours, whose content is in the (JSON) position: the resumed loader
    continues bit for bit, every sample is seen once, and the order is shuffled."""
    def make(seed: int = 3):
        return build_stream_dataloader(_shuffled_stream(seed), collate_fn=_stream_collate_hf, batch_size=3, seed=4,
                                       num_workers=workers)

    loader = make()
    assert isinstance(loader.dataset.dataset, ResumableShuffleBuffer)
    assert not has_shuffle_buffer(loader.dataset.dataset.source)
    reference = _batches(make())
    seen = [int(x) // 10 for batch in reference for x in batch["x"]]
    assert sorted(seen) == list(range(64)) and seen != sorted(seen)
    other = [int(x) // 10 for batch in _batches(make(seed=5)) for x in batch["x"]]
    assert other != seen, "the datasets shuffle seed must select the buffer's order"
    iterator = iter(loader)
    head = [next(iterator) for _ in range(7)]
    record = json.loads(json.dumps(loader.position(epoch=0, step=7)))  # what a checkpoint stores
    del iterator
    resumed = make()
    resumed.load_position(record)
    assert _equal(head + _batches(resumed.skip(7)), reference)


def test_shuffle_buffer_state_holds_tensors_exactly() -> None:
    """Examples formatted as torch tensors survive the JSON state bit for bit (values drawn at random)."""
    ds = datasets.Dataset.from_dict({"v": torch.randn(20, 3).tolist()}).to_iterable_dataset(num_shards=2)
    ds = ds.map(lambda e: {"v": [v * 1.0000001 for v in e["v"]]}).with_format("torch")
    buffer = resumable_shuffle_buffer(ds.shuffle(seed=0, buffer_size=6))
    reference = [e["v"] for e in buffer]
    iterator = iter(buffer)
    head = [next(iterator)["v"] for _ in range(5)]
    state = json.loads(json.dumps(buffer.state_dict()))
    assert len(state["buffer"]) == 6
    restored = resumable_shuffle_buffer(ds.shuffle(seed=0, buffer_size=6))
    restored.load_state_dict(state)
    got = head + [e["v"] for e in restored]
    assert len(got) == 20 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, reference))


def test_shuffle_buffer_state_after_any_example_resumes_exactly() -> None:
    """The state taken after any example (the buffer filling, replacing, draining; and again in a restored run) holds
    the buffer's content in step with it: each resume continues the uninterrupted order."""
    def make() -> ResumableShuffleBuffer:
        ds = datasets.Dataset.from_dict({"x": list(range(12))}).to_iterable_dataset(num_shards=2)
        return resumable_shuffle_buffer(ds.shuffle(seed=0, buffer_size=5))

    reference = [e["x"] for e in make()]
    assert sorted(reference) == list(range(12)) and reference != sorted(reference)
    for cut in range(1, 12):
        buffer = make()
        iterator = iter(buffer)
        head = [next(iterator)["x"] for _ in range(cut)]
        restored = make()
        restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
        iterator = iter(restored)
        middle = [next(iterator)["x"] for _ in range((12 - cut) // 2)]
        again = make()
        again.load_state_dict(json.loads(json.dumps(restored.state_dict())))
        assert head + middle + [e["x"] for e in again] == reference, cut


def test_shuffle_buffer_that_cannot_be_replaced_is_kept_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    ds = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=2)
    mixed = datasets.interleave_datasets([ds.shuffle(seed=0, buffer_size=4), ds])
    with pytest.raises(InexactResumeError, match="multi-source"):
        resumable_shuffle_buffer(mixed)
    loader = build_stream_dataloader(mixed, collate_fn=_stream_collate_hf, batch_size=2, seed=0)
    assert has_shuffle_buffer(loader.dataset.dataset)
    assert "NOT be bit-exact" in caplog.text


def test_shuffle_buffer_per_rank_after_split_by_node_resumes_exactly() -> None:
    """Data parallel: each rank's split stream gets its own buffer (rank in the seed); the ranks cover the data
    set once between them, and each resumes exactly."""
    from datasets.distributed import split_dataset_by_node

    def make(rank: int):
        split = split_dataset_by_node(_shuffled_stream(), rank=rank, world_size=2)
        return build_stream_dataloader(split, collate_fn=_stream_collate_hf, batch_size=3, seed=4, rank=rank)

    per_rank = [_batches(make(rank)) for rank in (0, 1)]
    seen = [int(x) // 10 for batches in per_rank for batch in batches for x in batch["x"]]
    assert sorted(seen) == list(range(64))
    for rank in (0, 1):
        loader = make(rank)
        iterator = iter(loader)
        head = [next(iterator) for _ in range(4)]
        record = json.loads(json.dumps(loader.position(epoch=0, step=4)))
        del iterator
        resumed = make(rank)
        resumed.load_position(record)
        assert _equal(head + _batches(resumed.skip(4)), per_rank[rank])


def test_shuffle_buffer_second_epoch_reshuffles_and_resumes() -> None:
    """set_epoch changes the buffer's draws; a position taken in epoch 1 resumes epoch 1 exactly."""
    def make():
        return build_stream_dataloader(_shuffled_stream(), collate_fn=_stream_collate_hf, batch_size=3, seed=4)

    loader = make()
    loader.set_epoch(1)
    epoch1 = _batches(loader)
    loader = make()
    epoch0 = _batches(loader)
    assert [b["x"].tolist() for b in epoch0] != [b["x"].tolist() for b in epoch1]
    loader = make()
    loader.set_epoch(1)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    record = json.loads(json.dumps(loader.position(epoch=1, step=5)))
    del iterator
    resumed = make()
    resumed.load_position(record)
    resumed.set_epoch(1)
    assert _equal(head + _batches(resumed.skip(5)), epoch1)
