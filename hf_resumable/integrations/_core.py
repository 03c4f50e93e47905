"""What both front doors share: their options, the inexact-resume and drift policies, and the upstream-version policy.

:class:`~hf_resumable.integrations.trainer.ResumableTrainer` and
:class:`~hf_resumable.integrations.accelerate.ResumableAccelerator` take the same options as keyword arguments
(each its own subset, spelled as before) and build one :class:`ResumeOptions` from them, validated when it is built.
They decide the same questions the same way, here:

* **Inexact resume** (:func:`inexact`): a missing piece of state raises
  :class:`~hf_resumable.errors.InexactResumeError` unless ``allow_inexact_resume=True``, which logs a WARNING.
* **Drift** (:func:`check_drift`): every setting that changed since the checkpoint is named (old -> new) in one
  :class:`~hf_resumable.errors.ConfigDriftError`, or in one WARNING when the user opted in.
* **After a commit** (:class:`AfterCommit`): what follows a checkpoint's commit (retention, uploads, dropping a
  converted checkpoint) is attached to the save's future and runs on the training thread once it has committed,
  never for a save that failed.
* **Upstream versions** (:func:`check_upstream`): a version outside the tested range is a WARNING (the run goes
  on); a missing internal that the integration needs is an :class:`UpstreamInternalsError` (an ``ImportError``),
  raised before anything is trained.

The preemption protocol (one all-reduce of the SIGTERM flag, MAX over int32) is
:func:`hf_resumable.preemption.agree_on_preemption`.

Example:

```python
>>> ResumeOptions(checkpoint_verify="full").checkpoint_verify
'full'
>>> ResumeOptions(keep_last=0)
Traceback (most recent call last):
...
ValueError: keep_last must be >= 1 or None, got 0.
```
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..checkpoint import wait_for_pending_saves
from ..errors import ConfigDriftError, HfResumableError, InexactResumeError
from ._trainer_hparams import RESUME_HYPERPARAMETERS

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT", "AfterCommit", "ResumeOptions", "UpstreamInternalsError", "changed_settings", "check_drift",
           "check_upstream", "inexact"]

# "option not given" (keep_last falls back to accelerate's ProjectConfiguration.total_limit).
DEFAULT: Any = type("_Default", (), {"__repr__": lambda self: "DEFAULT"})()


class UpstreamInternalsError(HfResumableError, ImportError):
    """The installed ``transformers`` or ``accelerate`` lacks an internal that an integration needs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeOptions:
    """The options of both front doors, validated when built (each front door uses the ones it documents).

    Args:
        allow_inexact_resume (`bool`, *optional*, defaults to `False`): resume despite a missing piece of state
            (and, for ``ResumableAccelerator``, a changed configuration), with a WARNING.
        allow_config_drift (`bool`, *optional*, defaults to `False`): ``ResumableTrainer``: resume despite a changed
            run configuration, with a WARNING.
        exit_on_preemption (`bool`, *optional*, defaults to `True`): exit with ``PREEMPTION_EXIT_CODE`` after the
            SIGTERM checkpoint has committed.
        handle_preemption (`bool`, *optional*, defaults to `True`): install the SIGTERM flag handler.
        checkpoint_verify (`str`, *optional*, defaults to `"quick"`): ``"quick"`` or ``"full"`` verification on load.
        push_checkpoints_to (`str`, *optional*): upload every committed checkpoint there in the background.
        storage_options (`dict`, *optional*): fsspec options for ``s3://`` pushes and resumes.
        save_async (`bool`, *optional*): write checkpoints in the background (``None``: the front door's default).
        standalone_checkpoints (`bool`, *optional*, defaults to `False`): store frozen parameters too.
        restore_callback_states (`bool`, *optional*, defaults to `True`): ``ResumableTrainer``: restore
            ``ExportableState`` callbacks.
        resume_hyperparameters (`str`, *optional*, defaults to `"checkpoint"`): ``ResumableTrainer``: which
            optimization hyperparameters win on resume (``"checkpoint"`` or ``"arguments"``).
        checkpoint_dir (`Path`, *optional*): ``ResumableAccelerator``: where automatic checkpoints go.
        keep_last (`int`, *optional*): ``ResumableAccelerator``: committed checkpoints kept (``None``: all;
            :data:`DEFAULT`: the naming's default).

    Raises:
        ValueError: an option outside its allowed values (named, with the allowed ones).
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

    def __post_init__(self) -> None:
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


def inexact(message: str, *, allow: bool, owner: str, error: type[InexactResumeError] = InexactResumeError) -> None:
    """The inexact-resume policy: raise ``error`` unless ``allow``, else log a WARNING and go on.

    Args:
        message (`str`): what is missing or changed, and where.
        allow (`bool`): the user passed ``allow_inexact_resume=True``.
        owner (`str`): the front door, named in the fix (``"ResumableTrainer"``).
        error (`type`, *optional*): the error to raise (``ConfigDriftError`` for a changed configuration).
    """
    if not allow:
        raise error(f"{message}; the run would not continue exactly. Resume from another checkpoint, or pass "
                    f"allow_inexact_resume=True to {owner} to continue anyway.")
    logger.warning("%s; continuing because allow_inexact_resume=True (NOT bit-exact).", message)


def check_drift(changed: Mapping[str, tuple[Any, Any]], *, checkpoint: str, allow: bool, option: str,
                owner: str) -> None:
    """The one drift check: every changed setting (``{name: (saved, current)}``) in one error, or one WARNING.

    Args:
        changed (`Mapping`): the settings that differ from the checkpoint's (empty: nothing happens).
        checkpoint (`str`): the checkpoint path, for the message.
        allow (`bool`): the user opted in (``option=True``).
        option (`str`): the opt-in option's name (``"allow_config_drift"``).
        owner (`str`): the front door, named in the fix.

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
    """The upstream-version policy of both integrations.

    Outside the tested range: a WARNING (the integration's own checks of the internals it uses still hold).
    A missing internal: :class:`UpstreamInternalsError`, since the integration cannot work without it.

    Args:
        package (`str`): ``"transformers"`` or ``"accelerate"``.
        installed (`str`): its installed version.
        tested (`Iterable[str]`): the tested range as specifiers (``(">=5.0", "<6.0")``).
        problems (`list[str]`): the internals found missing or changed (empty: none).

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

    def settle(self, *, poll: bool = False) -> None:
        """Wait for the save in flight, then run the follow-ups (with ``poll``: only once every attached save is done).

        Raises:
            AsyncSaveError: the background save failed; its follow-ups are dropped (nothing was committed).
        """
        if poll and (not self._pending or any(not future.done() for future, _ in self._pending)):
            return
        pending, self._pending = self._pending, []
        wait_for_pending_saves()
        for _, follow_up in pending:
            follow_up()
