"""The training-loop side of ``ResumableAccelerator``: prepared resumable loaders, accumulation windows and the watch
over a resumed loop that skips again what its loaders skipped (docs/accelerate.md, docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import accelerate
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device

from ..data import DATA_EPOCH, DATA_KIND, DATA_LOADER, DATA_NUM_BATCHES, DATA_STEP, ResumableDataLoader
from ..errors import DoubleSkipError
from ._elastic import seed_model_rng

if TYPE_CHECKING:
    from .accelerate import ResumableAccelerator

logger = logging.getLogger(__name__)

__all__ = ["AccumulationWindow", "ElasticBatch", "HandOuts", "ResumablePreparedLoader", "ResumablePreparedStream",
           "ResumedLoaders", "accumulation_windows", "count_window_items", "prepare_resumable_loader"]


@dataclasses.dataclass(frozen=True)
class ElasticBatch:
    """A micro-batch of the elastic layout (``elastic=True``) as its prepared loader handed it out.

    ``seed``, ``epoch`` and ``chunk`` key its model randomness (batch ``n`` of a rank's epoch is chunk
    ``n * world_size + rank``); ``samples`` are its samples that train (0: a padding batch, which lets this rank join
    the collectives of the epoch's last, shorter step); ``step_samples`` those its optimizer step trains on all ranks.
    """

    seed: int
    epoch: int
    chunk: int
    samples: int
    step_samples: int

    @property
    def is_padding(self) -> bool:
        """Whether it is a padding batch (trained with weight zero)."""
        return self.samples == 0

    def seed_model(self) -> None:
        """Seed torch's generators for training on it (dropout independent of the rank layout)."""
        seed_model_rng(self.seed, epoch=self.epoch, chunk=self.chunk)

    def loss_scale(self, *, num_processes: int, micro_batches: int) -> float | None:
        """The factor of its mean loss in a step of ``micro_batches`` micro-batches per rank: its share of the step's
        samples, or ``None`` for a whole step (the loss is divided as without ``elastic=True``). Pure.

        Example:

        ```python
        >>> whole = ElasticBatch(seed=0, epoch=0, chunk=0, samples=2, step_samples=8)  # 2 ranks x 2 x 2 samples
        >>> last = ElasticBatch(seed=0, epoch=0, chunk=4, samples=2, step_samples=2)  # the last step's only samples
        >>> padding = ElasticBatch(seed=0, epoch=0, chunk=5, samples=0, step_samples=2)  # the other rank's stand-in
        >>> [batch.loss_scale(num_processes=2, micro_batches=2) for batch in (whole, last, padding)]
        [None, 2.0, 0.0]
        ```
        """
        if self.samples * num_processes * micro_batches == self.step_samples:
            return None
        return num_processes * self.samples / self.step_samples


class HandOuts:
    """The elastic batch an accelerator's prepared loaders handed out most recently (``None``: none, or its loader's
    pass has ended): what ``backward`` weighs a loss by outside an :class:`AccumulationWindow`."""

    def __init__(self) -> None:
        self.batch: ElasticBatch | None = None


class _PreparedLoader(DataLoaderStateMixin):
    """What both prepared loaders share: device placement, the batches of ``epoch`` handed out, and the elastic
    hand-outs. ``layout`` holds their batch size, seed, rank and global batch (a batch sampler, or a stream)."""

    def __init__(self, loader: Any, *, gradient_state: GradientState, device: torch.device | None,
                 hand_outs: HandOuts | None, layout: Any, epoch: int) -> None:
        self.loader = loader
        self.gradient_state = gradient_state
        self.device = device
        self.dataset = loader.dataset
        self._layout = layout
        self.total_batch_size = layout.batch_size * layout.world_size
        self.epoch = epoch
        self.consumed = 0  # batches of ``epoch`` already handed out
        self.hand_outs = hand_outs
        self.last_batch: ElasticBatch | None = None  # elastic layout: the batch handed out last

    @property
    def batch_size(self) -> int:
        return self._layout.batch_size

    @property
    def seed(self) -> int:
        """The run seed of the loader's order and per-batch randomness."""
        return self._layout.seed

    def set_global_batch(self, global_batch: int) -> None:
        """Elastic layout: the examples per optimizer step over all ranks (kept from the checkpoint)."""
        self._layout.global_batch = global_batch

    @property
    def is_padding(self) -> bool:
        """Whether the batch handed out last is a padding batch of the elastic layout (this rank has no samples in
        the epoch's last, shorter step; ``backward`` scales its loss to zero): leave it out of logged losses."""
        return self.last_batch is not None and self.last_batch.is_padding


class ResumablePreparedLoader(_PreparedLoader):
    """A prepared :class:`~hf_resumable.data.ResumableDataLoader`: device placement, epoch and position.

    Iterating it yields the rest of the current epoch (from the restored position on), then advances
    :attr:`epoch`: iterate epochs as ``for epoch in range(loader.epoch, num_epochs): for batch in loader:``.
    ``end_of_dataloader`` is set on the epoch's last batch without prefetching (the batch count is known). With
    ``hand_outs`` (the elastic layout) each batch handed out is recorded as an :class:`ElasticBatch`, after
    seeding torch's generators for it; ``device=None`` leaves batches where they are.
    """

    def __init__(self, loader: ResumableDataLoader, *, gradient_state: GradientState,
                 device: torch.device | None, hand_outs: HandOuts | None = None) -> None:
        sampler = loader.batch_sampler
        super().__init__(loader, gradient_state=gradient_state, device=device, hand_outs=hand_outs, layout=sampler,
                         epoch=sampler.epoch)
        self._drop_last = sampler.drop_last

    def __len__(self) -> int:
        return len(self.loader.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select an epoch; selecting the current one keeps the position (so resumed runs may call it)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def __iter__(self) -> Iterator[Any]:
        if self.consumed >= len(self):
            self._next_epoch()
            return
        self.loader.set_epoch(self.epoch)
        source = self.loader.skip(self.consumed) if self.consumed else self.loader
        self.begin()
        try:
            for batch in source:
                self.consumed += 1
                self.end_of_dataloader = self.consumed == len(self)
                if self.hand_outs is not None:
                    samples, step_samples = self.loader.batch_sampler.elastic_weight(self.consumed - 1)
                    _hand_out(self, samples, step_samples)
                yield batch if self.device is None else send_to_device(batch, self.device)
        finally:
            self.end()
            _end_hand_outs(self)
        if self.consumed >= len(self):
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch, self.consumed = self.epoch + 1, 0

    def position(self) -> dict[str, Any]:
        """JSON record of where the next batch comes from (an exhausted epoch is recorded as the next one)."""
        epoch, consumed = (self.epoch + 1, 0) if self.consumed >= len(self) else (self.epoch, self.consumed)
        return self.loader.position(epoch=epoch, step=consumed)

    def fits(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` is a map-style position of an epoch as long as this loader's."""
        return record.get(DATA_KIND) == "map" and int(record.get(DATA_NUM_BATCHES, -1)) == len(self)

    def load_position(self, record: Mapping[str, Any], *, restart_epoch: bool = False) -> None:
        """Continue at ``record`` (from :meth:`position`) without fetching anything.

        Args:
            record (`Mapping`): the saved position.
            restart_epoch (`bool`, *optional*, defaults to `False`): keep only the epoch and start it over
                (the inexact fallback when the record does not :meth:`fits`).
        """
        self.epoch = int(record.get(DATA_EPOCH, 0))
        self.consumed = 0 if restart_epoch else int(record[DATA_STEP])

    def settings(self) -> dict[str, Any]:
        """What decides this loader's batches (compared at resume time)."""
        sampler = self.loader.batch_sampler
        return {"num_samples": sampler.num_samples, "batch_size": sampler.batch_size, "seed": sampler.seed,
                "shuffle": sampler.shuffle, "drop_last": sampler.drop_last, "num_batches": len(self)}


class ResumablePreparedStream(_PreparedLoader):
    """A prepared resumable stream (the loader of :func:`~hf_resumable.data.build_stream_dataloader`): device
    placement, epoch and position, as :class:`ResumablePreparedLoader`.

    The position is the ``StatefulDataLoader`` state after the batches handed out (docs/accelerate.md, "Streaming
    data"). The number of batches is not known in advance, so it reads one batch ahead to set ``end_of_dataloader``
    on the pass's last batch; the state is taken before that read, so the batch read ahead is not in the position.
    """

    def __init__(self, loader: Any, *, gradient_state: GradientState, device: torch.device | None,
                 hand_outs: HandOuts | None = None) -> None:
        # the data set is a SeededIterableDataset: it holds the stream's layout
        super().__init__(loader, gradient_state=gradient_state, device=device, hand_outs=hand_outs,
                         layout=loader.dataset, epoch=0)
        self._positioned = False  # the loader's next pass starts at ``consumed`` (a restored state)
        self._state: dict[str, Any] | None = None  # loader state after the ``consumed`` batches of this pass

    def set_epoch(self, epoch: int) -> None:
        """Select an epoch; selecting the current one keeps the position (so resumed runs may call it)."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self._positioned, self._state = epoch, 0, False, None

    def __iter__(self) -> Iterator[Any]:
        self.loader.set_epoch(self.epoch)
        if self.consumed and not self._positioned:  # a pass left early: continue after its last batch handed out
            self.loader.load_state_dict(self.loader.state_dict() if self._state is None else self._state)
        self._positioned = False
        self.begin()
        try:
            for batch, state, weight, last in _read_one_ahead(self.loader, self.dataset):
                self.consumed, self._state, self.end_of_dataloader = self.consumed + 1, state, last
                if self.hand_outs is not None:  # the stream knows the last step's length once it has read it
                    _hand_out(self, *weight)
                yield batch if self.device is None else send_to_device(batch, self.device)
        finally:
            self.end()
            _end_hand_outs(self)
        self.epoch, self.consumed, self._state = self.epoch + 1, 0, None

    def position(self) -> dict[str, Any]:
        """JSON record of where the next batch comes from (the start of a pass has no loader state)."""
        if not self.consumed:
            return {DATA_KIND: "stream", DATA_EPOCH: self.epoch, DATA_STEP: 0}
        # no state taken (restored and not iterated since): the loader's own state is the restored one
        return self.loader.position(epoch=self.epoch, step=self.consumed, state=self._state)

    def fits(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` is a streaming position."""
        return record.get(DATA_KIND) == "stream"

    def load_position(self, record: Mapping[str, Any], *, restart_epoch: bool = False) -> None:
        """Continue at ``record`` (from :meth:`position`, saved at any world size in the elastic layout).

        Raises:
            InexactResumeError: an elastic position that is not on an optimizer-step boundary of this world size.
        """
        self.epoch, self.consumed, self._positioned = int(record.get(DATA_EPOCH, 0)), 0, False
        self._state = None
        if restart_epoch or DATA_LOADER not in record:
            return
        self.consumed = self.loader.load_position(record)
        self._positioned = True

    def settings(self) -> dict[str, Any]:
        """What decides this loader's batches (compared at resume time)."""
        return {"kind": "stream", "batch_size": self.dataset.batch_size, "seed": self.dataset.seed,
                "drop_last": self.dataset.drop_last}


def _read_one_ahead(loader: Any, stream: Any) -> Iterator[tuple[Any, dict[str, Any] | None, Any, bool]]:
    """``loader``'s batches, each with the loader state and ``stream``'s elastic weight right after it was read, and
    whether it is the pass's last batch (the next batch is read before one is handed out)."""
    iterator = iter(loader)
    try:
        batch = next(iterator, _END)
        while batch is not _END:
            # a stream without state_dict() has no position (refused when one is asked for, as before)
            state, weight = loader.state_dict() if stream.is_stateful else None, stream.last_weight
            ahead = next(iterator, _END)
            yield batch, state, weight, ahead is _END
            batch = ahead
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


_END = object()


def _hand_out(loader: _PreparedLoader, samples: int, step_samples: int) -> None:
    """Record the elastic batch ``loader`` is handing out (its ``consumed``-th of the epoch) and seed torch's
    generators for it, so a loop that trains it at once draws the dropout masks an accumulation window would."""
    chunk = (loader.consumed - 1) * loader._layout.world_size + loader._layout.rank
    loader.last_batch = ElasticBatch(loader.seed, loader.epoch, chunk, samples, step_samples)
    loader.hand_outs.batch = loader.last_batch
    loader.last_batch.seed_model()


def _end_hand_outs(loader: _PreparedLoader) -> None:
    """``loader``'s pass ended (or was left): a later ``backward`` is not weighed by its last batch."""
    if loader.hand_outs is not None and loader.hand_outs.batch is loader.last_batch:
        loader.hand_outs.batch = None


def prepare_resumable_loader(accelerator: ResumableAccelerator, data_loader: Any,
                             device_placement: bool | None) -> Any:
    """Wrap a loader built by :mod:`hf_resumable.data` (no re-sharding) and register it with the accelerator's saved
    loaders.

    Raises:
        ValueError: the loader was built for another data-parallel rank or world size.
    """
    stream = not isinstance(data_loader, ResumableDataLoader)
    layout = data_loader.dataset if stream else data_loader.batch_sampler
    # a stream outside the elastic layout was split by rank beforehand: its world size is not its own
    rank, ranks = accelerator._data_rank()
    world_size = ranks if stream and layout.global_batch is None else layout.world_size
    if (layout.rank, world_size) != (rank, ranks):
        raise ValueError(
            f"The {type(data_loader).__name__} was built for rank {layout.rank} of {layout.world_size}, but this "
            f"process is data-parallel rank {rank} of {ranks}. Build it with the data-parallel rank and world "
            "size (accelerator.process_index and accelerator.num_processes without a ParallelismConfig), or use "
            "prepare_resumable_dataloader().")
    place = accelerator.device_placement if device_placement is None else device_placement
    wrapper = ResumablePreparedStream if stream else ResumablePreparedLoader
    prepared = wrapper(data_loader, gradient_state=accelerator.gradient_state,
                       device=accelerator.device if place else None,
                       hand_outs=accelerator._world_size_mode.hand_outs_for(layout))
    accelerator._resumable_loaders.append(prepared)
    return prepared



class AccumulationWindow:
    """The micro-batches of one optimizer step, with their item count summed over micro-batches and ranks.

    Iterate it inside ``accelerator.accumulate(model)``: the accelerator synchronises gradients (and lets the
    optimizer step) exactly on the window's last micro-batch, also in a short window at the end of an epoch.

    Args:
        batches (`list`): the micro-batches on this rank.
        num_items (`int`, *optional*): items (e.g. label tokens) in the whole window on all ranks.
        elastic (`list[ElasticBatch]`, *optional*): ``elastic=True``: per micro-batch, how its loader handed it out
            (torch's generators are seeded from it, and the accelerator scales its loss by its weight).
    """

    def __init__(self, batches: list[Any], num_items: int | None, *,
                 elastic: list[ElasticBatch] | None = None) -> None:
        self.batches = batches
        self.num_items = num_items
        self.elastic = elastic
        self.slot: tuple[int, int] | None = None  # (index, length) of the micro-batch being trained on

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def is_padding(self) -> bool:
        """Whether the micro-batch being trained on is a padding batch (``elastic=True``, the epoch's last, shorter
        step): ``backward`` scales its loss to zero; leave it out of logged losses too."""
        batch = self.current()
        return batch is not None and batch.is_padding

    def current(self) -> ElasticBatch | None:
        """The elastic batch being trained on (``None``: not the elastic layout, or not inside the window)."""
        if self.elastic is None or self.slot is None:
            return None
        return self.elastic[self.slot[0]]

    def __iter__(self) -> Iterator[Any]:
        try:
            for index, batch in enumerate(self.batches):
                self.slot = (index, len(self.batches))
                if self.elastic is not None:
                    self.elastic[index].seed_model()
                yield batch
        finally:
            self.slot = None


def accumulation_windows(accelerator: ResumableAccelerator, dataloader: Any,
                         count_items: Callable[[Any], int | torch.Tensor] | None) -> Iterator[AccumulationWindow]:
    """The loader's batches grouped into :class:`AccumulationWindow`\\ s, each handed to the accelerator while it is
    iterated (see ``ResumableAccelerator.accumulation_windows``)."""
    iterator = iter(dataloader)
    while True:
        batches, handed = accelerator._world_size_mode.window(dataloader, iterator,
                                                              accelerator.gradient_accumulation_steps)
        if not batches:
            return
        counted = batches if handed is None else [b for b, h in zip(batches, handed) if not h.is_padding]
        num_items = count_window_items(accelerator, counted, count_items) if count_items is not None else None
        accelerator._window = AccumulationWindow(batches, num_items, elastic=handed)
        try:
            yield accelerator._window
        finally:
            accelerator._window = None


def count_window_items(accelerator: ResumableAccelerator, batches: list[Any],
                       count_items: Callable[[Any], int | torch.Tensor]) -> int:
    """The items of a window's ``batches`` on this rank, summed over all processes (one all-reduce)."""
    local = sum(int(count_items(batch)) for batch in batches)
    if accelerator.num_processes == 1:
        return local
    total = accelerator.reduce(torch.tensor([local], dtype=torch.int64, device=accelerator.device), reduction="sum")
    return int(total.item())



# Code of these packages is never "the script's line" a message points at.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                      for module in (sys.modules[__package__.rpartition(".")[0]], accelerate, torch))


def _drawn_since(position: Mapping[str, Any], epoch: int, batch: int) -> float:
    """Batches drawn since the loader was at ``batch`` of ``epoch``, given its ``position()`` now (``inf``: more than
    an epoch). Without the epoch's length (a stream) only the next epoch's count: a lower bound, never refusing
    wrongly."""
    now_epoch, now_batch = int(position.get(DATA_EPOCH, 0)), int(position.get(DATA_STEP, 0))
    if now_epoch == epoch:
        return now_batch - batch
    if now_epoch != epoch + 1:
        return math.inf
    return int(position[DATA_NUM_BATCHES]) - batch + now_batch if DATA_NUM_BATCHES in position else now_batch


def script_location() -> str:
    """``file:line`` of the innermost caller outside hf_resumable, accelerate and torch (the training script)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class ResumedLoaders:
    """Where ``load_state`` put each prepared loader, to catch a script that skips again what its loader skipped.

    A skip by hand (more than one accumulation window drawn before the first backward) raises ``DoubleSkipError``;
    ``skip_first_batches(loader, n)`` repeated in a later epoch is found by :meth:`is_repeated_skip` and skips nothing,
    with a WARNING (the rules: docs/accelerate.md). Only loaders restored mid-epoch are watched.

    Example:

    ```python
    >>> watch = ResumedLoaders()
    >>> watch.is_repeated_skip(object(), 4)  # nothing was restored
    False

    ```
    """

    def __init__(self) -> None:
        self._restored: list[tuple[Any, int, int]] = []  # (loader, epoch, batch) restored mid-epoch by load_state
        self._armed = False  # the first backward after the resume has not happened yet
        self._warned: set[int] = set()

    def record(self, loaders: Iterable[Any]) -> None:
        """Remember where ``load_state`` just put ``loaders`` (each has ``position()``)."""
        self._restored = []
        for loader in loaders:
            position = loader.position()
            if int(position.get(DATA_STEP, 0)) > 0:
                self._restored.append((loader, int(position.get(DATA_EPOCH, 0)), int(position[DATA_STEP])))
        self._armed = bool(self._restored)

    def forget(self) -> None:
        """Stop watching (the loaders were freed)."""
        self._restored, self._armed = [], False

    def is_repeated_skip(self, loader: Any, num_batches: int) -> bool:
        """Whether ``skip_first_batches(loader, num_batches)`` repeats the resume skip in an epoch after the resumed
        one (the loader is between passes)."""
        for restored, epoch, batch in self._restored:
            if restored is loader and num_batches == batch:
                return int(loader.position().get(DATA_EPOCH, 0)) > epoch
        return False

    def warn_repeated_skip(self, loader: Any, num_batches: int) -> None:
        """The WARNING for a call :meth:`is_repeated_skip` found (once per loader)."""
        if id(loader) in self._warned:
            return
        self._warned.add(id(loader))
        epoch = next(e for restored, e, _ in self._restored if restored is loader)
        logger.warning(
            "skip_first_batches(loader, %d) at %s repeats the resume skip in a later epoch: load_state() restored "
            "this loader at batch %d of epoch %d and it continued there, so this epoch has nothing to skip; the call "
            "skips nothing (here and in later epochs). Call skip_first_batches only in the epoch the run resumed in "
            "(`if epoch == starting_epoch`), or not at all.", num_batches, script_location(), num_batches, epoch)

    def check_first_backward(self, window: int) -> None:
        """At the first backward after the resume: refuse if a restored loader had more than ``window`` batches
        drawn since.

        Raises:
            DoubleSkipError: the script threw away batches that the loader had already skipped.
        """
        if not self._armed:
            return
        self._armed = False
        for loader, epoch, batch in self._restored:
            drawn = _drawn_since(loader.position(), epoch, batch)
            if drawn > window:
                raise DoubleSkipError(
                    f"load_state() restored the training loader at batch {batch} of epoch {epoch}, and it continues "
                    f"there by itself; but {'the rest of that epoch' if drawn == math.inf else f'{drawn} batches'} "
                    f"were drawn from it before the first backward (a loop that trains what it draws takes at most "
                    f"{window}, one accumulation window). The script skips the trained batches again, as scripts "
                    "written for stock accelerate do (`if resume_step and step < resume_step: continue`), and they "
                    f"would never be trained. Remove that skip from the loop around {script_location()}; nothing was "
                    "trained yet.")
