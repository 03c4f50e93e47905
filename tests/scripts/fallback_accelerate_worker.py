"""A ``ResumableAccelerator`` loop for the resume-fallback tests (one rank; run alone or under gloo).

A GPT-2 wide enough that its weights and AdamW state are files above the quick-verification hash limit (those are
hash-checked only while a load reads them), dropout on, a resumable loader. It resumes with ``load_state()``,
trains to ``--steps`` optimizer steps, saves every ``--save-every`` steps up to ``--save-until``, and stops after
``--stop-after`` (as a crash would, but cleanly). Per rank it appends ``{"step", "loss"}`` (the loss as a hex
float) to ``OUT/losses-rank<r>.jsonl``, writes where it resumed from to ``OUT/resumed-rank<r>.json`` and, at the
end, its weights and optimizer state to ``OUT/final-rank<r>.safetensors``.

``--root`` may hold ``{rank}``: each rank then has its own checkpoint directory, as ranks on separate machines
with node-local copies of one checkpoint. With ``HFR_CORRUPT_AND_DIE_AFTER=k`` the first attempt under
``hf-resumable run`` (``HF_RESUMABLE_RESTARTS=0``) flips a byte in the tensor data of the newest checkpoint's largest
file after step k (a disk fault) and SIGKILLs itself; every attempt appends ``{"restarts", "resumed"}`` to
``OUT/attempts.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import struct
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from hf_resumable.checkpoint import wait_for_pending_saves
from hf_resumable.integrations.accelerate import ResumableAccelerator

VOCAB = 128


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--save-until", type=int, default=4)
    parser.add_argument("--stop-after", type=int, default=None)
    return parser.parse_args(argv)


def collate(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def flip_newest(root: Path) -> None:
    """One flipped byte in the middle of the tensor data of the newest checkpoint's largest file."""
    newest = max(root.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    largest = max(newest.rglob("*.safetensors"), key=lambda path: path.stat().st_size)
    data = bytearray(largest.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[(start + len(data)) // 2] ^= 0x40
    largest.write_bytes(bytes(data))


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:%(name)s:%(message)s")
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ResumableAccelerator(cpu=True, checkpoint_dir=args.root.format(rank=rank), handle_preemption=False,
                                       keep_last=None)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=320, n_head=2, vocab_size=VOCAB, n_positions=16,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(5)
    rows = torch.randint(3, VOCAB, (48, 12), generator=generator).tolist()
    loader = accelerator.prepare_resumable_dataloader(rows, collate_fn=collate, batch_size=2, seed=3)
    model, optimizer = accelerator.prepare(model, optimizer)
    loaded = accelerator.load_state()
    (out / f"resumed-rank{rank}.json").write_text(json.dumps(None if loaded is None else str(loaded.path)))
    with open(out / "attempts.jsonl", "a") as attempts:
        attempts.write(json.dumps({"restarts": os.environ.get("HF_RESUMABLE_RESTARTS"),
                                   "resumed": None if loaded is None else str(loaded.path)}) + "\n")
    die_after = os.environ.get("HFR_CORRUPT_AND_DIE_AFTER")
    windows = accelerator.accumulation_windows(loader)
    with open(out / f"losses-rank{rank}.jsonl", "a") as log:
        while accelerator.global_step < args.steps:
            for batch in next(windows):
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            step = accelerator.global_step
            log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            log.flush()
            if step % args.save_every == 0 and step <= args.save_until:
                accelerator.save_state()
            if step == args.stop_after:
                wait_for_pending_saves()
                return
            if die_after is not None and step == int(die_after) and os.environ.get("HF_RESUMABLE_RESTARTS") == "0":
                wait_for_pending_saves()
                flip_newest(Path(args.root))
                os.kill(os.getpid(), signal.SIGKILL)
    unwrapped = accelerator.unwrap_model(model)
    tensors = {f"model/{k}": v.detach().clone().contiguous() for k, v in unwrapped.state_dict().items()
               if k != "lm_head.weight"}  # tied to the embedding
    names = {id(p): n for n, p in unwrapped.named_parameters()}
    for param, state in optimizer.optimizer.state.items():
        for key, value in state.items():
            tensors[f"optim/{names[id(param)]}/{key}"] = torch.as_tensor(value).detach().clone().contiguous()
    save_file(tensors, str(out / f"final-rank{rank}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1:])
