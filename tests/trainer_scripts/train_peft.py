"""Fine-tune a tiny model whose base is frozen with ResumableTrainer and dump everything a test compares.

Run by tests/test_peft_resume.py; the same command line is used for the uninterrupted run, the run that gets
killed and its restart (kill switches and result files as in train_tiny.py). The base is loaded with
``from_pretrained(--base-dir)`` (so its provenance is recorded), then:

    --mode lora              PEFT LoRA (dropout 0.1 in the adapter) on q/v (Llama: + modules_to_save=["lm_head"])
    --mode frozen_embedding  a full fine-tune with the input embedding frozen (GPT-2: tied to the LM head)
    --mode qlora4            a bitsandbytes 4-bit (nf4) base with LoRA on top (CPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import torch
import transformers
from train_tiny import Interrupter, build_data, build_tokenizer, dump_results

TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}


def build_model(kind: str, mode: str, base_dir: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    quantization = None
    if mode == "qlora4":
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quantization,
                                                              **({"device_map": "cpu"} if quantization else {}))
    if mode == "frozen_embedding":
        model.get_input_embeddings().requires_grad_(False)
        return model
    torch.manual_seed(0)  # LoRA's own initialization
    modules_to_save = ["lm_head"] if kind == "llama" else None
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS[kind],
                                            modules_to_save=modules_to_save, task_type="CAUSAL_LM"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--base-dir", required=True)
    p.add_argument("--model", default="gpt2", choices=sorted(TARGETS))
    p.add_argument("--mode", default="lora", choices=["lora", "frozen_embedding", "qlora4"])
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--standalone", action="store_true")
    a = p.parse_args(argv)

    from hf_resumable.integrations.trainer import ResumableTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tokenizer = build_tokenizer()
    model = build_model(a.model, a.mode, a.base_dir)
    train, collator = build_data("lm", tokenizer, 44)
    args = transformers.TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=a.ga,
        max_steps=a.max_steps, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01,
        logging_steps=1, save_strategy="steps", save_steps=1, seed=42, report_to=[], disable_tqdm=True,
        use_cpu=True)
    trainer = ResumableTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                               processing_class=tokenizer, callbacks=[Interrupter(a.ga)],
                               standalone_checkpoints=a.standalone)
    output = trainer.train(resume_from_checkpoint=True)
    dump_results(trainer, Path(a.output_dir), output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
