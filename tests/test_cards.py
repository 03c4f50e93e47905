"""Model cards: metadata the Hub parses without warnings, training state, shard table, loading snippets."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load

from hf_resumable import save_checkpoint
from hf_resumable.checkpoint import read_manifest
from hf_resumable.checkpoint.summary import summarize_checkpoint
from hf_resumable.hub.cards import DEFAULT_TAGS, card_metadata, render_checkpoint_card, render_model_card

from helpers.tiny_models import tiny_gpt2, train_steps

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=1)
    path = tmp_path / "checkpoint-30"
    save_checkpoint(path, model=model, optimizer=optimizer, step=30, max_shard_size="60KB", metrics={"loss": 2.5},
                    training_state={"global_step": 30, "epoch": 1.5, "resumes": 2},
                    extra={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "world_size": 2})
    return path


def _parse_without_warnings(text: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> dict:
    readme = tmp_path / "README.md"
    readme.write_text(text, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING):
            metadata = metadata_load(readme)
            card = ModelCard.load(readme, ignore_metadata_errors=False)
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")], caplog.records
    assert card.data.to_dict() == metadata
    return metadata


def test_card_metadata_parses_without_warnings(checkpoint: Path, tmp_path: Path, caplog) -> None:
    card = render_checkpoint_card(checkpoint, repo_id="me/run", license="apache-2.0", tags=["gpt2"],
                                  datasets="me/corpus", base_model="me/base")
    metadata = _parse_without_warnings(str(card), tmp_path, caplog)
    assert metadata["library_name"] == "transformers"
    assert metadata["tags"] == [*DEFAULT_TAGS, "gpt2"]
    assert (metadata["license"], metadata["datasets"], metadata["base_model"]) == ("apache-2.0", ["me/corpus"],
                                                                                    "me/base")
    assert card_metadata(str(card)) == metadata


def test_card_training_state_and_shard_table(checkpoint: Path) -> None:
    text = render_checkpoint_card(checkpoint, repo_id="me/run", revision="step-30", path_in_repo="checkpoint-30").text
    assert "| Global step | 30 |" in text and "| Epoch | 1.5 |" in text and "| Resumes so far | 2 |" in text
    assert "| Effective batch size | 64 (8 per device x 4 accumulation x 2 ranks) |" in text
    assert "| Optimizer | AdamW |" in text and "| loss | 2.5 |" in text
    manifest = read_manifest(checkpoint)
    tensor_files = [name for name in manifest.files if name.endswith(".safetensors")]
    assert len(tensor_files) > 3
    for name in tensor_files:
        assert f"| `{name}` |" in text and f"`xxh3-128:{manifest.files[name].xxh3_128}`" in text
    assert 'load_lazily(model, "me/run", revision="step-30")' in text
    assert 'pull_checkpoint("hf://me/run@step-30/checkpoint-30")' in text
    assert "resume_from_checkpoint=" in text


def test_card_of_corrupt_checkpoint_says_so(checkpoint: Path, caplog) -> None:
    shard = next(checkpoint.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hf_resumable"):
        text = render_checkpoint_card(checkpoint, repo_id="me/run").text
    assert "| Verification | FAILED" in text
    assert any("does not verify" in r.getMessage() for r in caplog.records)


def test_card_without_recorded_progress_uses_dashes(tmp_path: Path, caplog) -> None:
    save_checkpoint(tmp_path / "weights", model=tiny_gpt2(), rng=False)
    card = render_checkpoint_card(tmp_path / "weights", repo_id="me/weights", pipeline_tag=None)
    assert "| Effective batch size | - |" in card.text and "| Optimizer | - |" in card.text
    assert "pipeline_tag" not in _parse_without_warnings(str(card), tmp_path, caplog)


def test_summary_takes_what_the_training_state_lacks_from_trainer_state(tmp_path: Path) -> None:
    # trainer_state.json gives every field the training state does not record (it once gave only the step, the epoch
    # and the per-device batch size); one the training state records, even nested, is taken from there.
    trainer_state = '{"global_step": 9, "epoch": 0.5, "train_batch_size": 4, "gradient_accumulation_steps": 2}'
    save_checkpoint(tmp_path / "c", model=torch.nn.Linear(2, 2), rng=False, training_state={"loop": {"epoch": 1.5}},
                    extra_files={"trainer_state.json": trainer_state})
    summary = summarize_checkpoint(tmp_path / "c")
    assert (summary.step, summary.epoch, summary.per_device_batch_size) == (9, 1.5, 4)
    assert summary.gradient_accumulation_steps == 2 and summary.effective_batch_size == 8


def test_card_and_inspect_of_a_checkpoint_whose_manifest_has_sha256_only(checkpoint: Path, capsys) -> None:
    import hashlib
    import json

    from hf_resumable.checkpoint.commit.manifest import Manifest
    from hf_resumable.cli import main
    from hf_resumable.format.safetensors_io import FileRecord

    manifest = read_manifest(checkpoint)
    files = {rel: FileRecord(r.size, sha256=hashlib.sha256((checkpoint / rel).read_bytes()).hexdigest())
             for rel, r in manifest.files.items()}
    (checkpoint / "manifest.json").write_bytes(Manifest(files=files, step=30, format_version=1).to_json())
    text = render_checkpoint_card(checkpoint, repo_id="me/run").text
    for name, record in files.items():
        if name.endswith(".safetensors"):
            assert f"| `{name}` |" in text and f"`sha256:{record.sha256}`" in text
    assert main(["inspect", "--json", "--full", str(checkpoint)]) == 0
    shards = json.loads(capsys.readouterr().out)["shards"]
    assert shards and all(s["xxh3_128"] is None and s["sha256"] == files[s["file"]].sha256 for s in shards)


def test_custom_template(checkpoint: Path, tmp_path: Path) -> None:
    template = tmp_path / "template.md"
    template.write_text("---\n{{ card_data }}\n---\n\nstep {{ step }} of {{ repo_id }}\n")
    card = render_model_card(summarize_checkpoint(checkpoint), repo_id="me/run", template_path=template)
    assert card.text.strip() == "step 30 of me/run"


def test_shipped_example_card_parses(tmp_path: Path, caplog) -> None:
    example = REPO_ROOT / "model_cards" / "example_checkpoint_card.md"
    metadata = _parse_without_warnings(example.read_text(encoding="utf-8"), tmp_path, caplog)
    assert metadata["library_name"] == "transformers" and "hf_resumable" in metadata["tags"]
