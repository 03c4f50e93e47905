"""The integration core both front doors share (integrations/_core.py, preemption.py): options validated when
built, one inexact/drift policy, one upstream-version policy, follow-ups attached to a save's future, and one
preemption agreement."""

from __future__ import annotations

import logging
import os
import signal
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from hf_resumable.errors import AsyncSaveError, ConfigDriftError, InexactResumeError
from hf_resumable.integrations import _core
from hf_resumable.integrations._core import (
    AfterCommit,
    ResumeOptions,
    UpstreamInternalsError,
    changed_settings,
    check_drift,
    check_upstream,
    inexact,
)
from hf_resumable.preemption import (
    PREEMPTION_EXIT_CODE,
    PreemptionAction,
    PreemptionHandler,
    PreemptionProtocol,
    exit_after_preemption,
)


@pytest.mark.parametrize(("field", "value", "match"), [("checkpoint_verify", "fast", "checkpoint_verify"),
                                                       ("resume_hyperparameters", "newest", "resume_hyperparameters"),
                                                       ("keep_last", 0, "keep_last")])
def test_options_are_validated_when_built(field, value, match):
    with pytest.raises(ValueError, match=match):
        ResumeOptions(**{field: value})


def test_options_are_frozen_and_normalized(tmp_path):
    options = ResumeOptions(allow_inexact_resume=1, save_async=0, checkpoint_dir=str(tmp_path))
    assert options.allow_inexact_resume is True and options.save_async is False and options.checkpoint_dir == tmp_path
    assert options.keep_last is _core.DEFAULT and ResumeOptions(keep_last=None).keep_last is None
    with pytest.raises(AttributeError):
        options.allow_inexact_resume = False


def test_both_front_doors_build_their_options_from_their_keywords(tmp_path):
    from hf_resumable.integrations.accelerate import ResumableAccelerator

    accelerator = ResumableAccelerator(checkpoint_dir=tmp_path, keep_last=3, allow_inexact_resume=True,
                                       handle_preemption=False)
    assert accelerator.resume_options == ResumeOptions(checkpoint_dir=tmp_path, keep_last=3, allow_inexact_resume=True,
                                                handle_preemption=False, save_async=False)
    assert accelerator.keep_last == 3
    with pytest.raises(ValueError, match="keep_last"):
        ResumableAccelerator(checkpoint_dir=tmp_path, keep_last=0, handle_preemption=False)


def test_inexact_policy_raises_or_warns(caplog):
    with pytest.raises(InexactResumeError, match="allow_inexact_resume=True to X"):
        inexact("no RNG", allow=False, owner="X")
    with caplog.at_level(logging.WARNING):
        inexact("no RNG", allow=True, owner="X")
    assert "NOT bit-exact" in caplog.text


def test_one_drift_check_names_every_changed_setting(caplog):
    changed = changed_settings({"world_size": 2, "seed": 1, "old": 0}, {"world_size": 1, "seed": 1})
    assert changed == {"world_size": (2, 1)}
    with pytest.raises(ConfigDriftError, match=r"world_size: 2 -> 1.*allow_config_drift=True to T"):
        check_drift(changed, checkpoint="c", allow=False, option="allow_config_drift", owner="T")
    check_drift({}, checkpoint="c", allow=False, option="o", owner="T")  # nothing changed
    with caplog.at_level(logging.WARNING):
        check_drift(changed, checkpoint="c", allow=True, option="o", owner="T")
    assert "world_size: 2 -> 1" in caplog.text


def test_upstream_policy_warns_outside_the_tested_range_and_raises_for_missing_internals(caplog):
    with caplog.at_level(logging.WARNING):
        check_upstream("accelerate", "9.0", (">=1.10", "<2.0"), [])
    assert "tested with accelerate >=1.10,<2.0; found 9.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_upstream("accelerate", "1.12.0", (">=1.10", "<2.0"), [])
    assert caplog.text == ""
    with pytest.raises(UpstreamInternalsError, match="Accelerator._do_sync is missing") as err:
        check_upstream("accelerate", "1.12.0", (">=1.10", "<2.0"), ["Accelerator._do_sync is missing"])
    assert isinstance(err.value, ImportError)


def test_follow_ups_run_after_the_commit_and_never_for_a_failed_save(monkeypatch):
    """A poll never blocks: once the save is done it runs the follow-ups without waiting for retention's deletions,
    as the settle before a save (``removals=False``) does; a plain settle waits for everything."""
    waited = []
    monkeypatch.setattr(_core, "wait_for_pending_saves", lambda: waited.append("save and deletions"))
    monkeypatch.setattr(_core, "background_saver", lambda: SimpleNamespace(wait=lambda: waited.append("save")))
    ran = []
    commits = AfterCommit()
    commits.attach(None, lambda: ran.append("blocking"))  # committed already: runs now
    assert ran == ["blocking"] and not commits.pending
    future = Future()
    commits.attach(future, lambda: ran.append("background"))
    commits.settle(poll=True)  # not done yet: nothing runs, nothing waits
    assert ran == ["blocking"] and waited == [] and commits.pending
    future.set_result(None)
    commits.settle(poll=True)
    assert ran == ["blocking", "background"] and waited == ["save"]
    commits.settle(removals=False)
    commits.settle()
    assert waited == ["save", "save", "save and deletions"]

    def failed() -> None:
        raise AsyncSaveError("disk full")

    monkeypatch.setattr(_core, "wait_for_pending_saves", failed)
    commits.attach(Future(), lambda: ran.append("lost"))
    with pytest.raises(AsyncSaveError):
        commits.settle()
    assert "lost" not in ran and not commits.pending


def test_preemption_agreement_in_one_process_is_the_local_flag():
    handler = PreemptionHandler()
    protocol = PreemptionProtocol(handler)  # no notice: the signal's step is saved, then the process exits
    cpu = torch.device("cpu")
    with handler:
        assert protocol.at_step_boundary(device=cpu, step=3) is PreemptionAction.TRAIN
        os.kill(os.getpid(), signal.SIGTERM)
        assert protocol.at_step_boundary(device=cpu, step=3) is PreemptionAction.SAVE_AND_EXIT
    assert PreemptionProtocol(None).at_step_boundary(device=cpu, step=3) is PreemptionAction.TRAIN
    with pytest.raises(SystemExit) as exited:
        exit_after_preemption(handler, checkpoint="out", step=3, exit=True)
    assert exited.value.code == PREEMPTION_EXIT_CODE
    exit_after_preemption(handler, checkpoint="out", step=3, exit=False)  # returns


def test_every_accelerate_loader_kind_has_the_one_position_interface(tmp_path):
    """ResumableAccelerator saves and restores every prepared loader through data._position.LoaderPosition."""
    from torch.utils.data import DataLoader

    from hf_resumable.data import build_map_dataloader
    from hf_resumable.data._position import LoaderPosition
    from hf_resumable.integrations._accelerate_data import StatefulLoaderPosition
    from hf_resumable.integrations.accelerate import ResumableAccelerator

    accelerator = ResumableAccelerator(checkpoint_dir=tmp_path, handle_preemption=False)
    data = [torch.tensor([float(i)]) for i in range(8)]
    rebuilt = accelerator.prepare(DataLoader(data, batch_size=2, shuffle=True))
    prepared = accelerator.prepare_resumable_dataloader(data, collate_fn=torch.stack, batch_size=2, seed=0)
    stateful = StatefulLoaderPosition(build_map_dataloader(data, collate_fn=torch.stack, batch_size=2, seed=0))
    for loader in (rebuilt, prepared, stateful):
        assert isinstance(loader, LoaderPosition), type(loader)
    for loader in (rebuilt, prepared):
        record = loader.position()
        assert loader.fits(record) and record["step"] == 0
    assert accelerator._resumable_loaders == [rebuilt, prepared]


def test_one_reader_of_torchdata_counters():
    """checkpoint.state._validate.batches_yielded reads both forms of StatefulDataLoader state; the loaders and the
    load
    validation use it (a corrupt counter is refused, an unknown form is None)."""
    from hf_resumable.checkpoint.state._validate import batches_yielded, check_data_position
    from hf_resumable.errors import CorruptCheckpointError

    assert batches_yielded({"_num_yielded": 3}, source="s") == 3
    assert batches_yielded({"_snapshot": {"_snapshot_step": 4}, "_steps_since_snapshot": 1}, source="s") == 5
    assert batches_yielded({"other": 1}, source="s") is None
    with pytest.raises(CorruptCheckpointError, match="loader/_snapshot/_snapshot_step"):
        check_data_position({"kind": "stream", "step": 0, "loader": {"_snapshot": {"_snapshot_step": -1}}},
                            source="data/rank-00000.json")


def test_the_trainer_loader_position_is_the_same_interface(tmp_path):
    """ResumableTrainer's training loader is saved through StepPosition, a LoaderPosition: the Trainer's optimizer
    steps (of gradient_accumulation_steps batches) say where the data stands, a short last window included."""
    from hf_resumable.data import build_map_dataloader
    from hf_resumable.data._loaders import StepPosition
    from hf_resumable.data._position import LoaderPosition

    loader = build_map_dataloader(list(range(10)), collate_fn=list, batch_size=2, seed=0)  # 5 batches per epoch
    steps = [0]
    position = StepPosition(loader, steps_done=lambda: steps[0], batches_per_step=2)  # 3 optimizer steps per epoch
    assert isinstance(position, LoaderPosition)
    expected = {0: (0, 0), 2: (0, 4), 3: (1, 0), 4: (1, 2)}
    for done, (epoch, step) in expected.items():
        steps[0] = done
        record = position.position()
        assert (record["epoch"], record["step"], record["num_batches"]) == (epoch, step, 5) and position.fits(record)
    assert not position.fits({"kind": "stream"})


def test_a_resumable_accelerator_pickles_with_its_options(tmp_path):
    """accelerate's users (and its own test suite) pickle a prepared Accelerator; the options' marker survives."""
    import pickle

    from accelerate.state import AcceleratorState, GradientState

    from hf_resumable import ResumableAccelerator
    from hf_resumable.integrations._core import DEFAULT

    # accelerate's shared states outlive an earlier test's Trainer (its loaders' weak references do not pickle,
    # with stock accelerate too): start from fresh ones, as accelerate's own pickling test does in its process
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = ResumableAccelerator(cpu=True, project_dir=str(tmp_path))
    restored = pickle.loads(pickle.dumps(accelerator))
    assert restored.resume_options == accelerator.resume_options
    assert pickle.loads(pickle.dumps(DEFAULT)) is DEFAULT
