"""Child process for the crash test: saves checkpoints in a loop until killed.

It prints ``saving N`` before and ``committed N`` after each save, so the parent can time its kill by events.

Weights at step s are a pure function of s, so the parent can check that whatever checkpoint it
finds holds exactly the weights of its step.
"""

import sys

import torch

from hf_resumable.checkpoint import find_latest_checkpoint, save_checkpoint


def weights(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {f"layer{i}.weight": torch.randn(256, 256, generator=generator) for i in range(8)}


def main(root: str) -> None:
    latest = find_latest_checkpoint(root)
    step = int(latest.name.split("-")[1]) if latest else 0
    print("ready", flush=True)
    while True:
        step += 1
        print(f"saving {step}", flush=True)
        save_checkpoint(f"{root}/checkpoint-{step}", model=weights(step), step=step, max_shard_size="600KB",
                        training_state={"global_step": step}, keep_last=3)
        print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
