"""Tiny real transformers models built from configs (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB = 128


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=1)
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg))


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
               pad_token_id=2)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def tiny_bert(seed: int = 0, **overrides) -> BertForMaskedLM:
    torch.manual_seed(seed)
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
               max_position_embeddings=64, pad_token_id=0)
    cfg.update(overrides)
    return BertForMaskedLM(BertConfig(**cfg))


FACTORIES = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}


def decay_groups(model: torch.nn.Module) -> list[dict]:
    """Two param groups whose hyper-parameters differ, as the Trainer builds them: matrices with weight decay, vectors
    (norms, biases) without."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def train_steps(model: torch.nn.Module, optimizer, scheduler=None, *, steps: int = 3, seed: int = 0,
                device: str | torch.device = "cpu") -> None:
    """A few real optimizer steps so the optimizer has state (batches drawn on the CPU, moved to ``device``)."""
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (2, 16), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()


def assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, fields in sa["state"].items():
        assert fields.keys() == sb["state"][index].keys()
        for name, value in fields.items():
            other = sb["state"][index][name]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), (index, name)
            else:
                assert value == other, (index, name)
