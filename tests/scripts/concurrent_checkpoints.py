"""Processes for tests/test_concurrency.py: a saving writer, readers that find/load/clean, and a racing saver.

Every process logs one JSON object per line to ``--log``. The model is tiny and every weight of the
checkpoint of step N equals N, so a reader can tell a checkpoint's content from its name.

``--commit-delay S`` widens the commit window: the writer sleeps S seconds inside ``fsync_tree``, which the
commit protocol calls between finishing the temp dir and renaming it into place (in earlier versions,
right after the temp dir's owner record was removed). It is a test-only hook, set by monkeypatching.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from hf_resumable.checkpoint import (
    apply_retention,
    cleanup_stale_temp_dirs,
    find_latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hf_resumable.checkpoint.commit import _fs


def model_with(value: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return model


def widen_commit_window(seconds: float) -> None:
    original = _fs.fsync_tree

    def slow(path: Path) -> None:
        time.sleep(seconds)
        original(path)

    _fs.fsync_tree = slow


def log(stream, **record) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def writer(args, out) -> int:
    root = Path(args.root)
    for step in range(1, args.saves + 1):
        try:
            save_checkpoint(root / f"checkpoint-{step}", model=model_with(float(step)), step=step, rng=False)
            log(out, committed=step)
            removed = apply_retention(root, keep_last=args.keep_last)
            if removed:
                log(out, removed=[p.name for p in removed])
        except Exception as err:  # noqa: BLE001 - the test asserts there are none
            log(out, error=f"{type(err).__name__}: {err}", step=step, trace=traceback.format_exc())
    return 0


def reader(args, out) -> int:
    root = Path(args.root)
    done = Path(args.until)
    while not done.exists():
        try:
            cleanup_stale_temp_dirs(root)
            path = find_latest_checkpoint(root)
        except Exception as err:  # noqa: BLE001
            log(out, error=f"find: {type(err).__name__}: {err}", trace=traceback.format_exc())
            continue
        if path is None:
            continue
        model = model_with(-1.0)
        try:
            loaded = load_checkpoint(path, model=model, restore_rng=False)
            values = {float(v) for p in model.parameters() for v in p.detach().reshape(-1)}
            ok = values == {float(loaded.step)} and path.name == f"checkpoint-{loaded.step}"
            log(out, got=path.name, ok=ok, values=sorted(values)[:3])
        except Exception as err:  # noqa: BLE001 - the test asserts there are none
            log(out, got=path.name, ok=False, error=f"{type(err).__name__}: {err}")
    return 0


def racer(args, out) -> int:
    """Wait for the start file, then save ``--target`` once (with a widened commit window)."""
    go = Path(args.until)
    while not go.exists():
        time.sleep(0.001)
    target = Path(args.root) / args.target
    try:
        save_checkpoint(target, model=model_with(float(args.value)), step=1, rng=False)
        log(out, committed=args.value)
    except Exception as err:  # noqa: BLE001
        log(out, error=type(err).__name__, builtin=[c.__name__ for c in type(err).__mro__], message=str(err))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "reader", "racer"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument("--until", default="")
    parser.add_argument("--target", default="checkpoint-1")
    parser.add_argument("--value", type=float, default=1.0)
    parser.add_argument("--commit-delay", type=float, default=0.0)
    args = parser.parse_args()
    if args.commit_delay:
        widen_commit_window(args.commit_delay)
    torch.set_num_threads(1)
    with open(args.log, "a") as out:
        log(out, pid=os.getpid(), role=args.role)
        return {"writer": writer, "reader": reader, "racer": racer}[args.role](args, out)


if __name__ == "__main__":
    sys.exit(main())
