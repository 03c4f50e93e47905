"""hf_resumable.hub against the local fake Hub, with the real huggingface_hub and transformers clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from huggingface_hub import HfApi, hf_hub_download
from transformers import AutoModelForCausalLM

from hf_resumable.constants import SHARDS_KEY
from hf_resumable.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HubError,
    IncompleteCheckpointError,
    UnsafeIndexError,
)
from hf_resumable.hub import (
    CheckpointUploader,
    HfUrl,
    download_shards,
    parse_hf_url,
    pull_checkpoint,
    push_checkpoint,
    push_sharded,
    resumable_download,
)

from helpers import zygote
from helpers.distributed_launch import child_env
from helpers.fakehub import FakeHub, Fault
from helpers.hub_fixtures import _hub_server, hub, hub_env, make_checkpoint_dir, new_repo_id, tiny_gpt2  # noqa: F401

INDEX = "model.safetensors.index.json"


def _index(repo_id: str, hub: FakeHub, revision: str = "main") -> dict:
    return json.loads(hub.read_file(repo_id, INDEX, revision))


def _shard_gets(hub: FakeHub) -> list[str]:
    """Shards fetched in full (not header probes)."""
    return sorted({r.path.split("/")[-1] for r in hub.requests("GET", r"\.safetensors$") if not r.range})


@pytest.fixture
def pushed_gpt2(hub: FakeHub) -> tuple[str, torch.nn.Module]:
    model = tiny_gpt2()
    repo_id = new_repo_id("gpt2")
    push_sharded(model, repo_id, max_shard_size="20KB")
    return repo_id, model


# --------------------------------------------------------------------------------------------------- push_sharded
def test_push_sharded_layout_aliases_and_hashes(hub: FakeHub, pushed_gpt2: tuple) -> None:
    repo_id, model = pushed_gpt2
    files = set(HfApi().list_repo_files(repo_id))
    index = _index(repo_id, hub)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and files == {INDEX, "config.json", "generation_config.json", *shards}
    assert index["metadata"]["lm_head.weight"] == "transformer.wte.weight"
    assert "lm_head.weight" not in index["weight_map"]
    for shard in shards:
        data = hub.read_file(repo_id, shard)
        assert index["metadata"][SHARDS_KEY][shard] == {"size": len(data),
                                                                "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def test_transformers_from_pretrained_on_pushed_repo(hub: FakeHub, pushed_gpt2: tuple) -> None:
    repo_id, model = pushed_gpt2
    loaded = AutoModelForCausalLM.from_pretrained(repo_id).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_repush_unchanged_uploads_no_lfs_bytes(hub: FakeHub, pushed_gpt2: tuple) -> None:
    repo_id, model = pushed_gpt2
    hub.clear_log()
    push_sharded(model, repo_id, max_shard_size="20KB")
    assert hub.requests("PUT") == []
    assert sum(r.bytes_received for r in hub.log) < 20_000


def test_repush_with_other_layout_deletes_stale_shards(hub: FakeHub, pushed_gpt2: tuple) -> None:
    repo_id, model = pushed_gpt2
    push_sharded(model, repo_id, max_shard_size="10MB")
    files = HfApi().list_repo_files(repo_id)
    assert sorted(f for f in files if f.endswith(".safetensors")) == ["model-00001-of-00001.safetensors"]


def test_push_with_processing_class(hub: FakeHub) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    repo_id = new_repo_id("tok")
    push_sharded(tiny_gpt2(), repo_id, processing_class=tokenizer)
    assert AutoTokenizer.from_pretrained(repo_id)("hello world")["input_ids"] == [1, 2]


def test_push_state_dict_with_shared_storage_multipart(hub: FakeHub) -> None:
    hub.multipart_threshold = 30_000
    hub.multipart_chunk_size = 16_000
    base = torch.arange(10_000, dtype=torch.float32)
    state = {"a": base, "b": base, "c": base[:10].clone(), "d": torch.ones(3)}
    repo_id = new_repo_id("shared")
    push_sharded(state, repo_id, max_shard_size="1GB")
    assert len(hub.requests("PUT", "/part/")) == 3 and hub.requests("POST", "/complete$")
    index = _index(repo_id, hub)
    assert index["metadata"]["b"] == "a" and set(index["weight_map"]) == {"a", "c", "d"}
    folder = download_shards(repo_id)
    from safetensors.torch import load_file

    assert torch.equal(load_file(folder / index["weight_map"]["a"])["a"], base)


def test_push_directory_and_to_branch(hub: FakeHub, tmp_path: Path) -> None:
    model = tiny_gpt2(seed=1)
    model.save_pretrained(tmp_path / "saved")
    repo_id = new_repo_id("dir")
    info = push_sharded(tmp_path / "saved", repo_id, revision="dev", card="---\nlicense: mit\n---\n# Tiny\n")
    assert hub.repo(repo_id).branches["dev"] == info.oid
    assert {"model.safetensors", "README.md"} <= set(HfApi().list_repo_files(repo_id, revision="dev"))
    assert hub.requests("POST", "/api/validate-yaml") and not (tmp_path / "saved/README.md").exists()
    assert hub.read_file(repo_id, "README.md", "dev").endswith(b"# Tiny\n")
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors.index.json"):
        push_sharded(tmp_path, repo_id)


# --------------------------------------------------------------------------------------------------- download_shards
def test_download_shards_fetches_only_needed_shards(hub: FakeHub, pushed_gpt2: tuple, tmp_path: Path) -> None:
    repo_id, _ = pushed_gpt2
    index = _index(repo_id, hub)
    wanted = [n for n in index["weight_map"] if n.startswith("transformer.h.1.")]
    needed = sorted({index["weight_map"][n] for n in wanted})
    hub.clear_log()
    folder = download_shards(repo_id, prefixes=["transformer.h.1."], local_dir=tmp_path / "dl")
    assert _shard_gets(hub) == needed and len(needed) < len(set(index["weight_map"].values()))
    assert sorted(p.name for p in folder.glob("*.safetensors")) == needed
    with pytest.raises(CheckpointMismatchError, match="no tensors named"):
        download_shards(repo_id, tensors=["nope.weight"])


def test_download_single_file_repo(hub: FakeHub, tmp_path: Path) -> None:
    repo_id = new_repo_id("single")
    model = tiny_gpt2(seed=2)
    model.save_pretrained(tmp_path / "m")
    HfApi().create_repo(repo_id)
    HfApi().upload_folder(folder_path=tmp_path / "m", repo_id=repo_id)
    assert (download_shards(repo_id) / "model.safetensors").is_file()


def _upload_index(repo_id: str, document: dict) -> None:
    HfApi().upload_file(path_or_fileobj=json.dumps(document).encode(), path_in_repo=INDEX, repo_id=repo_id)


def test_an_index_of_format_version_1_with_sha256_records_still_downloads_checked_by_sha256(
        hub: FakeHub, pushed_gpt2: tuple, tmp_path: Path) -> None:
    import hashlib

    repo_id, _ = pushed_gpt2
    old = _index(repo_id, hub)
    for shard in old["metadata"][SHARDS_KEY]:
        data = hub.read_file(repo_id, shard)
        old["metadata"][SHARDS_KEY][shard] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _upload_index(repo_id, old)
    assert sorted(p.name for p in download_shards(repo_id, local_dir=tmp_path / "ok").glob("*.safetensors")) == \
        sorted(old["metadata"][SHARDS_KEY])
    shard = sorted(old["metadata"][SHARDS_KEY])[0]
    old["metadata"][SHARDS_KEY][shard]["sha256"] = "f" * 64
    _upload_index(repo_id, old)
    with pytest.raises(CorruptCheckpointError, match="sha256 is"):
        download_shards(repo_id, local_dir=tmp_path / "bad")
    assert not (tmp_path / "bad" / shard).exists()


def test_download_shards_rejects_bad_repos(hub: FakeHub, pushed_gpt2: tuple, tmp_path: Path) -> None:
    repo_id, _ = pushed_gpt2
    good = _index(repo_id, hub)
    shard = sorted(good["metadata"][SHARDS_KEY])[0]
    tampered = json.loads(json.dumps(good))
    tampered["metadata"][SHARDS_KEY][shard]["xxh3_128"] = "f" * 32
    _upload_index(repo_id, tampered)
    with pytest.raises(CorruptCheckpointError, match="xxh3-128 is"):
        download_shards(repo_id, local_dir=tmp_path / "bad")
    assert not (tmp_path / "bad" / shard).exists()  # nothing partial looks complete

    _upload_index(repo_id, {"metadata": {}, "weight_map": {"w": "../../etc/passwd.safetensors"}})
    with pytest.raises(UnsafeIndexError, match="outside the checkpoint"):
        download_shards(repo_id)
    _upload_index(repo_id, {"metadata": {}, "weight_map": {"w": "model-00009-of-00009.safetensors"}})
    with pytest.raises(IncompleteCheckpointError, match="names shard 'model-00009-of-00009.safetensors'"):
        download_shards(repo_id)
    empty = new_repo_id("empty")
    HfApi().create_repo(empty)
    with pytest.raises(CheckpointNotFoundError, match="holds no safetensors model"):
        download_shards(empty)


# -------------------------------------------------------------------------------------------------- resumable_download
_CHILD = """
import sys
from hf_resumable.hub import resumable_download
try:
    resumable_download(sys.argv[1], sys.argv[2], revision=sys.argv[3], local_dir=sys.argv[4], max_retries=0)
except Exception as err:
    print("FAILED", type(err).__name__, err)
    sys.exit(3)
"""


def _child(args: list[str]) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-c", _CHILD, *args], env=child_env(), capture_output=True, text=True,
                      timeout=120)


@pytest.mark.slow
def test_cut_download_resumes_in_a_new_process(hub: FakeHub, tmp_path: Path) -> None:
    repo_id = new_repo_id("resume")
    data = os.urandom(3_000_000)
    HfApi().create_repo(repo_id)
    commit = HfApi().upload_file(path_or_fileobj=data, path_in_repo="ckpt/w.safetensors", repo_id=repo_id).oid
    args = [repo_id, "ckpt/w.safetensors", commit, str(tmp_path / "out")]
    hub.add_fault(Fault(r"/resolve/.*w\.safetensors", method="GET", kind="cut", cut_after=1_200_000, times=None))
    first = _child(args)
    assert first.returncode == 3 and "HubError" in first.stdout, first.stdout + first.stderr
    part = tmp_path / "out/ckpt/w.safetensors.part"
    have = part.stat().st_size
    assert have == 1_200_000 and not (tmp_path / "out/ckpt/w.safetensors").exists()
    hub.clear_faults()
    hub.clear_log()
    second = _child(args)
    assert second.returncode == 0, second.stdout + second.stderr
    gets = hub.requests("GET", r"w\.safetensors")
    assert [g.range for g in gets] == [f"bytes={have}-"] and gets[0].status == 206
    assert gets[0].bytes_sent == len(data) - have  # the completed bytes were not fetched again
    assert (tmp_path / "out/ckpt/w.safetensors").read_bytes() == data
    assert not part.exists() and not (tmp_path / "out/ckpt/w.safetensors.part.json").exists()


def test_resumable_download_retries_in_call_and_checks_hash(hub: FakeHub, tmp_path: Path) -> None:
    repo_id = new_repo_id("resume2")
    data = os.urandom(500_000)
    HfApi().create_repo(repo_id)
    HfApi().upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id=repo_id)
    hub.cdn = True
    hub.add_fault(Fault(r"^/cdn/", method="GET", kind="cut", cut_after=100_000))
    path = resumable_download(repo_id, "w.safetensors", local_dir=tmp_path)
    assert path.read_bytes() == data
    assert [r.range for r in hub.requests("GET", "^/cdn/")] == [None, "bytes=100000-"]
    hub.clear_log()
    assert resumable_download(repo_id, "w.safetensors", local_dir=tmp_path) == path
    assert hub.requests("GET") == []  # an up-to-date local copy is not fetched again
    with pytest.raises(CorruptCheckpointError, match="expected 0000"):
        resumable_download(repo_id, "w.safetensors", local_dir=tmp_path / "x", expected_sha256="0" * 64)
    assert list((tmp_path / "x").iterdir()) == [(tmp_path / "x/w.safetensors.part.json")]
    with pytest.raises(UnsafeIndexError, match="outside"):
        resumable_download(repo_id, "../w.safetensors", local_dir=tmp_path)


# --------------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("hf://me/run@step-120/checkpoint-120", HfUrl("me/run", "step-120", "checkpoint-120")),
        ("me/run", HfUrl("me/run")),
        ("hf://me/run/a/b", HfUrl("me/run", None, "a/b")),
        ("hf://datasets/me/data@refs%2Fpr%2F1", HfUrl("me/data", "refs/pr/1", "", "dataset")),
    ],
)
def test_parse_hf_url(url: str, expected: HfUrl) -> None:
    assert parse_hf_url(url) == expected


@pytest.mark.parametrize(("url", "match"), [("hf://onlyname", "namespace/name"), ("hf://me/run/../x", "outside")])
def test_parse_hf_url_rejects(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_hf_url(url)


def test_push_and_pull_checkpoint_on_branch_and_tag(hub: FakeHub, tmp_path: Path) -> None:
    files = {"weights.bin": os.urandom(50_000), "training_state.json": b'{"step": 120}',
             "rng/rank-00000.bin": os.urandom(1000)}
    local = make_checkpoint_dir(tmp_path / "checkpoint-120", files)
    repo_id = new_repo_id("run")
    pushed = push_checkpoint(local, repo_id, branch="step-120", tag="v-step-120")
    assert hub.repo(repo_id).branches["step-120"] == pushed.commit == hub.repo(repo_id).tags["v-step-120"]
    assert len(hub.requests("POST", "/commit/")) == 1  # one checkpoint, one commit
    pulled = pull_checkpoint(f"hf://{repo_id}@step-120/checkpoint-120", local_dir=tmp_path / "pulled")
    assert pulled == tmp_path / "pulled/checkpoint-120"
    for name, data in files.items():
        assert (pulled / name).read_bytes() == data
    hub.clear_log()
    assert pull_checkpoint(pushed.url, local_dir=tmp_path / "pulled") == pulled
    assert hub.requests("GET", "/resolve/") == []  # regular (git sha1) and LFS (sha256) files both up to date


def test_a_checkpoint_with_a_sha256_only_manifest_is_pushed_pulled_and_checked_by_sha256(hub: FakeHub,
                                                                                         tmp_path: Path) -> None:
    files = {"weights.bin": os.urandom(50_000), "training_state.json": b'{"step": 7}'}
    local = make_checkpoint_dir(tmp_path / "checkpoint-7", files, sha256_only=True)
    repo_id = new_repo_id("old")
    push_checkpoint(local, repo_id)
    pulled = pull_checkpoint(f"hf://{repo_id}/checkpoint-7", local_dir=tmp_path / "pulled")
    assert (pulled / "weights.bin").read_bytes() == files["weights.bin"]
    HfApi().upload_file(path_or_fileobj=os.urandom(50_000), path_in_repo="checkpoint-7/weights.bin", repo_id=repo_id)
    with pytest.raises(CorruptCheckpointError, match="weights.bin: downloaded sha256 is"):
        pull_checkpoint(f"hf://{repo_id}/checkpoint-7", local_dir=tmp_path / "p")


def test_pull_checkpoint_rejects_bad_checkpoints(hub: FakeHub, tmp_path: Path) -> None:
    repo_id = new_repo_id("bad")
    bad = make_checkpoint_dir(tmp_path / "bad" / "checkpoint-5", {"a.bin": b"abc"}, bad_hash_for="a.bin")
    with pytest.raises(CorruptCheckpointError, match="a.bin: xxh3-128 is"):
        push_checkpoint(bad, repo_id)  # a corrupt local checkpoint is never published
    good = make_checkpoint_dir(tmp_path / "checkpoint-5", {"a.bin": b"abc", "b.json": b"{}"})
    push_checkpoint(good, repo_id)
    HfApi().upload_file(path_or_fileobj=b"xyz", path_in_repo="checkpoint-5/a.bin", repo_id=repo_id)  # tampered
    with pytest.raises(CorruptCheckpointError, match="a.bin: downloaded xxh3-128 is"):  # caught while downloading
        pull_checkpoint(f"hf://{repo_id}/checkpoint-5", local_dir=tmp_path / "p")
    assert not (tmp_path / "p/checkpoint-5/a.bin").exists()
    HfApi().upload_file(path_or_fileobj=b"x", path_in_repo="half/a.bin", repo_id=repo_id)
    with pytest.raises(IncompleteCheckpointError, match="no manifest.json"):
        pull_checkpoint(f"hf://{repo_id}/half", local_dir=tmp_path / "q")
    (tmp_path / "nomanifest").mkdir()
    with pytest.raises(IncompleteCheckpointError, match="not a committed checkpoint"):
        push_checkpoint(tmp_path / "nomanifest", repo_id)


@pytest.mark.slow
def test_real_training_checkpoint_round_trip(hub: FakeHub, tmp_path: Path) -> None:
    from hf_resumable.checkpoint import save_checkpoint, verify_checkpoint

    model = tiny_gpt2(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    save_checkpoint(tmp_path / "checkpoint-1", model=model, optimizer=optimizer, step=1, max_shard_size="20KB")
    pushed = push_checkpoint(tmp_path / "checkpoint-1", new_repo_id("real"), tag="step-1")
    pulled = pull_checkpoint(pushed.url, local_dir=tmp_path / "pulled")
    assert verify_checkpoint(pulled, full=True).ok
    loaded = AutoModelForCausalLM.from_pretrained(pulled)
    assert torch.equal(loaded.transformer.h[1].mlp.c_fc.weight, model.transformer.h[1].mlp.c_fc.weight)


# --------------------------------------------------------------------------------------------------- uploader
def test_uploader_retries_500_and_keeps_fifo_order(hub: FakeHub, tmp_path: Path) -> None:
    repo_id = new_repo_id("upl")
    dirs = [make_checkpoint_dir(tmp_path / f"checkpoint-{s}", {"w.bin": os.urandom(2000)}) for s in (10, 20)]
    hub.add_fault(Fault(r"/commit/", method="POST", status=500, times=2))
    with CheckpointUploader(repo_id, base_delay=0.01, max_retries=3) as uploader:
        for d in dirs:
            uploader.submit(d, branch=f"step-{d.name.split('-')[1]}")
        results = uploader.wait(timeout=60)
    assert [r.local_path for r in results] == dirs
    assert uploader.confirmed() == set(dirs) and uploader.pending() == set()
    commits = hub.requests("POST", "/commit/")
    assert [c.status for c in commits] == [500, 500, 200, 200]
    assert "step-10" in commits[2].path and "step-20" in commits[3].path
    for r in results:
        assert hub.repo(repo_id).branches[r.revision] == r.commit


def test_uploader_never_reports_a_failed_commit(hub: FakeHub, tmp_path: Path) -> None:
    repo_id = new_repo_id("upl-fail")
    local = make_checkpoint_dir(tmp_path / "checkpoint-30", {"w.bin": b"123"})
    hub.add_fault(Fault(r"/commit/", method="POST", status=503, times=None))
    uploader = CheckpointUploader(repo_id, base_delay=0.01, max_retries=2)
    uploader.submit(local)
    with pytest.raises(HubError, match="failed after 3 attempts"):
        uploader.wait(timeout=60)
    assert uploader.confirmed() == set() and uploader.pending() == {local}
    assert "checkpoint-30/manifest.json" not in hub.head(repo_id).files
    hub.clear_faults()
    uploader.submit(local)  # the error was raised once; a resubmit succeeds
    assert [r.local_path for r in uploader.wait(timeout=60)] == [local]
    assert uploader.pending() == set() and uploader.confirmed() == {local}
    uploader.close()
    with pytest.raises(HubError, match="closed"):
        uploader.submit(local)
    assert hf_hub_download(repo_id, "checkpoint-30/w.bin", revision="main")


def test_pull_of_a_run_root_takes_the_newest_committed_checkpoint(hub: FakeHub, tmp_path: Path) -> None:
    from hf_resumable.hub import find_latest_hub_checkpoint

    repo_id = new_repo_id("root")
    for step in (5, 10):
        local = make_checkpoint_dir(tmp_path / "local" / f"checkpoint-{step}", {"a.bin": f"step {step}".encode()})
        push_checkpoint(local, repo_id)
    HfApi().upload_file(path_or_fileobj=b"partial", path_in_repo="checkpoint-15/a.bin", repo_id=repo_id)
    latest = find_latest_hub_checkpoint(f"hf://{repo_id}")
    assert latest is not None and latest.endswith("/checkpoint-10")
    pulled = pull_checkpoint(f"hf://{repo_id}", local_dir=tmp_path / "p")
    assert pulled == tmp_path / "p" / "checkpoint-10"
    assert (pulled / "a.bin").read_bytes() == b"step 10"
