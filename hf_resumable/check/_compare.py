"""PURE: two traces (an uninterrupted reference and an interrupted run) -> every difference, the first one, its cause.

A trace is the list of records :mod:`hf_resumable.trace` writes. Records are keyed by what they describe, never by
when they were written: a batch by ``(rank, optimizer step, micro-batch, loader kind)``, an optimizer update by
``(rank, step)``, a logged metric by ``(rank, step, n-th log of that step)``, a printed line by ``(rank, step,
its template, n-th line of that template in the step)`` (:mod:`._printed`). A printed number that already differs
in the killed launch, before any kill or resume, measures something else than training (a time, a port): its
template is not compared in that run. Every record of every launch of the
interrupted run is compared with the reference's record of the same key (steps redone after a resume are compared
too), and every update and log of the reference must appear in some launch. A checkpoint load (``resume``) is
compared with the reference's update of the step it restores.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._printed import split_numbers

logger = logging.getLogger(__name__)

__all__ = ["Difference", "Comparison", "compare_traces", "likely_cause", "CATEGORIES"]

# What differed, in the order a step computes it: the state it starts from, its batches and the RNG before each
# forward pass, the losses, the update (learning rate, settings, weights, optimizer state), what it logged.
CATEGORIES = {
    "restored-weights": "the weights restored from the checkpoint",
    "restored-optimizer": "the optimizer state restored from the checkpoint",
    "restored-hyper": "the optimizer settings restored from the checkpoint",
    "batch": "the batch (data order or collation randomness)",
    "inputs": "the model's inputs (the batch as the forward pass received it)",
    "rng": "the RNG state before the forward pass",
    "loss": "the loss",
    "lr": "the learning rate (the optimizer step of the schedule)",
    "hyper": "the optimizer settings",
    "weights": "the weights",
    "optimizer": "the optimizer state",
    "metric": "only a logged metric",
    "printed": "only a printed or logged number",
    "missing": "a step or log the reference has (the interrupted run never produced it)",
    "extra": "a step or log the reference does not have",
}
_ORDER = {name: index for index, name in enumerate(CATEGORIES)}
README_SECTION = "README.md, section \"Check your own script\""
_MOVED = "the data order"  # in a batch's detail: the batch is one the reference used at another step


@dataclass(frozen=True)
class Difference:
    """One difference between the interrupted run and the reference.

    Args:
        step (`int`): the optimizer step it belongs to (a restored state belongs to the step after the checkpoint).
        rank (`int`): the process rank.
        attempt (`int`): which launch of the interrupted run (0: the one that was killed).
        category (`str`): a key of `CATEGORIES`.
        detail (`str`): which tensor, generator, metric or micro-batch.
        resumed_from (`int`, *optional*): the checkpoint step this launch resumed from (None: it started fresh).
    """

    step: int
    rank: int
    attempt: int
    category: str
    detail: str
    resumed_from: int | None = None
    micro: int = field(default=0, compare=False)

    def sort_key(self) -> tuple[int, int, int, int, int]:
        return self.step, self.micro if self.category in ("batch", "inputs", "rng", "loss") else 0, \
            _ORDER[self.category], self.rank, self.attempt

    def describe(self) -> str:
        where = f"rank {self.rank}, launch {self.attempt}"
        where += f", resumed from step {self.resumed_from}" if self.resumed_from is not None else ", not resumed"
        return f"{CATEGORIES[self.category]}: {self.detail} ({where})"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "attempt": self.attempt, "category": self.category,
                "what": CATEGORIES[self.category], "detail": self.detail, "resumed_from": self.resumed_from}


@dataclass(frozen=True)
class Comparison:
    """Every difference, sorted (first = earliest step, then in the order the step computes things)."""

    differences: tuple[Difference, ...]  # sorted
    steps: int  # optimizer steps of the reference (rank 0)
    compared: int  # records of the interrupted run that were compared

    @property
    def exact(self) -> bool:
        return not self.differences

    @property
    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    def at_first_step(self) -> list[Difference]:
        """Every difference at the first differing step (the same rank first)."""
        if not self.differences:
            return []
        first = self.differences[0]
        return [d for d in self.differences if d.step == first.step and d.attempt == first.attempt]


def _key(record: Mapping[str, Any], logs: Counter) -> tuple | None:
    kind, rank, step = record["kind"], record.get("rank", 0), record.get("step")
    if kind == "batch":
        return kind, rank, step, record.get("micro", 0), record.get("source", "library")
    if kind in ("forward", "inputs", "loss"):
        return kind, rank, step, record.get("micro", 0)
    if kind in ("update", "final"):
        return kind, rank, step
    if kind == "log":
        logs[(rank, step)] += 1
        return kind, rank, step, logs[(rank, step)]
    if kind == "print":
        template = (record.get("source", "stdout"), split_numbers(record["text"])[0])
        logs[(rank, step, template)] += 1
        return kind, rank, step, template, logs[(rank, step, template)]
    return None


def _index(records: Iterable[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
    logs: Counter = Counter()
    keyed = {}
    for record in records:
        key = _key(record, logs)
        if key is not None:
            keyed.setdefault(key, record)
    return keyed


def _positions(reference: Iterable[Mapping[str, Any]]) -> dict[tuple, tuple[int, int]]:
    """Where each batch (and model input) of the reference was used: ``(kind, rank, digests) -> (step, micro)``."""
    found: dict[tuple, tuple[int, int]] = {}
    for record in reference:
        if record["kind"] in ("batch", "inputs"):
            digests = record.get("batch") or record.get("inputs") or {}
            found.setdefault((record["kind"], record.get("rank", 0), tuple(sorted(digests.items()))),
                             (record["step"], record.get("micro", 0)))
    return found


def _unstable_prints(reference: dict[tuple, Mapping[str, Any]], run: Iterable[Mapping[str, Any]]) -> set[tuple]:
    """Templates whose numbers differ in the killed launch, before any kill or resume: not training values."""
    unstable, logs = set(), Counter()
    for record in run:
        if record["kind"] != "print" or record.get("attempt", 0) != 0:
            continue
        key = _key(record, logs)
        ref = reference.get(key)
        if ref is not None and split_numbers(ref["text"])[1] != split_numbers(record["text"])[1]:
            unstable.add(key[3])
    return unstable


def _differing(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Names whose values differ between two ``{name: digest}`` maps (a name on one side only differs too)."""
    return sorted(name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name))


def _moved(record: Mapping[str, Any], digests: Mapping[str, str], positions: Mapping[tuple, tuple[int, int]]) -> str:
    """`` (it is the reference's batch of step S, micro-batch M)`` when the same digests were used elsewhere."""
    where = positions.get((record["kind"], record.get("rank", 0), tuple(sorted(digests.items()))))
    if where is None or where == (record["step"], record.get("micro", 0)):
        return ""
    return f" (it is the reference's {record['kind']} of step {where[0]}, micro-batch {where[1]}: {_MOVED})"


def _compare_record(record: Mapping[str, Any], ref: Mapping[str, Any],
                    positions: Mapping[tuple, tuple[int, int]]) -> list[tuple[str, str]]:
    """``[(category, detail)]`` for one record against the reference's record of the same key."""
    kind = record["kind"]
    micro = f"micro-batch {record.get('micro', 0)}"
    if kind in ("batch", "inputs"):
        names = _differing(record[kind], ref[kind])
        source = f" of the script's {record['source']}" if record.get("source") else ""
        return [(kind, f"{micro}{source}: {', '.join(names)}{_moved(record, record[kind], positions)}")] \
            if names else []
    if kind == "forward":
        names = _differing(record["rng"], ref["rng"])
        return [("rng", f"forward pass {record.get('micro', 0)}: {', '.join(names)} generator")] if names else []
    if kind == "print":
        ours, theirs = split_numbers(ref["text"])[1], split_numbers(record["text"])[1]
        return [] if ours == theirs else [("printed", f"{record.get('source', 'stdout')} line {ref['text']!r} in "
                                                      f"the reference, {record['text']!r} here")]
    if kind in ("loss", "log"):
        names = [name for name in _differing(record["metrics"], ref["metrics"])]
        if not names:
            return []
        shown = ", ".join(f"{n} {_readable(ref['metrics'].get(n))} -> {_readable(record['metrics'].get(n))}"
                          for n in names[:4])
        return [("loss" if kind == "loss" else "metric", f"{micro}: {shown}" if kind == "loss" else shown)]
    found = []
    if record.get("lr") != ref.get("lr"):
        found.append(("lr", f"{[_readable(v) for v in ref.get('lr') or []]} in the reference, "
                            f"{[_readable(v) for v in record.get('lr') or []]} here"))
    when = "after the optimizer step" if kind == "update" else "at the end of training"
    for name in ("hyper", "weights", "optimizer"):
        if name in record and name in ref and record[name] != ref[name]:
            found.append((name, when if name != "hyper" else "param_groups (not lr)"))
    return found


def _readable(value: Any) -> str:
    if isinstance(value, str):
        try:
            return repr(float.fromhex(value))
        except ValueError:
            return value
    return repr(value)


def _compare_resume(record: Mapping[str, Any], ref: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    step = record["step"]
    if ref is None:
        return [("missing", f"the run resumed from step {step}, which the reference never completed")]
    found = []
    for name in ("weights", "optimizer", "hyper"):
        if name in record and name in ref and record[name] != ref[name]:
            found.append((f"restored-{name}", f"loaded from the checkpoint of step {step}, not equal to the "
                                              f"reference after step {step}"))
    return found


def compare_traces(reference: list[Mapping[str, Any]], run: list[Mapping[str, Any]]) -> Comparison:
    """Compare an interrupted run's trace (all its launches) with the reference's.

    Args:
        reference (`list[dict]`): the uninterrupted run's records (one launch).
        run (`list[dict]`): the interrupted run's records, every launch (``attempt``) of it.

    Returns:
        `Comparison`: every difference, sorted; ``first`` is the one to report.

    Example:

    ```python
    >>> ref = [{"kind": "update", "rank": 0, "attempt": 0, "step": 1, "lr": ["0x1p-10"]}]
    >>> compare_traces(ref, ref).exact
    True
    >>> bad = [{"kind": "update", "rank": 0, "attempt": 1, "step": 1, "lr": ["0x1p-9"]}]
    >>> compare_traces(ref, bad).first.category
    'lr'
    ```
    """
    ref_index = _index(reference)
    positions = _positions(reference)
    unstable = _unstable_prints(ref_index, run)
    differences: list[Difference] = []
    seen: set[tuple] = set()
    compared = 0
    for attempt in sorted({record.get("attempt", 0) for record in run}):
        records = [r for r in run if r.get("attempt", 0) == attempt]
        resumed = {r.get("rank", 0): r["step"] for r in records if r["kind"] == "resume"}

        def add(record: Mapping[str, Any], found: list[tuple[str, str]], step: int) -> None:
            rank = record.get("rank", 0)
            differences.extend(Difference(step=step, rank=rank, attempt=attempt, category=category, detail=detail,
                                          resumed_from=resumed.get(rank), micro=record.get("micro", 0))
                               for category, detail in found)

        logs: Counter = Counter()
        for record in records:
            if record["kind"] == "resume":
                compared += 1
                add(record, _compare_resume(record, ref_index.get(("update", record.get("rank", 0),
                                                                   record["step"]))), record["step"] + 1)
                continue
            key = _key(record, logs)
            if key is None or (record["kind"] == "print" and key[3] in unstable):
                continue
            ref = ref_index.get(key)
            if record["kind"] in ("print", "final") and ref is None:  # a line only this launch prints, the state
                continue  # of a launch that exits early (SIGTERM): nothing to compare
            compared += 1
            seen.add(key)
            if ref is None:
                add(record, [("extra", f"{record['kind']} record (the reference has none at this step)")],
                    record["step"])
            else:
                add(record, _compare_record(record, ref, positions), record["step"])
    for key, ref in ref_index.items():
        if key not in seen and ref["kind"] in ("update", "log", "final"):
            what = {"update": "the optimizer step", "final": "the end of training"}.get(
                ref["kind"], f"log entry {key[-1]} of this step")
            differences.append(Difference(step=key[2], rank=key[1], attempt=-1, category="missing",
                                          detail=f"{what} never ran in any launch"))
    steps = len({r["step"] for r in reference if r["kind"] == "update" and r.get("rank", 0) == 0})
    return Comparison(differences=tuple(sorted(differences, key=Difference.sort_key)), steps=steps,
                      compared=compared)


# ------------------------------------------------------------------------------------------------ causes
_GENERATOR_CAUSE = (
    "a generator the library cannot see: the data order or the collator/data set draws from a generator that is "
    "neither the global one nor reachable from the collator or data set, e.g. a module-level "
    "numpy.random.default_rng(...), random.Random(...) or torch.Generator() in the script, so it restarts from its "
    "seed after a restart. Make it an attribute of the collator (or data set), or draw from the global generators; "
    f"see {README_SECTION}")
_CAUSES = {
    "restored-weights": "the model is not restored: load_checkpoint(model=...) is not called on the model that is "
                        "trained, or the weights are re-initialized or changed after loading",
    "restored-optimizer": "the optimizer state is not restored: pass optimizer= to load_checkpoint (the same "
                          "optimizer object that is stepped), and do not rebuild it after loading",
    "restored-hyper": "optimizer settings differ after the load: the script changes param_groups after loading",
    "rng": "the global RNG state does not resume: the script seeds or draws from a global generator after "
           "load_checkpoint (e.g. set_seed after loading), or loads without restoring the RNG (restore_rng=False)",
    "loss": "the loss differs while the batch and RNG were equal: the forward pass depends on state outside the "
            "checkpoint (a module attribute, a buffer not in the state dict) or on nondeterministic kernels",
    "lr": "the learning-rate schedule does not resume: the scheduler is not restored (pass scheduler= to "
          "load_checkpoint, and save it), or it is stepped a different number of times after a restart",
    "hyper": "the optimizer's param_groups settings change differently after a restart (set them before "
             "load_checkpoint, or save the object that changes them)",
    "weights": "the update differs while its inputs were equal: something the step uses is not in the checkpoint "
               "(gradients accumulated before the save, an EMA, a GradScaler that is not saved) or the kernels are "
               "nondeterministic",
    "optimizer": "the optimizer state differs after an update whose inputs were equal: the optimizer keeps state "
                 "outside its state_dict, or the kernels are nondeterministic",
    "metric": "a logged value is computed from state the checkpoint does not hold (a running average or counter "
              "in the script), while the training itself is exact",
    "missing": "the resumed run does not continue where the checkpoint stopped: its data position or step "
               "counter is not restored (pass data_state= / the library's data loader), or it stops early",
    "extra": "the resumed run repeats or adds steps: its step counter or data position is not restored",
    "printed": "a number the script prints or logs is computed from state the checkpoint does not hold (a running "
               "average, a counter or a generator of the script), while everything the library traces is exact",
    "inputs": "the batch the data loader yielded was equal, but the model received different inputs: a transform "
              "in the training loop draws from a generator the library cannot see (a module-level "
              "numpy.random.default_rng(...), random.Random(...) or torch.Generator()), so it restarts from its "
              "seed after a restart. Draw from the global generators, which the checkpoint restores, or save and "
              f"restore that generator's state; see {README_SECTION}",
}
_ORDER_CAUSE = ("the data position does not resume: after the restart the loader yields batches the reference used "
                "at other steps (a plain DataLoader restarts from its beginning, or its shuffle order is drawn anew). "
                "Build it with hf_resumable.data.build_map_dataloader (or ResumableAccelerator.prepare) and resume "
                f"its position, or skip to the saved position yourself; see {README_SECTION}")
_LOADER_GENERATOR_CAUSE = (
    "randomness in the data pipeline that is not restored: the script's own DataLoader yields different data at "
    "this step (an unseeded transform, or a data set / collate function that draws from a generator the library "
    "cannot see, e.g. a module-level numpy.random.default_rng(...)). Draw from the global generators, or use "
    f"hf_resumable.data.build_map_dataloader, whose per-sample randomness is keyed by position; see {README_SECTION}")


def likely_cause(comparison: Comparison) -> str:
    """A sentence on the likely cause of the first difference (empty for an exact run)."""
    first = comparison.first
    if first is None:
        return ""
    if first.resumed_from is None and first.attempt >= 0 and first.category not in ("missing", "extra"):
        return ("the script is not deterministic: this launch had not resumed anything yet, and it already differs "
                "from the reference (seed everything, use deterministic kernels, and run the reference twice)")
    categories = {d.category for d in comparison.at_first_step()}
    if first.category in ("batch", "inputs") and _MOVED in first.detail:
        return _ORDER_CAUSE
    if first.category == "batch":
        if "rng" in categories:
            return ("the global RNG state differs too: " + _CAUSES["rng"] + "; a batch drawn from it differs in turn")
        return _LOADER_GENERATOR_CAUSE if "the script's DataLoader" in first.detail else _GENERATOR_CAUSE
    if first.category == "inputs" and "rng" in categories:
        return "the global RNG state differs too: " + _CAUSES["rng"] + "; the model's inputs differ in turn"
    return _CAUSES[first.category]
