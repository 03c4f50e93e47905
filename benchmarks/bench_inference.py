"""Greedy generation from a model 4x larger than its memory budget: StreamingModel vs accelerate disk offload.

A random Llama-shaped model (~2.5 GB of fp32 weights, safetensors shards) is generated once. Each side then runs
with the same prompt, the same budget (a quarter of the weights) and the same number of new tokens (``--tokens``,
default 32; ``--cold-tokens`` in the cold regime), greedy with the KV cache:

- ``accelerate``: ``AutoModelForCausalLM.from_pretrained(dir, device_map="auto", max_memory={"cpu": budget},
  offload_folder=...)``. transformers maps disk-offloaded weights to the checkpoint's own safetensors files, and
  accelerate's ``AlignDevicesHook`` loads each offloaded layer synchronously in its forward pre-hook.
- ``streamed``: ``hf_resumable.lazy.StreamingModel.from_pretrained(dir, max_memory=budget)``: every block is
  streamed, the next one read on a background thread while the current one computes.
- ``streamed-resident`` (``--with-resident``): the same with ``keep_resident=True`` (the rest of the budget filled
  with resident blocks), to show what they buy.

Two regimes (``--regimes warm,cold``), each side in a fresh subprocess (peak RSS is its own), the model's files
dropped from the page cache (``posix_fadvise(DONTNEED)`` per file, other users' cache untouched) before each:

- ``warm``: the page cache may hold the files, so after the first token both sides read from memory.
- ``cold``, the regime of issue #25 (a model larger than memory): each process runs in a cgroup-v1 memory cgroup
  limited to the budget plus ``--overhead`` (default 640 MB: the imports, activations and the allocator), which
  counts its anonymous memory and its page cache together. The model (2.5 GB) is twice that limit, so for both
  sides most weights come from disk on every token. Needs root and a writable ``/sys/fs/cgroup/memory``.

Reported per side (median and min-max of ``--runs`` runs, the sides alternating within each run): tokens/s (new
tokens / ``generate`` wall time, first token included; the load is outside this window on both sides),
end-to-end tokens/s (new tokens / (load + ``generate``): what a fresh process waits for, whichever of the two
phases reads the weights first), decode tokens/s (tokens 2..N), cold first-token latency
(from the start of loading to the first new token), peak RSS (``VmHWM``), RSS after imports, and the share of the
files in the page cache at the end. The generated tokens must be identical across sides and regimes (the script
exits non-zero otherwise). Both sides run with ``torch.set_num_threads(--threads)``: on a 2-core machine one thread
computes and the other core is left to the reader (ours) or idle (accelerate).

Usage: ``python benchmarks/bench_inference.py [--runs 3] [--tokens 32] [--cold-tokens 32] [--regimes warm,cold]``

The last line is ``streamed vs accelerate disk offload: tokens/s X.XXx, peak RSS X.XXx``, for the cold regime (the
one the issue is about) when it ran.

Each side's fraction of the read bound is reported too, in every regime: the weight bytes it reads per token (the
streamed blocks; accelerate's layers offloaded to disk) times its tokens/s, over this storage's cold-read rate
(one stream, the model's files dropped from the page cache first). The ratio of the two sides depends on the
machine's disk; the fraction of the bound does not. ``--json PATH`` also writes every figure as JSON
(benchmarks/gpu_check.py reads it).

``--device cuda`` generates on the GPU: the budget is GPU memory, ``StreamingModel(device="cuda")`` copies each
streamed block onto the GPU before it runs, accelerate offloads what does not fit to disk (``max_memory={0: budget,
"cpu": 0}``). Each side's fraction of the host-to-device bound (bytes per token x tokens/s over this GPU's copy rate
from pageable memory, measured here) is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_resumable.format.sharding import parse_size

REPO_ROOT = Path(__file__).resolve().parents[1]
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
NEW_TOKENS = 32
PROMPT = [1, 345, 2001, 77, 4000, 12, 999, 5, 1500, 42, 8000, 7, 311, 64, 5001, 2]

BUILD = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from hf_resumable.hub import write_sharded_model
folder, hidden, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                     num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 384), vocab_size=8192,
                     tie_word_embeddings=False, max_position_embeddings=512)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
model.model.rotary_emb.__init__(config)
config.save_pretrained(folder)
write_sharded_model(model.state_dict(), folder, max_shard_size="500MB")
print(sum(p.numel() * p.element_size() for p in model.parameters()))
"""

CHILD = r"""
import json, os, sys, time
import psutil, torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from _bench_common import resident_pages as _resident
from hf_resumable.lazy import StreamingModel

side, folder, budget, threads, offload = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompt, device = json.loads(sys.argv[6]), sys.argv[8]
torch.set_num_threads(threads)
baseline = psutil.Process().memory_info().rss


class Clock(StoppingCriteria):
    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


start = time.perf_counter()
if side == "accelerate":
    # on a GPU the budget is the GPU's and the rest is offloaded to disk, as on the CPU (no RAM tier in between)
    memory = {"cpu": budget} if device == "cpu" else {0: budget, "cpu": 0}
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=memory,
                                                 offload_folder=offload)
    placement = sorted(map(str, set(model.hf_device_map.values())))
    offloaded = [model.get_submodule(name) if name else model for name, where in model.hf_device_map.items()
                 if where in ("disk", "cpu") and (where == "disk" or device != "cpu")]
    per_token = sum(p.numel() * p.element_size() for module in offloaded for p in module.parameters())
else:
    streamed = StreamingModel.from_pretrained(folder, max_memory=budget, keep_resident=side == "streamed-resident",
                                              device=None if device == "cpu" else device)
    model = streamed.__enter__()
    placement = [f"{len(streamed.residency.resident)} resident", f"{len(streamed.residency.streamed)} streamed"]
    per_token = sum(p.numel() * p.element_size() for i in streamed.residency.streamed
                    for p in streamed.blocks[i].parameters())
loaded = time.perf_counter()
clock = Clock()
with torch.no_grad():
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=int(sys.argv[7]),
                         min_new_tokens=int(sys.argv[7]),
                         do_sample=False, stopping_criteria=StoppingCriteriaList([clock]))
done = time.perf_counter()
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
cached = total = 0
for name in os.listdir(folder):
    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    size = os.fstat(fd).st_size
    pages = _resident(fd, size) or b""
    cached += sum(b & 1 for b in pages) * 4096
    total += size
    os.close(fd)
print(json.dumps({"tokens": out[0, len(prompt):].cpu().tolist(), "load_s": loaded - start, "generate_s": done - loaded,
                  "first_token_s": clock.times[0] - start, "decode_s": clock.times[-1] - clock.times[0],
                  "peak": peak, "baseline": baseline, "cached": min(1.0, cached / total), "placement": placement,
                  "bytes_per_token": per_token}))
"""


def drop_from_cache(folder: Path) -> None:
    """Evict ``folder``'s files from the page cache (only theirs: other users' cache stays)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "benchmarks")]),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def build_model(folder: Path, hidden: int, layers: int) -> int:
    """Write the random model (in a subprocess, so its memory is gone afterwards); return its weight bytes."""
    out = subprocess.run([sys.executable, "-c", BUILD, str(folder), str(hidden), str(layers)], env=_env(),
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def model_bytes(folder: Path, hidden: int, layers: int) -> int:
    """The weight bytes of the model in ``folder``, writing it first if ``folder`` holds none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["metadata"]["total_size"]
    folder.mkdir(parents=True, exist_ok=True)
    return build_model(folder, hidden, layers)


class MemoryCgroup:
    """A cgroup-v1 memory cgroup whose limit (anonymous memory and page cache together) is ``limit`` bytes: a
    process in it sees a machine with that much RAM, so a model larger than it is read from disk on every token."""

    def __init__(self, limit: int) -> None:
        self.path = CGROUP_ROOT / f"hf_resumable_bench_{os.getpid()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def join(self) -> None:  # runs in the child, before exec
        (self.path / "tasks").write_text(str(os.getpid()))

    def close(self) -> None:
        self.path.rmdir()


def measure(side: str, folder: Path, budget: int, threads: int, offload: Path, tokens: int,
            cgroup_limit: int | None, device: str = "cpu") -> dict:
    drop_from_cache(folder)
    command = [sys.executable, "-c", CHILD, side, str(folder), str(budget), str(threads), str(offload),
               json.dumps(PROMPT), str(tokens), device]
    cgroup = MemoryCgroup(cgroup_limit) if cgroup_limit else None
    try:
        out = subprocess.run(command, env=_env(), capture_output=True, text=True,
                             preexec_fn=cgroup.join if cgroup else None)
    finally:
        if cgroup:
            cgroup.close()
    if out.returncode != 0:
        raise SystemExit(f"{side} failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    med = statistics.median
    return {"tokens_per_s": med(len(r["tokens"]) / r["generate_s"] for r in runs),
            "end_to_end_per_s": med(len(r["tokens"]) / (r["load_s"] + r["generate_s"]) for r in runs),
            "decode_per_s": med((len(r["tokens"]) - 1) / r["decode_s"] for r in runs),
            "first_token_s": med(r["first_token_s"] for r in runs), "load_s": med(r["load_s"] for r in runs),
            "peak": med(r["peak"] for r in runs), "baseline": med(r["baseline"] for r in runs),
            "cached": med(r["cached"] for r in runs), "placement": runs[-1]["placement"],
            "bytes_per_token": med(r["bytes_per_token"] for r in runs)}


def cold_read_rate(folder: Path) -> float:
    """Bytes per second of one stream reading the model's files from storage (dropped from the page cache first)."""
    from _bench_common import raw_read

    drop_from_cache(folder)
    seconds = raw_read(folder, bytearray(16 << 20))
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / seconds


def host_to_device_rate(device: str, nbytes: int = 256 << 20) -> float:
    """Bytes per second of a copy from pageable host memory onto ``device`` (the best of 3, CUDA events)."""
    import torch

    host, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best


def read_bound_fraction(summary: dict, read_rate: float) -> float:
    """The share of the storage's cold-read rate a side's weight reads use: bytes per token x tokens/s / rate."""
    return summary["bytes_per_token"] * summary["tokens_per_s"] / read_rate


def run_regime(sides: tuple[str, ...], folder: Path, budget: int, args: argparse.Namespace, offload: Path,
               tokens: int, cgroup_limit: int | None) -> dict[str, list[dict]]:
    """``--runs`` runs of every side, alternating their order from run to run."""
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for run in range(args.runs):
        for side in sides if run % 2 == 0 else sides[::-1]:
            results[side].append(measure(side, folder, budget, args.threads, offload, tokens, cgroup_limit,
                                         args.device))
    return results


def table(regime: str, results: dict[str, list[dict]]) -> list[str]:
    labels = {"accelerate": "accelerate disk offload", "streamed": "hf_resumable StreamingModel",
              "streamed-resident": "hf_resumable StreamingModel, keep_resident=True"}
    rows = []
    for side, runs in results.items():
        s = summarize(runs)
        spread = [len(r["tokens"]) / r["generate_s"] for r in runs]
        rows.append(f"| {regime} | {labels[side]} | {', '.join(s['placement'])} | {s['tokens_per_s']:.3f} "
                    f"({min(spread):.3f}-{max(spread):.3f}) | {s['end_to_end_per_s']:.3f} | {s['decode_per_s']:.3f} | "
                    f"{s['first_token_s']:.2f} | "
                    f"{s['load_s']:.2f} | {s['peak'] / 1e6:.0f} | {s['baseline'] / 1e6:.0f} | {s['cached']:.0%} |")
    return rows


def ratios(results: dict[str, list[dict]]) -> tuple[float, float, list[float], float]:
    """tokens/s and peak-RSS ratios (streamed / accelerate) of the medians, the per-run tokens/s ratios, and the
    end-to-end tokens/s ratio (load included)."""
    acc, ours = summarize(results["accelerate"]), summarize(results["streamed"])
    per_run = [(len(o["tokens"]) / o["generate_s"]) / (len(a["tokens"]) / a["generate_s"])
               for a, o in zip(results["accelerate"], results["streamed"])]
    return (ours["tokens_per_s"] / acc["tokens_per_s"], ours["peak"] / acc["peak"], per_run,
            ours["end_to_end_per_s"] / acc["end_to_end_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS, help="new tokens in the warm regime")
    parser.add_argument("--cold-tokens", type=int, default=NEW_TOKENS, help="new tokens in the cold regime")
    parser.add_argument("--regimes", default="warm,cold", help="comma-separated: warm, cold")
    parser.add_argument("--overhead", type=parse_size, default="640MB",
                        help="cold regime: the memory cgroup's limit is the budget plus this")
    parser.add_argument("--with-resident", action="store_true", help="also run keep_resident=True")
    parser.add_argument("--folder", type=Path, default=None,
                        help="keep the model in this directory (written there if absent) instead of a temporary one")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--device", default="cpu",
                        help="where both sides generate (cuda: the budget is GPU memory, streamed blocks and "
                             "accelerate's offloaded layers are copied onto the GPU per token)")
    args = parser.parse_args()
    regimes = args.regimes.split(",")
    sides = ("accelerate", "streamed") + (("streamed-resident",) if args.with_resident else ())
    if "cold" in regimes and not os.access(CGROUP_ROOT, os.W_OK):
        raise SystemExit(f"the cold regime needs a writable cgroup-v1 memory hierarchy at {CGROUP_ROOT} (root); "
                         "pass --regimes warm to skip it.")
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_inference-") as tmp:
        folder, offload = args.folder or Path(tmp) / "model", Path(tmp) / "offload"
        weight_bytes = model_bytes(folder, args.hidden, args.layers)
        read_rate = cold_read_rate(folder)
        h2d_rate = host_to_device_rate(args.device) if args.device != "cpu" else None
        budget = weight_bytes // 4
        limit = budget + args.overhead
        for regime in regimes:
            results[regime] = run_regime(sides, folder, budget, args, offload,
                                         args.cold_tokens if regime == "cold" else args.tokens,
                                         limit if regime == "cold" else None)
    identical = len({tuple(r["tokens"][:min(args.tokens, args.cold_tokens)]) for by_side in results.values()
                     for runs in by_side.values() for r in runs}) == 1
    rows = [f"Model: {weight_bytes / 1e9:.2f} GB of fp32 weights ({args.layers} Llama blocks, hidden {args.hidden}); "
            f"budget {budget / 1e9:.3f} GB (a quarter); prompt of {len(PROMPT)} tokens, greedy; new tokens: "
            + ", ".join(f"{r} {args.cold_tokens if r == 'cold' else args.tokens}" for r in regimes)
            + f"; torch threads {args.threads}; median (min-max) of {args.runs} fresh processes per side, sides "
            "alternating; the model's files dropped from the page cache before each process; machine load average "
            f"{os.getloadavg()[0]:.1f} at the end."
            + (f" Cold: each process in a memory cgroup limited to {limit / 1e9:.3f} GB (budget + "
               f"{args.overhead / 1e9:.3f} GB), less than the model: every token reads most weights from disk."
               if "cold" in regimes else ""), "",
            "| regime | side | placement | tokens/s (min-max) | end-to-end tokens/s | decode tokens/s | "
            "cold first token (s) | load (s) | peak RSS (MB) | RSS after imports (MB) | files cached at end |",
            "|---" * 11 + "|"]
    for regime, by_side in results.items():
        rows += table(regime, by_side)
    rows += ["", f"generated tokens identical: {identical}"]
    for regime, by_side in results.items():
        speed, rss, per_run, end_to_end = ratios(by_side)
        rows.append(f"{regime}: tokens/s {speed:.2f}x (per run {', '.join(f'{r:.2f}' for r in per_run)}), "
                    f"end-to-end tokens/s {end_to_end:.2f}x, peak RSS {rss:.2f}x")
    rows += ["", f"Fraction of the read bound (bytes read per token x tokens/s over the cold-read rate of this "
             f"storage, {read_rate / 1e6:.0f} MB/s, one stream):"]
    for regime, by_side in results.items():
        rows.append(f"{regime}: " + ", ".join(
            f"{side} {read_bound_fraction(summarize(runs), read_rate):.2f} "
            f"({summarize(runs)['bytes_per_token'] / 1e6:.0f} MB per token)" for side, runs in by_side.items()))
    if h2d_rate is not None:
        rows.append(f"Fraction of the host-to-device bound ({h2d_rate / 1e9:.1f} GB/s from pageable memory, "
                    f"{args.device}): " + "; ".join(
                        f"{regime}: " + ", ".join(f"{side} {read_bound_fraction(summarize(runs), h2d_rate):.2f}"
                                                  for side, runs in by_side.items())
                        for regime, by_side in results.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "weight_bytes": weight_bytes, "budget": budget, "cold_read_bytes_per_s": read_rate,
            "device": args.device, "h2d_bytes_per_s": h2d_rate,
            "identical": identical, "regimes": {regime: {side: {**summarize(runs), "read_bound_fraction":
                                                               read_bound_fraction(summarize(runs), read_rate),
                                                               "h2d_bound_fraction": read_bound_fraction(
                                                                   summarize(runs), h2d_rate) if h2d_rate else None}
                                                         for side, runs in by_side.items()}
                                                for regime, by_side in results.items()}}, indent=1))
    final = "cold" if "cold" in results else regimes[-1]
    speed, rss, _, _ = ratios(results[final])
    rows.append(f"streamed vs accelerate disk offload: tokens/s {speed:.2f}x, peak RSS {rss:.2f}x")
    print("\n".join(rows))
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
