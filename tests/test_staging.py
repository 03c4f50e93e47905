"""The async-save staging copy: bit-exact copies of every kind of tensor, now or claimed by the threads that help,
and the byte comparison of tensor pairs."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from hf_resumable.checkpoint.background._staging import copy_into, equal_bytes, start_copy


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _sources() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3_000_000, generator=gen)
    return [
        base,                                               # large
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


def _check(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for buffer, source in zip(buffers, sources):
        assert buffer.shape == source.shape and buffer.dtype == source.dtype
        assert _bits(buffer) == _bits(source.resolve_conj())


def test_copy_into_is_bit_exact_for_every_kind_of_source():
    sources = _sources()
    buffers = [torch.full(s.shape, 0, dtype=s.dtype) for s in sources]
    copy_into(list(zip(buffers, sources)))
    _check(buffers, sources)


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_a_background_copy_is_bit_exact_whichever_threads_claim_it(helpers):
    sources = _sources()
    buffers = [torch.full(s.shape, 0, dtype=s.dtype) for s in sources]
    copy = start_copy(list(zip(buffers, sources)))
    assert not any(_bits(b) == _bits(s.resolve_conj()) for b, s in zip(buffers[:1], sources[:1]))  # nothing yet
    threads = [threading.Thread(target=copy.assist) for _ in range(helpers)]
    for thread in threads:
        thread.start()
    copy.join()
    for thread in threads:
        thread.join()
    _check(buffers, sources)
    copy.join()  # again: a no-op


def test_a_failing_background_copy_is_raised_by_join_and_stops_the_claims():
    sources = [torch.randn(1000) for _ in range(6)]
    buffers = [torch.zeros(1000) for _ in sources]
    calls = []

    def failing(dst, src, nbytes):
        calls.append(nbytes)
        if len(calls) == 2:
            raise OSError("copier failed")
        ctypes.memmove(dst, src, nbytes)

    copy = start_copy(list(zip(buffers, sources)), copier=failing)
    with pytest.raises(OSError, match="copier failed"):
        copy.join()
    assert len(calls) == 2  # nothing claimed after the error

    def broken(dst, src, nbytes):
        raise OSError("copier failed")

    with pytest.raises(OSError, match="copier failed"):
        copy_into([(buffers[0], sources[0])], copier=broken)


def test_equal_bytes_finds_any_difference_in_any_pair():
    big = torch.randn(3 << 20)
    pairs = [(big, big.clone()), (torch.arange(5), torch.arange(5)), (torch.zeros(0), torch.zeros(0))]
    assert equal_bytes(pairs)
    for index in (0, (3 << 20) - 1):
        other = big.clone()
        other[index] = other[index] + 1
        assert not equal_bytes([(big, other), *pairs[1:]])
    nan = torch.tensor([float("nan"), 0.0])
    assert equal_bytes([(nan, nan.clone())])  # the same bits, though NaN != NaN
    assert not equal_bytes([(torch.tensor([0.0]), torch.tensor([-0.0]))])
    assert not equal_bytes([(torch.zeros(2), torch.zeros(2, dtype=torch.float64))])
    strided = big[:8].view(2, 4).t()  # not contiguous: compared through torch
    assert equal_bytes([(strided, strided.clone())])
