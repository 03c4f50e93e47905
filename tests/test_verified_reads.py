"""Every byte a load uses is verified, by default, in every layout and at any world size (format/chunks.py,
format/slice_reader.py).

* Chunk hashes: the writer records the xxh3-64 of every 1 MiB chunk of a safetensors file; the records round-trip
  through the manifest, malformed ones are refused naming the field; :class:`VerifiedFile` reads any slice of a
  stored tensor bit-exactly, reading whole chunks and checking them, and a record without chunk hashes (format
  version 2) makes it hash the whole file first.
* Fault injection: one byte flipped at the start, the middle and the end of the tensor data of every safetensors
  file a load reads, in a regular checkpoint (``save_checkpoint``), a piece checkpoint written by one process
  (``save_checkpoint``), FSDP2 pieces of 2 gloo ranks reloaded at world size 1 and 2 (the middle byte; the
  first and last in an ``extended`` variant), and a DeepSpeed ZeRO-3 engine's partitions: each load raises
  ``CorruptCheckpointError`` naming that file, with the default ``verify``.
  The piece files exceed the quick verification's whole-file limit (4 MiB), so their flips are caught by the reads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import Manifest, load_checkpoint, read_manifest, save_checkpoint
from hf_resumable.constants import MANIFEST_FILE
from hf_resumable.errors import CorruptCheckpointError
from hf_resumable.format.chunks import CHUNK_DIGEST_CHARS, CHUNK_HASH_SIZE, ChunkHasher, chunk_span
from hf_resumable.format.safetensors_io import FileRecord, read_header, write_safetensors
from hf_resumable.format.slice_reader import VerifiedFile

from helpers.distributed_launch import launch_ranks
from helpers.tiny_models import tiny_gpt2

# Files above 4 MiB (the quick verification hashes smaller files whole), spanning several chunks.
BIG = dict(n_layer=1, n_embd=128, vocab_size=20000)
POSITIONS = ("start", "middle", "end")
WORKER = str(Path(__file__).parent / "scripts" / "verify_worker.py")


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_gpt2(seed=seed, **BIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(16).reshape(2, 8)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def flip_offset(path: Path, position: str) -> int:
    """The file offset of the first, middle or last byte of the tensor data of the safetensors file ``path``."""
    header = read_header(path)
    start, end = header.data_offset, header.file_size
    return {"start": start, "middle": (start + end) // 2, "end": end - 1}[position]


def corrupted_copies(checkpoint: Path, root: Path, positions: tuple[str, ...] = POSITIONS
                     ) -> dict[str, tuple[str, int]]:
    """One copy of ``checkpoint`` per safetensors file and position, with that byte flipped (the other files hard
    links); ``{copy name: (flipped file, offset)}``."""
    cases = {}
    for relpath in sorted(f for f in read_manifest(checkpoint).files if f.endswith(".safetensors")):
        for position in positions:
            name = f"{relpath.replace('/', '_')}-{position}"
            copy = root / name
            shutil.copytree(checkpoint, copy, copy_function=os.link)
            data = bytearray((checkpoint / relpath).read_bytes())
            offset = flip_offset(checkpoint / relpath, position)
            data[offset] ^= 0x40
            (copy / relpath).unlink()
            (copy / relpath).write_bytes(bytes(data))
            cases[name] = (relpath, offset)
    return cases


def assert_refused(load, cases: dict[str, tuple[str, int]], root: Path) -> None:
    silent = []
    for name, (relpath, offset) in cases.items():
        try:
            load(root / name)
        except CorruptCheckpointError as err:
            assert relpath in str(err), (name, str(err))
        else:
            silent.append(f"{relpath} byte {offset}")
    assert not silent, f"loaded without a word: {silent}"


# --- chunk hashes and verified slice reads ----------------------------------------------------------


def test_chunk_hasher_and_span():
    data = bytes(range(256)) * 40  # 10240 bytes: chunks of 4096, 4096, 2048
    hasher = ChunkHasher(4096)
    for start in range(0, len(data), 1000):
        hasher.feed(data[start : start + 1000])
    import xxhash

    assert hasher.hexdigests() == "".join(xxhash.xxh3_64_hexdigest(data[i : i + 4096]) for i in (0, 4096, 8192))
    assert chunk_span(4095, 4097, chunk_size=4096, size=10240) == (0, 8192)
    assert chunk_span(9000, 10240, chunk_size=4096, size=10240) == (8192, 10240)
    with pytest.raises(ValueError, match="outside"):
        chunk_span(0, 10241, chunk_size=4096, size=10240)


def test_written_records_hold_chunk_hashes_and_round_trip(tmp_path):
    tensors = [("a", torch.arange(700_000, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.int8))]
    record = write_safetensors(tmp_path / "x.safetensors", tensors)
    assert record.chunk_size == CHUNK_HASH_SIZE
    assert len(record.chunks) == CHUNK_DIGEST_CHARS * -(-record.size // CHUNK_HASH_SIZE) == 3 * CHUNK_DIGEST_CHARS
    assert FileRecord.from_json(record.to_json(), source="m", where="files['x']") == record
    assert "chunk_xxh3_64" not in record.whole().to_json()
    document = record.to_json()
    for field, value, match in (("chunk_xxh3_64", document["chunk_xxh3_64"][:-1], "chunk_xxh3_64"),
                                ("chunk_xxh3_64", document["chunk_xxh3_64"].upper(), "chunk_xxh3_64"),
                                ("chunk_size", 0, "chunk_size"), ("chunk_size", None, "chunk_xxh3_64")):
        with pytest.raises(CorruptCheckpointError, match=match):
            FileRecord.from_json({**document, field: value}, source="m", where="files['x']")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunk-hashes", "whole-file-record"])
def test_verified_slices_equal_the_tensor_and_a_flip_in_a_chunk_read_is_refused(tmp_path, chunked):
    weight = torch.randn(600, 700)  # 1.6 MiB: two chunks
    path = tmp_path / "w.safetensors"
    record = write_safetensors(path, [("w", weight), ("s", torch.tensor(3.0))])
    record = record if chunked else record.whole()
    header = read_header(path)
    index = (slice(100, 550), slice(3, 650))  # not contiguous in the file
    with VerifiedFile(path, header, record) as file:
        assert torch.equal(file.read_slice("w", index), weight[index])
        assert torch.equal(file.read_slice("w"), weight) and file.read_slice("s").item() == 3.0
    data = bytearray(path.read_bytes())
    data[header.data_offset + header.tensors["w"].start + 4 * 599 * 700] ^= 1  # last row: outside rows 100..549
    path.write_bytes(bytes(data))
    with VerifiedFile(path, header, record) as file:
        if chunked:  # rows 100..549 lie in chunk 0 and 1; the flip is in chunk 1 (which row 549 also uses)
            with pytest.raises(CorruptCheckpointError, match=r"w\.safetensors: bytes .* \(chunk 1\)"):
                file.read_slice("w", index)
        else:  # the whole file is hashed before the first read
            with pytest.raises(CorruptCheckpointError, match=r"w\.safetensors: xxh3-128 is"):
                file.read_slice("w", (slice(0, 1), slice(0, 1)))
    with VerifiedFile(path, header, None) as file:  # verify="none": no check
        assert not torch.equal(file.read_slice("w"), weight)


# --- fault injection, in process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verified")
    model, optimizer = trained()
    save_checkpoint(root / "regular" / "checkpoint-1", model=model, optimizer=optimizer, step=1)
    save_checkpoint(root / "pieces" / "checkpoint-1", model=model, optimizer=optimizer, step=1, layout="pieces")
    return root


@pytest.mark.parametrize("layout", ["regular", "pieces"])
def test_a_flipped_byte_anywhere_in_the_data_of_any_file_is_refused_naming_it(saved, tmp_path, layout):
    checkpoint = saved / layout / "checkpoint-1"
    big = [f for f, r in read_manifest(checkpoint).files.items() if r.size > 4 * 1024 * 1024]
    assert len(big) >= 2, big  # weights and optimizer state: checked by the reads, not by the quick verification
    cases = corrupted_copies(checkpoint, tmp_path)

    def load(directory: Path) -> None:
        model, optimizer = tiny_gpt2(seed=1, **BIG), None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        load_checkpoint(directory, model=model, optimizer=optimizer)

    load(checkpoint)  # the intact checkpoint loads
    assert_refused(load, cases, tmp_path)


def test_a_regular_checkpoint_read_as_pieces_refuses_flips_too(saved, tmp_path):
    """A regular checkpoint loaded by the piece reader (as the Accelerator does) checks the chunks it reads."""
    cases = corrupted_copies(saved / "regular" / "checkpoint-1", tmp_path)

    def load(directory: Path) -> None:
        model = tiny_gpt2(seed=1, **BIG)
        load_checkpoint(directory, model=model, optimizer=torch.optim.AdamW(model.parameters()))

    assert_refused(load, cases, tmp_path)


def test_version_2_records_hash_a_large_piece_file_whole_before_reading_slices_of_it(saved, tmp_path):
    """A manifest without chunk hashes (format version 2): the reader hashes every piece file once before using it."""
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(saved / "pieces" / "checkpoint-1", checkpoint)
    manifest = read_manifest(checkpoint)
    old = Manifest(files={k: r.whole() for k, r in manifest.files.items()}, step=manifest.step,
                   world_size=manifest.world_size, versions=manifest.versions, created=manifest.created,
                   format_version=2)
    (checkpoint / MANIFEST_FILE).write_bytes(old.to_json())
    model = tiny_gpt2(seed=1, **BIG)
    load_checkpoint(checkpoint, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    relpath = "sharded/optimizer-rank00000-of-00001.safetensors"
    assert old.files[relpath].size > 4 * 1024 * 1024
    data = bytearray((checkpoint / relpath).read_bytes())
    data[flip_offset(checkpoint / relpath, "end")] ^= 1
    (checkpoint / relpath).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"{relpath}: xxh3-128 is"):
        load_checkpoint(checkpoint, model=model, optimizer=torch.optim.AdamW(model.parameters()))


# --- fault injection, engines -----------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("positions", [("middle",), pytest.param(("start", "end"), marks=pytest.mark.extended)],
                         ids=["middle", "start-end"])
def test_fsdp2_pieces_of_two_ranks_refuse_every_flip_at_world_size_1_and_2(tmp_path, positions):
    results = launch_ranks([WORKER, "save", str(tmp_path)], world_size=2, timeout=180.0)
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    checkpoint = tmp_path / "checkpoint-1"
    files = read_manifest(checkpoint).files
    assert all(files[f"sharded/{kind}-rank0000{r}-of-00002.safetensors"].size > 4 * 1024 * 1024
               for kind in ("model", "optimizer") for r in range(2))
    cases = corrupted_copies(checkpoint, tmp_path, positions)

    def load(directory: Path) -> None:  # world size 1: every piece of every rank is read
        model = tiny_gpt2(seed=1, **BIG)
        load_checkpoint(directory, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                        allow_inexact_resume=True)

    load(checkpoint)
    assert_refused(load, {k: v for k, v in cases.items() if "rng_" not in k}, tmp_path)  # rank 0's RNG only
    (tmp_path / "cases.json").write_text(json.dumps(sorted(cases)))
    results = launch_ranks([WORKER, "load", str(tmp_path)], world_size=2, timeout=300.0)
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    outcomes = [json.loads((tmp_path / f"outcomes-rank{r}.json").read_text()) for r in range(2)]
    for name, (relpath, _) in cases.items():
        seen = [outcome[name] for outcome in outcomes]
        assert all(o["error"] in (None, "CorruptCheckpointError") for o in seen), (name, seen)
        # the rank that reads the flipped bytes refuses them (the other may not read that file at all)
        assert any(o["error"] and relpath in o["message"] for o in seen), (name, seen)


@pytest.mark.slow
def test_deepspeed_zero3_partitions_refuse_every_flip(tmp_path, monkeypatch):
    """A ZeRO-3 engine in one process (its weights given by the fp32 master weights in the optimizer file)."""
    for name, value in {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    ops = pytest.importorskip("deepspeed.ops")
    monkeypatch.setitem(ops.__compatible_ops__, "deepspeed_shm_comm", False)
    import deepspeed
    from deepspeed.utils import groups

    from hf_resumable.integrations._deepspeed import checkpoint_optimizer

    monkeypatch.setattr(groups, "_WORLD_GROUP", None)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        def engine():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
            config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                      "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        config=config)[0]

        saving = engine()
        saving.backward(saving(torch.ones(2, 1024)).square().sum())
        saving.step()
        checkpoint = tmp_path / "checkpoint-1"
        save_checkpoint(checkpoint, model=saving.module, optimizer=checkpoint_optimizer(saving.optimizer),
                        step=1, layout="pieces")
        assert read_manifest(checkpoint).files["sharded/optimizer-rank00000-of-00001.safetensors"].size > 8 * 2**20
        cases = corrupted_copies(checkpoint, tmp_path)

        def load(directory: Path) -> None:
            loading = engine()
            load_checkpoint(directory, model=loading.module,
                            optimizer=checkpoint_optimizer(loading.optimizer))

        load(checkpoint)
        assert_refused(load, cases, tmp_path)
    finally:
        torch.distributed.destroy_process_group()
