"""Read streamed blocks ahead of the forward pass on a background thread, at most ``slots`` blocks in memory."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["BlockPrefetcher"]

Block = dict[str, torch.Tensor]


class BlockPrefetcher:
    """A thread that reads the streamed blocks in forward order, cyclically, while earlier blocks compute.

    ``read(index)`` runs on the thread and returns a block's tensors (file reads release the GIL, so the read
    overlaps the running block's compute). A block occupies one of ``slots`` until :meth:`done` hands it back, so at
    most ``slots`` blocks are in memory (``1``: no read-ahead). The blocks are read in ``order`` (forward order); after
    the last one the thread goes on with the first: the next decoding step needs it, and reading it overlaps the
    head, the sampling and the embedding of the next token.

    :meth:`take` returns a block once read. Asked for a block other than the next in order (a pass that stopped
    half-way, or a caller running one block alone), it hands what was read ahead to ``discard(index, tensors)`` and
    restarts from that block. An error raised by ``read`` is raised again by :meth:`take`.

    Example:

    ```python
    >>> prefetcher = BlockPrefetcher([0, 1, 2], lambda i: {"w": torch.full((2,), float(i))}, lambda i, b: None,
    ...                              slots=2)
    >>> prefetcher.start()
    >>> prefetcher.take(0)["w"].tolist(), prefetcher.done(), prefetcher.take(1)["w"].tolist()
    ([0.0, 0.0], None, [1.0, 1.0])
    >>> prefetcher.close()

    ```
    """

    def __init__(self, order: Sequence[int], read: Callable[[int], Block], discard: Callable[[int, Block], None],
                 *, slots: int) -> None:
        if slots < 1 or not order:
            raise ValueError(f"BlockPrefetcher needs at least one block and one slot, got {len(order)} and {slots}.")
        self._order = list(order)
        self._position = {index: i for i, index in enumerate(self._order)}
        self._read, self._discard = read, discard
        self._free = threading.Semaphore(slots)
        self._cond = threading.Condition()
        self._ready: dict[int, Block] = {}
        self._next_read = 0  # position in _order the thread reads next
        self._next_take = 0  # position in _order the forward pass should ask for next
        self._epoch = 0  # bumped on a restart: blocks read for an older epoch are discarded
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hf_resumable-prefetch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._free.acquire()
            with self._cond:
                if self._stop:
                    return
                epoch, position = self._epoch, self._next_read
                self._next_read = (position + 1) % len(self._order)
            index = self._order[position]
            try:
                block = self._read(index)
            except BaseException as err:  # noqa: BLE001 - handed to the forward pass, which raises it
                with self._cond:
                    self._error = err
                    self._cond.notify_all()
                return
            with self._cond:
                if epoch == self._epoch and not self._stop:
                    self._ready[index] = block
                    self._cond.notify_all()
                    continue
            self._discard(index, block)
            self._free.release()

    def take(self, index: int) -> Block:
        """The tensors of block ``index``, waiting for the thread to read them.

        Raises:
            Exception: whatever reading the block raised (the original error, e.g. a corrupt shard).
        """
        with self._cond:
            if self._order[self._next_take] != index:
                self._restart(self._position[index])
            self._next_take = (self._position[index] + 1) % len(self._order)
            while index not in self._ready:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            return self._ready.pop(index)

    def _restart(self, position: int) -> None:
        """Drop the blocks read ahead and read on from ``position`` (holding the lock)."""
        logger.debug("prefetch restarts at block %d", self._order[position])
        self._epoch += 1
        for index, block in self._ready.items():
            self._discard(index, block)
            self._free.release()
        self._ready.clear()
        self._next_read = self._next_take = position

    def done(self) -> None:
        """A block taken has run and its memory is back in the pool: the thread may read one more."""
        self._free.release()

    def close(self) -> None:
        """Stop the thread and take back every block read ahead."""
        with self._cond:
            self._stop = True
            self._epoch += 1
        self._free.release()  # wake the thread if it waits for a slot
        if self._thread.ident is not None:
            self._thread.join()
        with self._cond:
            for index, block in self._ready.items():
                self._discard(index, block)
            self._ready.clear()
