"""The parallel, hash-checked reader of the load path: bit-exact, in place where it can, checked in byte order."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from hf_resumable.checkpoint.commit._parallel_read import FileRead, plan_reads, read_files
from hf_resumable.errors import CorruptCheckpointError
from hf_resumable.format.safetensors_io import hash_file, read_header, write_safetensors

TENSORS = {
    "a": torch.randn(300, 7),
    "b16": torch.randn(5, 33).to(torch.bfloat16),
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(3.5),
    "flags": torch.tensor([True, False, True]),
    "ints": torch.arange(1001, dtype=torch.int64),
}


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(3):
        path = tmp_path / f"f{i}.safetensors"
        write_safetensors(path, [(f"{name}{i}", t + i if t.dtype != torch.bool else t) for name, t in TENSORS.items()],
                          fsync=False)
        paths.append(path)
    return paths


def _reads(paths, into=None, expected=True):
    return [FileRead(p, read_header(p), hash_file(p) if expected else None, into or {}) for p in paths]


@pytest.mark.parametrize("chunk_bytes, workers", [(64, 8), (1000, 3), (8 << 20, 1)])
def test_every_tensor_comes_back_bitwise(files, chunk_bytes, workers):
    out = read_files(_reads(files), workers=workers, chunk_bytes=chunk_bytes)
    expected = {k: v for p in files for k, v in load_file(p).items()}
    assert out.keys() == expected.keys()
    for name, tensor in expected.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


def test_destinations_are_filled_in_place_or_through_staging(files):
    expected = load_file(files[0])
    in_place, ints = torch.empty(300, 7), torch.empty(1001, dtype=torch.int64)
    pointer = in_place.data_ptr()
    out = read_files(_reads(files[:1], {"a0": in_place, "ints0": ints}), chunk_bytes=128)
    assert in_place.data_ptr() == pointer and torch.equal(in_place, expected["a0"])
    assert torch.equal(ints, expected["ints0"])
    assert "a0" not in out and "ints0" not in out and "scalar0" in out
    cast = torch.empty(300, 7, dtype=torch.float64)  # another dtype: staged, then copied
    read_files(_reads(files[:1], {"a0": cast}))
    assert torch.equal(cast, expected["a0"].double())
    strided = torch.empty(7, 300).t()  # not contiguous: staged
    read_files(_reads(files[:1], {"a0": strided}))
    assert torch.equal(strided, expected["a0"])


def _flip(path, offset_from_end):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("workers", [1, 4])
def test_a_flipped_byte_anywhere_is_found_and_staged_destinations_stay_untouched(files, workers):
    records = [hash_file(p) for p in files]
    _flip(files[1], 2000)
    cast = torch.zeros(300, 7, dtype=torch.float64)
    reads = [FileRead(p, read_header(p), r, {"a0": cast} if i == 0 else {}) for i, (p, r) in
             enumerate(zip(files, records))]
    with pytest.raises(CorruptCheckpointError, match=r"f1\.safetensors: xxh3-128 is"):
        read_files(reads, workers=workers, chunk_bytes=256)
    assert not cast.any()  # file 0 was fine, but nothing is copied into a staged destination before every check


def test_records_without_xxh3_are_checked_by_sha256(files):
    old = [hash_file(p, xxh3_128=False, sha256=True) for p in files]
    assert all(r.xxh3_128 is None and r.sha256 is not None for r in old)
    reads = [FileRead(p, read_header(p), r) for p, r in zip(files, old)]
    assert len(read_files(reads, chunk_bytes=512)) == len(TENSORS) * 3
    _flip(files[2], 10)
    for workers in (1, 4):
        with pytest.raises(CorruptCheckpointError, match="sha256 is"):
            read_files([FileRead(p, read_header(p), r) for p, r in zip(files, old)], workers=workers, chunk_bytes=512)


def test_a_file_truncated_after_its_header_was_read(files):
    header = read_header(files[0])
    with open(files[0], "r+b") as f:
        f.truncate(header.file_size - 100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_files([FileRead(files[0], header, None)])


def test_the_plan_covers_every_byte_once(files):
    chunks, fresh, staged = plan_reads(_reads(files), chunk_bytes=100)
    for path, file_chunks in zip(files, chunks):
        covered = sorted((c.offset, c.offset + len(c.view)) for c in file_chunks)
        assert covered[0][0] == 0 and covered[-1][1] == path.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert [c.index for c in file_chunks] == list(range(len(file_chunks)))
    assert len(fresh) == len(TENSORS) * 3 and not staged



def test_reads_fill_fresh_and_existing_destinations_in_place(files):
    expected = load_file(files[0])
    new_target, old_target = torch.empty(300, 7), torch.zeros(1001, dtype=torch.int64)
    reads = [FileRead(files[0], read_header(files[0]), hash_file(files[0]), {"a0": new_target, "ints0": old_target})]
    read_files(reads, chunk_bytes=1024, workers=3)
    assert torch.equal(new_target, expected["a0"]) and torch.equal(old_target, expected["ints0"])

def test_the_number_of_streams_is_the_override_or_the_default(files, monkeypatch):
    from hf_resumable import _tuning
    from hf_resumable._tuning import READ_STREAMS_ENV, read_streams

    monkeypatch.delenv(READ_STREAMS_ENV, raising=False)
    for cores, streams in ((1, 1), (2, 1), (5, 2), (8, 4), (96, 4)):  # one per two usable cores, 1 to 4
        monkeypatch.setattr(_tuning, "_usable_cores", lambda cores=cores: cores)
        assert read_streams() == streams
    monkeypatch.setenv(READ_STREAMS_ENV, " 3 ")
    assert read_streams() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(READ_STREAMS_ENV, bad)
        with pytest.raises(ValueError, match=READ_STREAMS_ENV):
            read_streams()
        with pytest.raises(ValueError, match=READ_STREAMS_ENV):
            read_files(_reads(files))


@pytest.mark.parametrize("workers", [1, 3])
def test_every_chunk_is_read_once_in_file_order_by_one_stream(files, monkeypatch, workers):
    from hf_resumable.checkpoint.commit import _parallel_read

    seen, pread = [], _parallel_read._pread_into
    monkeypatch.setattr(_parallel_read, "_pread_into", lambda fd, chunk, path: seen.append((path, chunk.offset))
                        or pread(fd, chunk, path))
    out = read_files(_reads(files), workers=workers, chunk_bytes=256)
    if workers == 1:  # one stream: the files one after the other, each front to back
        assert seen == sorted(seen, key=lambda item: (files.index(item[0]), item[1]))
    assert len(seen) == len(set(seen)) and {path for path, _ in seen} == set(files)
    for path in files:
        assert all(torch.equal(out[name], t) for name, t in load_file(path).items())


@pytest.mark.parametrize("workers", [1, 3])
def test_short_reads_are_continued_until_every_byte_is_in(files, monkeypatch, workers):
    """``preadv`` may return fewer bytes than asked (signals, network filesystems): the reader asks again."""
    real, calls = os.preadv, []

    def short(fd, buffers, offset, *args):
        calls.append(offset)
        return real(fd, [memoryview(buffers[0])[:333]], offset, *args)

    monkeypatch.setattr(os, "preadv", short)
    out = read_files(_reads(files), workers=workers, chunk_bytes=4096)
    assert len(calls) > sum(len(c) for c in plan_reads(_reads(files), chunk_bytes=4096)[0])
    for path in files:
        assert all(torch.equal(out[name], t) for name, t in load_file(path).items())


def test_verified_bytes_are_copied_from_memory_without_a_read_or_a_hash(files, tmp_path):
    data = files[0].read_bytes()
    header = read_header(files[0])
    gone = tmp_path / "not-on-disk.safetensors"  # nothing is opened: the bytes come from ``data``
    target = torch.zeros(300, 7)
    out = read_files([FileRead(gone, header, None, {"a0": target}, data=data)], chunk_bytes=128)
    expected = load_file(files[0])
    assert torch.equal(target, expected["a0"])
    assert all(torch.equal(out[name], t) for name, t in expected.items() if name != "a0")
    with pytest.raises(ValueError, match="expected=None"):
        FileRead(gone, header, hash_file(files[0]), data=data)
    with pytest.raises(CorruptCheckpointError, match="verified bytes end"):
        read_files([FileRead(gone, header, None, data=data[:-8])])


def test_a_file_refused_by_its_check_is_refused_before_any_byte_lands(files):
    targets = {"a0": torch.zeros(300, 7)}
    stats = []

    def refuse(now: os.stat_result) -> None:
        stats.append(now)
        raise CorruptCheckpointError("changed after the checkpoint was verified")

    reads = _reads(files[1:]) + [FileRead(files[0], read_header(files[0]), hash_file(files[0]), targets,
                                          check=refuse)]
    with pytest.raises(CorruptCheckpointError, match="changed after"):
        read_files(reads, workers=4, chunk_bytes=64)
    assert stats and stats[0].st_ino == os.stat(files[0]).st_ino
    assert not targets["a0"].any()


def test_a_failing_read_is_raised_after_every_thread_stopped(files, monkeypatch):
    import errno

    real, calls = os.preadv, []

    def failing(fd, buffers, offset, *args):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", failing)
    reads = _reads(files)
    with pytest.raises(OSError, match="Input/output error"):
        read_files(reads, workers=3, chunk_bytes=256)
    total = sum(len(c) for c in plan_reads(reads, chunk_bytes=256)[0])
    assert len(calls) < total  # the other streams stopped claiming chunks
    monkeypatch.setattr(os, "preadv", real)
    out = read_files(reads, workers=3, chunk_bytes=256)  # nothing was left open or half-done
    assert all(torch.equal(out[name], t) for path in files for name, t in load_file(path).items())
