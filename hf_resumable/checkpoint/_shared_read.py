"""Read once: on a data-parallel (DDP) resume every rank loads the same model and optimizer, so the tensor files are
split across the ranks (the same PURE plan as a save's, :func:`._replicas.plan_replica_writers`), each rank reads
its share from storage (hash-checked while read, as a single-process load) and broadcasts each file's tensors over
the checkpoint's gloo group once the file verified, while it reads its next files (the receives are posted ahead,
in the same order on every rank). Then the ranks learn whether every read verified, and only then are received
bytes copied into destinations that could not take them in place, or the load returns. Each byte therefore comes
from storage once across the ranks, and every byte sent was hash-checked by the rank that read it; a mismatch
raises the same ``CorruptCheckpointError`` on every rank (the failing rank still sends what it has, so that no
rank waits; the model's parameters may then hold part of it, as after a mismatch in a single-process load).

It applies when every rank's reads agree (:func:`read_signature`: the files' sizes and every tensor's destination
kind) and the ranks do not all read through one page cache. Ranks on one machine each read every file instead (known
without a collective where torchrun's ``LOCAL_WORLD_SIZE`` is the world size, else from :func:`page_cache_identity`:
one kernel, one filesystem): the kernel reads each page from storage once for all of them (they read the same files
at the same time), and a copy out of the page cache costs less than one through gloo (docs/benchmarks.md).
``HF_RESUMABLE_SHARED_READS=always`` exchanges on one machine too, ``0`` never (every rank reads every file, as
before). Where the reads may be shared, ``OpenedCheckpoint.load_into`` of a model or an
optimizer under torch.distributed is collective: every rank calls it (as a DDP resume does); a rank that fails
before its reads tells the others (:func:`announce_failure`), so none waits for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import errors
from ..distributed import all_gather_json, checkpoint_group, is_distributed, rank_and_world_size
from ._parallel_read import FileRead, _in_place, read_files
from ._replicas import plan_replica_writers
from ._writer import _describe
from .async_save import BACKGROUND_SAVER

logger = logging.getLogger(__name__)

__all__ = ["shares_reads", "read_signature", "read_shared", "announce_failure", "page_cache_identity",
           "one_page_cache", "SHARED_READS_ENV"]

# "0": every rank reads every file of a load (the per-rank reads, e.g. as a benchmark's baseline); "always": the ranks
# split and exchange the files even where they share one page cache; unset or "1": they exchange across machines only.
SHARED_READS_ENV = "HF_RESUMABLE_SHARED_READS"
EXCHANGE_ALWAYS = "always"
# Set by torchrun (and launchers built on it): the ranks on this machine.
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


def shares_reads() -> bool:
    """Whether a load under torch.distributed agrees with the other ranks on sharing its reads (then collective).

    Not with ``HF_RESUMABLE_SHARED_READS=0``, nor where the launcher says that every rank runs on this machine
    (torchrun's ``LOCAL_WORLD_SIZE`` is the world size): every rank then reads every file through the one page cache,
    with no collective. Elsewhere :func:`read_shared` finds out whether the ranks share a page cache.
    """
    mode = os.environ.get(SHARED_READS_ENV, "1")
    if not is_distributed() or mode == "0":
        return False
    _, world_size = rank_and_world_size()
    return mode == EXCHANGE_ALWAYS or os.environ.get(LOCAL_WORLD_SIZE_ENV) != str(world_size)


def page_cache_identity(path: str | os.PathLike) -> str | None:
    """What ranks reading ``path`` through the same page cache have in common: the running kernel (its boot id,
    else the host name) and the filesystem object (device and inode); ``None`` if ``path`` cannot be inspected."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
    except OSError:
        kernel = socket.gethostname()
    return f"{kernel}:{info.st_dev}:{info.st_ino}"


def one_page_cache(identities: Sequence[str | None]) -> bool:
    """Whether every rank reads through one page cache (pure): all :func:`page_cache_identity` values known and equal.

    Example:

    ```python
    >>> one_page_cache(["k:1:2", "k:1:2"]), one_page_cache(["k:1:2", "j:1:2"]), one_page_cache([None, None])
    (True, False, False)
    ```
    """
    return bool(identities) and identities[0] is not None and all(i == identities[0] for i in identities)


def _destination(read: FileRead, name: str) -> list[Any]:
    """How ``name``'s bytes land on this rank: in place, copied into a destination of that dtype/shape, or new."""
    target, info = read.into.get(name), read.header.tensors[name]
    if target is None:
        return ["new"]
    if _in_place(target, info):
        return ["in place"]
    return ["copy", str(target.dtype), list(target.shape)]


def read_signature(reads: Sequence[FileRead]) -> str:
    """What every rank's reads must share to be split (a digest): per file, its size, whether it comes from
    memory, and each tensor's destination kind."""
    described = [[read.header.file_size, read.data is not None,
                  [[name, *_destination(read, name)] for name in sorted(read.header.tensors)]] for read in reads]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def _rebuild(description: Mapping[str, Any], context: str) -> Exception:
    """Another rank's error (``_writer._describe``) as the same hf_resumable type (else an ``OSError`` with its
    errno, or a RuntimeError)."""
    message = f"{context}: {description['message']}"
    kind = getattr(errors, description["type"], None)
    if isinstance(kind, type) and issubclass(kind, errors.HfResumableError):
        return kind(message)
    if description["errno"] is not None:
        return OSError(description["errno"], message)
    return RuntimeError(message)


def _raise_if_failed(gathered: list[dict[str, Any]], local: BaseException | None, context: str) -> None:
    failed = [entry["error"] for entry in gathered if entry["error"] is not None]
    if local is not None:
        raise local
    if failed:
        raise _rebuild(failed[0], context)


def announce_failure(err: BaseException) -> None:
    """Tell the other ranks of a load that this one failed before its reads (they raise the same kind of error)."""
    all_gather_json({"signature": None, "cache": None, "error": _describe(err)}, group=checkpoint_group())


def read_shared(reads: list[FileRead], *, source: str) -> dict[str, torch.Tensor]:
    """:func:`._parallel_read.read_files` of ``reads``, the files split across the ranks when they agree (collective).

    Raises:
        CorruptCheckpointError: a hash mismatch on any rank (the same type on every rank), or another rank's error
            of another kind (its type kept where it is one of hf_resumable's, else its errno).
    """
    BACKGROUND_SAVER.wait()  # the save's collectives use the same group: never two at once
    group = checkpoint_group()
    rank, world_size = rank_and_world_size()
    # 1. Agree: the same reads on every rank (and none failed planning its load); whether they share a page cache.
    agreed = all_gather_json({"signature": read_signature(reads), "cache": page_cache_identity(source), "error": None},
                             group=group)
    _raise_if_failed(agreed, None, f"loading {source} failed on another rank")
    if any(entry["signature"] != agreed[0]["signature"] for entry in agreed):
        logger.debug("ranks load different tensors from %s: each reads every file", source)
        return read_files(reads)
    if (os.environ.get(SHARED_READS_ENV) != EXCHANGE_ALWAYS
            and one_page_cache([entry["cache"] for entry in agreed])):
        logger.debug("every rank reads %s through one page cache: each reads every file, storage serves it once",
                     source)
        return read_files(reads)
    # 2. Each rank reads its share (bytes kept by verification are in every rank's memory: read there), in the order
    #    of the files, and sends each run of its files as soon as they are read and verified, while the receives of
    #    the other ranks' files are already posted: reads and transfers overlap.
    owners = plan_replica_writers({f"{i:08d}": read.header.file_size for i, read in enumerate(reads)
                                   if read.data is None}, world_size)
    owner = [owners.get(f"{i:08d}", rank) for i in range(len(reads))]
    fresh: dict[str, torch.Tensor] = {}
    exchange = _Exchange(rank, group, fresh)
    local = None
    for mine, run in _runs(reads, owner, rank):
        if mine and local is None:
            try:
                fresh.update(read_files([read for read, _ in run]))
            except Exception as err:
                local = err  # its sends still go out (every rank posts the same broadcasts); nothing is applied
        for read, src in run:
            exchange.post(read, src)
    exchange.wait()
    # 3. Every rank learns whether every read verified before any received byte is applied.
    outcome = all_gather_json({"error": None if local is None else _describe(local)}, group=group)
    _raise_if_failed(outcome, local, f"reading {source} failed on another rank")
    exchange.apply()
    return fresh


def _runs(reads: list[FileRead], owner: list[int], rank: int) -> list[tuple[bool, list[tuple[FileRead, int]]]]:
    """Consecutive files this rank reads (``True``) or receives (``False``), in the files' order."""
    runs: list[tuple[bool, list[tuple[FileRead, int]]]] = []
    for read, src in zip(reads, owner):
        mine = src == rank
        if not runs or runs[-1][0] != mine:
            runs.append((mine, []))
        runs[-1][1].append((read, src))
    return runs


class _Exchange:
    """The broadcasts of one shared load: each tensor of a file from the rank that read it, posted without waiting,
    in the same order on every rank (one gloo group orders them); copies into destinations that cannot take the
    bytes in place wait for :meth:`apply`."""

    def __init__(self, rank: int, group: Any, fresh: dict[str, torch.Tensor]) -> None:
        self.rank, self.group, self.fresh = rank, group, fresh
        self.works: list[Any] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def post(self, read: FileRead, src: int) -> None:
        import torch.distributed as dist

        if read.data is not None:  # in every rank's memory: read there
            return
        for info in sorted(read.header.tensors.values(), key=lambda t: t.start):
            buffer = self._buffer(read, info, sending=src == self.rank)
            if buffer.numel():
                self.works.append(dist.broadcast(buffer.detach().reshape(-1).view(torch.uint8), src=src,
                                                 group=self.group, async_op=True))

    def _buffer(self, read: FileRead, info: Any, *, sending: bool) -> torch.Tensor:
        name, target = info.name, read.into.get(info.name)
        if target is None:
            if name not in self.fresh:  # a receive (or the send of a read that failed)
                self.fresh[name] = torch.empty(info.shape, dtype=info.torch_dtype)
            return self.fresh[name]
        if _in_place(target, info):
            return target
        if sending:
            return target.detach().to("cpu", copy=True).contiguous()
        buffer = torch.empty(tuple(target.shape), dtype=target.dtype)
        self.copies.append((buffer, target))
        return buffer

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def apply(self) -> None:
        with torch.no_grad():
            for buffer, target in self.copies:
                target.copy_(buffer)
