"""Train a tiny model with ResumableTrainer (or the stock Trainer) and dump everything a test compares.

Run by the subprocess tests in tests/test_trainer_*.py. The same command line is used for the
uninterrupted run, the run that gets killed, and its restart; only environment variables decide
where the process kills itself:

    HFR_KILL_AFTER_SAVE=k   SIGKILL right after checkpoint-k has committed (on_save of step k)
    HFR_KILL_MID_STEP=k     SIGKILL inside optimizer step k+1 (after its first micro-batch backward,
                            or before its forward when gradient_accumulation_steps == 1)
    HFR_SIGTERM_AT=k        SIGTERM to itself at the start of optimizer step k+1
    HFR_SLOW_AFTER_SIGTERM=s  every optimizer step from k+1 on (after HFR_SIGTERM_AT=k) takes s seconds more
                            (a sleep at its start): a step time that makes a preemption notice's decision certain
    HFR_SIGNAL_RANK=r       under torchrun: only rank r sends itself the signals above (default: every rank)
    HFR_KILL_JOB_AFTER_SAVE=k   under torchrun: rank 0 SIGKILLs the whole job (the torchrun agent and every
                            worker) right after checkpoint-k has committed
    HFR_FAIL_SAVE=k         writing checkpoint-k's tensor files fails with OSError(ENOSPC) (a full disk), after
                            part of the first file is written

``--device cuda`` trains on the GPU (tests/test_gpu.py; ``cpu``, the default, is the same flow on the CPU), with
``--precision fp16`` (a GradScaler whose initial scale is ``--init-scale``: a huge one makes the first steps
overflow, and the scaler skips them) or ``bf16``; ``--deterministic`` sets the deterministic settings of
docs/limits.md (``torch.use_deterministic_algorithms(True)``, cuDNN deterministic, no TF32, eager attention; the
caller sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` before CUDA starts).

With ``--save-async`` a save returns before its checkpoint has committed: on_save of step k then only means that
checkpoint-(k-1) has committed (the save of step k waited for it), checkpoint-k may still be in flight.

At the end it writes OUTPUT_DIR/result.json (log history) and OUTPUT_DIR/final.safetensors (model
parameters and optimizer state tensors); under torchrun rank r > 0 writes result-rank{r}.json and
final-rank{r}.safetensors, and a rank leaving through a preemption exit writes exit-rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 64
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def build_model(kind: str, **config_options) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(n_layer=2, n_embd=config_options.pop("n_embd", 32), n_head=2, vocab_size=VOCAB,
                            n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, pad_token_id=0,
                            **config_options)
        return GPT2LMHeadModel(config)
    if kind == "llama":
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
                             attention_dropout=0.1, pad_token_id=0, **config_options)
        return LlamaForCausalLM(config)
    if kind == "bert":
        config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.1,
                            attention_probs_dropout_prob=0.1, pad_token_id=0, **config_options)
        return BertForMaskedLM(config)
    raise ValueError(kind)


def token_rows(n: int, *, seed: int = 1234, min_len: int = 5, max_len: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(len(SPECIAL), VOCAB, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


def augment_python_numpy(ids: list[int]) -> list[int]:
    """Random augmentation drawing from python random and numpy's global generator."""
    ids = list(ids)
    if len(ids) > 6 and random.random() < 0.5:
        del ids[random.randrange(len(ids))]
    noise = np.random.randint(len(SPECIAL), VOCAB)
    ids[np.random.randint(len(ids))] = int(noise)
    return ids


class RandomCropDataset(torch.utils.data.Dataset):
    """A plain torch Dataset whose __getitem__ draws from numpy's and torch's global generators."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        ids = self.rows[index]
        start = int(np.random.randint(0, 3))
        ids = ids[start:]
        ids = [i if torch.rand(()) > 0.1 else 4 for i in ids]
        return {"input_ids": ids}


class NoisyCollator:
    """A custom collator that pads and then draws from torch's global generator (token noise)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.inner = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def __call__(self, features: list[dict]) -> dict:
        batch = self.inner(features)
        noise = torch.randint(len(SPECIAL), VOCAB, batch["input_ids"].shape)
        flip = (torch.rand(batch["input_ids"].shape) < 0.05) & (batch["attention_mask"] == 1)
        batch["input_ids"] = torch.where(flip, noise, batch["input_ids"])
        return batch


class PrivateRngCollator:
    """A custom collator with its own numpy generator (a private stream, not the global one)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.inner = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        self.rng = np.random.default_rng(0)

    def __call__(self, features: list[dict]) -> dict:
        batch = self.inner(features)
        noise = torch.from_numpy(self.rng.random(tuple(batch["input_ids"].shape)))
        flip = (noise < 0.1) & (batch["attention_mask"] == 1)
        batch["input_ids"] = torch.where(flip, torch.full_like(batch["input_ids"], 4), batch["input_ids"])
        return batch


def wwm_rows(n: int) -> list[dict]:
    """Rows with offset mappings whose words span 1-3 tokens (for whole-word masking)."""
    rng = np.random.default_rng(99)
    out = []
    for _ in range(n):
        ids, offsets, pos = [], [], 0
        while len(ids) < 16:
            for piece in range(int(rng.integers(1, 4))):
                ids.append(int(rng.integers(len(SPECIAL), VOCAB)))
                offsets.append([pos, pos + 2])
                pos += 2
            pos += 1  # a space between words
        out.append({"input_ids": ids[:16], "offset_mapping": offsets[:16]})
    return out


def build_data(kind: str, tokenizer: PreTrainedTokenizerFast, n: int):
    rows = datasets.Dataset.from_dict({"input_ids": token_rows(n)})
    if kind == "lm":
        return rows, DataCollatorForLanguageModeling(tokenizer, mlm=False)
    if kind == "lm_transform":
        ds = datasets.Dataset.from_dict({"input_ids": token_rows(n)})
        ds.set_transform(lambda batch: {"input_ids": [augment_python_numpy(r) for r in batch["input_ids"]]})
        return ds, NoisyCollator(tokenizer)
    if kind == "torch_random":
        return RandomCropDataset(token_rows(n)), DataCollatorForLanguageModeling(tokenizer, mlm=False)
    if kind == "mlm":
        return rows, DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    if kind == "mlm_seeded":  # the collator's own generator (seed=, re-seeded per worker by transformers)
        return rows, DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=123)
    if kind == "private_rng":
        return rows, PrivateRngCollator(tokenizer)
    if kind == "wwm":
        rows = wwm_rows(n)
        ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})
        return ds, DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, whole_word_mask=True)
    if kind in ("stream", "stream_shuffle"):
        ds = datasets.Dataset.from_dict({"input_ids": token_rows(n)}).to_iterable_dataset(num_shards=4)
        if kind == "stream_shuffle":
            ds = ds.shuffle(seed=7, buffer_size=16)
        ds = ds.map(lambda row: {"input_ids": augment_python_numpy(row["input_ids"])})
        return ds, DataCollatorForLanguageModeling(tokenizer, mlm=False)
    raise ValueError(kind)


class Interrupter(TrainerCallback):
    """Kills this process at the step named by HFR_* environment variables."""

    def __init__(self, ga: int) -> None:
        self.ga = ga
        self.after_save = _env_int("HFR_KILL_AFTER_SAVE")
        self.mid_step = _env_int("HFR_KILL_MID_STEP")
        self.sigterm_at = _env_int("HFR_SIGTERM_AT")
        self.slow_after_sigterm = float(os.environ.get("HFR_SLOW_AFTER_SIGTERM") or 0)
        self.kill_job_after_save = _env_int("HFR_KILL_JOB_AFTER_SAVE")
        signal_rank = _env_int("HFR_SIGNAL_RANK")
        if signal_rank is not None and signal_rank != RANK:
            self.after_save = self.mid_step = self.sigterm_at = None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.after_save:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == self.kill_job_after_save and RANK == 0:
            kill_torchrun_job()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.sigterm_at is not None and state.global_step >= self.sigterm_at and self.slow_after_sigterm:
            time.sleep(self.slow_after_sigterm)
        if self.ga == 1 and state.global_step == self.mid_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == self.mid_step:
            os.kill(os.getpid(), signal.SIGKILL)


class WeightedTrainer(transformers.Trainer):
    """A user subclass that samples rows with weights 1, 2, 3, 1, 2, 3, ... (with replacement)."""

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        weights = [1.0 + i % 3 for i in range(len(dataset))]
        return torch.utils.data.WeightedRandomSampler(weights, num_samples=len(dataset), replacement=True)


RANK = int(os.environ.get("RANK", "0"))


def kill_torchrun_job() -> None:
    """SIGKILL the torchrun agent (this process's parent) and every process under it, this one last."""
    import psutil

    # Forked from the test zygote, this process's parent is the zygote, and torchrun's child is the client that
    # asked for it (tests/helpers/zygote.py sets HFR_ZYGOTE_CLIENT_PID); its workers die with their clients.
    client = os.environ.get("HFR_ZYGOTE_CLIENT_PID")
    agent = (psutil.Process(int(client)) if client else psutil.Process()).parent()
    victims = [agent] + [p for p in agent.children(recursive=True) if p.pid != os.getpid()]
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


class ScalerRecorder(TrainerCallback):
    """Records, at each optimizer step's end, the GradScaler's scale and whether the step was skipped (an overflow)."""

    def __init__(self) -> None:
        self.trainer = None
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        scaler = self.trainer.accelerator.scaler
        if scaler is not None:
            self.steps.append({"step": state.global_step, "scale": scaler.get_scale(),
                               "skipped": bool(self.trainer.accelerator.optimizer_step_was_skipped)})


def install_grad_scaler(trainer, init_scale: float) -> None:
    """A GradScaler starting at ``init_scale`` (a huge one overflows at once), backing off fast (a step skipped on
    overflow divides the scale by 256) and growing after 3 good steps, so that skips and growth both happen within
    a few steps. Set before ``train()`` prepares the optimizer, which takes the accelerator's scaler then."""
    if trainer.accelerator.scaler is not None:
        trainer.accelerator.scaler = torch.amp.GradScaler(trainer.accelerator.device.type, init_scale=init_scale,
                                                          backoff_factor=2.0 ** -8, growth_interval=3)


class SaveRecorder(TrainerCallback):
    """Records, at each on_save, whether the checkpoint of that step was still being written in the background."""

    def __init__(self) -> None:
        self.trainer = None
        self.in_flight: list[int] = []

    def on_save(self, args, state, control, **kwargs):
        from hf_resumable.checkpoint.api import background_saver
        from hf_resumable.checkpoint.background.async_save import _SaveJob

        # the stock Trainer has no _commits; a blocking save's follow-ups wait for its deferred fsyncs, not a write
        if getattr(getattr(self.trainer, "_commits", None), "pending", False) and isinstance(
                background_saver()._job, _SaveJob):
            self.in_flight.append(state.global_step)


def fail_saves_of(step: int) -> None:
    """Make the tensor files of checkpoint-``step`` fail to write as on a full disk (ENOSPC, after 1 KiB)."""
    import errno

    from hf_resumable.checkpoint.commit import _writer

    original = _writer.write_safetensors
    marker = f".tmp-checkpoint-{step}."

    def write_safetensors(path, *args, **kwargs):
        if any(part.startswith(marker) for part in Path(path).parts):
            with open(path, "xb") as partial:
                partial.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return original(path, *args, **kwargs)

    _writer.write_safetensors = write_safetensors


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def dump_results(trainer, output_dir: Path, train_output, saves_in_flight: list[int] = (),
                 scaler_steps: list[dict] = ()) -> None:
    model = trainer.accelerator.unwrap_model(trainer.model)
    tensors = {f"model/{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            for key, value in trainer.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"optim/{names[id(p)]}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
    suffix = f"-rank{RANK}" if RANK else ""
    save_file(tensors, str(output_dir / f"final{suffix}.safetensors"))
    # Wall-clock fields are the only non-deterministic ones; they are removed by name.
    timing = ("_runtime", "_samples_per_second", "_steps_per_second", "step_time")  # step_time: TRL's GRPO
    history = [{k: v for k, v in entry.items() if not k.endswith(timing)} for entry in trainer.state.log_history]
    resumed_from = getattr(trainer, "resumed_from", None)
    metrics = {k: v for k, v in train_output.metrics.items() if not k.endswith(timing)}
    result = {"log_history": history, "global_step": train_output.global_step,
              "lr": trainer.lr_scheduler.get_last_lr(),
              "resumed_from": str(resumed_from) if resumed_from else None,
              "saves_in_flight_at_on_save": list(saves_in_flight),
              "scaler_steps": list(scaler_steps),
              "scaler": trainer.accelerator.scaler.state_dict() if trainer.accelerator.scaler is not None else None,
              "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
              "train_output": {"global_step": train_output.global_step, "training_loss": train_output.training_loss,
                               "metrics": metrics}}
    (output_dir / f"result{suffix}.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "bert"])
    p.add_argument("--width", type=int, default=None, help="gpt2's n_embd (256: files above the quick-hash limit)")
    p.add_argument("--data", default="lm")
    p.add_argument("--samples", type=int, default=44)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--logging-strategy", default="steps", choices=["steps", "epoch"])
    p.add_argument("--eval", action="store_true", help="evaluate every save, load_best_model_at_end")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--early-stopping", type=int, default=None,
                   help="EarlyStoppingCallback patience (threshold 1.0: every evaluation after the first counts)")
    p.add_argument("--no-restore-callbacks", action="store_true",
                   help="ResumableTrainer(restore_callback_states=False)")
    p.add_argument("--weighted-sampler", action="store_true",
                   help="a user Trainer subclass whose _get_train_sampler is a WeightedRandomSampler (make_resumable)")
    p.add_argument("--stock", action="store_true", help="use transformers.Trainer (for comparisons)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--sampling", default="random", choices=["random", "sequential", "group_by_length"])
    p.add_argument("--allow-config-drift", action="store_true")
    p.add_argument("--allow-inexact-resume", action="store_true")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--save-async", action="store_true", help="ResumableTrainer(save_async=True)")
    p.add_argument("--preemption-notice", type=float, default=None, help="ResumableTrainer(preemption_notice=...)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="no", choices=["no", "fp16", "bf16"], help="TrainingArguments(fp16/bf16)")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16, help="the fp16 GradScaler's initial scale")
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms and eager attention")
    a = p.parse_args(argv)

    from hf_resumable.integrations.trainer import ResumableTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tokenizer = build_tokenizer()
    if a.deterministic:  # the settings docs/limits.md names, kept in one place: the reference loop's
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from custom_loop import use_deterministic_settings

        use_deterministic_settings()
    options = {"attn_implementation": "eager"} if a.deterministic else {}
    model = build_model(a.model, **options, **({"n_embd": a.width} if a.width is not None else {}))
    if a.lora:
        from peft import LoraConfig, get_peft_model

        target = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "bert": ["query", "value"]}[a.model]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=target))
    train, collator = build_data(a.data, tokenizer, a.samples)
    evaluation = {}
    if a.eval:
        evaluation = dict(eval_strategy="steps", eval_steps=a.save_steps, load_best_model_at_end=True,
                          metric_for_best_model="eval_loss", greater_is_better=False)
    args = TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=a.batch, per_device_eval_batch_size=8,
        gradient_accumulation_steps=a.ga, num_train_epochs=a.epochs, max_steps=a.max_steps, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, logging_steps=a.logging_steps,
        logging_strategy=a.logging_strategy, train_sampling_strategy=a.sampling,
        save_strategy="steps", save_steps=a.save_steps, save_total_limit=a.save_total_limit,
        dataloader_num_workers=a.workers, seed=a.seed, report_to=[], disable_tqdm=True, use_cpu=a.device == "cpu",
        fp16=a.precision == "fp16", bf16=a.precision == "bf16",
        remove_unused_columns=a.data != "wwm",  # the whole-word-masking collator needs offset_mapping
        **evaluation)
    if _env_int("HFR_FAIL_SAVE") is not None:
        fail_saves_of(_env_int("HFR_FAIL_SAVE"))
    recorder, scaler_recorder = SaveRecorder(), ScalerRecorder()
    callbacks = [Interrupter(a.ga), recorder, scaler_recorder]
    if a.early_stopping is not None:
        callbacks.append(transformers.EarlyStoppingCallback(early_stopping_patience=a.early_stopping,
                                                            early_stopping_threshold=1.0))
    kwargs = dict(model=model, args=args, train_dataset=train, data_collator=collator, processing_class=tokenizer,
                  callbacks=callbacks)
    if a.eval:
        kwargs["eval_dataset"] = datasets.Dataset.from_dict({"input_ids": token_rows(16, seed=5)})
    if a.stock:
        trainer = transformers.Trainer(**kwargs)
    elif a.weighted_sampler:
        from hf_resumable.integrations.trainer import make_resumable

        trainer = make_resumable(WeightedTrainer)(allow_config_drift=a.allow_config_drift, save_async=a.save_async,
                                                  **kwargs)
    else:
        trainer = ResumableTrainer(allow_config_drift=a.allow_config_drift,
                                   allow_inexact_resume=a.allow_inexact_resume,
                                   restore_callback_states=not a.no_restore_callbacks, save_async=a.save_async,
                                   preemption_notice=a.preemption_notice, **kwargs)
    recorder.trainer = scaler_recorder.trainer = trainer
    if a.precision == "fp16":
        install_grad_scaler(trainer, a.init_scale)
    try:
        output = trainer.train(resume_from_checkpoint=not a.no_resume)
        dump_results(trainer, Path(a.output_dir), output, recorder.in_flight, scaler_recorder.steps)
    except SystemExit as exit_:  # preemption: record which step this rank saved before leaving
        record = {"code": exit_.code, "global_step": trainer.state.global_step}
        (Path(a.output_dir) / f"exit-rank{RANK}.json").write_text(json.dumps(record))
        raise
    finally:
        if torch.distributed.is_initialized():
            # gloo left to interpreter exit can SIGABRT there (a known torch issue); destroying the group while
            # the DDP-wrapped model still holds it can deadlock when the model is released: release it first.
            import gc

            del trainer, kwargs, model, recorder, scaler_recorder
            gc.collect()
            torch.distributed.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
