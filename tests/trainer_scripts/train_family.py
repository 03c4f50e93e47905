"""Train a tiny Trainer subclass made resumable with ``make_resumable`` and dump everything a test compares.

    --trainer sft        TRL SFTTrainer (text data set, tokenized by TRL), logging every 2 steps
    --trainer sft_peft   the same with peft_config=LoraConfig(...) (TRL wraps the model)
    --trainer dpo        TRL DPOTrainer (prompt/chosen/rejected), explicit reference model
    --trainer grpo       TRL GRPOTrainer (2 sampled completions per prompt, a length reward; its RepeatSampler
                         is replayed by position)
    --trainer seq2seq    transformers' Seq2SeqTrainer, T5, evaluation with predict_with_generate every 2 steps

The kill switches (HFR_KILL_AFTER_SAVE, HFR_KILL_MID_STEP, ...) and the result files are those of
train_tiny.py; the same command is used for the uninterrupted run, the killed one and its restart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import numpy as np
import transformers
from train_tiny import VOCAB, Interrupter, build_model, build_tokenizer, dump_results, token_rows


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def build_t5() -> transformers.PreTrainedModel:
    import torch

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                                   dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=3)
    return transformers.T5ForConditionalGeneration(config)


def exact_tokens(prediction: transformers.EvalPrediction) -> dict[str, float]:
    predictions, labels = prediction.predictions, prediction.label_ids
    width = min(predictions.shape[1], labels.shape[1])
    mask = labels[:, :width] > 0
    return {"token_accuracy": float(((predictions[:, :width] == labels[:, :width]) & mask).sum() / max(mask.sum(), 1))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--trainer", required=True, choices=["sft", "sft_peft", "dpo", "grpo", "seq2seq"])
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--ga", type=int, default=2)
    a = p.parse_args(argv)

    from hf_resumable.integrations.trainer import make_resumable

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tokenizer = build_tokenizer()
    tokenizer.eos_token = "[SEP]"
    common = dict(output_dir=a.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=a.ga,
                  max_steps=a.max_steps, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
                  logging_steps=2, save_strategy="steps", save_steps=1, seed=42, report_to=[], disable_tqdm=True,
                  use_cpu=True)
    rows = token_rows(44)
    callbacks = [Interrupter(a.ga)]
    if a.trainer in ("sft", "sft_peft"):
        from trl import SFTConfig, SFTTrainer

        peft_config = None
        if a.trainer == "sft_peft":
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                                     task_type="CAUSAL_LM")
        train = datasets.Dataset.from_dict({"text": [words(r) for r in rows]})
        trainer = make_resumable(SFTTrainer)(
            model=build_model("gpt2"), args=SFTConfig(max_length=32, **common), train_dataset=train,
            processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    elif a.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        rng = np.random.default_rng(3)
        train = datasets.Dataset.from_dict({
            "prompt": [words(r[:4]) for r in rows],
            "chosen": [words(rng.integers(5, VOCAB, 4).tolist()) for _ in rows],
            "rejected": [words(rng.integers(5, VOCAB, 4).tolist()) for _ in rows]})
        trainer = make_resumable(DPOTrainer)(
            model=build_model("gpt2"), ref_model=build_model("gpt2"), args=DPOConfig(max_length=32, **common),
            train_dataset=train, processing_class=tokenizer, callbacks=callbacks)
    elif a.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        def reward(completions: list[str], **kwargs) -> list[float]:
            return [len(set(completion.split())) / 4 for completion in completions]

        train = datasets.Dataset.from_dict({"prompt": [words(r[:4]) for r in rows]})
        trainer = make_resumable(GRPOTrainer)(
            model=build_model("gpt2"), reward_funcs=reward, train_dataset=train, processing_class=tokenizer,
            args=GRPOConfig(num_generations=2, max_completion_length=4, **common), callbacks=callbacks)
    else:
        def pairs(source: list[list[int]]) -> datasets.Dataset:
            return datasets.Dataset.from_dict({"input_ids": [r[:12] for r in source],
                                               "labels": [list(reversed(r[:5])) + [3] for r in source]})

        model = build_t5()
        args = transformers.Seq2SeqTrainingArguments(
            predict_with_generate=True, generation_max_length=8, eval_strategy="steps", eval_steps=2,
            per_device_eval_batch_size=8, **common)
        trainer = make_resumable(transformers.Seq2SeqTrainer)(
            model=model, args=args, train_dataset=pairs(rows), eval_dataset=pairs(token_rows(8, seed=5)),
            data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer,
            compute_metrics=exact_tokens, callbacks=callbacks)
    output = trainer.train(resume_from_checkpoint=True)
    dump_results(trainer, Path(a.output_dir), output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
