"""Checkpoint write bandwidth: 2 ranks each writing their own FSDP2 shards vs one rank writing everything.

For a Llama-shaped model + AdamW state (about 350 MB by default), measured in the same run on the same disk:

- raw write+fsync of the same byte count, one stream and two parallel streams (the disk's limits),
- ``save_checkpoint`` by 1 process holding a plain model (rank 0 writes every byte),
- ``save_checkpoint`` by 2 gloo ranks under FSDP2 ``fully_shard`` (each rank writes its half),
- the same with ``layout="hf"`` (weights all-gathered and written whole as 50 MB HF shards, round robin),
- ``save_checkpoint`` (the regular single-writer format) by 1 process, for reference.

Each save is timed from a barrier to its return (manifest committed, every file fsynced: these modes save with
``durability="immediate"``, as the raw writes and DCP they are compared with fsync). The writers
run in ``--rounds`` interleaved rounds (the load of a shared machine drifts), each doing a warm-up save
and ``--repeats`` timed ones; medians are reported. Page caches are dropped before every write when the
process may write ``/proc/sys/vm/drop_caches``. Ranks are plain subprocesses with the ``torchrun``
environment on 127.0.0.1. Prints a markdown table with bandwidths and ratios. (Upload throughput to an
object store is measured elsewhere.)

With ``--stall``, instead: the cost of a checkpoint to the training loop at 2 gloo ranks on the same FSDP2
model + AdamW state, in one process group and interleaved rounds: our blocking ``save_checkpoint``,
our ``blocking=False`` stall (until the call returns; the files are then written in the background), torch's
DCP ``dcp.save`` and DCP ``dcp.async_save``'s stall (until it returns its future), each also timed to
completion; and, on a DDP replica of the same model in the same processes, ``save_checkpoint`` blocking and
``blocking=False`` (the ranks split the replica's files). Medians of every rank's times (the
slower rank of each save counts); each stall is compared with the blocking save of the same kind of model.

With ``--replicated``, instead: ``save_checkpoint`` of a DDP replica (every rank holds the same Llama-shaped model
and AdamW state) by 2 gloo ranks, blocking, with the replicated model and optimizer files split across the ranks
(today's plan) and with rank 0 writing all of them (the single-writer plan, ``HF_RESUMABLE_SPLIT_REPLICAS=0``),
alternating in one process group; the slower rank of each save counts, medians of ``--repeats`` each. Each save is
also broken down per rank into its phases (capture, the commit protocol's steps, the tensor files' writes, the waits
in its collectives) with the process's CPU seconds, and the same rounds time a raw baseline of the same bytes (the
least work a save does per byte: write, xxh3-128, fsync) by rank 0 alone on 1 and 2 threads and by both ranks
each writing half: how much splitting the writers can gain on this machine at all.

With ``--engines``, instead: the front doors' engines at 2 gloo ranks, FSDP2 through accelerate and DeepSpeed ZeRO
(``--zero-stage``, default 2 and 3) through accelerate, on the same Llama-shaped model + AdamW, one process group per
engine: our blocking ``save_checkpoint`` (what ``ResumableAccelerator.save_state`` writes under these
engines; by default it returns once committed and fsyncs on the saver's thread, timed until it returns and until its
fsyncs are done; and with ``durability="immediate"``, every file fsynced before the commit) and the stall of
``blocking=False`` (until it returns; the files are then written in the background) against
stock ``Accelerator.save_state`` (torch DCP under FSDP, DeepSpeed's ``save_checkpoint`` under ZeRO), and our load
(``open_checkpoint`` + ``OpenedCheckpoint.load_into``) against stock ``load_state``, in rotating order; medians (slower
rank). accelerate turns FSDP and DeepSpeed on for accelerator devices only, so on CPU the workers install the same
test-only shim as the test suite (gloo collectives, the CPU as the device); on GPUs it is not needed.

Usage:
    python benchmarks/bench_distributed.py --engines [--repeats 5] [--hidden 512] [--zero-stage 2 3] [--dir DIR]
    python benchmarks/bench_distributed.py [--rounds 3] [--repeats 2] [--dir /path/on/the/disk] [--hidden 512]
    python benchmarks/bench_distributed.py --stall [--repeats 5] [--hidden 512]
    python benchmarks/bench_distributed.py --replicated [--repeats 5] [--dir /dev/shm] [--max-shard-size 2GB]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from _bench_common import drop_caches

REPO_ROOT = Path(__file__).resolve().parent.parent


def build(hidden: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=16000, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def prime_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with state (one step on random gradients), after any sharding."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- workers ---------------------------------------------------------------------------------------


def time_saves(save, root: Path, repeats: int, *, rank: int = 0) -> tuple[list[float], int]:
    """Run ``save(path)`` ``repeats`` times between barriers; seconds per save and bytes of one checkpoint."""
    from hf_resumable.distributed import barrier

    seconds, size = [], 0
    for i in range(repeats):
        path = root / f"checkpoint-{i}"
        if rank == 0:
            drop_caches()
        barrier()
        start = time.perf_counter()
        save(path)
        seconds.append(time.perf_counter() - start)
        barrier()
        if rank == 0:
            size = dir_bytes(path)
            shutil.rmtree(path)
    return seconds, size


def worker(mode: str, root: Path, repeats: int, hidden: int, out: Path) -> None:
    """One process of a measurement: ``sharded-2`` (a rank under FSDP2), ``sharded-1`` or ``regular-1``."""
    import torch.distributed as dist

    from hf_resumable import save_checkpoint

    torch.set_num_threads(1)
    rank = 0
    model = build(hidden)
    if mode in ("sharded-2", "sharded-hf-2"):
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = prime_optimizer(model)
    if mode == "regular-1":
        def writer(path: Path) -> None:
            save_checkpoint(path, model=model, optimizer=optimizer, step=0, durability="immediate")
    else:
        def writer(path: Path) -> None:
            save_checkpoint(path, model=model, optimizer=optimizer, step=0,
                            layout="hf" if mode == "sharded-hf-2" else "pieces", max_shard_size="50MB",
                            durability="immediate")
    seconds, size = time_saves(writer, root, repeats + 1, rank=rank)
    seconds = seconds[1:]  # the first save pays one-time costs (first touch of buffers, imports)
    if rank == 0:
        out.write_text(json.dumps({"seconds": seconds, "bytes": size}))
    if dist.is_initialized():
        dist.destroy_process_group()


def gate_waited() -> float:
    """Seconds optimizer steps have waited so far for background copies (the library's step gates)."""
    try:
        from hf_resumable.checkpoint.background._step_gate import _GATES
    except ImportError:  # a library without the step gate: the save call itself copies every tensor
        return 0.0
    return sum(gate.waited for gate in list(_GATES.values()))


# The kinds of the --stall and --engines rounds that write nothing (the training steps without a save in flight).
NO_SAVE = ("training step, no save", "training step, no save, DDP")


def round_order(names: list[str], round_: int, *, then: Iterable[str] = ()) -> list[str]:
    """Round ``round_``'s order of the timed kinds ``names``: the saves rotated by the round (the machine's load
    drifts), then ``then`` (the loads of the saves), then the kinds that write nothing (:data:`NO_SAVE`), never right
    before a save.

    A save that follows a kind writing nothing starts from page cache freed (by the cache drop before that kind) a
    second or more earlier. A VM that hands free memory back to its host (free page reporting: the 2-core VM
    these figures come from, ``/sys/module/page_reporting``) has often given it back by then, and every page of
    the save's page-cache writes is then refaulted by the host: the same 2 x 174 MB write took 0.06-0.08 s after the
    drop of a just-written checkpoint and 0.25-0.65 s where the VM had reported freed memory to the host in between.
    In a plain rotation the kinds keep their neighbours: our blocking save followed the step without a save in every
    round, and under ZeRO-3 (whose step is the longest, about 1.1 s) often lost the page cache's warm pages."""
    saves = [name for name in names if name not in NO_SAVE]
    shift = round_ % len(saves)
    return [*saves[shift:], *saves[:shift], *then, *(name for name in names if name in NO_SAVE)]


def _timed(save, path: Path, blocking: bool, rank: int, step=None) -> tuple[float, float, float, float]:
    """One save (or load) on every rank, caches dropped first: (seconds until it returned, seconds until done, the
    seconds of ``step()`` (the next training step, run right after the call returned), and of its wait at the step
    gate)."""
    import torch.distributed as dist

    if rank == 0:
        drop_caches()
    dist.barrier()
    start = time.perf_counter()
    finish = save(path, blocking)
    returned = time.perf_counter() - start
    stepped = waited = 0.0
    if step is not None:
        waited = gate_waited()
        stepped = time.perf_counter()
        step()
        stepped, waited = time.perf_counter() - stepped, gate_waited() - waited
    finish()
    total = time.perf_counter() - start
    dist.barrier()
    return returned, total, stepped, waited


def stall_worker(root: Path, repeats: int, hidden: int, out: Path) -> None:
    """One FSDP2 rank: every save kind ``repeats`` times in rotating order; per save, the stall and the total."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from hf_resumable import save_checkpoint, wait_for_pending_saves

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(hidden)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = prime_optimizer(model)
    replica = torch.nn.parallel.DistributedDataParallel(build(hidden)).module  # DDP: every rank holds all of it
    replica_optimizer = prime_optimizer(replica)

    def ours(path: Path, blocking: bool):
        save_checkpoint(path, model=model, optimizer=optimizer, step=0, blocking=blocking,
                        durability="immediate", layout="pieces")
        return wait_for_pending_saves

    def ours_ddp(path: Path, blocking: bool):
        save_checkpoint(path, model=replica, optimizer=replica_optimizer, step=0, blocking=blocking,
                        durability="immediate")
        return wait_for_pending_saves

    # DCP's own gloo group, as its docs advise for async_save (ours uses its own as well): on the default group the
    # background save's collectives interleave with the next step's FSDP all-gathers, a collective mismatch in gloo.
    dcp_group = dist.new_group(backend="gloo")

    def theirs(path: Path, blocking: bool):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        if blocking:
            dcp.save(state, checkpoint_id=str(path), process_group=dcp_group)
            return lambda: None
        future = dcp.async_save(state, checkpoint_id=str(path), process_group=dcp_group)
        return lambda: future.result()

    def no_save(path: Path, blocking: bool):
        return lambda: None

    batch = torch.randint(0, 16000, (1, 16), generator=torch.Generator().manual_seed(rank))

    def step(on: torch.nn.Module, with_optimizer: torch.optim.Optimizer):
        def run() -> None:  # the next training step, which a background save's copy overlaps (and may hold)
            on(input_ids=batch, labels=batch).loss.backward()
            with_optimizer.step()
            with_optimizer.zero_grad()
        return run

    sharded_step, replica_step = step(model, optimizer), step(replica, replica_optimizer)
    kinds = {"ours blocking": (ours, True), "ours async": (ours, False), "DCP save": (theirs, True),
             "DCP async_save": (theirs, False), "ours blocking, DDP": (ours_ddp, True),
             "ours async, DDP": (ours_ddp, False), "training step, no save": (no_save, True),
             "training step, no save, DDP": (no_save, True)}
    steps = {"ours async": sharded_step, "DCP async_save": sharded_step, "training step, no save": sharded_step,
             "ours async, DDP": replica_step, "training step, no save, DDP": replica_step}
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in kinds}
    names = list(kinds)
    for i in range(repeats + 1):  # the first round warms up (staging buffers, DCP's first plan)
        for name in round_order(names, i):
            save, blocking = kinds[name]
            path = root / f"{name.replace(' ', '-')}-{i}"
            timing = _timed(save, path, blocking, rank, step=steps.get(name))
            if i:
                times[name].append(timing)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    from hf_resumable.distributed import all_gather_json

    gathered = all_gather_json(times)  # settled: the worker exits soon after (distributed.settle)
    if rank == 0:
        slowest = {name: [[max(per_rank[name][k][j] for per_rank in gathered) for j in range(4)]
                          for k in range(repeats)] for name in names}
        out.write_text(json.dumps({"times": slowest, "bytes_per_rank": sum(
            t.numel() * t.element_size() for t in list(model.state_dict().values()))}))
    dist.destroy_process_group()


# Phases of a DDP replica save, timed on every rank (``--replicated``): (module, function, label); the wrappers add the
# seconds of every call (writes on helper threads overlap, so their sum may exceed the save's wall time).
SAVE_PHASES = [("api", "capture_payload", "capture"), ("commit._writer", "begin_save", "step 1 (begin_save)"),
               ("commit._writer", "write_safetensors", "tensor files (sum per file)"),
               ("commit._writer", "write_payload", "step 2: write own files"),
               ("commit._writer", "all_gather_json", "all_gather (waits for the slower rank)"),
               ("commit._writer", "index_document", "indexes (rank 0)"),
               ("commit._writer", "commit_dir", "commit: fsync + rename"),
               ("commit._writer", "broadcast_json", "step 5 broadcast")]


def time_phases(phases: dict[str, float]) -> None:
    """Wrap the library functions of :data:`SAVE_PHASES` to add their seconds into ``phases`` (benchmark only)."""
    import importlib

    lock = threading.Lock()
    for module_name, function, label in SAVE_PHASES:
        module = importlib.import_module(f"hf_resumable.checkpoint.{module_name}")
        original = getattr(module, function)

        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                with lock:
                    phases[_label] = phases.get(_label, 0.0) + time.perf_counter() - start

        setattr(module, function, timed)


def _cpu_seconds() -> float:
    """CPU time of this process, every thread (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raw_hashed_writes(root: Path, nbytes: int, streams: int) -> None:
    """The least work a save does per byte, on ``streams`` threads (each its own file and 1/streams of ``nbytes``):
    write and xxh3-128 of every 16 MiB chunk, then fsync (records carry no sha256 since format version 2)."""
    import xxhash

    chunk = memoryview(os.urandom(16 << 20))

    def write(path: Path, size: int) -> None:
        fast = xxhash.xxh3_128()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for offset in range(0, size, len(chunk)):
            piece = chunk[: min(len(chunk), size - offset)]
            os.write(fd, piece)
            fast.update(piece)
        os.fsync(fd)
        os.close(fd)
        path.unlink()

    threads = [threading.Thread(target=write, args=(root / f"raw-{os.getpid()}-{i}", nbytes // streams))
               for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def replicated_worker(root: Path, repeats: int, hidden: int, max_shard_size: str, out: Path) -> None:
    """One rank of a DDP replica: blocking saves, split and single-writer alternating, and the raw baseline of the
    same bytes (rank 0 alone on 1 and 2 threads, both ranks each half on 1); every save's seconds, per phase."""
    import torch.distributed as dist

    from hf_resumable import save_checkpoint
    from hf_resumable._tuning import SPLIT_REPLICAS_ENV

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(hidden)  # seeded: the same weights and optimizer state on every rank
    optimizer = prime_optimizer(model)
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(), *(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))])
    phases: dict[str, float] = {}
    time_phases(phases)
    plans = {"split": "1", "single writer": "0"}
    raw = {"raw, rank 0 alone, 1 thread": (1, [0]), "raw, rank 0 alone, 2 threads": (2, [0]),
           "raw, 2 ranks, each half on 1 thread": (1, [0, 1])}
    times: dict[str, list[float]] = {name: [] for name in [*plans, *raw]}
    profile: dict[str, list[dict[str, float]]] = {name: [] for name in plans}
    for i in range(repeats + 1):  # the first round warms up
        for name in (list(plans) if i % 2 else list(plans)[::-1]):
            os.environ[SPLIT_REPLICAS_ENV] = plans[name]
            path = root / f"{name.replace(' ', '-')}-{i}"
            if rank == 0:
                drop_caches()
            dist.barrier()
            phases.clear()
            cpu, start = _cpu_seconds(), time.perf_counter()
            save_checkpoint(path, model=model, optimizer=optimizer, step=0, max_shard_size=max_shard_size,
                            durability="immediate")
            seconds = time.perf_counter() - start
            dist.barrier()
            if i:
                times[name].append(seconds)
                profile[name].append({**phases, "CPU seconds, all threads": _cpu_seconds() - cpu, "save": seconds})
            if rank == 0:
                size = dir_bytes(path)
                files = sum(1 for p in path.rglob("*.safetensors"))
                shutil.rmtree(path, ignore_errors=True)
        for name, (streams, ranks) in raw.items():
            if rank == 0:
                drop_caches()
            dist.barrier()
            start = time.perf_counter()
            if rank in ranks:
                raw_hashed_writes(root, tensor_bytes // len(ranks), streams)
            seconds = time.perf_counter() - start
            dist.barrier()
            if i:
                times[name].append(seconds if rank in ranks else 0.0)
    from hf_resumable.distributed import all_gather_json

    gathered = all_gather_json({"times": times, "profile": profile})  # settled (distributed.settle)
    if rank == 0:
        slowest = {name: [max(r["times"][name][k] for r in gathered) for k in range(repeats)] for name in times}
        per_rank = {name: [r["profile"][name] for r in gathered] for name in plans}
        out.write_text(json.dumps({"times": slowest, "bytes": size, "files": files, "raw_bytes": tensor_bytes,
                                   "profile": per_rank}))
    dist.destroy_process_group()


def _install_cpu_engines(engine: str) -> None:
    """accelerate enables FSDP / DeepSpeed for accelerator devices only: on CPU, gloo collectives with the CPU as the
    device (the test suite's shim, ``tests/helpers/engine_fixtures.py``)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if torch.cuda.is_available():
        return
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    os.environ["DS_ACCELERATOR"] = "cpu"
    if engine == "deepspeed":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of a CPU op
    PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
        "gloo", DistributedType.MULTI_GPU)


def _engine_accelerator(engine: str, stage: int):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if engine == "deepspeed":
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], cpu_ram_efficient_loading=False))


def _fsync_tree(path: Path) -> None:
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def engines_worker(engine: str, root: Path, repeats: int, hidden: int, stage: int, out: Path) -> None:
    """One rank of an engine: our saves and loads and accelerate's, in rotating order; seconds of each (the stall
    and the total for a save)."""
    _install_cpu_engines(engine)
    import torch.distributed as dist

    from hf_resumable import wait_for_pending_saves
    from hf_resumable.checkpoint import open_checkpoint, save_checkpoint
    from hf_resumable.integrations._deepspeed import checkpoint_optimizer
    from hf_resumable.integrations._engines import checkpoint_model

    torch.set_num_threads(1)
    accelerator = _engine_accelerator(engine, stage)
    model = build(hidden)
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randint(0, 16000, (1, 16), device=accelerator.device)
    accelerator.backward(prepared(input_ids=batch, labels=batch).loss)  # one step: AdamW state exists
    optimizer.step()
    optimizer.zero_grad()
    ours_model = checkpoint_model(prepared, accelerator.unwrap_model(prepared))
    ours_optimizer = checkpoint_optimizer(optimizer)
    rank = dist.get_rank()

    def step() -> None:  # the next training step, which a background save's copy overlaps (and may hold)
        accelerator.backward(prepared(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()

    def ours(path: Path, blocking: bool, durability: str = "deferred"):
        save_checkpoint(path, model=ours_model, optimizer=ours_optimizer, step=0, blocking=blocking,
                        durability=durability, layout="pieces")
        return wait_for_pending_saves  # a background save's commit, or a blocking save's deferred fsyncs

    def ours_immediate(path: Path, blocking: bool):
        return ours(path, blocking, durability="immediate")

    def theirs(path: Path, durable: bool):
        accelerator.save_state(str(path))
        if durable:  # their files fsynced, as our commit fsyncs ours (both ranks' files, each by its writer's node)
            dist.barrier()
            if rank == 0:
                _fsync_tree(path)
        return lambda: None

    def ours_load(path: Path, blocking: bool):
        open_checkpoint(path).load_into(model=ours_model, optimizer=ours_optimizer, restore_rng=True)
        return lambda: None

    def theirs_load(path: Path, blocking: bool):
        accelerator.load_state(str(path))
        return lambda: None

    def no_save(path: Path, blocking: bool):
        return lambda: None

    kinds = {"ours blocking": (ours, True), "ours blocking, fsync first": (ours_immediate, True),
             "ours async": (ours, False), "accelerate save_state": (theirs, False),
             "accelerate save_state + fsync": (theirs, True), "training step, no save": (no_save, True)}
    loads = {"ours load": (ours_load, "ours blocking"),  # each loads the checkpoint its kind saved this round
             "accelerate load_state": (theirs_load, "accelerate save_state")}
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in [*kinds, *loads]}
    names = list(kinds)
    stepped = ("ours async", "training step, no save")  # the loop runs its next step after these
    for i in range(repeats + 1):  # the first round warms up (staging buffers, first plans)
        for name in round_order(names, i, then=loads):  # the step without a save last, after the loads
            save, blocking = kinds[name] if name in kinds else loads[name]
            path = root / f"{(name if name in kinds else blocking).replace(' ', '-')}-{i}"
            timing = _timed(save, path, blocking if name in kinds else True, rank,
                            step=step if name in stepped else None)
            if i:
                times[name].append(timing)
        dist.barrier()
        if rank == 0:
            for path in root.glob(f"*-{i}"):
                shutil.rmtree(path, ignore_errors=True)
    from hf_resumable.distributed import all_gather_json

    gathered = all_gather_json(times)  # settled: the worker exits soon after (distributed.settle)
    if rank == 0:
        slowest = {name: [[max(per_rank[name][k][j] for per_rank in gathered) for j in range(4)]
                          for k in range(repeats)] for name in times}
        out.write_text(json.dumps({"times": slowest, "engine": engine, "stage": stage, "parameters": sum(
            p.numel() for p in build(hidden).parameters())}))
    dist.destroy_process_group()


def engines_report(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"2 gloo ranks, a Llama-shaped model (hidden {args.hidden}, {results[0]['parameters'] / 1e6:.0f}M "
             f"parameters) + AdamW through accelerate, under {args.dir or tempfile.gettempdir()}; median of "
             f"{args.repeats} rounds (slower rank of each), after a warm-up round. Saves: until the call returns, "
             "and until the checkpoint is committed (ours blocking: and its deferred fsyncs done; \"fsync first\": "
             "durability='immediate', every file fsynced before the commit). Our async save's stall is the call "
             "plus the wait of the next optimizer step at the step gate (the loop runs that step: forward, backward, "
             "step); that step's time is compared with a step with no save in flight.", "",
             "| engine | operation | returns after (s) | done after (s) | vs stock (speed, higher is better) "
             "| vs our blocking save |", "|---|---|---:|---:|---:|---:|"]
    for result in results:
        times = result["times"]
        engine = "FSDP2 (DCP)" if result["engine"] == "fsdp" else f"DeepSpeed ZeRO-{result['stage']}"

        def median(name: str, index: int) -> float:
            return statistics.median(entry[index] for entry in times[name])

        stock_save, durable = median("accelerate save_state", 1), median("accelerate save_state + fsync", 1)
        blocking = median("ours blocking", 0)  # what the loop waits for; its fsyncs follow on the saver's thread
        for name in times:
            if name == "training step, no save":
                continue
            versus, mine, returned = "", "", f"{median(name, 0):.3f}"
            if name == "ours blocking":
                versus = (f"returns {stock_save / blocking:.2f}x; durable {durable / median(name, 1):.2f}x vs "
                          "save_state + fsync")
            elif name == "ours blocking, fsync first":
                versus = f"{stock_save / median(name, 1):.2f}x; {durable / median(name, 1):.2f}x vs save_state + fsync"
                mine = f"{median(name, 0) / blocking:.2f}x the time"
            elif name == "ours load":
                versus = f"{median('accelerate load_state', 1) / median(name, 1):.2f}x"
            elif name == "ours async":
                stall = statistics.median(entry[0] + entry[3] for entry in times[name])
                returned = f"{median(name, 0):.3f} + gate {median(name, 3):.3f}"
                versus = f"stall {stock_save / stall:.1f}x shorter than save_state"
                normal, overlapped = median("training step, no save", 2), median(name, 2)
                mine = (f"stall {stall / blocking:.3f}x ({stall / median('ours blocking, fsync first', 1):.3f}x fsync "
                        f"first); next step {overlapped:.3f} s = {overlapped / normal:.2f}x a step with no save "
                        f"({normal:.3f} s)")
            lines.append(f"| {engine} | {name} | {returned} | {median(name, 1):.3f} | {versus} | {mine} |")
    return "\n".join(lines)


def replicated_report(result: dict, args: argparse.Namespace) -> str:
    times, profile = result["times"], result["profile"]
    split, single = (statistics.median(times[name]) for name in ("split", "single writer"))
    one, two = (statistics.median(times[f"raw, rank 0 alone, {n}"]) for n in ("1 thread", "2 threads"))
    both = statistics.median(times["raw, 2 ranks, each half on 1 thread"])
    lines = [
        f"2 gloo ranks, DDP replica of a Llama-shaped model (hidden {args.hidden}) + AdamW, save_checkpoint(blocking, "
        f"max_shard_size={args.max_shard_size}): {result['bytes'] / 1e6:.0f} MB in {result['files']} safetensors "
        f"files, under {args.dir or tempfile.gettempdir()}; median of {args.repeats} alternating saves each (slower "
        f"rank), after a warm-up round. Raw: {result['raw_bytes'] / 1e6:.0f} MB (the tensors' bytes) written, "
        "xxh3'd in 16 MiB chunks, fsynced, in the same rounds.", "",
        "| plan | median s | min-max s | MB/s |", "|---|---:|---:|---:|",
        *(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} | "
          f"{result['bytes'] / statistics.median(t) / 1e6:.0f} |" for name, t in times.items()),
        "", "Per rank, median seconds of each phase (CPU seconds: every thread of the process):", "",
        "| phase | " + " | ".join(f"{plan}, rank {r}" for plan in profile for r in range(len(profile[plan]))) + " |",
        "|---|" + "---:|" * sum(len(ranks) for ranks in profile.values())]
    columns = [runs for ranks in profile.values() for runs in ranks]  # per plan and rank: one dict per save
    for label in dict.fromkeys(label for runs in columns for run in runs for label in run):
        cells = [statistics.median(run.get(label, 0.0) for run in runs) for runs in columns]
        lines.append(f"| {label} | " + " | ".join(f"{cell:.3f}" for cell in cells) + " |")
    lines += ["", f"raw, 2 ranks / rank 0 alone on 2 threads: {both / two:.2f}x; on 1 thread: {both / one:.2f}x "
              "(the split's ceiling on this machine)",
              f"split / single writer: {split / single:.2f}x the time (lower is better)"]
    return "\n".join(lines)


def stall_report(result: dict, args: argparse.Namespace) -> str:
    times = result["times"]

    def median(name: str, index: int) -> float:
        return statistics.median(entry[index] for entry in times[name])

    def stall(name: str) -> float:  # the call, plus the next step's wait at the step gate (0 where none ran)
        return statistics.median(entry[0] + entry[3] for entry in times[name])

    blocking, dcp_stall = median("ours blocking", 1), stall("DCP async_save")
    lines = [f"2 gloo ranks, FSDP2 Llama-shaped model (hidden {args.hidden}) + AdamW (and a DDP replica of it); "
             f"median of {args.repeats} interleaved saves each (slower rank), after a warm-up round. A background "
             "save's stall is its call plus the wait of the next optimizer step at the step gate (the loop runs that "
             "step); that step's time is compared with a step with no save in flight.", "",
             "| save | stall (s): call + gate wait | slowest return (s) | done after (s) | stall vs our blocking save "
             "| vs DCP async_save stall | next step vs a step with no save |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in times:
        if name.startswith("training step"):
            continue
        total, slowest = median(name, 1), max(entry[0] for entry in times[name])
        ddp = name.endswith("DDP")
        base = median("ours blocking, DDP", 1) if ddp else blocking
        versus = "" if ddp else f"{stall(name) / dcp_stall:.2f}x"
        normal = median("training step, no save, DDP" if ddp else "training step, no save", 2)
        inflation = f"{median(name, 2) / normal:.2f}x" if median(name, 2) else ""
        lines.append(f"| {name} | {median(name, 0):.3f} + {median(name, 3):.3f} | {slowest:.3f} | {total:.3f} | "
                     f"{stall(name) / base:.3f}x | {versus} | {inflation} |")
    lines += ["", f"ours blocking vs DCP save: {median('DCP save', 1) / blocking:.2f}x the speed (higher is better)"]
    return "\n".join(lines)

# --- driver ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(mode: str, world_size: int, root: Path, args: argparse.Namespace) -> dict:
    out = root / f"{mode}.json"
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        argv = [sys.executable, __file__, "--worker", mode, "--dir", str(root), "--repeats", str(args.repeats),
                "--hidden", str(args.hidden), "--max-shard-size", args.max_shard_size,
                "--zero-stage", *(str(stage) for stage in args.zero_stage)]
        procs.append(subprocess.Popen(argv, env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"{mode}: a worker failed")
    return json.loads(out.read_text())


def raw_writes(root: Path, size: int, streams: int, repeats: int) -> list[float]:
    """Seconds to write+fsync ``size`` bytes split over ``streams`` parallel files (os.write releases the GIL)."""
    chunk = memoryview(os.urandom(16 << 20))

    def write(path: Path, nbytes: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for offset in range(0, nbytes, len(chunk)):
            os.write(fd, chunk[: min(len(chunk), nbytes - offset)])
        os.fsync(fd)
        os.close(fd)

    seconds = []
    for _ in range(repeats):
        drop_caches()
        threads = [threading.Thread(target=write, args=(root / f"raw-{i}", size // streams)) for i in range(streams)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds.append(time.perf_counter() - start)
        for i in range(streams):
            (root / f"raw-{i}").unlink()
    return seconds


def report(rows: dict[str, tuple[list[float], int]], args: argparse.Namespace) -> str:
    def bandwidth(name: str) -> float:
        seconds, size = rows[name]
        return size / statistics.median(seconds) / 1e6

    base = bandwidth("save_checkpoint, 1 rank writes everything")
    raw = bandwidth("raw write+fsync, 1 stream")
    size = rows["save_checkpoint, 2 ranks (FSDP2)"][1]
    lines = [f"Median of {args.rounds * args.repeats} timed writes each ({args.rounds} interleaved rounds x "
             f"{args.repeats}, after a warm-up save); checkpoint of {size / 1e6:.0f} MB (Llama-shaped weights + "
             "AdamW state).", "",
             "| writer | median s | min-max s | MB/s | vs 1-rank sharded save | vs raw 1-stream write |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, (seconds, _size) in rows.items():
        mbps = bandwidth(name)
        lines.append(f"| {name} | {statistics.median(seconds):.2f} | {min(seconds):.2f}-{max(seconds):.2f} | "
                     f"{mbps:.0f} | {mbps / base:.2f}x | {mbps / raw:.2f}x |")
    return "\n".join(lines)


CONFIGS = {  # row name -> (worker mode, world size)
    "save_checkpoint, 2 ranks (FSDP2)": ("sharded-2", 2),
    "save_checkpoint(layout=\"hf\"), 2 ranks (FSDP2)": ("sharded-hf-2", 2),
    "save_checkpoint, 1 rank writes everything": ("sharded-1", 1),
    "save_checkpoint (regular format), 1 process": ("regular-1", 1),
}
RAW = {"raw write+fsync, 1 stream": 1, "raw write+fsync, 2 parallel streams": 2}


def measure(root: Path, args: argparse.Namespace) -> dict[str, tuple[list[float], int]]:
    """Interleaved rounds (the machine's load drifts): every writer once per round, in a rotating order."""
    rows: dict[str, tuple[list[float], int]] = {name: ([], 0) for name in [*CONFIGS, *RAW]}
    names = list(CONFIGS)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            mode, world_size = CONFIGS[name]
            result = launch(mode, world_size, root, args)
            rows[name] = (rows[name][0] + result["seconds"], result["bytes"])
        size = rows["save_checkpoint, 1 rank writes everything"][1]
        for name, streams in RAW.items():
            rows[name] = (rows[name][0] + raw_writes(root, size, streams, args.repeats), size)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each writer once per round)")
    parser.add_argument("--repeats", type=int, default=2, help="timed saves per writer and round (after a warm-up)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to test (default: a temp dir)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the Llama-shaped model")
    parser.add_argument("--stall", action="store_true", help="compare save stalls with torch DCP instead")
    parser.add_argument("--replicated", action="store_true",
                        help="DDP replica: ranks sharing the save vs rank 0 writing it all")
    parser.add_argument("--engines", action="store_true",
                        help="FSDP2 and DeepSpeed through accelerate: our saves and loads vs save_state / load_state")
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[2, 3],
                        help="DeepSpeed ZeRO stages of --engines (each in its own process group)")
    parser.add_argument("--max-shard-size", default="2GB", help="shard size of --replicated saves")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "stall":
        stall_worker(args.dir, args.repeats, args.hidden, args.dir / "stall.json")
        return
    if args.worker is not None and args.worker.startswith("engine-"):  # engine-fsdp, engine-zero2, engine-zero3
        engine = args.worker.removeprefix("engine-")
        stage = int(engine.removeprefix("zero")) if engine.startswith("zero") else 0
        engines_worker("deepspeed" if stage else engine, args.dir, args.repeats, args.hidden, stage,
                       args.dir / f"{args.worker}.json")
        return
    if args.worker == "replicated":
        replicated_worker(args.dir, args.repeats, args.hidden, args.max_shard_size, args.dir / "replicated.json")
        return
    if args.worker is not None:
        worker(args.worker, args.dir, args.repeats, args.hidden, args.dir / f"{args.worker}.json")
        return
    root = Path(tempfile.mkdtemp(prefix="bench-distributed-", dir=args.dir))
    try:
        if args.engines:
            engines = ["fsdp", *(f"zero{stage}" for stage in args.zero_stage)]
            print(engines_report([launch(f"engine-{e}", 2, root, args) for e in engines], args))
        elif args.stall:
            print(stall_report(launch("stall", 2, root, args), args))
        elif args.replicated:
            print(replicated_report(launch("replicated", 2, root, args), args))
        else:
            print(report(measure(root, args), args))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
