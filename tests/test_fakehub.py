"""Contract tests: the real huggingface_hub client against the local fake Hub (tests/helpers/fakehub.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, HfFileSystem, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from helpers.fakehub import FakeHub, Fault
from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id  # noqa: F401


def _files(tmp_path: Path, files: dict[str, bytes]) -> Path:
    folder = tmp_path / "upload"
    for name, data in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return folder


def _payload(size: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def test_create_repo_twice_answers_409_with_url(hub: FakeHub) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    first = api.create_repo(repo_id)
    second = api.create_repo(repo_id, exist_ok=True)
    assert first.repo_id == second.repo_id == repo_id
    with pytest.raises(HfHubHTTPError, match="409"):
        api.create_repo(repo_id)


def test_upload_folder_regular_and_lfs_round_trip(hub: FakeHub, tmp_path: Path) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    files = {"config.json": b'{"a": 1}', "weights.safetensors": _payload(300_000), "sub/dir/notes.txt": b"hi"}
    info = api.upload_folder(folder_path=_files(tmp_path, files), repo_id=repo_id, commit_message="add")
    assert len(info.oid) == 40
    assert sorted(api.list_repo_files(repo_id)) == sorted(files)
    puts = hub.requests("PUT", r"^/_lfs/")
    assert len(puts) == 1 and puts[0].bytes_received == 300_000
    for name, data in files.items():
        assert Path(hf_hub_download(repo_id, name)).read_bytes() == data
    snap = snapshot_download(repo_id, revision=info.oid)
    assert (Path(snap) / "sub/dir/notes.txt").read_bytes() == b"hi"
    # Re-uploading unchanged files makes no LFS transfer.
    hub.clear_log()
    api.upload_folder(folder_path=_files(tmp_path, files), repo_id=repo_id)
    assert hub.requests("PUT") == []


def test_multipart_upload_sends_parts_and_completion(hub: FakeHub, tmp_path: Path) -> None:
    hub.multipart_threshold = 100_000
    hub.multipart_chunk_size = 40_000
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = _payload(130_000, seed=1)
    api.upload_file(path_or_fileobj=data, path_in_repo="big.bin", repo_id=repo_id)
    assert len(hub.requests("PUT", r"/part/")) == 4
    assert len(hub.requests("POST", r"/complete$")) == 1
    assert hub.read_file(repo_id, "big.bin") == data


def test_resolve_headers_and_errors(hub: FakeHub, tmp_path: Path) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    api.upload_folder(folder_path=_files(tmp_path, {"a.txt": b"abc", "m.safetensors": _payload(1000)}),
                      repo_id=repo_id)
    url = huggingface_hub.hf_hub_url(repo_id, "m.safetensors")
    meta = huggingface_hub.get_hf_file_metadata(url)
    assert meta.etag == hashlib.sha256(_payload(1000)).hexdigest() and meta.size == 1000
    assert meta.commit_hash == hub.head(repo_id).oid
    regular = huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, "a.txt"))
    assert regular.etag == hashlib.sha1(b"blob 3\0abc").hexdigest()
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo_id, "missing.txt")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(repo_id, "a.txt", revision="nope")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("user/does-not-exist", "a.txt")


def test_range_requests_206_and_416(hub: FakeHub, tmp_path: Path) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = _payload(5000, seed=2)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id=repo_id)
    session = huggingface_hub.get_session()
    url = huggingface_hub.hf_hub_url(repo_id, "w.safetensors")
    part = session.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == data[100:200]
    assert part.headers["Content-Range"] == "bytes 100-199/5000"
    beyond = session.get(url, headers={"Range": "bytes=5000-"})
    assert beyond.status_code == 416 and beyond.headers["Content-Range"] == "bytes */5000"


def test_hf_file_system_ranged_reads(hub: FakeHub) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = _payload(200_000, seed=3)
    api.upload_file(path_or_fileobj=data, path_in_repo="x.safetensors", repo_id=repo_id)
    hub.clear_log()
    fs = HfFileSystem(skip_instance_cache=True)
    with fs.open(f"{repo_id}/x.safetensors", "rb", block_size=1024) as f:
        f.seek(150_000)
        assert f.read(100) == data[150_000:150_100]
    ranged = [r for r in hub.requests("GET", "/resolve/") if r.range]
    assert ranged and all(r.bytes_sent <= 2048 for r in ranged)


def test_cdn_redirect_drops_token_and_downloads(hub: FakeHub) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = _payload(4096, seed=4)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id=repo_id)
    hub.cdn = True
    hub.clear_log()
    path = hf_hub_download(repo_id, "w.safetensors")
    assert Path(path).read_bytes() == data
    cdn = hub.requests("GET", r"^/cdn/")
    assert len(cdn) == 1 and "authorization" not in cdn[0].headers
    assert hub.requests("HEAD", "/resolve/")[0].status == 302


def test_tree_pagination_and_branches_tags(hub: FakeHub, tmp_path: Path) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    names = {f"d/f{i:02d}.txt": str(i).encode() for i in range(7)}
    info = api.upload_folder(folder_path=_files(tmp_path, names), repo_id=repo_id)
    old_page = hub.page_size
    hub.page_size = 3
    try:
        assert sorted(api.list_repo_files(repo_id)) == sorted(names)
    finally:
        hub.page_size = old_page
    assert len(hub.requests("GET", r"/tree/.*cursor=")) >= 2
    api.create_branch(repo_id, branch="step-10")
    api.create_branch(repo_id, branch="step-10", exist_ok=True)
    api.create_tag(repo_id, tag="v1", revision=info.oid)
    refs = api.list_repo_refs(repo_id)
    assert {b.name for b in refs.branches} == {"main", "step-10"}
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1", info.oid)]
    paths = api.get_paths_info(repo_id, ["d/f01.txt", "d", "nope"])
    assert sorted(p.path for p in paths) == ["d", "d/f01.txt"]
    assert api.model_info(repo_id, files_metadata=True).sha == info.oid
    assert len(api.list_repo_commits(repo_id)) == 2


def test_parent_commit_conflict_is_412(hub: FakeHub) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    first = api.upload_file(path_or_fileobj=b"1", path_in_repo="a.txt", repo_id=repo_id)
    api.upload_file(path_or_fileobj=b"2", path_in_repo="a.txt", repo_id=repo_id)
    with pytest.raises(HfHubHTTPError, match="412"):
        api.create_commit(repo_id, [CommitOperationAdd("b.txt", b"3")], commit_message="x",
                          parent_commit=first.oid)


def test_fault_500_then_cut_body_resumes_inside_one_call(hub: FakeHub) -> None:
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    with pytest.raises(HfHubHTTPError, match="500"):
        hub.add_fault(Fault(r"/commit/", method="POST", status=500))
        api.upload_file(path_or_fileobj=b"x", path_in_repo="a.txt", repo_id=repo_id)
    assert "a.txt" not in hub.head(repo_id).files
    data = _payload(300_000, seed=5)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id=repo_id)
    hub.add_fault(Fault(r"/resolve/.*w\.safetensors", method="GET", kind="cut", cut_after=1000))
    path = hf_hub_download(repo_id, "w.safetensors", cache_dir=os.environ["HF_HUB_CACHE"] + "-cut")
    assert Path(path).read_bytes() == data
    gets = hub.requests("GET", r"/resolve/.*w\.safetensors")
    assert gets[0].fault == "cut" and gets[0].bytes_sent == 1000 and len(gets) == 2


def test_request_log_contract_for_hf_hub_download(hub: FakeHub) -> None:
    """A client upgrade that changes the endpoints it calls fails here loudly."""
    api = HfApi()
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id=repo_id)
    hub.clear_log()
    hf_hub_download(repo_id, "config.json")
    calls = [(r.method, r.path.split("?")[0]) for r in hub.log if "agent-harnesses" not in r.path]
    assert calls == [("HEAD", f"/{repo_id}/resolve/main/config.json"), ("GET", f"/{repo_id}/resolve/main/config.json")]


def test_slow_fault_whoami_and_delete_repo(hub: FakeHub) -> None:
    import time

    api = HfApi()
    assert api.whoami()["name"] == "user"
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    hub.add_fault(Fault(r"/api/models/.*/revision/", kind="slow", delay=0.3))
    start = time.monotonic()
    assert api.repo_info(repo_id, revision="main").sha == hub.head(repo_id).oid
    assert time.monotonic() - start >= 0.3
    api.delete_repo(repo_id)
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info(repo_id)
