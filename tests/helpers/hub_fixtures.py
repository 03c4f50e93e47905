"""Pytest fixtures that start the local fake Hub and point the real ``huggingface_hub`` client at it.

Import the fixtures into a test module (``from helpers.hub_fixtures import hub, hub_env  # noqa: F401``). The server is
started once per importing module and stopped at its end; every test gets a fresh cache directory, an empty request
log and no faults.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import tiny_models
from helpers.fakehub import FakeHub

__all__ = ["hub", "hub_env", "hub_constants", "hub_environ", "new_repo_id", "make_checkpoint_dir", "on_meta",
           "tiny_gpt2", "tiny_llama"]


def hub_environ(endpoint: str, home: Path) -> dict[str, str]:
    """Environment variables that point a (sub)process' huggingface_hub at ``endpoint`` with a private cache."""
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_TOKEN": "hf_dummy_token",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_ETAG_TIMEOUT": "30",
        "HF_HUB_DOWNLOAD_TIMEOUT": "30",
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }


def hub_constants(endpoint: str, home: Path) -> dict[str, object]:
    """``huggingface_hub.constants`` values to set when the library was imported before the environment was."""
    return {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_OFFLINE": False,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_DISABLE_TELEMETRY": True,
    }


@pytest.fixture(scope="module")
def _hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    server = FakeHub(tmp_path_factory.mktemp("fakehub"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def hub_env(_hub_server: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Point huggingface_hub (already imported or not) at the fake server, with a per-test cache."""
    import huggingface_hub
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    env = hub_environ(_hub_server.endpoint, home)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_HUB_OFFLINE", "HUGGINGFACE_CO_STAGING", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in hub_constants(_hub_server.endpoint, home).items():
        monkeypatch.setattr(constants, key, value)
    huggingface_hub.utils.disable_progress_bars()
    huggingface_hub.close_session()  # the next client reads NO_PROXY afresh
    yield env
    huggingface_hub.close_session()


@pytest.fixture
def hub(_hub_server: FakeHub, hub_env: dict[str, str]) -> Iterator[FakeHub]:
    """The running fake Hub, with an empty request log, no faults, and the client pointed at it."""
    _hub_server.clear_faults()
    _hub_server.clear_log()
    _hub_server.cdn = False
    _hub_server.multipart_threshold = None
    yield _hub_server
    _hub_server.clear_faults()
    _hub_server.cdn = False
    _hub_server.multipart_threshold = None


def new_repo_id(prefix: str = "repo") -> str:
    """A repo id no other test uses."""
    return f"user/{prefix}-{uuid.uuid4().hex[:8]}"


def tiny_gpt2(*, seed: int = 0):
    """``tiny_models.tiny_gpt2`` (tied lm_head) in eval mode, so forward passes are deterministic."""
    return tiny_models.tiny_gpt2(seed).eval()


def tiny_llama(*, seed: int = 0):
    """``tiny_models.tiny_llama`` with grouped-query attention (4 heads, 2 KV heads), in eval mode."""
    return tiny_models.tiny_llama(seed, num_attention_heads=4, num_key_value_heads=2).eval()


def on_meta(model):
    """A fresh copy of ``model``'s architecture on the meta device (buffers stay real)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return type(model)(model.config).eval()


def make_checkpoint_dir(directory: Path, files: dict[str, bytes], *, bad_hash_for: str | None = None,
                        sha256_only: bool = False) -> Path:
    """A committed-looking checkpoint directory: ``files`` (and a ``training_state.json``, which every checkpoint
    has, if they hold none) plus a ``manifest.json`` with the record (size and xxh3-128) of each; with
    ``sha256_only``, a manifest of format version 1 as the oldest writers made it (size and sha256)."""
    import hashlib

    from hf_resumable.checkpoint.commit.manifest import Manifest
    from hf_resumable.format.safetensors_io import FileRecord, record_of

    directory.mkdir(parents=True, exist_ok=True)
    records = {}
    for name, data in {"training_state.json": b"{}", **files}.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        records[name] = record_of(data) if name != bad_hash_for else FileRecord(len(data), xxh3_128="0" * 32)
        if sha256_only:
            records[name] = FileRecord(len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest = Manifest(files=records, format_version=1) if sha256_only else Manifest(files=records)
    (directory / "manifest.json").write_bytes(manifest.to_json())
    return directory
