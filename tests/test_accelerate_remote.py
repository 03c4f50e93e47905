"""ResumableAccelerator pushes committed checkpoints to the Hub in the background and resumes from hf://."""

from __future__ import annotations

import torch
from accelerate.state import AcceleratorState, GradientState

from helpers.accelerate_runs import _build_small, _train_windows
from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id  # noqa: F401 - fixtures


def test_push_while_training_and_resume_from_the_hub_bit_exact(hub, tmp_path):
    repo_id = new_repo_id("accel")
    accelerator, model, optimizer, loader, _ = _build_small(tmp_path / "run1", keep_last=1,
                                                            push_checkpoints_to=repo_id)
    windows = accelerator.accumulation_windows(loader)
    for _ in range(2):
        _train_windows(accelerator, model, optimizer, windows, 1)
        accelerator.save_state()
        assert (tmp_path / "run1" / f"checkpoint-{accelerator.global_step}").exists()
    accelerator.wait_for_uploads(timeout=120)
    files = set(hub.head(repo_id).files)
    assert {"checkpoint-1/manifest.json", "checkpoint-2/manifest.json"} <= files  # queued, none skipped
    assert len(hub.requests("POST", "/commit/")) == 2  # one commit per checkpoint
    _train_windows(accelerator, model, optimizer, windows, 1)
    accelerator.save_state()  # uploads of 1 and 2 are confirmed: retention may now delete them locally
    assert sorted(p.name for p in (tmp_path / "run1").iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-3"]
    accelerator.wait_for_uploads(timeout=120)
    rest = _train_windows(accelerator, model, optimizer, windows, 1)
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, model2, optimizer2, loader2, _ = _build_small(tmp_path / "new-runtime")
    loaded = resumed.load_state(f"hf://{repo_id}")  # the newest committed checkpoint on the Hub
    assert loaded.step == 3 and resumed.global_step == 3
    assert _train_windows(resumed, model2, optimizer2, resumed.accumulation_windows(loader2), 1) == rest
    for key, value in resumed.unwrap_model(model2).state_dict().items():
        assert torch.equal(value, weights[key]), key
