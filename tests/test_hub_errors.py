"""Hub and lazy loading: every bad answer from the Hub is a typed HubError naming repo, commit and file.

Against the local fake Hub with the real huggingface_hub client: a missing shard (404), a server error
(500), an unknown dtype in a shard header, a malformed ``hf_resumable_shards`` record, an index naming
10,000 shards (refused before any shard request), and shard headers fetched concurrently.
"""

from __future__ import annotations

import json
import struct
import types

import pytest
import torch
from huggingface_hub import HfApi
from huggingface_hub.errors import EntryNotFoundError

from hf_resumable.errors import (
    HubEntryNotFoundError,
    HubError,
    HubFormatError,
    HubServerError,
    IncompleteCheckpointError,
    UnsafeIndexError,
)
from hf_resumable.hub import push_sharded
from hf_resumable.lazy import LazyStateDict, load_lazily

from helpers.fakehub import FakeHub, Fault
from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id, tiny_llama  # noqa: F401

INDEX = "model.safetensors.index.json"


def _pushed(hub: FakeHub, *, shards: str = "20KB") -> tuple[str, torch.nn.Module, dict]:
    model = tiny_llama()
    repo_id = new_repo_id("errors")
    push_sharded(model, repo_id, max_shard_size=shards)
    index = json.loads(hub.read_file(repo_id, INDEX))
    return repo_id, model, index


def _upload(repo_id: str, path: str, data: bytes) -> None:
    HfApi().upload_file(path_or_fileobj=data, path_in_repo=path, repo_id=repo_id)


def test_missing_shard_is_a_typed_404_naming_repo_commit_and_file(hub):
    repo_id, _model, index = _pushed(hub)
    victim = sorted(set(index["weight_map"].values()))[1]
    HfApi().delete_file(victim, repo_id=repo_id)
    commit = hub.head(repo_id).oid
    with pytest.raises(HubEntryNotFoundError) as raised:
        LazyStateDict.from_pretrained(repo_id)
    message = str(raised.value)
    assert repo_id in message and commit[:12] in message and victim in message
    assert isinstance(raised.value, (IncompleteCheckpointError, EntryNotFoundError, FileNotFoundError))


def test_server_error_on_a_shard_header_is_a_typed_hub_server_error(hub):
    repo_id, _model, index = _pushed(hub)
    victim = sorted(set(index["weight_map"].values()))[0]
    hub.add_fault(Fault(path_regex=victim, status=500, times=None))
    with pytest.raises(HubServerError) as raised:
        LazyStateDict.from_pretrained(repo_id)
    assert "500" in str(raised.value) and repo_id in str(raised.value) and victim in str(raised.value)


def test_server_error_on_a_shard_download_is_a_typed_hub_server_error(hub):
    repo_id, model, index = _pushed(hub)
    weights = LazyStateDict.from_pretrained(repo_id)
    name = "model.layers.1.mlp.down_proj.weight"
    hub.add_fault(Fault(path_regex=weights.meta(name).filename, method="GET", status=503, times=None))
    with pytest.raises(HubServerError, match="503"):
        weights[name]
    hub.clear_faults()
    assert torch.equal(weights[name], model.state_dict()[name])  # nothing cached from the failure


def test_server_error_resolving_the_revision_is_a_typed_hub_server_error(hub):
    """The first request of from_pretrained (repo info: the commit of the revision) answered 500: huggingface_hub's
    raw HfHubHTTPError escaped."""
    repo_id, _model, _index = _pushed(hub)
    hub.add_fault(Fault(path_regex=rf"^/api/models/{repo_id}", method="GET", status=500, times=None))
    with pytest.raises(HubServerError) as raised:
        LazyStateDict.from_pretrained(repo_id, revision="main")
    assert "500" in str(raised.value) and f"{repo_id}@main" in str(raised.value)


def test_server_error_on_the_index_is_a_typed_hub_server_error_not_a_missing_model(hub, monkeypatch):
    """hf_hub_download reports a HEAD that answered 500 (after its retries) as a file it cannot find: that was
    taken for a repo without an index, then (model.safetensors too) for a repo without any model."""
    import huggingface_hub.utils._http as hub_http

    monkeypatch.setattr(hub_http, "time", types.SimpleNamespace(sleep=lambda _seconds: None))  # its retry backoff
    repo_id, _model, _index = _pushed(hub)
    hub.add_fault(Fault(path_regex=r"/model\.safetensors(\.index\.json)?$", method="HEAD", status=500, times=None))
    with pytest.raises(HubServerError) as raised:
        LazyStateDict.from_pretrained(repo_id)
    message = str(raised.value)
    assert "500" in message and repo_id in message and hub.head(repo_id).oid[:12] in message and INDEX in message


def _shard_with_dtype(dtype: str) -> bytes:
    header = json.dumps({"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0" * 8


def test_unknown_dtype_in_a_shard_header_is_a_typed_format_error(hub):
    repo_id = new_repo_id("dtype")
    HfApi().create_repo(repo_id)
    _upload(repo_id, "model-00001-of-00001.safetensors", _shard_with_dtype("F4X"))
    _upload(repo_id, INDEX, json.dumps({"metadata": {}, "weight_map": {
        "w": "model-00001-of-00001.safetensors"}}).encode())
    with pytest.raises(HubFormatError, match="F4X") as raised:
        LazyStateDict.from_pretrained(repo_id)
    assert repo_id in str(raised.value) and "model-00001-of-00001.safetensors" in str(raised.value)


@pytest.mark.parametrize("record", [{"size": "big", "sha256": "0" * 64}, {"size": 10}, "not a record",
                                    {"size": 10, "sha256": "xyz"}])
def test_malformed_shard_record_is_a_typed_format_error(hub, record):
    repo_id, _model, index = _pushed(hub)
    shard = sorted(set(index["weight_map"].values()))[0]
    index["metadata"]["hf_resumable_shards"][shard] = record
    _upload(repo_id, INDEX, json.dumps(index).encode())
    weights = LazyStateDict.from_pretrained(repo_id)
    name = next(n for n, f in index["weight_map"].items() if f == shard)
    with pytest.raises(HubFormatError, match="hf_resumable_shards") as raised:
        weights[name]
    assert shard in str(raised.value) and repo_id in str(raised.value)


def test_records_that_are_not_an_object_are_a_typed_format_error(hub):
    repo_id, model, index = _pushed(hub)
    index["metadata"]["hf_resumable_shards"] = ["nope"]
    _upload(repo_id, INDEX, json.dumps(index).encode())
    with pytest.raises(HubFormatError):
        load_lazily(type(model)(model.config), repo_id)


def test_index_naming_ten_thousand_shards_is_refused_before_any_shard_request(hub):
    repo_id, _model, index = _pushed(hub)
    names = list(index["weight_map"])
    crafted = {f"t{i}": f"model-{i:05d}-of-10000.safetensors" for i in range(10_000)}
    crafted.update({n: f"model-{i:05d}-of-10000.safetensors" for i, n in enumerate(names)})
    _upload(repo_id, INDEX, json.dumps({"metadata": {}, "weight_map": crafted}).encode())
    hub.clear_log()
    with pytest.raises(UnsafeIndexError, match="10000 shard files"):
        LazyStateDict.from_pretrained(repo_id)
    assert hub.requests(path_regex=r"\.safetensors$") == []


def test_shard_headers_are_fetched_concurrently(hub):
    repo_id, _model, index = _pushed(hub, shards="8KB")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 12
    hub.clear_log()
    hub.add_fault(Fault(path_regex=r"\.safetensors$", kind="slow", delay=0.3, times=None))
    weights = LazyStateDict.from_pretrained(repo_id)
    assert set(weights.filenames) == set(shards)
    spans = [(r.started, r.ended) for r in hub.requests(path_regex=r"\.safetensors$") if r.range]
    assert len(spans) >= len(shards)
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert overlap >= 4, f"at most {overlap} header requests were in flight at once"


def test_hub_errors_are_also_oserrors_like_huggingface_hubs_own():
    assert issubclass(HubError, OSError) and issubclass(HubServerError, HubError)
