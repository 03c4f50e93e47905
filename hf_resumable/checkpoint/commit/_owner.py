"""Who owns a temporary name: every entry the commit protocol creates next to checkpoints (``.tmp-``, ``.trash-``,
``.removing-``, ``.pin-``) carries its owner (host hash, pid, start time) in its name, so it is never ownerless, and
only entries of provably dead owners are ever removed (docs/architecture.md, "Concurrency").

Example:

```python
>>> tag = OwnerTag(host="3fa2b1c0", pid=7, start=123)
>>> name = member_name(".tmp-", "checkpoint-5", tag, nonce="00ff00ff")
>>> name
'.tmp-checkpoint-5.3fa2b1c0.7.123.00ff00ff'
>>> owned = parse_member_name(name)
>>> owned.prefix, owned.target, owned.owner, owned.nonce
('.tmp-', 'checkpoint-5', OwnerTag(host='3fa2b1c0', pid=7, start=123), '00ff00ff')
>>> parse_member_name(".tmp-something-else") is None
True

```
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
import uuid
from dataclasses import dataclass

__all__ = ["OwnerTag", "OwnedName", "current_owner", "member_name", "parse_member_name", "owner_is_alive",
           "owner_can_act"]

_NAME_RE = re.compile(
    r"^(?P<prefix>\.(?:tmp|trash|pin|removing)-)(?P<target>.+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d{1,10})\.(?P<start>\d{1,20})"
    r"\.(?P<nonce>[0-9a-f]{8})(?P<mark>\.d)?$"
)
# Bit of SIGKILL in the pending-signal masks of /proc/<pid>/status (bit n-1 for signal n).
_SIGKILL_BIT = 1 << 8
# Mark appended to a trash name once its owner has decided to delete it (readers stop waiting for it).
DELETING_MARK = ".d"


@dataclass(frozen=True)
class OwnerTag:
    """A process: a hash of its host name, its pid and its start time (clock ticks since boot; 0 if unknown)."""

    host: str
    pid: int
    start: int

    def __str__(self) -> str:
        return f"{self.host}.{self.pid}.{self.start}"


@dataclass(frozen=True)
class OwnedName:
    """A parsed owned name (see the module docstring)."""

    prefix: str
    target: str
    owner: OwnerTag
    nonce: str
    mark: str = ""


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``); ``None`` if there is no such process or it
    has exited (a zombie: killed, its parent has not reaped it yet, and ``kill(pid, 0)`` still succeeds)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[:1] in ([b"Z"], [b"X"]):  # field 3, the state: zombie or dead, it holds nothing any more
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


@functools.lru_cache(maxsize=None)
def _owner_of(pid: int) -> OwnerTag:
    host = hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return OwnerTag(host=host, pid=pid, start=_start_time(pid) or 0)


def current_owner() -> OwnerTag:
    """This process's tag (recomputed after a fork, since the pid changes)."""
    return _owner_of(os.getpid())


def member_name(prefix: str, target: str, owner: OwnerTag | None = None, *, nonce: str | None = None,
                mark: str = "") -> str:
    """The owned name ``<prefix><target>.<owner>.<nonce>[mark]``."""
    owner = owner or current_owner()
    return f"{prefix}{target}.{owner}.{nonce or uuid.uuid4().hex[:8]}{mark}"


def parse_member_name(name: str) -> OwnedName | None:
    """Parse an owned name; ``None`` for anything else (which is then never treated as ours)."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    owner = OwnerTag(match["host"], int(match["pid"]), int(match["start"]))
    return OwnedName(match["prefix"], match["target"], owner, match["nonce"], match["mark"] or "")


def owner_is_alive(owner: OwnerTag) -> bool:
    """Whether ``owner`` may still be running: ``True`` unless provably dead (same host, and no process with that pid
    and start time; a zombie is dead)."""
    if owner.host != current_owner().host:
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    except OverflowError:
        return False
    start = _start_time(owner.pid)
    if start is None:
        return False
    # A recorded start time that differs means the pid was reused by a new process.
    return not (owner.start and start and start != owner.start)


def owner_can_act(owner: OwnerTag) -> bool:
    """Whether ``owner`` may still run code of its own: alive and not being killed. A process sent ``SIGKILL`` stays in
    the process table until the kernel gets to it (a while on a loaded machine) but never returns to its own code."""
    if not owner_is_alive(owner):
        return False
    return owner.host != current_owner().host or not _sigkill_pending(owner.pid)


def _sigkill_pending(pid: int) -> bool:
    """Whether ``SIGKILL`` is pending for ``pid`` (process-wide or for its main thread; Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        if line.startswith((b"ShdPnd:", b"SigPnd:")):
            try:
                if int(line.split(b":", 1)[1], 16) & _SIGKILL_BIT:
                    return True
            except ValueError:
                return False
    return False
