"""``ResumableTrainer`` built in-process: on the tiny GPT-2 of train_tiny.py (:func:`_trainer`), and on the tiny
regression model of transformers' own trainer tests (:func:`regression_trainer`)."""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from torch import nn
from transformers import (
    DataCollatorForLanguageModeling,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)

from hf_resumable.integrations.trainer import ResumableTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_scripts"))
import train_tiny  # noqa: E402  (tiny models, tokenizer and data shared with the subprocess grid)


def _trainer(output_dir: Path, *, ga: int = 1, batch: int = 4, seed: int = 42, samples: int = 24, max_steps: int = 2,
             dropout_model: str = "gpt2", **kwargs) -> ResumableTrainer:
    tokenizer = train_tiny.build_tokenizer()
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=ga, max_steps=max_steps, save_steps=2, logging_steps=1,
                             seed=seed, report_to=[], disable_tqdm=True, use_cpu=True, learning_rate=1e-3)
    data = datasets.Dataset.from_dict({"input_ids": train_tiny.token_rows(samples)})
    return ResumableTrainer(model=train_tiny.build_model(dropout_model), args=args, train_dataset=data,
                            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), **kwargs)


class RegressionConfig(PretrainedConfig):
    model_type = "hfr-test-regression"

    def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.a, self.b = a, b


def _regression(a: torch.Tensor, b: torch.Tensor, input_x: torch.Tensor, labels: torch.Tensor | None) -> dict:
    y = input_x * a + b
    return {"logits": y} if labels is None else {"loss": nn.functional.mse_loss(y, labels), "logits": y}


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(float(config.a)))
        self.b = nn.Parameter(torch.tensor(float(config.b)))
        self.post_init()

    def forward(self, input_x, labels=None):
        return _regression(self.a, self.b, input_x, labels)


class RegressionModel(nn.Module):
    """Not a PreTrainedModel."""

    def __init__(self, a: float = 0.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))

    def forward(self, input_x, labels=None):
        return _regression(self.a, self.b, input_x, labels)


class RegressionDataset(torch.utils.data.Dataset):
    def __init__(self, length: int = 64, a: float = 2.0, b: float = 3.0, seed: int = 42) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (a * self.x + b + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"input_x": self.x[index], "labels": self.y[index]}


def regression_trainer(output_dir: Path, *, train_len: int = 64, pretrained: bool = True, callbacks=(),
                       trainer_class: type = ResumableTrainer, **arguments) -> Trainer:
    arguments.setdefault("report_to", [])
    args = TrainingArguments(str(output_dir), use_cpu=True, disable_tqdm=True, **arguments)
    model = RegressionPreTrainedModel(RegressionConfig()) if pretrained else RegressionModel()
    return trainer_class(model=model, args=args, train_dataset=RegressionDataset(train_len),
                         eval_dataset=RegressionDataset(16, seed=5), callbacks=list(callbacks))


def _checkpoints(output_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))


def _evaluate_with(values: list[float]):
    """A stand-in for Trainer._evaluate returning ``values`` in turn, then the last one (the mock skips
    ``on_evaluate``, so the stock loop evaluates once more at the epoch end, as it does here with ``Trainer``)."""
    calls = iter(values)

    def evaluate(*args, **kwargs) -> dict[str, float]:
        return {"eval_accuracy": next(calls, values[-1])}
    return evaluate
