"""``accelerator.prepare(DataLoader(...))`` with ResumableAccelerator: accelerate's loader classes, resumed exactly.

A plain ``DataLoader`` (shuffled, with random augmentation in the data set and the collator, with and without
worker processes) is saved in the middle of an epoch and resumed by a fresh accelerator: the remaining batches,
the next epoch and every random draw are the ones the uninterrupted run saw, and no skipped batch is fetched.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from hf_resumable.errors import DoubleSkipError, InexactResumeError
from hf_resumable.integrations.accelerate import ResumableAccelerator

from helpers import zygote
from helpers.accelerate_runs import (
    _fresh_accelerate_state,  # noqa: F401 - autouse: a fresh accelerate state
    stream_accelerator,
    stream_accumulate_run,
)
from helpers.distributed_launch import REPO_ROOT, child_env

STREAM_WORKER = REPO_ROOT / "tests" / "scripts" / "stream_accumulate_worker.py"


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class NoisyDataset(Dataset):
    """22 samples with random augmentation in ``__getitem__``; counts fetches made in this process."""

    def __init__(self) -> None:
        self.fetched = 0

    def __len__(self) -> int:
        return 22

    def __getitem__(self, index: int) -> dict:
        self.fetched += 1
        return {"x": torch.tensor([float(index)]) + torch.rand(1), "index": index}


def noisy_collate(items: list[dict]) -> dict:
    """Randomness from python ``random`` and numpy, as collators do (masking, cropping...)."""
    x = torch.cat([item["x"] for item in items])
    return {"x": x + random.random() + float(np.random.rand()), "index": torch.tensor([i["index"] for i in items])}


def as_lists(batches: list[dict]) -> list[tuple]:
    return [(b["index"].tolist(), b["x"].tolist()) for b in batches]


def make_loader(num_workers: int = 0, **options) -> DataLoader:
    return DataLoader(NoisyDataset(), batch_size=4, shuffle=True, collate_fn=noisy_collate, num_workers=num_workers,
                      **options)


def build(tmp_path, *, seed: int, num_workers: int = 0, config: DataLoaderConfiguration | None = None):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False,
                                       dataloader_config=config)
    torch.manual_seed(seed)
    model = torch.nn.Linear(1, 1)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                                   make_loader(num_workers))
    return accelerator, model, optimizer, loader


def train_on(accelerator, model, optimizer, batch) -> None:
    accelerator.backward(torch.nn.functional.dropout(model(batch["x"][:, None]), 0.5).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_loader_saved_mid_epoch_resumes_the_remaining_batches_exactly(tmp_path, num_workers):
    accelerator, model, optimizer, loader = build(tmp_path, seed=0, num_workers=num_workers)
    assert isinstance(loader, DataLoaderShard) and isinstance(loader, DataLoader)
    seen = {0: [], 1: []}
    for epoch in range(2):
        for step, batch in enumerate(loader):
            train_on(accelerator, model, optimizer, batch)
            seen[epoch].append(batch)
            if epoch == 0 and step == 2:
                accelerator.save_state()  # inside the loop: 3 batches of epoch 0 consumed
                after_save = torch.rand(3)  # the main process's RNG stream after the save point
    assert len(seen[0]) == 6 and as_lists(seen[0]) != as_lists(seen[1])  # reshuffled every epoch
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    reset_accelerate()
    resumed, model2, optimizer2, loader2 = build(tmp_path, seed=123, num_workers=num_workers)  # another seed
    dataset = loader2.dataset.dataset
    resumed.load_state()
    assert torch.equal(torch.rand(3), after_save)  # RNG restored (dropout below draws from it)
    rest = {0: [], 1: []}
    for epoch in range(loader2.iteration, 2):
        for batch in loader2:
            train_on(resumed, model2, optimizer2, batch)
            rest[epoch].append(batch)
    assert as_lists(rest[0]) == as_lists(seen[0][3:])  # the same samples with the same random augmentation
    assert as_lists(rest[1]) == as_lists(seen[1])
    if num_workers == 0:
        assert dataset.fetched == 22 - 12 + 22  # the 3 skipped batches (12 samples) were never fetched
    for key, value in resumed.unwrap_model(model2).state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_iterating_a_prepared_loader_leaves_the_main_rng_alone(tmp_path):
    accelerator, _, _, loader = build(tmp_path, seed=0, num_workers=0)
    torch.manual_seed(7)
    random.seed(7)
    list(loader)
    after = (torch.rand(1), random.random())
    torch.manual_seed(7)
    random.seed(7)
    assert (torch.rand(1), random.random()) == after


def test_without_shuffle_the_batches_are_accelerates(tmp_path):
    def plain(index_only):
        return DataLoader(list(range(10)), batch_size=3)

    stock = Accelerator(cpu=True)
    want = [b.tolist() for b in stock.prepare(plain(True))]
    reset_accelerate()
    ours = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    loader = ours.prepare(plain(True))
    assert [b.tolist() for b in loader] == want
    assert len(loader) == 4 and loader.total_batch_size == 3


@pytest.mark.parametrize(("config", "cls"), [
    (DataLoaderConfiguration(use_stateful_dataloader=True), StatefulDataLoader),
    (DataLoaderConfiguration(dispatch_batches=True), DataLoaderDispatcher),
])
def test_stateful_and_dispatching_loaders_keep_their_class_and_resume(tmp_path, config, cls):
    accelerator, model, optimizer, loader = build(tmp_path, seed=0, config=config)
    assert isinstance(loader, cls) and isinstance(loader, DataLoader)
    batches = []
    for step, batch in enumerate(loader):
        batches.append(batch)
        if step == 1:
            accelerator.save_state()
    reset_accelerate()
    resumed, _, _, loader2 = build(tmp_path, seed=5, config=config)
    resumed.load_state()
    assert as_lists(list(loader2)) == as_lists(batches[2:])
    assert loader2.state_dict()["epoch"] == 1


def test_skip_first_batches_after_load_state_continues_once(tmp_path):
    """accelerate's checkpointing example: load_state(), then skip_first_batches(loader, resume_step)."""
    accelerator, _, _, loader = build(tmp_path, seed=0)
    epoch0 = []
    for step, batch in enumerate(loader):
        epoch0.append(batch)
        if step == 3:
            accelerator.save_state()
    epoch1 = list(loader)
    reset_accelerate()
    resumed, _, _, loader2 = build(tmp_path, seed=0)
    resumed.load_state()
    with pytest.raises(ValueError, match="restored this loader at batch 4"):
        resumed.skip_first_batches(loader2, 2)
    active = resumed.skip_first_batches(loader2, 4)
    assert active is loader2
    assert as_lists(list(active)) == as_lists(epoch0[4:]) and as_lists(list(loader2)) == as_lists(epoch1)

    reset_accelerate()
    fresh, _, _, loader3 = build(tmp_path / "fresh", seed=0)
    assert as_lists(list(fresh.skip_first_batches(loader3, 2))) == as_lists(epoch0[2:])  # no restored position
    assert as_lists(list(loader3)) == as_lists(epoch1)  # later passes are whole epochs


# ------------------------------------------------------------------------- a script's own skip on top of ours
# Scripts written for stock accelerate skip what was trained themselves after load_state; the loader here already
# continues at its saved batch. Through a plain DataLoader (accelerate's prepared classes) and a resumable loader.
KINDS = [pytest.param("plain", 1, id="plain-DataLoader"), pytest.param("resumable", 2, id="prepare_resumable-ga2")]


def build_kind(tmp_path, kind: str, ga: int):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False,
                                       gradient_accumulation_steps=ga)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if kind == "plain":
        loader = accelerator.prepare(make_loader())
    else:
        loader = accelerator.prepare_resumable_dataloader(NoisyDataset(), collate_fn=noisy_collate, batch_size=4,
                                                          seed=0)
    return accelerator, model, optimizer, loader


def train_micro_batch(accelerator, model, optimizer, batch) -> None:
    with accelerator.accumulate(model):
        accelerator.backward(model(batch["x"][:, None]).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


def indices(batches: list[dict]) -> list[list[int]]:
    return [b["index"].tolist() for b in batches]


def epochs_of_a_run(tmp_path, kind: str, ga: int, *, epochs: int, save_after: int | None = None) -> list[list[dict]]:
    """Train ``epochs`` epochs; with ``save_after``, save after that many batches of epoch 0 and stop there."""
    accelerator, model, optimizer, loader = build_kind(tmp_path, kind, ga)
    seen = []
    for _epoch in range(epochs):
        seen.append([])
        with contextlib.closing(iter(loader)) as batches:  # closed before accelerate's state is reset
            for batch in batches:
                train_micro_batch(accelerator, model, optimizer, batch)
                seen[-1].append(batch)
                if len(seen[-1]) == save_after:
                    accelerator.save_state()
                    break
        if len(seen[-1]) == save_after:
            break
    reset_accelerate()
    return seen


@pytest.mark.parametrize("resume_step", [2, 4])  # 4: the skip throws away the rest of epoch 0 (of 6 batches)
@pytest.mark.parametrize(("kind", "ga"), KINDS)
def test_a_script_that_skips_the_restored_batches_by_hand_is_refused_before_any_step(tmp_path, kind, ga,
                                                                                      resume_step):
    """transgenic #59 and scripts older than skip_first_batches: ``if step < resume_step: continue``."""
    reference = epochs_of_a_run(tmp_path / "reference", kind, ga, epochs=1)
    epochs_of_a_run(tmp_path / "run", kind, ga, epochs=1, save_after=resume_step)
    resumed, model, optimizer, loader = build_kind(tmp_path / "run", kind, ga)
    resumed.load_state()
    loaded = {k: v.clone() for k, v in resumed.unwrap_model(model).state_dict().items()}
    # 2 (resume_step 2), or the last 2 of epoch 0 and 1 of epoch 1 (resume_step 4), thrown away, then 1 trained
    with pytest.raises(DoubleSkipError, match=f"restored the training loader at batch {resume_step} of epoch 0.*"
                                              "but 3 batches were drawn") as refused:
        for epoch in range(2):
            with contextlib.closing(iter(loader)) as batches:  # closed before accelerate's state is reset
                for step, batch in enumerate(batches):
                    if epoch == 0 and resume_step and step < resume_step:
                        continue
                    train_micro_batch(resumed, model, optimizer, batch)
    assert isinstance(refused.value, RuntimeError) and isinstance(refused.value, InexactResumeError)
    assert f"{__file__}:" in str(refused.value) and "Remove that skip" in str(refused.value)
    assert resumed.global_step == resume_step // ga  # no optimizer step was taken, no weight moved
    for key, value in resumed.unwrap_model(model).state_dict().items():
        assert torch.equal(value, loaded[key]), key
    reset_accelerate()

    # the loop without its own skip trains the rest of the epoch, the whole first window drawn before a backward
    resumed, model, optimizer, loader = build_kind(tmp_path / "run", kind, ga)
    resumed.load_state()
    rest = []
    for window in resumed.accumulation_windows(loader):
        for batch in window:
            train_micro_batch(resumed, model, optimizer, batch)
            rest.append(batch)
    assert indices(rest) == indices(reference[0][resume_step:])


@pytest.mark.parametrize(("kind", "ga"), KINDS)
def test_skip_first_batches_in_every_epoch_after_a_resume_skips_once(tmp_path, kind, ga, caplog):
    """Megatron-Bridge #4565, open-instruct: ``skip_first_batches(loader, resume_step)`` in every epoch after a
    resume. The first call (accelerate's own idiom) is what the loader already did; the later ones skip nothing."""
    reference = epochs_of_a_run(tmp_path / "reference", kind, ga, epochs=3)
    epochs_of_a_run(tmp_path / "run", kind, ga, epochs=1, save_after=4)
    resumed, model, optimizer, loader = build_kind(tmp_path / "run", kind, ga)
    resumed.load_state()
    resume_step, trained = 4, []
    with caplog.at_level("WARNING"):
        for _epoch in range(0, 3):
            active = resumed.skip_first_batches(loader, resume_step) if resume_step else loader
            trained.append([])
            for batch in active:
                train_micro_batch(resumed, model, optimizer, batch)
                trained[-1].append(batch)
    assert [indices(epoch) for epoch in trained] == [indices(reference[0][4:]), *map(indices, reference[1:])]
    warnings = [r.getMessage() for r in caplog.records if "repeats the resume skip" in r.getMessage()]
    assert len(warnings) == 1 and f"{__file__}:" in warnings[0], warnings


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_a_loader_that_cannot_be_positioned_says_so_at_prepare(tmp_path, caplog):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    with caplog.at_level("WARNING"):
        loader = accelerator.prepare(DataLoader(Stream(), batch_size=2))
    assert "position is not saved" in caplog.text and "IterableDataset" in caplog.text
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


class StatefulStream(IterableDataset):
    """A stream whose state_dict() is its position (as datasets.IterableDataset's is)."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        while self.position < 12:
            self.position += 1
            yield self.position - 1
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def test_a_stateful_iterable_loader_resumes_mid_epoch_as_with_stock_accelerate(tmp_path):
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False,
                                       dataloader_config=config)
    loader = accelerator.prepare(DataLoader(StatefulStream(), batch_size=2))
    batches = []
    for step, batch in enumerate(loader):
        batches.append(batch.tolist())
        if step == 1:
            accelerator.save_state()
    reset_accelerate()
    resumed = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False,
                                   dataloader_config=config)
    loader2 = resumed.prepare(DataLoader(StatefulStream(), batch_size=2))
    resumed.load_state()
    assert [b.tolist() for b in loader2] == batches[2:]



def test_a_stream_marks_its_last_batch_as_stock_accelerate(tmp_path):
    """A prepared stream reads one batch ahead, as accelerate's ``DataLoaderShard`` does: a direct loop inside
    ``accumulate`` marks the pass's last batch (``end_of_dataloader``) and takes the optimizer steps of stock
    accelerate, the pass's shorter last step too, to its weights."""
    stock_marks, stock_weight = stream_accumulate_run(Accelerator(cpu=True, gradient_accumulation_steps=2))
    assert [sync for _, sync in stock_marks] == [False, True, False, True, True] * 2  # the 5th: a step of one
    assert [end for end, _ in stock_marks] == [False] * 4 + [True] + [False] * 4 + [True]
    marks, weight = stream_accumulate_run(stream_accelerator(tmp_path))
    assert marks == stock_marks and torch.equal(weight, stock_weight)


@pytest.mark.slow
@pytest.mark.parametrize("save_after", [4, 5, 7])  # before the pass's last (read-ahead) batch, at its end, pass 2
def test_a_stream_killed_after_a_save_resumes_as_stock_accelerate_trains(tmp_path, save_after):
    """The same loop SIGKILLed right after ``save_state`` and run again continues bit for bit: the batch read ahead
    is not in the saved position."""
    stock_marks, stock_weight = stream_accumulate_run(Accelerator(cpu=True, gradient_accumulation_steps=2))
    reset_accelerate()
    checkpoints, marks_file = tmp_path / "checkpoints", tmp_path / "marks.json"
    command = [sys.executable, str(STREAM_WORKER), str(checkpoints), str(save_after), str(marks_file)]
    killed = zygote.run(command, env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    head = [tuple(mark) for mark in json.loads(marks_file.read_text())]
    tail, weight = stream_accumulate_run(stream_accelerator(checkpoints))
    assert head + tail == stock_marks and torch.equal(weight, stock_weight)
