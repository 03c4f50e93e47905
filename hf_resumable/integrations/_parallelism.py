"""accelerate's N-D layouts (``ParallelismConfig``) as the front doors need them, PURE: a process's data-parallel
rank, the layout a checkpoint records, and the layouts refused before step 1 (docs/multi-gpu.md).

accelerate builds its mesh as ``("dp_replicate", "dp_shard", "cp", "sp", "tp")`` (sizes of 1 left out) over ranks
in row-major order, so a process's data rank is its rank divided by the size of the other dimensions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedEngineError
from ._core import UpstreamInternalsError

logger = logging.getLogger(__name__)

__all__ = ["KEY_PARALLELISM", "ParallelLayout", "layout_of", "parse_layout", "data_parallel_rank",
           "accelerate_tp_ready", "check_runnable"]

KEY_PARALLELISM = "parallelism"  # in a run's recorded settings: ParallelLayout.describe() of its ParallelismConfig

# accelerate's canonical mesh order (``ParallelismConfig._get_mesh``): data-parallel dimensions first
_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The sizes of an N-D layout (1 for a dimension not used): data parallel replicated (``dp_replicate``) and
    sharded (``dp_shard``); context, sequence and tensor parallel (``cp``, ``sp``, ``tp``), whose groups' ranks read
    the same batches.

    Example:

    ```python
    >>> layout = ParallelLayout(dp_shard=2, tp=2)
    >>> layout.describe(), layout.data_rank(1), layout.data_rank(2), layout.data_world
    ('dp_shard=2 x tp=2', 0, 1, 2)
    ```
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in _ORDER:
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name} must be >= 1, got {getattr(self, name)}.")

    @property
    def world_size(self) -> int:
        return self.data_world * self.group_size

    @property
    def data_world(self) -> int:
        """How many data-parallel ranks read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def group_size(self) -> int:
        """How many processes read the same batches (one tensor/context/sequence-parallel group)."""
        return self.cp * self.sp * self.tp

    def data_rank(self, process_index: int) -> int:
        """The data-parallel rank of process ``process_index`` (its coordinate over the data dimensions)."""
        if not 0 <= process_index < self.world_size:
            raise ValueError(f"process {process_index} is not in the {self.describe()} layout of "
                             f"{self.world_size} processes.")
        return process_index // self.group_size

    def describe(self) -> str:
        """The layout as ``dp_shard=2 x tp=2`` (the dimensions larger than 1; ``dp_replicate=1`` when none is)."""
        used = [f"{name}={getattr(self, name)}" for name in _ORDER if getattr(self, name) > 1]
        return " x ".join(used) or "dp_replicate=1"


def layout_of(config: Any) -> ParallelLayout | None:
    """The :class:`ParallelLayout` of an accelerate ``ParallelismConfig`` (``None`` without one)."""
    if config is None:
        return None
    return ParallelLayout(**{name: int(getattr(config, f"{name}_size", 1) or 1) for name in _ORDER})


def parse_layout(text: str) -> ParallelLayout:
    """The layout :meth:`ParallelLayout.describe` wrote (pure): how a resume reads the layout a checkpoint recorded.

    Raises:
        ValueError: ``text`` is not a ``describe()`` of a layout (names the part that is not).

    Example:

    ```python
    >>> parse_layout("dp_replicate=2 x tp=2").data_world
    2
    ```
    """
    sizes: dict[str, int] = {}
    for part in text.split(" x "):
        name, _, size = part.partition("=")
        if name not in _ORDER or not size.isdigit() or name in sizes:
            raise ValueError(f"{text!r} is not a recorded ParallelismConfig layout ({part!r}: expected one of "
                             f"{', '.join(_ORDER)} as name=size, each once).")
        sizes[name] = int(size)
    return ParallelLayout(**sizes)


def data_parallel_rank(layout: ParallelLayout | None, *, process_index: int, world_size: int) -> tuple[int, int]:
    """A process's data-parallel rank and the number of data-parallel ranks under ``layout`` (pure): the rule both
    front doors shard their batches by. Without a layout (or one of another world size):
    ``(process_index, world_size)``.

    Example:

    ```python
    >>> data_parallel_rank(ParallelLayout(dp_replicate=2, tp=2), process_index=3, world_size=4)
    (1, 2)
    ```
    """
    if layout is None or layout.world_size != world_size:
        return process_index, world_size
    return layout.data_rank(process_index), layout.data_world


def accelerate_tp_ready() -> bool:
    """Whether accelerate's FSDP2 + tensor-parallel preparation can run with the installed transformers (accelerate
    1.16 imports transformers' ``ReplicateParallel``, which transformers 5 no longer has)."""
    try:
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    except ImportError:
        return False
    return True


def check_runnable(layout: ParallelLayout | None, *, device_type: str, fsdp2: bool, tp_ready: bool = True) -> None:
    """Refuse, before step 1, a layout that cannot train as it says (pure).

    * Context and sequence parallel run on accelerator devices only; on the CPU they are refused.
    * Data parallel beside tensor (or context) parallel without FSDP2: accelerate then averages no gradient over the
      data-parallel ranks, so their replicas drift apart and no checkpoint could hold them.
    * FSDP2 with tensor parallel where accelerate's preparation cannot run (``tp_ready``:
      :func:`accelerate_tp_ready`).

    Raises:
        UnsupportedEngineError: ``cp`` or ``sp`` larger than 1 on the CPU; data and tensor parallel without FSDP2.
        UpstreamInternalsError: FSDP2 with tensor parallel when ``tp_ready`` is false (also an ``ImportError``).

    Example:

    ```python
    >>> check_runnable(ParallelLayout(dp_shard=2, tp=2), device_type="cpu", fsdp2=True)
    >>> check_runnable(ParallelLayout(dp_shard=2, cp=2), device_type="cpu", fsdp2=True)
    Traceback (most recent call last):
    ...
    hf_resumable.errors.UnsupportedEngineError: ParallelismConfig dp_shard=2 x cp=2: context parallel ...
    ```
    """
    if layout is None:
        return
    for name, what in (("cp", "context parallel"), ("sp", "sequence parallel")):
        if getattr(layout, name) > 1 and device_type == "cpu":
            raise UnsupportedEngineError(
                f"ParallelismConfig {layout.describe()}: {what} ({name}_size={getattr(layout, name)}) runs on GPUs "
                f"only (torch's ring attention / DeepSpeed's Ulysses); on the CPU ResumableAccelerator refuses it "
                f"before step 1. Run it on GPUs, or set {name}_size=1 (dp_shard and tp train on the CPU).")
    if layout.data_world > 1 and layout.group_size > 1 and not fsdp2:
        raise UnsupportedEngineError(
            f"ParallelismConfig {layout.describe()} without an FSDP2 plugin: accelerate averages no gradient over the "
            f"{layout.data_world} data-parallel ranks under tensor/context parallel, so their replicas would drift "
            "apart and no checkpoint could hold them. Nothing was trained. Pass "
            "fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...) with dp_shard_size > 1.")
    if fsdp2 and layout.tp > 1 and not tp_ready:
        import accelerate
        import transformers

        sizes = {"tp_size": layout.tp, "fsdp_size": layout.dp_shard, "dp_replicate_size": layout.dp_replicate}
        distributed = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)
        raise UpstreamInternalsError(
            f"ParallelismConfig {layout.describe()}: accelerate {accelerate.__version__} prepares FSDP2 beside tensor "
            "parallel with transformers.integrations.tensor_parallel.ReplicateParallel, which transformers "
            f"{transformers.__version__} does not have, so prepare() cannot run (stock accelerate stops there with "
            "an ImportError). Nothing was trained. To fix it: pin a transformers release that still has "
            "ReplicateParallel beside this accelerate (or an accelerate that no longer imports it), or train this "
            f"layout with ResumableTrainer and a model loaded with DistributedConfig({distributed}), which resumes "
            "it; tensor parallel alone (tp_size) and FSDP2 alone (dp_replicate_size x dp_shard_size) also run "
            "through ResumableAccelerator.")
