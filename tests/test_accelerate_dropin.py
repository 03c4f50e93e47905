"""ResumableAccelerator as a drop-in for accelerate scripts: what stock accelerate scripts do must just work.

Each test is a loop shape or a call that stock ``accelerate`` scripts use, run against the one-line import change.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration
from safetensors.torch import load_file, save_file

from hf_resumable.checkpoint import list_checkpoints, read_manifest, verify_checkpoint
from hf_resumable.errors import CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError
from hf_resumable.integrations.accelerate import (
    CheckpointIterationExistsError,
    HookFileConflictError,
    ResumableAccelerator,
)

from helpers.accelerate_runs import _fresh_accelerate_state  # noqa: F401 - autouse: a fresh accelerate state


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def weights_of(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def build_plain(tmp_path, **options):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False, **options)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def plain_step(accelerator, model, optimizer, seed: int) -> None:
    """accelerate's nlp_example shape: backward, step, zero_grad; no ``accumulate()``."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


# ------------------------------------------------------------------ item 1: steps are counted however the loop looks


def test_loop_without_accumulate_saves_every_step_and_resumes_the_newest(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path, keep_last=None)
    saved = {}
    for step in range(1, 7):
        plain_step(accelerator, model, optimizer, step)
        assert accelerator.global_step == step
        if step % 2 == 0:
            assert accelerator.save_state() == tmp_path / f"checkpoint-{step}"
            saved[step] = weights_of(accelerator, model)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    assert [read_manifest(tmp_path / f"checkpoint-{s}").step for s in (2, 4, 6)] == [2, 4, 6]
    assert not same_weights(saved[2], saved[6])

    reset_accelerate()
    resumed, model2, optimizer2 = build_plain(tmp_path)
    assert resumed.load_state().step == 6
    assert resumed.global_step == 6
    assert same_weights(weights_of(resumed, model2), saved[6])
    plain_step(resumed, model2, optimizer2, 7)
    assert resumed.global_step == 7 and resumed.save_state() == tmp_path / "checkpoint-7"


def test_micro_steps_of_an_accumulation_window_are_not_optimizer_steps(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, gradient_accumulation_steps=2, checkpoint_dir=tmp_path,
                                       handle_preemption=False)
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for micro in range(1, 6):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 3)).sum())
            optimizer.step()  # accelerate steps only on the window's last micro-batch
            optimizer.zero_grad()
        assert accelerator.global_step == micro // 2, micro


def test_step_skipped_by_the_grad_scaler_is_not_counted(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)  # fp16 on a GPU would create one
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 3)).sum() * float("inf"))  # overflow: the scaler skips this step
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.step_was_skipped and accelerator.global_step == 0
    accelerator.backward(model(torch.ones(2, 3)).sum())
    optimizer.step()
    optimizer.zero_grad()
    assert not optimizer.step_was_skipped and accelerator.global_step == 1


def test_second_save_of_the_same_step_writes_unless_the_state_is_provably_identical(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path)
    plain_step(accelerator, model, optimizer, 1)
    target = accelerator.save_state()
    manifest = os.stat(target / "manifest.json")
    assert accelerator.save_state() == target  # nothing changed: nothing written
    assert os.stat(target / "manifest.json").st_ino == manifest.st_ino

    with torch.no_grad():  # weights edited without an optimizer step (the step counter does not move)
        accelerator.unwrap_model(model).weight.add_(1.0)
    edited = weights_of(accelerator, model)
    assert accelerator.save_state() == target and accelerator.global_step == 1
    assert os.stat(target / "manifest.json").st_ino != manifest.st_ino  # replaced atomically

    torch.rand(1)  # the RNG moved: the checkpoint of this step must hold the new RNG state
    manifest = os.stat(target / "manifest.json")
    accelerator.save_state()
    assert os.stat(target / "manifest.json").st_ino != manifest.st_ino

    reset_accelerate()
    resumed, model2, _ = build_plain(tmp_path)
    resumed.load_state()
    assert same_weights(weights_of(resumed, model2), edited)


# ------------------------------------------------------------------ item 2: existing output directories


def test_save_state_into_an_existing_empty_directory_and_again_into_the_same_path(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path / "unused")
    with tempfile.TemporaryDirectory(dir=tmp_path) as latest:  # what accelerate's own tests and scripts do
        plain_step(accelerator, model, optimizer, 1)
        assert accelerator.save_state(latest) == Path(latest)
        first = weights_of(accelerator, model)
        plain_step(accelerator, model, optimizer, 2)
        accelerator.save_state(latest)  # a reused "latest" folder: replaced atomically
        second = weights_of(accelerator, model)
        assert not same_weights(first, second)
        assert verify_checkpoint(latest, full=True).ok and read_manifest(latest).step == 2
        plain_step(accelerator, model, optimizer, 3)
        accelerator.load_state(latest)
        assert same_weights(weights_of(accelerator, model), second) and accelerator.global_step == 2


def test_save_state_refuses_a_directory_with_foreign_files_and_touches_nothing(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path / "unused")
    target = tmp_path / "results"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="files hf_resumable did not write") as caught:
        accelerator.save_state(target)
    assert isinstance(caught.value, FileExistsError)
    assert sorted(os.listdir(target)) == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["results"]  # no temp directory left behind either

    stock = tmp_path / "stock"
    stock.mkdir()
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
        (stock / name).write_bytes(b"x")
    with pytest.raises(CheckpointExistsError, match="stock accelerate"):
        accelerator.save_state(stock)
    assert sorted(os.listdir(stock)) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]


# ------------------------------------------------------------------ item 3: every argument accelerate accepts


def test_save_and_load_accept_accelerates_arguments(tmp_path, caplog):
    accelerator, model, optimizer = build_plain(tmp_path / "unused")
    plain_step(accelerator, model, optimizer, 1)
    accelerator.save_state(tmp_path / "safe", safe_serialization=True)
    with caplog.at_level("WARNING"):
        accelerator.save_state(tmp_path / "pickle", safe_serialization=False)
        accelerator.save_state(tmp_path / "pickle2", False, max_shard_size="1GB")  # DeepSpeed's save options
    assert caplog.text.count("never writes pickle") == 1  # said once, in one line
    assert caplog.text.count("DeepSpeed's own save_checkpoint") == 1
    for name in ("safe", "pickle", "pickle2"):
        files = set(read_manifest(tmp_path / name).files)
        assert not [f for f in files if f.endswith((".bin", ".pkl", ".pt"))], files
        assert any(f.endswith(".safetensors") for f in files)
    saved = weights_of(accelerator, model)
    plain_step(accelerator, model, optimizer, 2)
    with caplog.at_level("WARNING"):
        accelerator.load_state(tmp_path / "pickle", map_location="cpu", strict=True)
        accelerator.load_state(str(tmp_path / "pickle"), load_kwargs={"weights_only": True}, map_location="on_device")
    assert "torch.load options" in caplog.text
    assert same_weights(weights_of(accelerator, model), saved)
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed"):
        accelerator.load_state(tmp_path / "safe", map_location="invalid")
    with pytest.raises(TypeError, match="unsupported options"):
        accelerator.load_state(tmp_path / "safe", weights_only=True)


# ------------------------------------------------------------------ item 8: a path that does not exist


def test_load_state_of_a_missing_path_says_it_does_not_exist(tmp_path):
    accelerator, *_ = build_plain(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as caught:
        accelerator.load_state(tmp_path / "checkpoint-7")
    assert isinstance(caught.value, ValueError)  # what accelerate raises
    assert "interrupted" not in str(caught.value)
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / "random_states_0.pkl").write_bytes(b"x")
    (stock / "model.safetensors").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError, match="stock accelerate"):
        accelerator.load_state(stock)


# ------------------------------------------------------------------ item 4: ProjectConfiguration


def build_project(tmp_path, **config):
    accelerator = ResumableAccelerator(cpu=True, handle_preemption=False, project_dir=str(tmp_path),
                                       project_config=ProjectConfiguration(automatic_checkpoint_naming=True,
                                                                           **config))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return accelerator, model, optimizer


def automatic(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "checkpoints"), key=lambda n: int(n.split("_")[1]))


def test_automatic_naming_advances_the_iteration_and_keeps_everything_by_default(tmp_path):
    accelerator, model, optimizer = build_project(tmp_path)
    for step in range(5):
        plain_step(accelerator, model, optimizer, step)
        assert accelerator.save_state(tmp_path / "ignored, as in accelerate") == \
            tmp_path / "checkpoints" / f"checkpoint_{step}"
    assert automatic(tmp_path) == [f"checkpoint_{i}" for i in range(5)]
    assert accelerator.project_configuration.iteration == 5 and os.listdir(tmp_path) == ["checkpoints"]


def test_total_limit_keeps_the_newest_and_never_deletes_foreign_directories(tmp_path):
    foreign = tmp_path / "checkpoints" / "checkpoint_0"
    foreign.mkdir(parents=True)
    (foreign / "README.md").write_text("a checkpoint someone else wrote")
    accelerator, model, optimizer = build_project(tmp_path, total_limit=2, iteration=1)
    for step in range(4):
        plain_step(accelerator, model, optimizer, step)
        accelerator.save_state()
    assert automatic(tmp_path) == ["checkpoint_0", "checkpoint_3", "checkpoint_4"]
    assert (foreign / "README.md").read_text() == "a checkpoint someone else wrote"


def test_automatic_resume_skips_a_corrupt_newest_checkpoint_and_never_collides(tmp_path, caplog):
    accelerator, model, optimizer = build_project(tmp_path)
    saved = {}
    for step in range(3):
        plain_step(accelerator, model, optimizer, step)
        accelerator.save_state()
        saved[step] = weights_of(accelerator, model)
    shard = next((tmp_path / "checkpoints" / "checkpoint_2").glob("model*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4])  # a disk fault after the commit
    shard_size = shard.stat().st_size

    reset_accelerate()
    resumed, model2, optimizer2 = build_project(tmp_path)
    with caplog.at_level("WARNING"):
        loaded = resumed.load_state()
    assert loaded.path.name == "checkpoint_1" and "checkpoint_2" in caplog.text
    assert same_weights(weights_of(resumed, model2), saved[1]) and resumed.global_step == 2
    # the corrupt one is set aside (corrupt-checkpoint_2, kept): the iterations go on as after a clean resume
    assert resumed.project_configuration.iteration == 2
    plain_step(resumed, model2, optimizer2, 9)
    assert resumed.save_state().name == "checkpoint_2"
    assert (tmp_path / "checkpoints" / "corrupt-checkpoint_2" / shard.name).stat().st_size == shard_size


def test_an_existing_automatic_checkpoint_is_refused_like_accelerate_does(tmp_path):
    accelerator, model, optimizer = build_project(tmp_path)
    accelerator.save_state()
    accelerator.project_configuration.iteration = 0
    with pytest.raises(CheckpointIterationExistsError, match="already exists") as caught:
        accelerator.save_state()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FileExistsError)
    assert verify_checkpoint(tmp_path / "checkpoints" / "checkpoint_0").ok


# ------------------------------------------------------------------ item 5: save/load pre-hooks


def test_hooks_save_adapters_themselves_and_their_files_are_committed(tmp_path):
    """The LoRA/EMA pattern of diffusers' scripts: the save hook writes its own files and pops the weights it
    saved; the load hook pops the models it loads itself."""
    accelerator, model, optimizer = build_plain(tmp_path / "unused")
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", models is accelerator._models, len(weights), os.path.isdir(output_dir)))
        state = {k: v.contiguous() for k, v in accelerator.unwrap_model(models[0]).state_dict().items()}
        os.makedirs(os.path.join(output_dir, "adapter"))
        save_file(state, os.path.join(output_dir, "adapter", "adapter_model.safetensors"))
        with open(os.path.join(output_dir, "data.json"), "w") as handle:
            json.dump({"class_name": type(models[0]).__name__}, handle)
        weights.pop()  # "make sure to pop weight so that corresponding model is not saved again"

    def load_hook(models, input_dir):
        calls.append(("load", len(models), input_dir))
        model_ = models.pop()
        accelerator.unwrap_model(model_).load_state_dict(
            load_file(os.path.join(input_dir, "adapter", "adapter_model.safetensors")))
        with open(os.path.join(input_dir, "data.json")) as handle:
            model_.class_name = json.load(handle)["class_name"]

    handles = [accelerator.register_save_state_pre_hook(save_hook),
               accelerator.register_load_state_pre_hook(load_hook)]
    plain_step(accelerator, model, optimizer, 1)
    target = accelerator.save_state(tmp_path / "ckpt")
    saved = weights_of(accelerator, model)
    files = read_manifest(target).files
    assert {"adapter/adapter_model.safetensors", "data.json"} <= set(files)  # hashed like every file
    assert not [f for f in files if f.startswith("model")], "the hook popped the weights: not saved again"
    assert verify_checkpoint(target, full=True).ok

    plain_step(accelerator, model, optimizer, 2)
    accelerator.load_state(target)
    assert calls == [("save", True, 1, True), ("load", 1, str(target))]
    assert same_weights(weights_of(accelerator, model), saved) and model.class_name == "Linear"

    for handle in handles:
        handle.remove()
    plain_step(accelerator, model, optimizer, 3)
    accelerator.save_state(tmp_path / "plain")
    assert len(calls) == 2 and any(f.startswith("model") for f in read_manifest(tmp_path / "plain").files)


def test_a_hook_file_named_like_a_checkpoint_file_is_refused(tmp_path):
    accelerator, model, optimizer = build_plain(tmp_path / "unused")

    def bad_hook(models, weights, output_dir):
        Path(output_dir, "training_state.json").write_text("{}")

    accelerator.register_save_state_pre_hook(bad_hook)
    with pytest.raises(HookFileConflictError, match="training_state.json"):
        accelerator.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ item 6: several models, optimizers, schedulers


class Ema:
    """A registered object holding tensors (an EMA of the generator's weights)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: torch.nn.Module) -> None:
        for key, value in model.state_dict().items():
            self.shadow[key].mul_(0.9).add_(value.detach(), alpha=0.1)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


def build_gan(tmp_path):
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=tmp_path, handle_preemption=False)
    torch.manual_seed(0)
    generator, discriminator = torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.3),
                                                                         torch.nn.Linear(4, 1))
    temperature = torch.nn.Parameter(torch.ones(()))  # a learnable parameter outside every model
    g_opt = torch.optim.Adam([*generator.parameters(), temperature], lr=1e-2)
    d_opt = torch.optim.AdamW(discriminator.parameters(), lr=1e-2)
    g_sched = torch.optim.lr_scheduler.StepLR(g_opt, step_size=1, gamma=0.9)
    d_sched = torch.optim.lr_scheduler.ExponentialLR(d_opt, gamma=0.8)
    generator, discriminator, g_opt, d_opt, g_sched, d_sched = accelerator.prepare(
        generator, discriminator, g_opt, d_opt, g_sched, d_sched)
    ema = Ema(accelerator.unwrap_model(generator))
    accelerator.register_for_checkpointing(ema)
    return accelerator, (generator, discriminator, temperature, g_opt, d_opt, g_sched, d_sched, ema)


def gan_steps(accelerator, parts, count: int) -> list[float]:
    generator, discriminator, temperature, g_opt, d_opt, g_sched, d_sched, ema = parts
    losses = []
    for _ in range(count):
        noise = torch.randn(8, 2)
        d_loss = discriminator(generator(noise).detach()).mean() - discriminator(torch.randn(8, 3)).mean()
        accelerator.backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        g_loss = -(discriminator(generator(noise)) / temperature).mean()
        accelerator.backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        discriminator.zero_grad()
        g_sched.step()
        d_sched.step()
        ema.update(accelerator.unwrap_model(generator))
        losses.append(g_loss.item())
    return losses


def test_two_models_two_optimizers_a_free_parameter_and_an_ema_resume_bit_for_bit(tmp_path):
    accelerator, parts = build_gan(tmp_path)
    gan_steps(accelerator, parts, 3)
    assert accelerator.global_step == 3  # each optimizer stepped 3 times
    target = accelerator.save_state()
    files = set(read_manifest(target).files)
    assert "model.safetensors" in files  # model 0 as stock accelerate's save_state (and save_pretrained) writes it
    want = gan_steps(accelerator, parts, 3)
    final = [weights_of(accelerator, parts[0]), weights_of(accelerator, parts[1]), parts[2].detach().clone(),
             parts[3].state_dict(), parts[4].state_dict(), parts[7].shadow]

    reset_accelerate()
    resumed, parts2 = build_gan(tmp_path)
    gan_steps(resumed, parts2, 1)  # diverge first: the load must overwrite everything
    assert resumed.load_state().path == target and resumed.global_step == 3
    assert gan_steps(resumed, parts2, 3) == want
    got = [weights_of(resumed, parts2[0]), weights_of(resumed, parts2[1]), parts2[2].detach().clone(),
           parts2[3].state_dict(), parts2[4].state_dict(), parts2[7].shadow]
    assert same_weights(got[0], final[0]) and same_weights(got[1], final[1]) and torch.equal(got[2], final[2])
    for mine, theirs in ((got[3], final[3]), (got[4], final[4])):
        assert mine["param_groups"] == theirs["param_groups"]
        assert mine["state"].keys() == theirs["state"].keys()
        for key in mine["state"]:
            assert all(torch.equal(mine["state"][key][k], theirs["state"][key][k]) for k in mine["state"][key])
    assert same_weights(got[5], final[5])
    assert parts2[5].state_dict() == parts[5].state_dict() and parts2[6].state_dict() == parts[6].state_dict()
