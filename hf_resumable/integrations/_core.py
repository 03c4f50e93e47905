"""What both front doors share: their options (:class:`ResumeOptions`), the inexact-resume policy, the one drift
check, the follow-ups of a commit (:class:`AfterCommit`) and the upstream-version policy (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..checkpoint import wait_for_pending_saves
from ..checkpoint.api import background_saver
from ..errors import ConfigDriftError, HfResumableError, InexactResumeError
from ..format.rng import RngState, restore_rng_state
from ..preemption import check_notice
from ._trainer_hparams import RESUME_HYPERPARAMETERS

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT", "AfterCommit", "ResumeOptions", "UpstreamInternalsError", "changed_settings", "check_drift",
           "check_upstream", "inexact", "notice_save_in_flight", "patched"]

class _Default:
    """The "option not given" marker; one instance, which stays itself when the options are pickled or copied
    (accelerate's users pickle a prepared Accelerator)."""

    def __repr__(self) -> str:
        return "DEFAULT"

    def __reduce__(self) -> str:
        return "DEFAULT"


# "option not given" (keep_last falls back to accelerate's ProjectConfiguration.total_limit).
DEFAULT: Any = _Default()


class UpstreamInternalsError(HfResumableError, ImportError):
    """The installed ``transformers`` or ``accelerate`` lacks an internal that an integration needs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeOptions:
    """The options of both front doors (their keyword arguments, documented there), validated when built;
    ``keep_last`` is :data:`DEFAULT` when not given.

    Raises:
        ValueError: an option outside its allowed values (named, with the allowed ones).

    Example:

    ```python
    >>> ResumeOptions(keep_last=0)
    Traceback (most recent call last):
    ...
    ValueError: keep_last must be >= 1 or None, got 0.
    ```
    """

    allow_inexact_resume: bool = False
    allow_config_drift: bool = False
    exit_on_preemption: bool = True
    handle_preemption: bool = True
    checkpoint_verify: str = "quick"
    push_checkpoints_to: str | None = None
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    save_async: bool | None = None
    standalone_checkpoints: bool = False
    restore_callback_states: bool = True
    resume_hyperparameters: str = "checkpoint"
    checkpoint_dir: Path | None = None
    keep_last: int | None = DEFAULT
    elastic: bool = False
    # seconds from SIGTERM to SIGKILL (None: save the signal's step and exit at once); see hf_resumable.preemption
    preemption_notice: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.elastic, bool):
            raise ValueError(f"elastic must be True or False, got {self.elastic!r}.")
        for field in ("allow_inexact_resume", "allow_config_drift", "exit_on_preemption", "handle_preemption",
                      "standalone_checkpoints", "restore_callback_states"):
            object.__setattr__(self, field, bool(getattr(self, field)))
        if self.save_async is not None:
            object.__setattr__(self, "save_async", bool(self.save_async))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        if self.checkpoint_verify not in ("quick", "full"):
            raise ValueError(f"checkpoint_verify must be 'quick' or 'full', got {self.checkpoint_verify!r}.")
        if self.resume_hyperparameters not in RESUME_HYPERPARAMETERS:
            raise ValueError(f"resume_hyperparameters must be one of {RESUME_HYPERPARAMETERS}, got "
                             f"{self.resume_hyperparameters!r}.")
        if self.keep_last is not DEFAULT and self.keep_last is not None and not self.keep_last >= 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {self.keep_last}.")
        object.__setattr__(self, "preemption_notice", check_notice(self.preemption_notice))


def restore_resumed_rng(state: RngState | None, *, across_world_sizes: bool, allow_inexact_resume: bool,
                        missing: Callable[[], None]) -> None:
    """Restore a resumed rank's RNG, the one rule of both front doors.

    ``across_world_sizes`` (``elastic=True``): the model's randomness is keyed per micro-batch, so a rank the
    checkpoint had keeps its other streams and a new rank (no state) starts from its seed. At the same world size a
    rank without state calls ``missing`` (an inexact resume); ``allow_inexact_resume`` also allows another device
    count.
    """
    if across_world_sizes:
        if state is not None:
            restore_rng_state(state, allow_device_mismatch=True)
        return
    if state is None:
        missing()
        return
    restore_rng_state(state, allow_device_mismatch=allow_inexact_resume)


def inexact(message: str, *, allow: bool, owner: str, error: type[InexactResumeError] = InexactResumeError) -> None:
    """The inexact-resume policy: raise ``error`` (naming the front door ``owner`` in the fix) unless ``allow``, else
    log a WARNING and go on."""
    if not allow:
        raise error(f"{message}; the run would not continue exactly. Resume from another checkpoint, or pass "
                    f"allow_inexact_resume=True to {owner} to continue anyway.")
    logger.warning("%s; continuing because allow_inexact_resume=True (NOT bit-exact).", message)


def check_drift(changed: Mapping[str, tuple[Any, Any]], *, checkpoint: str, allow: bool, option: str,
                owner: str) -> None:
    """The one drift check: every changed setting (``{name: (saved, current)}``) in one error, or one WARNING when
    the user opted in (``<option>=True`` of the front door ``owner``).

    Raises:
        ConfigDriftError: ``changed`` is not empty and ``allow`` is false.
    """
    if not changed:
        return
    details = ", ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changed.items())
    message = f"Resuming {checkpoint} with a different configuration ({details})"
    if not allow:
        raise ConfigDriftError(f"{message}. The run would not continue exactly. Restore the original settings, or "
                               f"pass {option}=True to {owner} to continue as well as possible.")
    logger.warning("%s; continuing because %s=True. The run will NOT continue bit for bit.", message, option)


def changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{name: (saved, current)}`` for every setting recorded on both sides that differs (pure)."""
    return {key: (saved[key], current[key]) for key in saved if key in current and saved[key] != current[key]}


def check_upstream(package: str, installed: str, tested: Iterable[str], problems: list[str]) -> None:
    """The upstream-version policy of both integrations: outside the ``tested`` range (specifiers such as
    ``(">=5.0", "<6.0")``) a WARNING, since the checks of the internals still hold; a missing or changed internal
    (``problems``) is an error, since the integration cannot work without it.

    Raises:
        UpstreamInternalsError: ``problems`` is not empty.
    """
    tested = tuple(tested)
    if problems:
        raise UpstreamInternalsError(
            f"hf_resumable's {package} integration cannot guarantee exact resume with {package} {installed}: "
            + "; ".join(problems) + f". Install a {package} version in {', '.join(tested)}.")
    if Version(installed) not in SpecifierSet(",".join(tested)):
        logger.warning("hf_resumable's %s integration was tested with %s %s; found %s. Its internals are still as "
                       "expected; run the integration tests before trusting resumes.", package, package,
                       ",".join(tested), installed)


class AfterCommit:
    """Follow-ups of checkpoint commits, attached to each save's future and run on the training thread.

    A blocking save (``future=None``) has committed when it returns: its follow-up runs at once. A background
    save's runs at the first :meth:`settle` after its future is done, and never if the save failed.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Future, Callable[[], None]]] = []

    @property
    def pending(self) -> bool:
        """Whether a follow-up waits for its save."""
        return bool(self._pending)

    def attach(self, future: Future | None, follow_up: Callable[[], None]) -> None:
        """Run ``follow_up`` once the save of ``future`` has committed (now for a blocking save)."""
        if future is None:
            follow_up()
        else:
            self._pending.append((future, follow_up))

    def settle(self, *, poll: bool = False, removals: bool = True) -> None:
        """Wait for the save in flight, then run the follow-ups (with ``poll``: only once every attached save is done).

        With ``removals=False`` or ``poll``, checkpoints retention removed may still be being deleted (the next
        save's write waits for them itself).

        Raises:
            AsyncSaveError: the background save failed; its follow-ups are dropped (nothing was committed).
        """
        if poll and (not self._pending or any(not future.done() for future, _ in self._pending)):
            return
        pending, self._pending = self._pending, []
        if removals and not poll:
            wait_for_pending_saves()
        else:
            background_saver().wait()
        for _, follow_up in pending:
            follow_up()


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.<name>`` is ``value`` for the duration of the block (how the integrations bend upstream internals)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def notice_save_in_flight() -> Future | None:
    """The future of the notice checkpoint's background write, given the training loop's CPU priority from now on
    (it is the one checkpoint that must commit before SIGKILL); ``None`` when the save was blocking or is done."""
    saver = background_saver()
    if not saver.writing:
        return None
    saver.expedite()
    return saver.future
