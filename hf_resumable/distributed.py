"""``torch.distributed`` glue: small pickle-free collectives, and a rendezvous that survives torchrun's restarts.

``all_gather_object`` and ``broadcast_object_list`` pickle their payloads; checkpoint coordination
only ever needs JSON, so it is sent as UTF-8 bytes in uint8 tensors instead.

Under ``torchrun --max-restarts`` the workers of every attempt meet in the *agent's* TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``), which outlives the attempts, and ``env://`` gives them that store with no
per-attempt prefix: a restarted worker can read the previous attempt's gloo address of a peer and fail with
"connectFullMesh ... Connection refused". Importing this module (``import hf_resumable`` does) wraps torch's
``env://`` rendezvous so that each attempt's process group lives under a key prefix of its own (see
[`init_process_group`]); nothing changes outside torchelastic's agent store. ``HF_RESUMABLE_ATTEMPT_STORE=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .errors import CorruptCheckpointError, CorruptOnAnotherRankError, ReadFailedOnAnotherRankError

logger = logging.getLogger(__name__)

__all__ = [
    "is_distributed",
    "rank_and_world_size",
    "barrier",
    "all_gather_json",
    "settle",
    "broadcast_json",
    "agreed_reads",
    "checkpoint_group",
    "init_process_group",
    "install_attempt_scoped_rendezvous",
]


def is_distributed() -> bool:
    """True when a default process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)``, ``(0, 1)`` outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier()`` when distributed, else nothing."""
    if is_distributed():
        dist.barrier(group=group)


# How long a collective's caller waits for gloo's worker threads to let go of its tensors (see `settle`).
_SETTLE_SECONDS = 10.0


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def settle(*tensors: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Return once the gloo backend holds none of ``tensors``, the tensors of a collective that has completed.

    A gloo work keeps its tensors until its worker thread destroys it, a moment after ``wait()`` has returned, and
    releasing a tensor that has a Python object takes the GIL there. When the interpreter is already shutting down
    (the collective was among the process's last), that thread is ended inside a C++ destructor and a run that
    succeeded aborts at exit: "terminate called without an active exception", SIGABRT (torch 2.13; see
    pytorch/pytorch#179291). The collectives in this library call this, so a process may exit right after them.
    Other backends return at once; so does a torch without ``Tensor._use_count``.
    """
    if dist.get_backend(group) != "gloo" or not all(hasattr(t, "_use_count") for t in tensors):
        return
    deadline = time.monotonic() + _SETTLE_SECONDS
    while any(t._use_count() > 1 for t in tensors):
        if time.monotonic() > deadline:
            logger.debug("gloo still holds a collective's tensors after %.0f s; going on.", _SETTLE_SECONDS)
            return
        time.sleep(0.0005)


def all_gather_json(value: Any, *, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` (JSON-able), in rank order, on every rank (of ``group``, default: the world)."""
    if not is_distributed():
        return [value]
    device = _device(group)
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    count = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.all_gather(sizes, count, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    settle(count, padded, *sizes, *gathered, group=group)
    return [json.loads(bytes(g[: int(s.item())].cpu().tolist()).decode()) for g, s in zip(gathered, sizes)]


def broadcast_json(value: Any, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """``value`` from rank ``src`` (JSON-able), on every rank."""
    if not is_distributed():
        return value
    return all_gather_json(value if dist.get_rank() == src else None, group=group)[src]


@contextlib.contextmanager
def agreed_reads(source: str) -> Iterator[None]:
    """Run reads inside; on leaving, every rank learns whether any rank's reads failed, and how.

    Collective (every rank enters it at the same point, on the default group). A rank finds a flipped byte, or
    meets an unreadable file, only in the files it reads itself, in the middle of a load; it must not leave while
    the others go on into their next collectives (an engine's gathers while it applies a load, the training
    loop's), where they would wait for it or meet its next collective instead. So a load reads into new tensors
    inside this, and changes live objects only after it. Every rank leaves it together when any rank raised an
    `Exception` inside (``KeyboardInterrupt`` and ``SystemExit`` are not caught). An error that is already agreed
    (`CorruptOnAnotherRankError` or `ReadFailedOnAnotherRankError`, from an agreement nested inside) is passed on
    as it is.

    Args:
        source (`str`): what was read (a checkpoint), named in the error.

    Raises:
        CorruptCheckpointError: on every rank when every rank that failed raised it inside: the first such rank's
            own error there, `CorruptOnAnotherRankError` naming that rank and its report (type, message, file) on
            the others.
        ReadFailedOnAnotherRankError: on the ranks that did not fail, or failed only by corruption, when a rank
            raised any other error inside (an `OSError`, a `MemoryError`, a `CheckpointMismatchError`); it names
            the first such rank and its error. That rank, and each other rank that raised such an error, raises
            its own error unchanged. A resume does not fall back to an earlier checkpoint for these.

    Example:

    ```python
    >>> with agreed_reads("out/checkpoint-8"):  # doctest: +SKIP
    ...     filled = read_my_pieces()
    >>> apply(filled)  # every rank's reads succeeded  # doctest: +SKIP
    ```
    """
    found: Exception | None = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - every rank must learn of any failure; re-raised below
        found = err
    told = found is None or isinstance(found, (CorruptOnAnotherRankError, ReadFailedOnAnotherRankError))
    reports = all_gather_json(None if told else [isinstance(found, CorruptCheckpointError), _describe(found)])
    failed = [(rank, corrupt, report) for rank, each in enumerate(reports) if each is not None
              for corrupt, report in [each]]
    if not failed:
        if found is not None:  # agreed inside already
            raise found
        return
    # any failure other than corruption stops every rank: only a corrupt checkpoint is worth trying an earlier one
    rank, corrupt, report = next((each for each in failed if not each[1]), failed[0])
    if found is not None and not isinstance(found, CorruptCheckpointError):
        raise found  # this rank's own error (a builtin type stays one), or one agreed inside
    if corrupt and found is not None and (told or rank == rank_and_world_size()[0]):
        raise found
    if corrupt:
        raise CorruptOnAnotherRankError(f"{source}: rank {rank} found a corrupt file while it read its part "
                                        f"({report}); nothing was loaded on any rank. Load an earlier checkpoint.",
                                        rank=rank, report=report) from found
    raise ReadFailedOnAnotherRankError(f"{source}: rank {rank} could not read its part ({report}), so every rank "
                                       f"stopped here. Fix what rank {rank} reported (its log holds the traceback) "
                                       "and start again.", rank=rank, report=report) from found


def _describe(err: Exception) -> str:
    """``err`` as one line for the other ranks: its type, its errno's name for an ``OSError``, its message."""
    code = errno.errorcode.get(err.errno) if isinstance(err, OSError) and err.errno is not None else None
    return f"{type(err).__name__}{f' ({code})' if code else ''}: {err}"


_side: dict[int, dist.ProcessGroup] = {}


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo process group of all ranks that only checkpoint commits use (``None`` outside torch.distributed).

    Background saves gather their file records and agree on the commit over it, so their collectives never
    interleave with the training loop's on the default group. Created on first use, which is collective
    (every rank calls it at the same point: a save); re-created after the default group is.
    """
    if not is_distributed():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _side:
        _side.clear()
        _side[key] = dist.new_group(backend="gloo")
    return _side[key]


# --- torchrun restarts: one key namespace per attempt in the agent's store -------------------------------------------

_MEETING = "hf_resumable/rendezvous"  # where an attempt's ranks agree on its number
_ATTEMPT = "hf_resumable/attempt-"  # + the number: the prefix of that attempt's process group keys
_POLL_SECONDS = 0.02


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group``, safe under torchrun's restarts; takes exactly the same arguments.

    Under torchelastic with the agent's store (``torchrun``'s default), the group's keys are put under a prefix that
    the attempt's ranks agree on first, so one attempt never reads another's (a restarted worker would otherwise
    connect to the previous attempt's address of its peer). Elsewhere, and with an explicit ``store`` or a
    non-``env://`` ``init_method``, it is ``torch.distributed.init_process_group`` unchanged. ``import hf_resumable``
    already installs the same behaviour for plain ``torch.distributed.init_process_group`` calls (accelerate's,
    the Trainer's, a custom loop's); this function is for code that wants to say so explicitly.

    Example:

    ```python
    >>> from hf_resumable.distributed import init_process_group
    >>> init_process_group("gloo")  # doctest: +SKIP
    ```
    """
    install_attempt_scoped_rendezvous()
    dist.init_process_group(*args, **kwargs)


def install_attempt_scoped_rendezvous() -> bool:
    """Wrap torch's ``env://`` rendezvous handler so that each torchelastic attempt gets its own key prefix.

    Idempotent; returns whether the wrapper is installed (``False`` when ``HF_RESUMABLE_ATTEMPT_STORE=0`` or this
    torch has no ``env://`` handler to wrap).

    Example:

    ```python
    >>> from hf_resumable.distributed import install_attempt_scoped_rendezvous
    >>> install_attempt_scoped_rendezvous()
    True
    ```
    """
    if os.environ.get("HF_RESUMABLE_ATTEMPT_STORE", "1") == "0":
        return False
    handlers = getattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers:
        logger.debug("torch.distributed has no env:// rendezvous handler to wrap; torchrun restarts are not scoped")
        return False
    if not getattr(handlers["env"], "_hf_resumable_attempt_scoped", False):
        handlers["env"] = _attempt_scoped(handlers["env"])
    return True


def _attempt_scoped(env_handler: Callable[..., Iterator[tuple[dist.Store, int, int]]]):
    def handler(url: str, timeout: datetime.timedelta = dist.constants.default_pg_timeout, **kwargs: Any):
        inner = env_handler(url, timeout=timeout, **kwargs)
        store, rank, world_size = next(inner)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and world_size > 0:
            store = _attempt_store(store, rank, world_size, timeout=timeout)
        yield store, rank, world_size
        next(inner)  # torch's own "unable to perform re-rendezvous" error

    handler._hf_resumable_attempt_scoped = True
    return handler


def _attempt_store(store: dist.Store, rank: int, world_size: int, *,
                  timeout: datetime.timedelta = dist.constants.default_pg_timeout) -> dist.PrefixStore:
    """``store`` under a prefix that every rank of this attempt (and no rank of any other) agrees on.

    The ranks cannot use ``TORCHELASTIC_RESTART_COUNT``: it counts one agent's restarts, and agents of a
    multi-node job restart different numbers of times (a node that was SIGKILLed and started again counts from
    0). Instead rank 0 draws a fresh number from a counter in the store, and hands it to each other rank in reply
    to a nonce that rank has just written; a reply to an older process's nonce is ignored. Processes of an
    attempt that ended are dead before the next attempt starts (the agents stop their workers before they
    re-rendezvous), so nothing stale is written once rank 0 has cleared the nonces.

    Raises:
        torch.distributed.DistStoreError: a rank did not answer within ``timeout``.
    """
    meeting = dist.PrefixStore(_MEETING, store)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        attempt = meeting.add("counter", 1)
        for peer in range(1, world_size):
            meeting.delete_key(f"join/{peer}")
        for peer in range(1, world_size):
            nonce = _poll(lambda p=peer: meeting.get(f"join/{p}") if meeting.check([f"join/{p}"]) else None,
                          deadline, f"rank {peer} to join attempt {attempt}")
            meeting.set(f"reply/{peer}", nonce + b" " + str(attempt).encode())
    else:
        nonce = f"{uuid.uuid4().hex}-{os.getpid()}".encode()

        def reply() -> int | None:
            meeting.set(f"join/{rank}", nonce)  # again on every poll: rank 0 may clear it after our first write
            if meeting.check([f"reply/{rank}"]):
                answer_nonce, _, number = meeting.get(f"reply/{rank}").partition(b" ")
                if answer_nonce == nonce:
                    return int(number)
            return None

        attempt = _poll(reply, deadline, "rank 0 to open this attempt's rendezvous")
    logger.debug("rank %d: process group keys under %s%d (restart count %s)", rank, _ATTEMPT, attempt,
                 os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    return dist.PrefixStore(f"{_ATTEMPT}{attempt}", store)


def _poll(probe: Callable[[], Any], deadline: float, waiting_for: str) -> Any:
    while (value := probe()) is None:
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"Timed out waiting for {waiting_for} in torchelastic's store (hf_resumable's per-attempt "
                "rendezvous). Check that every worker started; HF_RESUMABLE_ATTEMPT_STORE=0 turns this off."
            )
        time.sleep(_POLL_SECONDS)
    return value


install_attempt_scoped_rendezvous()
