"""The async-save staging copy: a pure split plan, and bit-exact copies of every kind of tensor."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hf_resumable.checkpoint import _staging
from hf_resumable.checkpoint._staging import Piece, copy_into, plan_chunks

COPIERS = {"memmove": ctypes.memmove}
if _staging._nt_copy is not None:
    COPIERS["non-temporal"] = _staging._nt_copy


@pytest.mark.parametrize("sizes", [[], [0], [1], [100, 28], [7, 0, 13, 4096, 1], [10_000] * 5, [1 << 20, 3, 5 << 10]])
@pytest.mark.parametrize("chunk", [1, 64, 100, 4096, 1 << 20])
def test_plan_covers_every_byte_once(sizes, chunk):
    pieces = plan_chunks(sizes, chunk=chunk, align=64)
    covered = [[0] * size for size in sizes]
    for piece in pieces:
        assert 0 < piece.length <= max(chunk, 64) + 63
        assert piece.offset % 64 == 0  # cuts inside a tensor fall on cache lines
        for offset in range(piece.offset, piece.offset + piece.length):
            covered[piece.index][offset] += 1
    assert all(count == 1 for row in covered for count in row)
    assert pieces == sorted(pieces, key=lambda p: (p.index, p.offset))  # in order: each tensor read front to back


def test_plan_example_and_bad_arguments():
    assert plan_chunks([100, 28], chunk=64, align=4) == [Piece(0, 0, 64), Piece(0, 64, 36), Piece(1, 0, 28)]
    with pytest.raises(ValueError, match="chunk"):
        plan_chunks([1], chunk=0)
    with pytest.raises(ValueError, match="workers"):
        copy_into([(torch.empty(1), torch.ones(1))], workers=0)


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("copier", sorted(COPIERS))
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_copy_into_is_bit_exact_for_every_kind_of_source(workers, copier):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3_000_000, generator=gen)
    sources = [
        base,                                               # large, split into pieces across threads
        base[17:1017],                                      # view with a storage offset
        torch.randn(64, 48, generator=gen).t(),             # non-contiguous: falls back to copy_
        torch.randn(300, generator=gen).to(torch.bfloat16),
        torch.randint(0, 255, (1001,), generator=gen, dtype=torch.uint8),
        torch.rand(77, generator=gen) > 0.5,                # bool
        torch.tensor(3.0),                                  # 0-dim
        torch.empty(0, 5),                                  # empty
        torch.randn(10, 2, generator=gen, dtype=torch.complex64).conj(),  # conj bit: falls back to copy_
        torch.nn.Parameter(torch.randn(513, 7, generator=gen)),          # requires_grad
    ]
    buffers = [torch.full(s.shape, 0, dtype=s.dtype) for s in sources]
    copy_into(list(zip(buffers, sources)), workers=workers, copier=COPIERS[copier])
    for buffer, source in zip(buffers, sources):
        assert buffer.shape == source.shape and buffer.dtype == source.dtype
        assert _bits(buffer) == _bits(source.resolve_conj())


def test_fast_copy_extension_is_built_where_a_c_compiler_exists():
    import shutil
    import sysconfig
    from pathlib import Path

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if shutil.which(compiler) is None or not headers.exists():
        pytest.skip(f"no C compiler ({compiler}) or Python headers here: the memmove fallback is what runs")
    assert _staging._nt_copy is not None, "hf_resumable._fastcopy was not built; reinstall with `pip install -e .`"
    assert _staging.COPY_KIND == "non-temporal"


@pytest.mark.skipif(_staging._nt_copy is None, reason="hf_resumable._fastcopy not built")
@pytest.mark.parametrize("dst_offset", [0, 1, 13, 64])
@pytest.mark.parametrize("src_offset", [0, 3, 64])
@pytest.mark.parametrize("nbytes", [0, 1, 63, 4096 * 4 - 1, 4096 * 4 + 63, 4096 * 4 * 3 + 4097, 1 << 20])
def test_non_temporal_copy_is_bit_exact_at_any_alignment_and_length(dst_offset, src_offset, nbytes):
    source = torch.randint(0, 256, (nbytes + 128,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    target = torch.zeros(nbytes + 128, dtype=torch.uint8)
    _staging._nt_copy(target.data_ptr() + dst_offset, source.data_ptr() + src_offset, nbytes)
    assert torch.equal(target[dst_offset : dst_offset + nbytes], source[src_offset : src_offset + nbytes])
    assert not target[:dst_offset].any() and not target[dst_offset + nbytes :].any()  # nothing outside written


def test_non_temporal_copy_rejects_null_addresses():
    if _staging._nt_copy is None:
        pytest.skip("hf_resumable._fastcopy not built")
    with pytest.raises(ValueError, match="null"):
        _staging._nt_copy(0, 0, 8)


def test_a_failing_copy_is_raised_and_the_helpers_serve_the_next_copy():
    source = torch.randn(12_000_000)  # 12 pieces, above the parallel threshold: the helper threads take part
    buffer = torch.zeros_like(source)
    calls = []

    def failing(dst, src, nbytes):
        calls.append(nbytes)
        if len(calls) == 3:
            raise OSError("copier failed")
        ctypes.memmove(dst, src, nbytes)

    with pytest.raises(OSError, match="copier failed"):
        copy_into([(buffer, source)], workers=3, copier=failing)
    assert len(calls) < len(plan_chunks([source.numel() * 4]))  # the other threads stopped claiming pieces
    copy_into([(buffer, source)], workers=3, copier=ctypes.memmove)
    assert torch.equal(buffer, source)


def test_helpers_are_started_once_and_the_caller_copies_alone_when_none_wakes():
    source, buffer = torch.randn(5_000_000), torch.zeros(5_000_000)
    copy_into([(buffer, source)], workers=2)
    helpers = list(_staging._CREW._threads)
    assert helpers and all(t.is_alive() and t.daemon for t in helpers)
    copy_into([(buffer, source)], workers=2)
    assert _staging._CREW._threads == helpers  # no thread started per copy
    # A job whose helper never wakes (a loaded machine) costs nothing: the caller claims every piece itself.
    source.add_(1)
    nbytes = source.numel() * source.element_size()
    job = _staging._Job(plan_chunks([nbytes]), [(buffer.data_ptr(), source.data_ptr(), nbytes)], ctypes.memmove, 2)
    job.work()
    job.wait()
    assert torch.equal(buffer, source)


@pytest.mark.parametrize("workers", [1, 3])
def test_equal_bytes_finds_any_difference_in_any_pair(workers):
    from hf_resumable.checkpoint._staging import equal_bytes

    big = torch.randn(3 << 20)  # 12 MiB: compared by the helper threads, piece by piece
    pairs = [(big, big.clone()), (torch.arange(5), torch.arange(5)), (torch.zeros(0), torch.zeros(0))]
    assert equal_bytes(pairs, workers=workers)
    for index in (0, (3 << 20) - 1):
        other = big.clone()
        other[index] = other[index] + 1
        assert not equal_bytes([(big, other), *pairs[1:]], workers=workers)
    nan = torch.tensor([float("nan"), 0.0])
    assert equal_bytes([(nan, nan.clone())], workers=workers)  # the same bits, though NaN != NaN
    assert not equal_bytes([(torch.tensor([0.0]), torch.tensor([-0.0]))], workers=workers)
    assert not equal_bytes([(torch.zeros(2), torch.zeros(2, dtype=torch.float64))], workers=workers)
    strided = big[:8].view(2, 4).t()  # not contiguous: compared through torch
    assert equal_bytes([(strided, strided.clone())], workers=workers)


def test_written_files_start_their_writeback_and_fall_back_to_flushing_behind(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from hf_resumable.format import safetensors_io

    tensors = [("a", torch.randn(1 << 20)), ("b", torch.arange(10))]
    calls = []

    def refused(fd, offset, nbytes, flags):
        calls.append((offset, nbytes, flags))
        return -1  # as on a file system that does not support it

    for name, function in (("native", safetensors_io._SYNC_FILE_RANGE), ("refused", refused)):
        if function is None:
            continue
        monkeypatch.setattr(safetensors_io, "_SYNC_FILE_RANGE", function)
        monkeypatch.setattr(safetensors_io, "WRITE_BEHIND", 1 << 20)
        record = safetensors_io.write_safetensors(tmp_path / f"{name}.safetensors", tensors)
        loaded = load_file(tmp_path / f"{name}.safetensors")
        hashed = safetensors_io.hash_file(tmp_path / f"{name}.safetensors")
        assert (record.size, record.xxh3_128) == (hashed.size, hashed.xxh3_128)
        assert all(torch.equal(loaded[key], value) for key, value in tensors)
    assert len(calls) == 1 and calls[0][0] == 0 and calls[0][2] == 2  # tried once, then flushed behind
