"""Which blocks stay in memory and how many are read ahead, given a memory budget (pure: sizes in, plan out)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import MemoryBudgetError
from ..format.sharding import parse_size

logger = logging.getLogger(__name__)

__all__ = ["ResidencyPlan", "plan_residency", "smallest_budget"]

# Streamed blocks in memory at once when the budget allows read-ahead: the one running and the next one, read
# while it runs. More slots only help when reading is faster than computing, and then two already hide the reads.
PREFETCH_SLOTS = 2


@dataclass(frozen=True)
class ResidencyPlan:
    """Where each block's weights live while a streamed model runs.

    Args:
        resident (`tuple[int, ...]`): blocks loaded once and kept for the whole run.
        streamed (`tuple[int, ...]`): blocks read from the shards on every forward pass, in forward order.
        slots (`int`): streamed blocks in memory at once: ``2`` reads the next block while one runs, ``1`` reads
            each block just before it runs, ``0`` when nothing is streamed.
        weight_bytes (`int`): weight bytes held at the peak: the non-block weights, the resident blocks and
            ``slots`` of the largest streamed block.
        budget (`int`, *optional*): the budget in bytes (``None``: none was set).
    """

    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    slots: int
    weight_bytes: int
    budget: int | None = None

    @property
    def prefetch(self) -> bool:
        """Whether the next block is read while the current one runs."""
        return self.slots > 1


def smallest_budget(outside_bytes: int, block_bytes: Sequence[int]) -> int:
    """The smallest budget that runs the model: its non-block weights plus its largest block.

    Example:

    ```python
    >>> smallest_budget(100, [40, 50, 40])
    150

    ```
    """
    return outside_bytes + max(block_bytes, default=0)


def _spread(count: int, total: int) -> tuple[int, ...]:
    """``count`` block indices out of ``total``, evenly spaced, so the reader keeps reading while they run."""
    if count <= 0:
        return ()
    return tuple(sorted({min(total - 1, (2 * i + 1) * total // (2 * count)) for i in range(count)}))


def plan_residency(outside_bytes: int, block_bytes: Sequence[int], *, max_memory: int | str | None = None,
                   prefetch: bool = True, keep_resident: bool = False) -> ResidencyPlan:
    """Plan which blocks stay resident and how many are read ahead within ``max_memory`` bytes of weights.

    The non-block weights are always resident; then one slot for the block that runs, a second for the next one
    (``prefetch``) and, with ``keep_resident``, resident blocks spread over the depth of the model. A budget that
    holds every weight streams nothing. Why resident blocks are off by default: docs/streamed-inference.md.

    Args:
        outside_bytes (`int`): bytes of the weights outside the blocks.
        block_bytes (`Sequence[int]`): bytes of each block, in forward order.
        max_memory (`int` or `str`, *optional*): the budget for weights, as bytes or a string like ``"1GB"``
            (``None``: stream every block, with read-ahead when ``prefetch``).
        prefetch (`bool`, *optional*, defaults to `True`): read the next block while one runs, when it fits.
        keep_resident (`bool`, *optional*, defaults to `False`): fill the rest of the budget with resident blocks.

    Returns:
        [`ResidencyPlan`].

    Raises:
        MemoryBudgetError: if ``max_memory`` holds less than the non-block weights plus the largest block; the
            message names the smallest budget that works.
        ValueError: if ``max_memory`` cannot be parsed.

    Example:

    ```python
    >>> plan = plan_residency(100, [50] * 8, max_memory=300)
    >>> plan.resident, plan.slots, plan.weight_bytes
    ((), 2, 200)
    >>> plan_residency(100, [50] * 8, max_memory=300, keep_resident=True).resident
    (2, 6)
    >>> plan_residency(100, [50] * 8, max_memory=160).slots
    1

    ```
    """
    blocks = tuple(range(len(block_bytes)))
    largest = max(block_bytes, default=0)
    wanted_slots = PREFETCH_SLOTS if prefetch else 1
    if max_memory is None:
        slots = min(wanted_slots, len(blocks))
        return ResidencyPlan((), blocks, slots, outside_bytes + slots * largest)
    budget = parse_size(max_memory)
    minimum = smallest_budget(outside_bytes, block_bytes)
    if budget < minimum:
        raise MemoryBudgetError(
            f"max_memory={max_memory!r} ({budget:,} bytes) cannot hold the weights outside the blocks "
            f"({outside_bytes:,} bytes) plus one block ({largest:,} bytes). The smallest budget that works is "
            f"{minimum:,} bytes ({minimum / 1e9:.3f} GB); {minimum + largest:,} bytes also reads the next block "
            "while one runs. Pass max_memory of at least that."
        )
    if outside_bytes + sum(block_bytes) <= budget:
        return ResidencyPlan(blocks, (), 0, outside_bytes + sum(block_bytes), budget)
    slots = wanted_slots if budget >= outside_bytes + wanted_slots * largest else 1
    room = budget - outside_bytes - slots * largest
    resident = _spread(min(room // largest, len(blocks) - 1), len(blocks)) if keep_resident else ()
    streamed = tuple(i for i in blocks if i not in resident)
    slots = min(slots, len(streamed))
    used = outside_bytes + sum(block_bytes[i] for i in resident) + slots * max(block_bytes[i] for i in streamed)
    if slots == 1 and prefetch:
        logger.warning("max_memory=%s holds one streamed block at a time: each block is read just before it runs "
                       "(no read-ahead). %d bytes would read the next block while one runs.", max_memory,
                       outside_bytes + 2 * largest)
    return ResidencyPlan(resident, streamed, slots, used, budget)
