"""``ResumableTrainer(..., elastic=True)``: a run SIGKILLed and relaunched on another number of processes is the
same run as the uninterrupted one.

The same command (tests/scripts/elastic_trainer_worker.py) is launched with ``torchrun --nproc-per-node 2``, killed,
relaunched with plain ``python`` (1 process: gradient accumulation 2 -> 4), killed, and relaunched with 2 processes
again. Compared with an uninterrupted 2-process run: the multiset of sample indices of every optimizer step, every
logged loss (1e-5 relative) and every final weight tensor (1e-5 relative L2) -- with dropout ON, since the dropout
masks are keyed by the global micro-batch, not by the rank.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.elastic_runs import (
    WORKER,
    assert_same_run,
    launch,
    samples_per_epoch,
    steps_of_rank,
)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_then_one_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """26 samples, a global batch of 8: every epoch ends with a step of 2 samples (rank 1 pads at 2 processes), trained
    here by one process (accumulation 4: one micro-batch) and by two in the reference."""
    tail = ("--num-samples", "26")
    reference = tmp_path / "reference"
    launch(reference, nproc=2, max_steps=5, extra=tail)
    run = tmp_path / "run"
    launch(run, nproc=2, max_steps=5, kill_after=1, expect_kill=True, extra=tail)
    launch(run, nproc=1, max_steps=5, kill_after=4, expect_kill=True, extra=tail)  # gradient accumulation 2 -> 4
    launch(run, nproc=2, max_steps=5, extra=tail)  # 4 -> 2
    assert json.loads((run / "result.json").read_text())["resumed_from"].endswith("checkpoint-4")
    assert steps_of_rank(run, 1) == [1, 5]  # the world size really changed
    assert_same_run(reference, run, steps=5)
    assert samples_per_epoch(run, 4)[0] == Counter(range(26))  # every sample of the epoch once, the last 2 too


def _trainer(output: Path, *, elastic: bool, data: Any = None, cls: type | None = None, **options: Any) -> Any:
    from transformers import TrainingArguments

    from hf_resumable import ResumableTrainer

    from helpers.elastic_data import CropRows, collate
    from helpers.tiny_models import tiny_gpt2

    trainer_options = {k: options.pop(k) for k in ("allow_config_drift",) if k in options}
    args = TrainingArguments(output_dir=str(output), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=options.pop("max_steps", 2), save_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False, **options)
    data = CropRows(24) if data is None else data
    return (cls or ResumableTrainer)(model=tiny_gpt2(), args=args, train_dataset=data, data_collator=collate,
                                     elastic=elastic, save_async=False, **trainer_options)


@pytest.mark.slow
def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_in_process(tmp_path: Path, monkeypatch,
                                                                                   caplog) -> None:
    """One process writes checkpoint-1 (global batch 2 x 2 x 1 = 4); a resume that reports 3 processes (the Trainer's
    world size patched, so no process group is needed: the plan runs before anything distributed) is refused; one
    that reports 2 gets half the accumulation, logged once."""
    monkeypatch.syspath_prepend(str(WORKER.parent))
    from transformers import TrainingArguments

    from hf_resumable.errors import ConfigDriftError
    from hf_resumable.integrations._elastic import ElasticWorldSizeError
    from hf_resumable.integrations._trainer_restore import open_for_resume

    output = tmp_path / "run"
    trainer = _trainer(output, elastic=True)
    trainer.args.max_steps = 1
    trainer.train(resume_from_checkpoint=True)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 3))
    with pytest.raises(ElasticWorldSizeError, match=r"world sizes \[1, 2\]"):
        _trainer(output, elastic=True).train(resume_from_checkpoint=True)
    with pytest.raises(ConfigDriftError, match="world_size: 1 -> 3") as error:  # without elastic=True: as before
        _trainer(output, elastic=False).train(resume_from_checkpoint=True)
    assert not isinstance(error.value, ElasticWorldSizeError)
    assert not (output / "checkpoint-2").exists()
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))  # divides: accumulation 2 -> 1
    trainer = _trainer(output, elastic=True)
    with caplog.at_level(logging.INFO, logger="hf_resumable"):
        open_for_resume(trainer, output / "checkpoint-1")
    assert trainer.args.gradient_accumulation_steps == 1
    assert "world size 1 -> 2: gradient_accumulation_steps 2 -> 1" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_an_elastic_epoch_trains_the_samples_and_steps_of_one_without_elastic(tmp_path: Path, monkeypatch,
                                                                              stream: bool) -> None:
    """26 samples, global batch 4: 7 optimizer steps an epoch, the last of 2 samples, with and without
    ``elastic=True``; every sample trains once. A stream of 26 (one pass) too, except that without ``elastic=True``
    the Trainer's loop, which learns where a stream ends only when it reads past it, trains the last 2 with the next
    pass's first 4 in step 7."""
    monkeypatch.syspath_prepend(str(WORKER.parent))
    from transformers import TrainerCallback

    from helpers.elastic_data import FETCHED, CropRows, crop_stream

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.samples: list[list[int]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.samples.append(sorted(set(FETCHED)))
            FETCHED.clear()

    runs = {}
    for elastic in (False, True):
        FETCHED.clear()
        trainer = _trainer(tmp_path / f"elastic-{elastic}", elastic=elastic, data=crop_stream(26) if stream else
                           CropRows(26), max_steps=7, save_strategy="no", allow_config_drift=True)
        steps = Steps()
        trainer.add_callback(steps)
        trainer.train()
        runs[elastic] = steps.samples
    assert [len(step) for step in runs[True]] == [4] * 6 + [2]
    assert [len(step) for step in runs[False]] == [4] * 6 + [6 if stream else 2]
    assert sorted(i for step in runs[True] for i in step) == list(range(26))


@pytest.mark.slow
def test_orders_that_elastic_cannot_keep_are_refused_before_step_one(tmp_path: Path, monkeypatch) -> None:
    """A subclass's own ``_get_train_sampler`` and a stream read by loader workers (which split its order) are
    refused at ``train()`` start with a typed error; nothing is trained."""
    monkeypatch.syspath_prepend(str(WORKER.parent))
    from hf_resumable import ResumableTrainer
    from hf_resumable.errors import InexactResumeError

    from helpers.elastic_data import crop_stream

    class OwnSampler(ResumableTrainer):
        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(dataset if dataset is not None else self.train_dataset)

    with pytest.raises(InexactResumeError, match="custom sampler"):
        _trainer(tmp_path / "sampler", elastic=True, cls=OwnSampler).train()
    with pytest.raises(InexactResumeError, match="dataloader_num_workers=2"):
        _trainer(tmp_path / "workers", elastic=True, data=crop_stream(40), dataloader_num_workers=2).train()
    assert not list(tmp_path.glob("*/checkpoint-*"))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_before_step_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launch(run, nproc=1, max_steps=1, accumulation=3)  # global batch 2 x 3 x 1 = 6
    out = launch(run, nproc=2, max_steps=2, accumulation=3, expect_fail=True)
    assert "ElasticWorldSizeError" in out and "world sizes [1, 3]" in out, out[-5000:]
    assert not (run / "checkpoint-2").exists()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """10 samples, a global batch of 4: step 3 (2 samples) ends the epoch; at 2 processes rank 1 pads it."""
    tail = ("--num-samples", "10")
    reference = tmp_path / "reference"
    launch(reference, nproc=1, max_steps=3, extra=tail)  # global batch 2 x 2 x 1 = 4
    run = tmp_path / "run"
    launch(run, nproc=1, max_steps=3, kill_after=1, expect_kill=True, extra=tail)
    launch(run, nproc=2, max_steps=3, extra=tail)  # gradient accumulation 2 -> 1
    assert steps_of_rank(run, 1) == [2, 3]
    assert json.loads((run / "result.json").read_text())["gradient_accumulation_steps"] == 1
    assert_same_run(reference, run, steps=3)
    assert samples_per_epoch(run, 3) == [Counter(range(10))]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_resumed_on_two_ranks_after_one_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """A shuffled ``datasets`` stream with a random ``.map`` crop: step k is stream positions [4k, 4k + 4) at any
    world size. One process (gradient accumulation 2) is killed after step 1; two processes (accumulation 1) continue
    from rank 0's position, the new rank included. A pass is 10 examples: step 3 trains its last 2 (rank 1 pads)."""
    stream = ("--stream", "--num-samples", "10")
    reference = tmp_path / "reference"
    launch(reference, nproc=1, max_steps=3, extra=stream)
    run = tmp_path / "run"
    launch(run, nproc=1, max_steps=3, kill_after=1, expect_kill=True, extra=stream)
    launch(run, nproc=2, max_steps=3, extra=stream)
    assert steps_of_rank(run, 1) == [2, 3]
    assert json.loads((run / "result.json").read_text())["gradient_accumulation_steps"] == 1
    assert_same_run(reference, run, steps=3)
    assert samples_per_epoch(run, 3) == [Counter(range(10))]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_on_two_ranks_then_one_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """A pass is 20 examples: step 3 trains its last 4 (one process: 2 micro-batches and 2 padding ones), step 4 the
    next pass's first 8."""
    stream = ("--stream", "--num-samples", "20")
    reference = tmp_path / "reference"
    launch(reference, nproc=2, extra=stream)
    run = tmp_path / "run"
    launch(run, nproc=2, kill_after=1, expect_kill=True, extra=stream)
    launch(run, nproc=1, kill_after=3, expect_kill=True, extra=stream)  # gradient accumulation 2 -> 4
    launch(run, nproc=2, extra=stream)  # 4 -> 2
    assert steps_of_rank(run, 1) == [1, 4]
    assert_same_run(reference, run, steps=4)
    assert samples_per_epoch(run, 3)[0] == Counter(range(20))


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_on_two_ranks_then_one_then_two_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """The Trainer with ``fsdp_config={"version": 2}`` (gloo ranks on CPU, every launch through torchrun): the
    checkpoint's per-rank pieces are resharded for the new world size."""
    engine = {"extra": ("--engine", "fsdp"), "torchrun": True}
    reference = tmp_path / "reference"
    launch(reference, nproc=2, **engine)
    run = tmp_path / "run"
    launch(run, nproc=2, kill_after=1, expect_kill=True, **engine)
    launch(run, nproc=1, kill_after=3, expect_kill=True, **engine)
    launch(run, nproc=2, **engine)
    assert json.loads((run / "result.json").read_text())["distributed_type"] == "DistributedType.FSDP"
    assert steps_of_rank(run, 1) == [1, 4]
    assert_same_run(reference, run, steps=4)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_on_two_ranks_then_one_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """The Trainer with a DeepSpeed ZeRO-2 config (gloo ranks on CPU, every launch through torchrun): the optimizer
    partitions are resharded for one rank, which accumulates 4 micro-batches where two ranks accumulated 2."""
    # 26 samples: step 4 ends the epoch with 2 (at 2 ranks rank 1 trains a padding micro-batch, labels ignored)
    engine = {"extra": ("--engine", "deepspeed", "--num-samples", "26"), "torchrun": True, "max_steps": 4}
    reference = tmp_path / "reference"
    launch(reference, nproc=2, **engine)
    run = tmp_path / "run"
    launch(run, nproc=2, kill_after=1, expect_kill=True, **engine)
    launch(run, nproc=1, **engine)
    result = json.loads((run / "result.json").read_text())
    assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["gradient_accumulation_steps"] == 4
    assert steps_of_rank(run, 1) == [1]
    assert_same_run(reference, run, steps=4)
    assert samples_per_epoch(run, 4) == [Counter(range(26))]


def test_the_trainer_world_size_mode_differs_only_in_the_steps_elastic_changes() -> None:
    """The mode chosen once per trainer: the fixed one keeps every change as drift and positions per rank; the elastic
    one drops the world size and accumulation it planned, positions map-style loaders by step, and resumes across
    world sizes."""
    from hf_resumable.integrations._elastic import plan_elastic_resume
    from hf_resumable.integrations._trainer_elastic import ElasticTrainerWorldSize, trainer_world_size_mode

    fixed, elastic = trainer_world_size_mode(False), trainer_world_size_mode(True)
    assert isinstance(elastic, ElasticTrainerWorldSize) and (fixed.enabled, elastic.enabled) == (False, True)
    plan = plan_elastic_resume(saved_world_size=2, saved_accumulation=2, per_device_batch=4, world_size=1)
    changed = {"world_size": (2, 1), "gradient_accumulation_steps": (2, 4), "seed": (1, 2)}
    assert fixed.drift(dict(changed), plan) == changed
    assert elastic.drift(dict(changed), None) == changed  # same world size: nothing planned, nothing dropped
    assert elastic.drift(dict(changed), plan) == {"seed": (1, 2)}
    assert [mode.resumes_across(2, 1) for mode in (fixed, elastic)] == [False, True]
    assert not elastic.resumes_across(2, 2)
    assert [mode.positions_by_step(kind) for mode in (fixed, elastic) for kind in ("map", "stream")] == [
        False, False, True, False]
