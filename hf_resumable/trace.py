"""The per-step trace that ``hf-resumable check`` compares: written only when ``HF_RESUMABLE_TRACE`` names a directory.

With the variable unset every hook below returns after one check of a module global and no optimizer or module hook
is installed, so training is unchanged. With it set, each process appends JSON lines (flushed per line, so a SIGKILL
loses nothing already written) to ``<dir>/rank-<rank>.jsonl``; the records and the other ``HF_RESUMABLE_TRACE_*``
variables: docs/check.md#the-trace.

Example:

```python
>>> from hf_resumable import trace
>>> trace.is_enabled()  # HF_RESUMABLE_TRACE is not set
False
```
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

logger = logging.getLogger(__name__)

__all__ = ["TRACE_ENV", "ATTEMPT_ENV", "STOP_ENV", "WEIGHTS_ENV", "OUT_ENV", "is_enabled", "traced_batches", "on_load",
           "on_save", "on_loss", "on_logs", "on_metrics", "read_trace", "trace_file"]

TRACE_ENV = "HF_RESUMABLE_TRACE"  # directory of the trace; unset: tracing is off
ATTEMPT_ENV = "HF_RESUMABLE_TRACE_ATTEMPT"  # launch number within one run (0: first launch)
STOP_ENV = "HF_RESUMABLE_TRACE_STOP"  # park the process at this event until it is killed
WEIGHTS_ENV = "HF_RESUMABLE_TRACE_WEIGHTS"  # "step" (default) or "checkpoint": when to digest parameters
OUT_ENV = "HF_RESUMABLE_TRACE_OUT"  # the run's {out} directory (printed lines name it "{out}")

_UNSEEDED_SEED = 0x5EED  # python's and numpy's global generators under a trace (see _start)
_MAX_LINE = 400  # characters of a printed line that are kept
_OWN_LOGGERS = ("hf_resumable",)  # the library's own log records are about checkpoints, not training: not recorded

# Logged values that measure time, not training: never compared.
TIMING_METRICS = ("_runtime", "_per_second", "_time")


def trace_file(directory: str | os.PathLike, rank: int) -> Path:
    """The JSON-lines file of ``rank`` in a trace directory."""
    return Path(directory) / f"rank-{rank:05d}.jsonl"


# ------------------------------------------------------------------------------------------------ digests
def _tensor_digest(tensor: torch.Tensor) -> str:
    tensor = tensor.detach()
    if hasattr(tensor, "to_local"):  # a DTensor: this rank's piece
        tensor = tensor.to_local()
    tensor = tensor.cpu().contiguous().reshape(-1)
    digest = xxhash.xxh3_64(f"{tensor.dtype}:{tensor.numel()}".encode())
    if tensor.numel():
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _value_digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if isinstance(value, np.ndarray):
        return _tensor_digest(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, float):
        return value.hex()
    text = repr(value)
    if " at 0x" in text:  # an object's address differs in every process: only its type is compared
        text = type(value).__qualname__
    return xxhash.xxh3_64(text.encode()).hexdigest()


def digest_batch(batch: Any, prefix: str = "") -> dict[str, str]:
    """``{path: digest}`` of every leaf of a batch (dicts by key, sequences by index)."""
    if isinstance(batch, Mapping):
        items = [(f"{prefix}{key}", value) for key, value in batch.items()]
    elif isinstance(batch, (list, tuple)) and not (batch and all(isinstance(v, (int, float)) for v in batch)):
        items = [(f"{prefix}{index}", value) for index, value in enumerate(batch)]
    else:
        return {prefix or "batch": _value_digest(batch)}
    found: dict[str, str] = {}
    for key, value in items:
        if isinstance(value, (Mapping, list, tuple)):
            found.update(digest_batch(value, f"{key}."))
        else:
            found[key] = _value_digest(value)
    return found


def digest_rng() -> dict[str, str]:
    """Digests of the global generators: python, numpy, torch CPU and every initialized CUDA device."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    found = {"python": xxhash.xxh3_64(repr((version, state, gauss)).encode()).hexdigest(),
             "numpy": xxhash.xxh3_64(keys.tobytes() + repr((name, pos, has_gauss, cached)).encode()).hexdigest(),
             "torch": _tensor_digest(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            found[f"cuda:{index}"] = _tensor_digest(state)
    return found


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def digest_optimizer(optimizer: torch.optim.Optimizer, *, tensors: bool) -> dict[str, Any]:
    """Learning rates (``float.hex``), and digests of the other group settings, the parameters and the state."""
    found: dict[str, Any] = {"lr": [float(group.get("lr", 0.0)).hex() for group in optimizer.param_groups],
                             "hyper": _value_digest([sorted((k, repr(v)) for k, v in group.items()
                                                            if k not in ("params", "lr"))
                                                     for group in optimizer.param_groups])}
    if tensors:
        weights, state = xxhash.xxh3_64(), xxhash.xxh3_64()
        for param in _optimizer_params(optimizer):
            weights.update(_tensor_digest(param).encode())
            for key in sorted(optimizer.state.get(param, {}), key=str):
                state.update(f"{key}={_value_digest(optimizer.state[param][key])};".encode())
        found.update(weights=weights.hexdigest(), optimizer=state.hexdigest())
    return found


# ------------------------------------------------------------------------------------------------ the writer
class _Tracer:
    """One process's trace: the file, the step counter and the stop point."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
        self.stop = os.environ.get(STOP_ENV) or None
        self.per_step = os.environ.get(WEIGHTS_ENV, "step") != "checkpoint"
        self.out = os.environ.get(OUT_ENV) or None
        self.completed = 0  # optimizer steps completed (set from the checkpoint on resume)
        self.micro = 0  # batches yielded since the last optimizer step
        self.losses = 0  # losses backpropagated since the last optimizer step
        self.forwards = 0  # training forward passes since the last optimizer step
        self.trained = False  # a training forward pass has run in this process
        self.depth = 0  # module calls in progress (a forward pass is a call at depth 0)
        self.saves = 0
        self.logs_seen: int | None = None  # entries of the Trainer's log history already recorded
        self.primary: int | None = None  # id() of the optimizer whose steps are counted
        # that optimizer, for the digests at exit (held: the script's references are gone by then)
        self.primary_optimizer: torch.optim.Optimizer | None = None
        self.in_library_loader = 0  # > 0 while a library loader fetches its next batch (recorded by that loader)
        self.pending_batch: dict[str, str] | None = None  # the last batch another DataLoader yielded
        self.pending_loss: float | None = None  # the unscaled loss ResumableAccelerator.backward is given
        self._handle = None
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child (a DataLoader worker) writes nothing

    def rank(self) -> int:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return int(os.environ.get("RANK", "0"))

    def write(self, record: dict[str, Any]) -> None:
        if os.getpid() != self._pid:
            return
        record = {**record, "rank": self.rank(), "attempt": self.attempt, "pid": os.getpid()}
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock:
            if self._handle is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._handle = open(trace_file(self.directory, record["rank"]), "a", encoding="utf-8")  # noqa: SIM115
            self._handle.write(line)
            self._handle.flush()

    def park_if(self, event: str) -> None:
        """At the configured stop point: record it, then wait (forever) for the check to kill this process."""
        if self.stop != event:
            return
        self.write({"kind": "stop", "at": event})
        logger.warning("hf-resumable check: parked at %s, waiting to be killed", event)
        threading.Event().wait()

    def before_forward(self, _module: Any, _args: Any) -> None:
        if self.depth == 0:
            pending, self.pending_batch = self.pending_batch, None  # an evaluation batch is dropped here too
            if torch.is_grad_enabled():  # a training forward pass (evaluation runs without grad)
                step = self.completed + 1
                if pending is not None:
                    self.write({"kind": "batch", "source": "DataLoader", "step": step, "micro": self.forwards,
                                "batch": pending})
                    self.park_if(f"batch:{step}:{self.forwards}")
                self.write({"kind": "forward", "step": step, "micro": self.forwards, "rng": digest_rng()})
                self.forwards += 1
                self.trained = True
        self.depth += 1

    def after_forward(self, _module: Any, args: Any, kwargs: Any, _output: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and torch.is_grad_enabled() and self.forwards:
            inputs = {**digest_batch(list(args), "arg."), **digest_batch(dict(kwargs or {}))}
            self.write({"kind": "inputs", "step": self.completed + 1, "micro": self.forwards - 1, "inputs": inputs})

    def after_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if not self.trained:  # before any training forward pass: an engine initializing its state (DeepSpeed ZeRO
            return  # steps its optimizer once with zero gradients while it loads a checkpoint), not a training step
        if self.primary is None:
            self.primary, self.primary_optimizer = id(optimizer), optimizer
        if id(optimizer) != self.primary:
            return
        self.completed += 1
        self.micro = self.losses = self.forwards = self.depth = 0
        self.write({"kind": "update", "step": self.completed,
                    **digest_optimizer(optimizer, tensors=self.per_step)})
        self.park_if(f"update:{self.completed}")

    def at_exit(self) -> None:
        """Without per-step digests: the weights and optimizer state as the process ends (the final ones)."""
        optimizer = self.primary_optimizer
        if self.per_step or optimizer is None:
            return
        record = {"kind": "final", "step": self.completed, **digest_optimizer(optimizer, tensors=True)}
        record.pop("lr")
        self.write(record)

    def on_backward(self, tensors: Any) -> None:
        if not (isinstance(tensors, torch.Tensor) and tensors.numel() == 1):
            return
        value = self.pending_loss if self.pending_loss is not None else float(tensors.detach().float())
        self.pending_loss = None
        self.write({"kind": "loss", "step": self.completed + 1, "micro": self.losses,
                    "metrics": {"loss": value.hex()}})
        self.losses += 1

    def on_text(self, line: str, source: str) -> None:
        """A printed line or a log message: recorded when it holds a number (nothing else could be compared)."""
        line = line.strip()
        if not line or not any(char.isdigit() for char in line) or os.getpid() != self._pid:
            return
        if self.out:
            line = line.replace(self.out, "{out}")
        # a line printed right after an optimizer step (nothing of the next one has run yet) reports that step
        after_update = self.completed and not (self.forwards or self.micro or self.losses)
        self.write({"kind": "print", "source": source, "step": self.completed + (0 if after_update else 1),
                    "text": line[:_MAX_LINE]})


class _StdoutTap:
    """``sys.stdout`` that also hands each complete line to the tracer (every attribute is the stream's)."""

    def __init__(self, stream: Any, tracer: _Tracer) -> None:
        self._stream, self._tracer, self._partial = stream, tracer, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        if isinstance(text, str):
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self._tracer.on_text(line, "stdout")
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _tap_data_loaders(tracer: _Tracer) -> None:
    """Each batch any DataLoader iterator returns outside a library loader is kept for the next forward pass."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    original = _BaseDataLoaderIter.__next__

    def __next__(self: Any) -> Any:
        batch = original(self)
        if tracer.in_library_loader == 0:
            tracer.pending_batch = digest_batch(batch)
        return batch

    _BaseDataLoaderIter.__next__ = __next__


def _tap_backward(tracer: _Tracer) -> None:
    """``torch.autograd.backward`` (which ``Tensor.backward`` calls) records the scalar it backpropagates."""
    original = torch.autograd.backward

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        tracer.on_backward(tensors)
        return original(tensors, *args, **kwargs)

    torch.autograd.backward = backward


def _tap_text(tracer: _Tracer) -> None:
    """stdout lines and the log records loggers handle (a record below a logger's level never reaches handle)."""
    sys.stdout = _StdoutTap(sys.stdout, tracer)
    original = logging.Logger.handle

    def handle(self: logging.Logger, record: logging.LogRecord) -> Any:
        if not record.name.startswith(_OWN_LOGGERS):
            try:
                tracer.on_text(f"{record.name}: {record.getMessage()}", "logging")
            except (TypeError, ValueError):  # a malformed message: logging reports it itself
                pass
        return original(self, record)

    logging.Logger.handle = handle


def _start() -> _Tracer | None:
    directory = os.environ.get(TRACE_ENV)
    if not directory:
        return None
    tracer = _Tracer(Path(directory))
    # python's and numpy's global generators start from the OS's entropy (torch's from a fixed seed): fix them, so
    # that a script that never seeds them (and may never use them) does not differ from itself in every run
    random.seed(_UNSEEDED_SEED)
    np.random.seed(_UNSEEDED_SEED)
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(tracer.after_step)
    register_module_forward_pre_hook(tracer.before_forward)  # the RNG state right before each forward pass
    register_module_forward_hook(tracer.after_forward, with_kwargs=True)
    _tap_data_loaders(tracer)
    _tap_backward(tracer)
    _tap_text(tracer)
    import atexit

    atexit.register(tracer.at_exit)
    return tracer


_TRACER: _Tracer | None = _start()


def is_enabled() -> bool:
    """Whether this process writes a trace (``HF_RESUMABLE_TRACE`` was set when hf_resumable was imported)."""
    return _TRACER is not None


# ------------------------------------------------------------------------------------------------ hooks
def traced_batches(batches: Iterator[Any]) -> Iterator[Any]:
    """``batches`` itself when tracing is off; else a generator that records each batch as it is yielded."""
    if _TRACER is None:
        return batches
    return _traced(_TRACER, batches)


def _traced(tracer: _Tracer, batches: Iterator[Any]) -> Iterator[Any]:
    iterator = iter(batches)
    while True:
        tracer.in_library_loader += 1  # the DataLoader iterators it draws from are not recorded a second time
        try:
            batch = next(iterator)
        except StopIteration:
            return
        finally:
            tracer.in_library_loader -= 1
        step, micro = tracer.completed + 1, tracer.micro
        tracer.micro += 1
        tracer.write({"kind": "batch", "step": step, "micro": micro, "batch": digest_batch(batch)})
        tracer.park_if(f"batch:{step}:{micro}")
        yield batch


def on_load(step: int | None, optimizer: torch.optim.Optimizer | None) -> None:
    """A checkpoint of ``step`` was loaded: the step counter continues from it."""
    if _TRACER is None:
        return
    _TRACER.completed, _TRACER.micro, _TRACER.losses, _TRACER.forwards = int(step or 0), 0, 0, 0
    record: dict[str, Any] = {"kind": "resume", "step": _TRACER.completed}
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):  # accelerate's wrapper
        optimizer = optimizer.optimizer
    if optimizer is not None:
        _TRACER.primary, _TRACER.primary_optimizer = id(optimizer), optimizer
        record.update(digest_optimizer(optimizer, tensors=True))
        record.pop("lr")  # the scheduler has already moved it on to the next step's value
    _TRACER.write(record)


def on_save(step: int | None) -> None:
    """A save's files are written and not yet committed (the check's "inside a save" kill point)."""
    if _TRACER is None:
        return
    _TRACER.saves += 1
    _TRACER.write({"kind": "save", "index": _TRACER.saves, "step": step})
    _TRACER.park_if(f"save:{_TRACER.saves}")


def on_loss(loss: torch.Tensor) -> None:
    """The loss ``ResumableAccelerator.backward`` is given, before its scaling: recorded at its backward pass."""
    if _TRACER is None:
        return
    _TRACER.pending_loss = float(loss.detach().float())


def on_logs(history: Sequence[Mapping[str, Any]]) -> None:
    """New entries of a Trainer's ``state.log_history`` (restored entries of earlier steps are skipped)."""
    if _TRACER is None:
        return
    seen = _TRACER.logs_seen
    if seen is None:  # the first call of this process: what is there came from the checkpoint
        seen = sum(1 for entry in history if int(entry.get("step", 0)) <= _TRACER.completed - 1)
    for entry in history[seen:]:
        _TRACER.write({"kind": "log", "step": int(entry.get("step", 0)), "metrics": _metric_values(entry)})
    _TRACER.logs_seen = len(history)


def on_metrics(values: Mapping[str, Any], step: int | None) -> None:
    """Metrics a script logs (``ResumableAccelerator.log``), at its ``step`` or else at the optimizer steps done."""
    if _TRACER is None:
        return
    _TRACER.write({"kind": "log", "step": _TRACER.completed if step is None else int(step),
                   "metrics": _metric_values(values)})


def _metric_values(values: Mapping[str, Any]) -> dict[str, str]:
    """Each logged value as compared: a float (or a one-element tensor) as ``float.hex``; timings left out."""
    found = {}
    for key, value in values.items():
        if key == "step" or key.endswith(TIMING_METRICS):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, float):
            found[key] = value.hex()
        else:
            found[key] = repr(value) if isinstance(value, (int, str, bool, type(None))) else _value_digest(value)
    return found


# ------------------------------------------------------------------------------------------------ reading
def read_trace(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a trace directory, rank files in rank order, each in the order written.

    A last line cut short by a kill is dropped.
    """
    records: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.endswith("\n"):
                records.append(json.loads(line))
    return records
