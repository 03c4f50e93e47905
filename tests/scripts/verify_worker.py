"""One rank of a 2-rank FSDP2 run on gloo (CPU), started by tests/test_verified_reads.py.

Usage: ``python verify_worker.py MODE ROOT`` with the torchrun environment set.

* ``save``: an FSDP2 GPT-2 whose piece files span several hashed chunks, one AdamW step, then
  ``save_checkpoint`` to ROOT/checkpoint-1.
* ``load``: for every corrupted copy listed in ROOT/cases.json, a fresh FSDP2 model and AdamW and
  ``load_checkpoint`` of it; each rank writes what every load did to ROOT/outcomes-rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import init_device_mesh  # noqa: E402

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_resumable.errors import CorruptCheckpointError  # noqa: E402

from helpers.tiny_models import tiny_gpt2  # noqa: E402

# Piece files above the quick verification's whole-file limit (4 MiB), each spanning several 1 MiB chunks.
MODEL = dict(n_layer=1, n_embd=128, vocab_size=20000)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_gpt2(seed=0, **MODEL)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build()
    if mode == "save":
        ids = torch.arange(16).reshape(2, 8) + 2 * rank
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        save_checkpoint(root / "checkpoint-1", model=model, optimizer=optimizer, step=1, layout="pieces")
    else:
        outcomes = {}
        for case in json.loads((root / "cases.json").read_text()):
            model, optimizer = build()
            try:
                load_checkpoint(root / case, model=model, optimizer=optimizer)
                outcomes[case] = {"error": None}
            except CorruptCheckpointError as err:
                outcomes[case] = {"error": "CorruptCheckpointError", "message": str(err)}
            except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
                outcomes[case] = {"error": type(err).__name__, "message": str(err)}
        (root / f"outcomes-rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
