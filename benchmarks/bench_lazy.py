"""Peak memory of shard-by-shard loading, and bytes moved by a one-layer Hub request.

For a Llama-shaped model saved as >= 8 shards, each loading variant runs in a fresh subprocess (median of
``--runs`` runs after one warm-up run, so the page cache is warm for all of them alike):

- ``load_lazily``: hf_resumable, into a model built with ``accelerate.init_empty_weights()``;
- ``from_pretrained``: ``transformers.AutoModelForCausalLM.from_pretrained(dir)``;
- ``load_file all shards``: ``safetensors.torch.load_file`` of every shard into one dict, then
  ``model.load_state_dict`` (the naive way);
- ``stream_forward``: one forward pass of a meta model with blocks streamed (weights never all resident).

After loading, every variant reads each weight once (transformers 5 maps the files and reads lazily), so the
weights are resident in all of them.

The overhead of a variant is ``peak RSS - RSS after imports (modeling code included) - model weight bytes``
and is reported as a ratio to the
largest shard (target for ``load_lazily``: <= 1.25). Then a fake Hub (tests/helpers/fakehub.py) serves the model
and the bytes
sent for a one-layer ``download_shards`` are compared to a full ``snapshot_download``.

Usage: ``python benchmarks/bench_lazy.py [--runs 5] [--hidden 768] [--layers 8]``
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

REPO_ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import gc, json, os, sys
import psutil, torch
from accelerate import init_empty_weights
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from hf_resumable.lazy import load_lazily, stream_forward

variant, folder = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(folder)
with init_empty_weights():  # import the modeling code before the baseline: it is not loading overhead
    AutoModelForCausalLM.from_config(config)
gc.collect()
baseline = psutil.Process().memory_info().rss
if variant == "load_lazily":
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    load_lazily(model, folder)
elif variant == "from_pretrained":
    model = AutoModelForCausalLM.from_pretrained(folder)
elif variant == "load_file":
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    state = {}
    for shard in sorted(os.listdir(folder)):
        if shard.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, shard)))
    model.load_state_dict(state, strict=True)
    del state
if variant != "stream_forward":
    # Read every weight once: transformers 5 maps the files and reads lazily, so without this its weights would not
    # be resident at all and the variants would not be comparable.
    with torch.no_grad():
        checksum = sum(float(p.float().sum()) for p in model.parameters())
if variant == "stream_forward":
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    stream_forward(model, folder, torch.tensor([[1, 2, 3, 4]]))
# VmHWM is the high-water mark of this process' own address space; ru_maxrss would also count the parent's RSS
# at fork time (Linux keeps it across execve).
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"baseline": baseline, "peak": peak}))
"""

VARIANTS = [("load_lazily", "hf_resumable load_lazily"), ("from_pretrained", "transformers from_pretrained"),
            ("load_file", "safetensors load_file, all shards"), ("stream_forward", "hf_resumable stream_forward")]


def build_model(folder: Path, hidden: int, layers: int) -> dict:
    """Save a random Llama-shaped model as >= 8 shards; return its index metadata."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_resumable.hub import write_sharded_model

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                         vocab_size=8192, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    config.save_pretrained(folder)
    index = write_sharded_model(model.state_dict(), folder, max_shard_size=int(per_layer * 1.1))
    return index["metadata"]


def measure(variant: str, folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(folder)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_table(folder: Path, metadata: dict, runs: int) -> list[str]:
    shard_sizes = [r["size"] for r in metadata["hf_resumable_shards"].values()]
    largest, model_bytes = max(shard_sizes), metadata["total_size"]
    rows = [f"Model: {model_bytes / 1e6:.1f} MB of weights in {len(shard_sizes)} shards, largest shard "
            f"{largest / 1e6:.1f} MB; median of {runs} fresh processes each (after 1 warm-up).", "",
            "| variant | peak RSS above baseline (MB) | beyond model weights (MB) | beyond weights / largest shard |",
            "|---|---|---|---|"]
    for variant, label in VARIANTS:
        measure(variant, folder)  # warm-up: page cache, lazy imports
        above = statistics.median(m["peak"] - m["baseline"] for m in (measure(variant, folder) for _ in range(runs)))
        if variant == "stream_forward":  # never holds the whole model: compare the peak itself
            rows.append(f"| {label} (one forward pass) | {above / 1e6:.1f} | n/a: {above / model_bytes:.0%} of the "
                        f"weights resident at peak | {above / largest:.2f}x (peak itself) |")
            continue
        beyond = above - model_bytes
        rows.append(f"| {label} | {above / 1e6:.1f} | {beyond / 1e6:.1f} | {beyond / largest:.2f}x |")
    return rows


def download_table(folder: Path, layer: int) -> list[str]:
    """Bytes the fake Hub sends for one layer vs the whole repo."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from huggingface_hub import close_session, constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    from helpers.fakehub import FakeHub
    from helpers.hub_fixtures import hub_constants, hub_environ

    disable_progress_bars()

    with tempfile.TemporaryDirectory() as tmp, FakeHub(Path(tmp) / "hub") as hub:
        os.environ.update(hub_environ(hub.endpoint, Path(tmp) / "home"))
        for key, value in hub_constants(hub.endpoint, Path(tmp) / "home").items():
            setattr(constants, key, value)
        close_session()

        from hf_resumable.hub import download_shards, push_sharded

        push_sharded(folder, "bench/model")
        hub.clear_log()
        download_shards("bench/model", prefixes=[f"model.layers.{layer}."])
        one_layer = sum(r.bytes_sent for r in hub.log)
        hub.clear_log()
        snapshot_download("bench/model", cache_dir=Path(tmp) / "full")
        whole = sum(r.bytes_sent for r in hub.log)
    return ["", "| request through the fake Hub | bytes sent by the server | share of whole repo |", "|---|---|---|",
            f"| download_shards(prefixes=['model.layers.{layer}.']) | {one_layer:,} | {one_layer / whole:.1%} |",
            f"| snapshot_download (whole repo) | {whole:,} | 100.0% |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_lazy-") as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        metadata = build_model(folder, args.hidden, args.layers)
        if len(metadata["hf_resumable_shards"]) < 8:
            raise SystemExit(f"expected >= 8 shards, got {len(metadata['hf_resumable_shards'])}")
        rows = memory_table(folder, metadata, args.runs) + download_table(folder, args.layers // 2)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
