"""One rank of a ``ResumableAccelerator`` FSDP or DeepSpeed loop (2 gloo ranks on CPU, torchrun), started by
tests/test_engines.py.

Usage: ``torchrun --nproc-per-node 2 fsdp_accelerate_worker.py --output-dir DIR [--version 2] [--state-dict-type T]``,
or ``... --engine deepspeed [--zero-stage 2]``.
The same command trains uninterrupted, is held after a save (``HFR_HOLD_AFTER_SAVE=k``, then SIGKILLed by the test)
and resumes (``load_state()``). Every optimizer step is saved in the background (``save_async=True``); each rank
appends ``{"step", "loss"}`` (``float.hex``) to ``losses-rank{r}.jsonl`` and writes ``final-rank{r}.safetensors``
(its parameter pieces and optimizer state) at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from helpers import engine_fixtures as fx  # noqa: E402

if fx.requested_device() == "cpu":
    fx.install_cpu_engines()  # before the accelerator builds its state

import torch  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

from hf_resumable.integrations.accelerate import ResumableAccelerator  # noqa: E402


def make_rows(count: int = 44, length: int = 12) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(3, fx.VOCAB, (length,), generator=generator) for _ in range(count)]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    noise = torch.rand(ids.shape) < 0.1  # per-batch randomness (seeded by the batch's position)
    ids = torch.where(noise, torch.full_like(ids, 3), ids)
    return {"input_ids": ids, "labels": ids.clone()}


def engine_plugin(options) -> dict:
    if options.engine == "deepspeed":
        config = fx.deepspeed_config(options.zero_stage, batch_size=4)  # no loader in prepare(): say the batch size
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=config)}
    return {"fsdp_plugin": FullyShardedDataParallelPlugin(
        fsdp_version=options.version, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"], state_dict_type=options.state_dict_type,
        cpu_ram_efficient_loading=False, sync_module_states=False)}  # FSDP1 broadcasts from a CUDA device otherwise


def main() -> int:
    options = fx.parse_worker_args()
    output = options.output_dir
    output.mkdir(parents=True, exist_ok=True)
    accelerator = ResumableAccelerator(**engine_plugin(options), checkpoint_dir=output / "checkpoints",
                                       save_async=True, handle_preemption=False)
    model = fx.build_model(options.width)
    fsdp1 = options.engine == "fsdp" and options.version == 1
    if fsdp1:  # FSDP1 replaces the parameters: the model is prepared before the optimizer is built over them
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, options.max_steps)
    loader = accelerator.prepare_resumable_dataloader(make_rows(), collate_fn=collate, batch_size=4, seed=0)
    if fsdp1:
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state()
    with (output / f"losses-rank{fx.RANK}.jsonl").open("a") as log:
        for batch in loader:  # one epoch holds more steps than max_steps
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            log.write(json.dumps({"step": accelerator.global_step, "loss": loss.item().hex()}) + "\n")
            log.flush()
            accelerator.save_state()
            fx.hold_after_save(accelerator.global_step)
            if accelerator.global_step >= options.max_steps:
                break
    accelerator.end_training()
    model = model if fsdp1 else accelerator.unwrap_model(model)  # FSDP1's state dicts are read from its root
    fx.dump_local_state(model, optimizer.optimizer, output / f"final-rank{fx.RANK}.safetensors")
    del model, optimizer, accelerator
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
