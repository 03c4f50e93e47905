"""The hf-resumable command line on real checkpoints: inspect, verify, reshard, convert, push/pull, demo."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from hf_resumable import load_checkpoint, save_checkpoint, verify_checkpoint
from hf_resumable.cli import main
from hf_resumable.demo import RunRecord, compare_runs, format_comparison, load_run

from helpers import zygote
from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id  # noqa: F401
from helpers.tiny_models import assert_same_optimizer, assert_same_state, tiny_gpt2, train_steps

REPO_ROOT = Path(__file__).resolve().parents[1]


def _model_and_optimizer(seed: int = 0, groups=None):
    model = tiny_gpt2(seed=seed)
    params = model.parameters() if groups is None else [{"params": g} for g in groups(model)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    return model, optimizer


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    model, optimizer = _model_and_optimizer()
    train_steps(model, optimizer, steps=2)
    path = tmp_path / "run" / "checkpoint-2"
    save_checkpoint(path, model=model, optimizer=optimizer, step=2, max_shard_size="40KB",
                    training_state={"global_step": 2, "epoch": 0.25, "samples_seen": 16, "resumes": 1},
                    extra={"run_config": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                          "world_size": 1}})
    return path


def _flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------- verify / inspect
def test_verify_valid_and_corrupt(checkpoint: Path, capsys) -> None:
    assert _run(capsys, "verify", str(checkpoint))[0] == 0
    assert _run(capsys, "verify", "--full", str(checkpoint))[0] == 0
    _flip_byte(checkpoint / "model-00002-of-00004.safetensors")
    with open(checkpoint / "optimizer-00003-of-00008.safetensors", "r+b") as f:
        f.truncate(1000)
    code, out, err = _run(capsys, "verify", "--full", str(checkpoint))
    assert code == 1
    assert "model-00002-of-00004.safetensors: xxh3-128 is" in err
    assert "optimizer-00003-of-00008.safetensors: size is 1000 bytes" in err


def test_verify_incomplete_checkpoint_names_manifest(checkpoint: Path, capsys) -> None:
    (checkpoint / "manifest.json").unlink()
    code, _, err = _run(capsys, "verify", str(checkpoint))
    assert code == 1 and "manifest.json" in err and "not a committed checkpoint" in err


def test_inspect_table_and_json(checkpoint: Path, capsys) -> None:
    code, out, _ = _run(capsys, "inspect", str(checkpoint))
    assert code == 0
    assert "effective batch  8 (= 4 per device x 2 accumulation x 1 ranks)" in out
    assert "verification     OK [quick]" in out and "model-00001-of-00004.safetensors" in out
    code, out, _ = _run(capsys, "inspect", "--json", str(checkpoint))
    document = json.loads(out)
    expected_params = sum(p.numel() for p in tiny_gpt2().parameters())  # tied weights once
    assert (document["step"], document["epoch"], document["samples_seen"], document["resumes"]) == (2, 0.25, 16, 1)
    assert document["effective_batch_size"] == 8 and document["parameter_count"] == expected_params
    assert document["optimizer_class"] == "AdamW" and document["verified"] is True
    kinds = [s["kind"] for s in document["shards"]]
    assert kinds.count("model") == 4 and kinds.count("optimizer") == 8 and kinds.count("rng") == 1
    assert all(s["dtypes"] == {"F32": s["num_tensors"]} for s in document["shards"] if s["kind"] == "model")


@pytest.mark.slow
def test_inspect_reports_corruption(checkpoint: Path, capsys) -> None:
    _flip_byte(checkpoint / "model-00001-of-00004.safetensors")
    code, out, _ = _run(capsys, "inspect", "--json", str(checkpoint))
    document = json.loads(out)
    assert code == 1 and document["verified"] is False
    assert [p["file"] for p in document["problems"]] == ["model-00001-of-00004.safetensors"]
    assert document["step"] == 2  # still summarized as far as it can be read
    code, out, _ = _run(capsys, "inspect", str(checkpoint))
    assert code == 1 and "FAILED (1 problem(s))" in out and "! model-00001-of-00004.safetensors" in out


@pytest.mark.slow
@pytest.mark.parametrize("argv, fragment", [
    (["inspect", "{missing}"], "no such checkpoint directory"),
    (["verify", "{missing}"], "no such checkpoint directory"),
    (["reshard", "{checkpoint}", "--max-shard-size", "12XB"], "Cannot parse size '12XB'"),
    (["reshard", "{missing}", "--max-shard-size", "1MB"], "no manifest.json"),
    (["convert", "{checkpoint}"], "already an hf_resumable checkpoint"),
    (["push", "{missing}", "user/repo"], "no such checkpoint directory"),
])
def test_user_mistakes_print_one_line(checkpoint: Path, tmp_path: Path, capsys, argv, fragment) -> None:
    argv = [a.format(missing=tmp_path / "nope", checkpoint=checkpoint) for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code != 0
    assert len(err.strip().splitlines()) == 1 and fragment in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_python_dash_m_entry_point(checkpoint: Path) -> None:
    corrupt = zygote.run([sys.executable, "-m", "hf_resumable", "verify", str(checkpoint.parent / "nope")],
                             capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert corrupt.returncode == 2 and "Traceback" not in corrupt.stderr
    assert corrupt.stderr.startswith("hf-resumable verify: error:")


# ----------------------------------------------------------------------------------------------- reshard
def _load_fresh(path: Path, groups=None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = _model_and_optimizer(seed=7, groups=groups)
    load_checkpoint(path, model=model, optimizer=optimizer, restore_rng=False)
    return model, optimizer


def _shards(path: Path, kind: str) -> list[str]:
    return sorted(p.name for p in path.glob(f"{kind}-*.safetensors"))


def test_reshard_to_new_dir_and_in_place(checkpoint: Path, tmp_path: Path, capsys) -> None:
    before = _load_fresh(checkpoint)
    out = tmp_path / "resharded" / "checkpoint-2"
    code, stdout, _ = _run(capsys, "reshard", str(checkpoint), "--max-shard-size", "100KB", "--output", str(out))
    assert code == 0 and "2 model shard(s), 3 optimizer shard(s)" in stdout
    assert (len(_shards(checkpoint, "model")), len(_shards(out, "model"))) == (4, 2)
    assert (len(_shards(checkpoint, "optimizer")), len(_shards(out, "optimizer"))) == (8, 3)
    assert verify_checkpoint(out, full=True).ok
    after = _load_fresh(out)
    assert_same_state(before[0].state_dict(), after[0].state_dict())
    assert_same_optimizer(before[1], after[1])
    # Every other file is carried over byte for byte.
    for name in ("training_state.json", "config.json", "rng/rank-00000.safetensors"):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes()
    # In place, to one shard each: atomic replace of the same directory; one model file is model.safetensors.
    code, stdout, _ = _run(capsys, "reshard", str(checkpoint), "--max-shard-size", "10MB")
    assert code == 0 and "1 model shard(s), 1 optimizer shard(s)" in stdout
    assert _shards(checkpoint, "model") == [] and (checkpoint / "model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors.index.json").exists()
    assert _shards(checkpoint, "optimizer") == ["optimizer-00001-of-00001.safetensors"]
    assert not (checkpoint / "model-00002-of-00004.safetensors").exists()
    assert_same_state(before[0].state_dict(), _load_fresh(checkpoint)[0].state_dict())


# ----------------------------------------------------------------------------------------------- convert
class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(3, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint written by the stock transformers.Trainer (AdamW + linear schedule)."""
    from transformers import Trainer, TrainingArguments

    output = tmp_path_factory.mktemp("stock")
    args = TrainingArguments(output_dir=str(output), max_steps=2, save_steps=2, report_to=[], use_cpu=True,
                             per_device_train_batch_size=4, weight_decay=0.01, disable_tqdm=True, logging_steps=1)
    rng = torch.get_rng_state()
    Trainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens()).train()
    torch.set_rng_state(rng)
    return output / "checkpoint-2"


def _trainer_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    return [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]


@pytest.mark.slow
def test_convert_stock_trainer_checkpoint(stock_checkpoint: Path, tmp_path: Path, capsys, caplog) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "converted" / "checkpoint-2"
    with caplog.at_level("WARNING", logger="hf_resumable"):
        code, stdout, err = _run(capsys, "convert", str(stock_checkpoint), "--output", str(out),
                                 "--max-shard-size", "50KB")
    assert code == 0 and "converted" in stdout
    assert "NOTICE" in err and "weights_only=True" in err
    assert any(r.levelname == "WARNING" and "pickle" in r.getMessage() for r in caplog.records)
    assert not [p for p in out.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".pkl")]
    assert verify_checkpoint(out, full=True).ok and len(_shards(out, "model")) > 1

    model, optimizer = _model_and_optimizer(seed=9, groups=_trainer_groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loaded = load_checkpoint(out, model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=False)
    stock_model = AutoModelForCausalLM.from_pretrained(stock_checkpoint)
    assert_same_state(stock_model.state_dict(), model.state_dict())
    stock_optimizer = torch.load(stock_checkpoint / "optimizer.pt", weights_only=True)
    state = optimizer.state_dict()
    assert state["param_groups"] == stock_optimizer["param_groups"]
    assert state["state"].keys() == stock_optimizer["state"].keys()
    for index, fields in stock_optimizer["state"].items():
        for key, value in fields.items():
            assert torch.equal(value, state["state"][index][key]), (index, key)
    stock_scheduler = torch.load(stock_checkpoint / "scheduler.pt", weights_only=True)
    assert {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"} == \
        {k: v for k, v in stock_scheduler.items() if k != "lr_lambdas"}
    assert loaded.step == 2 and loaded.training_state["global_step"] == 2
    assert loaded.extra["converted_from"] == "transformers.Trainer"
    assert loaded.rng_state is not None
    code, summary, _ = _run(capsys, "inspect", "--json", str(out))
    document = json.loads(summary)
    assert (code, document["step"], document["epoch"], document["optimizer_class"]) == (0, 2, 0.5, "AdamW")
    stock_rng = torch.load(stock_checkpoint / "rng_state.pth", weights_only=False)
    assert torch.equal(loaded.rng_state.torch_cpu, stock_rng["cpu"])
    assert loaded.rng_state.python == stock_rng["python"]


def test_convert_refuses_non_transformers_dirs(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = _run(capsys, "convert", str(tmp_path / "empty"))
    assert code == 2 and "no config.json" in err


# ----------------------------------------------------------------------------------------------- push / pull
@pytest.mark.slow
def test_push_with_card_then_pull_and_inspect(hub, checkpoint: Path, tmp_path: Path, capsys) -> None:
    from huggingface_hub import ModelCard

    repo_id = new_repo_id("cli")
    code, out, _ = _run(capsys, "push", str(checkpoint), repo_id, "--revision", "step-2", "--license", "apache-2.0")
    assert code == 0 and out.startswith(f"hf://{repo_id}@")
    card = ModelCard(hub.read_file(repo_id, "README.md", "step-2").decode())
    assert card.data.library_name == "transformers" and "hf_resumable" in card.data.tags
    assert "| Global step | 2 |" in card.text
    assert not (checkpoint / "README.md").exists()  # the caller's directory is untouched
    # The card's lazy-loading snippet works against the pushed repo.
    from accelerate import init_empty_weights

    from hf_resumable.lazy import load_lazily

    assert f'load_lazily(model, "{repo_id}", revision="step-2")' in card.text
    with init_empty_weights():
        lazy = type(tiny_gpt2())(tiny_gpt2().config)
    assert load_lazily(lazy, repo_id, revision="step-2") == ([], [])
    expected, _ = _load_fresh(checkpoint)
    assert_same_state(expected.state_dict(), lazy.state_dict())
    code, out, _ = _run(capsys, "pull", f"hf://{repo_id}@step-2", "--local-dir", str(tmp_path / "pulled"))
    pulled = Path(out.strip())
    assert code == 0 and verify_checkpoint(pulled, full=True).ok
    code, out, _ = _run(capsys, "inspect", "--json", f"hf://{repo_id}@step-2")
    assert code == 0 and json.loads(out)["step"] == 2


@pytest.mark.slow
def test_push_into_subdirectory_with_tag_then_pull(hub, checkpoint: Path, tmp_path: Path, capsys) -> None:
    repo_id = new_repo_id("cli-sub")
    code, out, _ = _run(capsys, "push", str(checkpoint), repo_id, "--path-in-repo", "checkpoint-2", "--tag", "v2")
    url = out.strip()
    assert code == 0 and url.startswith(f"hf://{repo_id}@") and url.endswith("/checkpoint-2")
    assert hub.repo(repo_id).tags["v2"] in url
    code, out, _ = _run(capsys, "pull", f"hf://{repo_id}@v2/checkpoint-2", "--local-dir", str(tmp_path / "p"))
    assert code == 0 and Path(out.strip()) == tmp_path / "p" / "checkpoint-2"
    assert verify_checkpoint(tmp_path / "p" / "checkpoint-2", full=True).ok
    code, _, err = _run(capsys, "pull", new_repo_id("missing"), "--local-dir", str(tmp_path / "q"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------------------------- demo
def test_compare_runs_accepts_identical_and_rejects_any_difference() -> None:
    reference = RunRecord({1: 3.5, 2: 3.25, 3: 3.0}, "a" * 64)
    assert compare_runs(reference, RunRecord(dict(reference.losses), "a" * 64, [2])).ok
    one_ulp = RunRecord({**reference.losses, 2: math.nextafter(3.25, 4.0)}, "a" * 64)
    result = compare_runs(reference, one_ulp)
    assert not result.ok and result.problems == [f"step 2: loss 3.25 (uninterrupted) != {math.nextafter(3.25, 4.0)!r} "
                                                 "(resumed)"]
    assert "MISMATCH (1)" in format_comparison(result)
    assert not compare_runs(reference, RunRecord(dict(reference.losses), "b" * 64)).ok
    assert not compare_runs(reference, RunRecord({1: 3.5, 2: 3.25}, "a" * 64)).ok  # a step is missing
    assert not compare_runs(reference, RunRecord(dict(reference.losses), None)).ok  # did not finish
    assert compare_runs(RunRecord({1: float("nan")}, "x"), RunRecord({1: float("nan")}, "x")).ok


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path) -> None:
    """The real demo, small: SIGKILL after step 5 (checkpoints every 3), restart, identical losses and weights."""
    env = {**os.environ, "MPLBACKEND": "Agg"}
    result = zygote.run(
        [sys.executable, "-m", "hf_resumable", "demo", "--output", str(tmp_path / "demo"), "--max-steps", "8",
         "--save-every", "3", "--kill-at", "5", "--backend", "trainer"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "IDENTICAL: all 8 losses and the final weights match bit for bit." in result.stdout
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    assert report["ok"] and report["backend"] == "trainer" and report["kill_step"] >= 5
    assert report["resumed_from"] in ([3], [6])
    assert report["reference_sha256"] == report["resumed_sha256"]
    assert (tmp_path / "demo" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    resumed = load_run(tmp_path / "demo" / "resumed")
    assert sorted(resumed.losses) == list(range(1, 9))


@pytest.mark.slow
def test_demo_loop_backend_resumes_exactly_in_process(tmp_path: Path, monkeypatch) -> None:
    """The plain-loop backend: a crash right after step 4 (checkpoints every 3) and a restart match the reference."""
    from hf_resumable.demo import train as demo_train

    class Killed(BaseException):
        pass

    def fake_kill(pid, sig):
        raise Killed

    threads = torch.get_num_threads()
    try:
        reference = demo_train.train_loop(demo_train.DemoConfig(output=tmp_path / "ref", max_steps=6, save_every=3))
        monkeypatch.setattr(demo_train.os, "kill", fake_kill)
        config = demo_train.DemoConfig(output=tmp_path / "run", max_steps=6, save_every=3, kill_at=4)
        with pytest.raises(Killed):
            demo_train.train_loop(config)
        monkeypatch.undo()  # ``demo_train.os`` is the os module: the restart's liveness checks need the real kill
        assert len(load_run(tmp_path / "run").losses) == 4
        resumed = demo_train.train_loop(demo_train.DemoConfig(output=tmp_path / "run", max_steps=6, save_every=3))
    finally:
        torch.set_num_threads(threads)
    assert resumed == reference
    record = load_run(tmp_path / "run")
    assert record.resumed_from == [3] and sorted(record.losses) == list(range(1, 7))
    assert compare_runs(load_run(tmp_path / "ref"), record).ok


def test_summary_sees_through_optimizer_wrappers() -> None:
    from hf_resumable.checkpoint.summary import _optimizer_name

    adamw = {"betas": [0.9, 0.999], "decoupled_weight_decay": True, "lr": 1e-3}
    accelerated = "AdamW (in AcceleratedOptimizer)"
    assert _optimizer_name({"class": "AcceleratedOptimizer", "param_groups": [adamw]}) == accelerated
    sgd = {"momentum": 0.9, "dampening": 0, "lr": 0.1}
    assert _optimizer_name({"class": "AcceleratedOptimizer", "param_groups": [sgd]}) == "SGD (in AcceleratedOptimizer)"
    assert _optimizer_name({"class": "Lion", "param_groups": [{}]}) == "Lion"


def test_progress_bars_show_on_saves_only_when_enabled(tmp_path, capsys):
    import torch

    from hf_resumable.checkpoint import save_checkpoint
    from hf_resumable.progress import disable_progress_bars, enable_progress_bars

    save_checkpoint(tmp_path / "quiet", model={"w": torch.zeros(1024)}, rng=False)
    assert "saving" not in capsys.readouterr().err
    enable_progress_bars()
    try:
        save_checkpoint(tmp_path / "loud", model={"w": torch.zeros(1024)}, rng=False)
    finally:
        disable_progress_bars()
    assert "saving .tmp-loud" in capsys.readouterr().err
