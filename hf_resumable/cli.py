"""``hf-resumable``: the command line over the public API; every subcommand and its options: docs/cli.md.

Thin by design: each subcommand parses its arguments and calls one library function. User mistakes (a missing path,
a corrupt checkpoint, a bad size string) print one line to stderr and exit non-zero, without a traceback.

Example:

```bash
hf-resumable verify --full out/checkpoint-120     # exit 0 if valid, 1 if not
hf-resumable check --kills 3 -- python train.py --output_dir {out}   # exit 0: EXACT; 1: DIVERGES at step K
```
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ._urls import location_kind
from ._version import __version__
from .constants import MANIFEST_FILE, STOCK_OPTIMIZER_FILE
from .errors import HfResumableError

logger = logging.getLogger(__name__)

__all__ = ["main", "build_parser"]

EXIT_OK = 0
EXIT_INVALID = 1  # verification failed / demo runs differ
EXIT_USAGE = 2  # bad arguments, missing path, unreadable input (argparse uses 2 as well)


def _local_checkpoint(target: str, *, quiet: bool) -> Path:
    """A local directory for ``target``; ``hf://`` references are pulled (resumably, verified) first."""
    if location_kind(target) != "hub":
        return Path(target)
    from .hub import pull_checkpoint

    if not quiet:
        print(f"pulling {target} ...", file=sys.stderr)
    return pull_checkpoint(target)


# ------------------------------------------------------------------------------------------------ commands
def cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint.summary import summarize_checkpoint

    path = _local_checkpoint(args.path, quiet=args.quiet)
    summary = summarize_checkpoint(path, full=args.full)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.format_table())
    if not (path / MANIFEST_FILE).exists() and (path / STOCK_OPTIMIZER_FILE).exists() and not args.quiet:
        print(f"hint: {path} looks like a stock transformers.Trainer checkpoint; `hf-resumable convert {path}` "
              "turns it into a verified, pickle-free one.", file=sys.stderr)
    return EXIT_OK if summary.verified else EXIT_INVALID


def cmd_verify(args: argparse.Namespace) -> int:
    from .checkpoint import verify_checkpoint

    path = Path(args.path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    report = verify_checkpoint(path, full=args.full)
    if report.ok:
        if not args.quiet:
            print(report.summary())
        return EXIT_OK
    print(report.summary(), file=sys.stderr)
    return EXIT_INVALID


def cmd_convert(args: argparse.Namespace) -> int:
    from .conversions.stock import TrainerCheckpointFiles
    from .conversions.switch import convert_stock_checkpoint, detect_stock_kind, pickle_warning

    source = Path(args.path)
    output = Path(args.output) if args.output else source.parent / "hf_resumable" / source.name
    kind = detect_stock_kind(source)
    if kind != "trainer" or TrainerCheckpointFiles.scan(source).has_pickles:
        print(f"NOTICE: {pickle_warning(kind)}", file=sys.stderr)
    info = convert_stock_checkpoint(source, output, optimizer=args.optimizer, max_shard_size=args.max_shard_size,
                                    step=args.step, optimizer_dir=args.optimizer_dir, overwrite=args.overwrite)
    if not args.quiet:
        ranks = info.manifest.world_size
        print(f"converted {source} -> {info.path} (step {info.step}, {len(info.manifest.files)} files"
              f"{f', for {ranks} ranks' if ranks > 1 else ''})")
        if kind != "trainer":
            print("NOTICE: the first resume from it is NOT bit-exact (the stock run's data order and random streams "
                  "are not in its checkpoint); every checkpoint after it resumes bit for bit.", file=sys.stderr)
    return EXIT_OK


def cmd_reshard(args: argparse.Namespace) -> int:
    from .checkpoint.summary import summarize_checkpoint
    from .conversions.stock import reshard_checkpoint

    target = reshard_checkpoint(args.path, max_shard_size=args.max_shard_size, output=args.output)
    if not args.quiet:
        shards = summarize_checkpoint(target).shards
        counts = {kind: sum(s.kind == kind for s in shards) for kind in ("model", "optimizer")}
        print(f"resharded {args.path} -> {target} ({counts['model']} model shard(s), "
              f"{counts['optimizer']} optimizer shard(s))")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .conversions.export import export_model

    path = _local_checkpoint(args.path, quiet=args.quiet)
    target = export_model(path, args.output, base=args.base, revision=args.revision, merge_adapters=args.merge,
                          max_shard_size=args.max_shard_size, verify="full" if args.full else "quick",
                          master_weights=args.master_weights)
    if not args.quiet:
        print(f"exported {args.path} -> {target}")
    return EXIT_OK


def cmd_push(args: argparse.Namespace) -> int:
    from .hub.cards import render_checkpoint_card

    path = Path(args.path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if args.path_in_repo is not None or args.tag is not None:
        from .hub import push_checkpoint

        if not args.no_card:
            logger.warning("push_checkpoint (used for --path-in-repo/--tag) takes no model card; pushing without one.")
        pushed = push_checkpoint(path, args.repo_id, path_in_repo=args.path_in_repo, branch=args.revision,
                                 tag=args.tag, commit_message=args.commit_message, private=args.private)
        print(pushed.url)
        return EXIT_OK
    from .hub import push_sharded

    card = None if args.no_card else str(render_checkpoint_card(path, repo_id=args.repo_id, revision=args.revision,
                                                                license=args.license))
    info = push_sharded(path, args.repo_id, revision=args.revision, commit_message=args.commit_message,
                        private=args.private, card=card)
    print(f"hf://{args.repo_id}@{info.oid}")
    return EXIT_OK


def cmd_pull(args: argparse.Namespace) -> int:
    from .hub import pull_checkpoint

    path = pull_checkpoint(args.reference, revision=args.revision, local_dir=args.local_dir)
    print(path)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    from .demo import format_comparison, run_demo

    output = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="hf_resumable-demo-"))
    if not args.quiet:
        print(f"Training a tiny GPT-2 twice in {output}: once uninterrupted, once SIGKILLed at a random step and "
              "restarted with the same command ...", flush=True)
    report = run_demo(output, max_steps=args.max_steps, save_every=args.save_every, seed=args.seed,
                      kill_step=args.kill_at, backend=args.backend, plot=not args.no_plot,
                      progress=not args.quiet and sys.stderr.isatty())
    if not args.quiet or not report.comparison.ok:
        print(format_comparison(report.comparison, kill_step=report.kill_step,
                                resumed_from=report.resumed.resumed_from))
        print(f"\ntrainer:   {'ResumableTrainer' if report.backend == 'trainer' else 'plain torch loop'} "
              f"(--backend {report.backend})")
        print(f"loss plot: {report.plot or 'skipped (matplotlib not installed)'}")
        print(f"report:    {output / 'demo_report.json'}  ({report.seconds:.1f} s)")
    return EXIT_OK if report.comparison.ok else EXIT_INVALID


def _command_after_dashes(args: argparse.Namespace, example: str) -> list[str] | None:
    """The command given after ``--`` (``None``, with the usage printed, when there is none)."""
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print(f"hf-resumable {args.command}: error: give the command to {args.command} after `--`, e.g. "
              f"hf-resumable {args.command} -- {example}", file=sys.stderr)
        return None
    return command


def cmd_check(args: argparse.Namespace) -> int:
    from .check import CheckOptions, run_check
    from .errors import CheckLaunchError

    command = _command_after_dashes(args, "python train.py --output_dir {out}")
    if command is None:
        return EXIT_USAGE
    options = CheckOptions(kills=args.kills, seed=args.seed, timeout=args.timeout)
    try:
        report = run_check(command, options=options)
    except CheckLaunchError as err:
        print(f"hf-resumable check: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        report.write_json(args.json)
    print(report.summary())
    return EXIT_OK if report.exact else EXIT_INVALID


def cmd_run(args: argparse.Namespace) -> int:
    from .restart import RestartOptions, run_with_restarts

    command = _command_after_dashes(args, "python train.py --output_dir out")
    if command is None:
        return EXIT_USAGE
    options = RestartOptions(max_restarts=args.max_restarts, warm=not args.cold, preimport=tuple(args.preimport))
    return run_with_restarts(command, options)


# ------------------------------------------------------------------------------------------------ parser
def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="print only results and errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages of hf_resumable")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hf-resumable`` (one sub-parser per command)."""
    parser = argparse.ArgumentParser(
        prog="hf-resumable", description="Inspect, verify, convert, reshard, push and pull hf_resumable checkpoints, "
                                         "and run the kill-and-resume demo.")
    parser.add_argument("--version", action="version", version=f"hf_resumable {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("inspect", help="summarize a checkpoint (step, batch, shards, verification)")
    p.add_argument("path", help="checkpoint directory or hf://namespace/name[@revision][/sub/dir]")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--full", action="store_true", help="verify every hash (reads every byte)")
    p.set_defaults(func=cmd_inspect)

    p = commands.add_parser("verify", help="check a checkpoint; exit 0 if valid, 1 if not")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--full", action="store_true", help="recompute every hash: xxh3-128, and sha256 "
                   "where an older manifest has one (default: quick check)")
    p.set_defaults(func=cmd_verify)

    p = commands.add_parser("convert", help="convert a stock Trainer, Trainer+DeepSpeed, accelerate FSDP or "
                            "transformers distributed checkpoint (reads pickles!)")
    p.add_argument("path", help="stock checkpoint directory: a Trainer checkpoint-N (config.json, model*.safetensors, "
                   "optimizer.pt, ... or DeepSpeed's global_stepN/), accelerate's FSDP save_state directory "
                   "(pytorch_model_fsdp_0/, optimizer_0/), or save_pretrained(distributed_checkpoint=True)'s "
                   "(shard-*-model-*.safetensors)")
    p.add_argument("--output", help="new checkpoint directory (default: <parent>/hf_resumable/<name>)")
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "adagrad", "rmsprop"],
                   help="optimizer class of the run (default: inferred from its state)")
    p.add_argument("--max-shard-size", default="2GB", help="shard size of the new checkpoint (default: 2GB)")
    p.add_argument("--step", type=int, help="optimizer step of an accelerate FSDP or transformers distributed "
                   "checkpoint (default: from the optimizer state)")
    p.add_argument("--optimizer-dir", help="the directory save_optimizer_distributed wrote, for a transformers "
                   "distributed checkpoint (default: PATH itself or PATH/optimizer, if either holds a .metadata)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.set_defaults(func=cmd_convert)

    p = commands.add_parser("reshard", help="rewrite model and optimizer shards with a new size")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--max-shard-size", required=True, help="new shard size, e.g. 500MB or 2GiB")
    p.add_argument("--output", help="write here instead of replacing the checkpoint in place")
    p.set_defaults(func=cmd_reshard)

    p = commands.add_parser("export", help="write a checkpoint (with its frozen base) as a from_pretrained directory")
    p.add_argument("path", help="checkpoint directory or hf://namespace/name[@revision][/sub/dir]")
    p.add_argument("--output", required=True, help="new model directory (must not exist or be empty)")
    p.add_argument("--base", help="base model directory or Hub repo id (default: the one the checkpoint records)")
    p.add_argument("--revision", help="Hub revision of --base (default: the recorded commit)")
    p.add_argument("--merge", action="store_true", help="merge PEFT adapters into the weights (default: base weights "
                   "and adapter files side by side)")
    p.add_argument("--max-shard-size", default="5GB", help="shard size of the written weights (default: 5GB)")
    p.add_argument("--full", action="store_true", help="check every byte of the base against the checkpoint's "
                   "record (default: names, dtypes, shapes and sampled bytes)")
    p.add_argument("--master-weights", action="store_true", help="DeepSpeed ZeRO checkpoints: write the fp32 master "
                   "weights of the optimizer partitions instead of the training-dtype weights")
    p.set_defaults(func=cmd_export)

    p = commands.add_parser("push", help="upload a checkpoint to the Hub with a model card")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("repo_id", help="namespace/name (created if missing)")
    p.add_argument("--revision", "--branch", dest="revision", help="target branch (created if missing)")
    p.add_argument("--path-in-repo", help="upload into this sub-directory (no model card)")
    p.add_argument("--tag", help="tag the commit (no model card)")
    p.add_argument("--commit-message")
    p.add_argument("--private", action="store_true", default=None, help="create the repo private")
    p.add_argument("--license", help="license id for the model card metadata, e.g. apache-2.0")
    p.add_argument("--no-card", action="store_true", help="do not write README.md")
    p.set_defaults(func=cmd_push)

    p = commands.add_parser("pull", help="download a checkpoint (resumable, verified against its manifest)")
    p.add_argument("reference", help="hf://namespace/name[@revision][/sub/dir] or namespace/name")
    p.add_argument("--revision", help="branch, tag or commit (overrides @revision)")
    p.add_argument("--local-dir", help="destination (default: under HF_HOME, keyed by commit)")
    p.set_defaults(func=cmd_pull)

    p = commands.add_parser("demo", help="train, SIGKILL at a random step, resume, and prove the runs are identical")
    p.add_argument("--output", help="demo directory (default: a new temporary directory)")
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps per run (default: 40)")
    p.add_argument("--save-every", type=int, default=5, help="checkpoint interval in steps (default: 5)")
    p.add_argument("--kill-at", type=int, help="kill after this step (default: random)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=["auto", "trainer", "loop"], default="auto",
                   help="ResumableTrainer ('trainer'), the plain torch loop ('loop'), or the trainer if available")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.set_defaults(func=cmd_demo)

    p = commands.add_parser("check", help="run CMD, kill it and rerun it at N points, and compare it bit for bit "
                                          "with an uninterrupted run; exit 0 if EXACT, 1 if it DIVERGES")
    p.add_argument("--kills", type=int, default=3, help="interrupted runs (kill points), default: 3")
    p.add_argument("--seed", type=int, default=0, help="chooses the kill points (default: 0)")
    p.add_argument("--timeout", type=float, help="seconds one launch may run (default: no limit)")
    p.add_argument("--json", help="also write the report to this JSON file")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...",
                   help="the training command; {out} becomes a fresh directory per run")
    p.set_defaults(func=cmd_check)

    p = commands.add_parser("run", help="run CMD and start it again when its process dies, from a standby "
                                        "interpreter whose imports are done")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (default: 3)")
    p.add_argument("--cold", action="store_true", help="no standby interpreter: each restart starts a new one")
    p.add_argument("--preimport", nargs="+", default=[], metavar="MODULE",
                   help="modules for the standby to import beside the script's leading imports, e.g. "
                        "transformers.trainer")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the training command")
    p.set_defaults(func=cmd_run)

    for sub in commands.choices.values():
        _add_common(sub)
    return parser


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.INFO if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_resumable").setLevel(level)
    if args.quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    elif sys.stderr.isatty():
        from .progress import enable_progress_bars

        enable_progress_bars()


def _one_line(err: BaseException) -> str:
    """The error message on one line (multi-line reports are joined, so every bad file stays named)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) or type(err).__name__


def _is_network_error(err: BaseException) -> bool:
    """Connection errors of the Hub client's HTTP library (not OSError subclasses), by module name."""
    return type(err).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-resumable`` (and ``python -m hf_resumable``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    package_logger = logging.getLogger("hf_resumable")
    previous_level = package_logger.level
    _configure_logging(args)
    try:
        return _run(args)
    finally:  # called in-process (a notebook, a test): leave the caller's logging as it was
        package_logger.setLevel(previous_level)


def _run(args: argparse.Namespace) -> int:
    """Run the chosen command; every error becomes one line on stderr and an exit code."""
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` & co: not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (HfResumableError, OSError, ValueError) as err:  # OSError: missing paths, disk full, Hub HTTP errors
        if args.verbose:
            logger.exception("%s failed", args.command)
        print(f"hf-resumable {args.command}: error: {_one_line(err)[:2000]}", file=sys.stderr)
        return EXIT_INVALID if isinstance(err, HfResumableError) and args.command == "verify" else EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - a bad input must never end in a traceback
        if args.verbose:
            logger.exception("%s failed", args.command)
        if _is_network_error(err):
            print(f"hf-resumable {args.command}: error: cannot reach the Hub ({type(err).__name__}: "
                  f"{_one_line(err)})", file=sys.stderr)
        else:
            hint = "" if args.verbose else " (run with --verbose for the traceback)"
            print(f"hf-resumable {args.command}: error: {type(err).__name__}: {_one_line(err)[:2000]}{hint}",
                  file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hf-resumable {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
