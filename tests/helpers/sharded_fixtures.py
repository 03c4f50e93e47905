"""Shared by tests/test_sharded.py and its 2-rank worker: tiny models, an elastic training loop, references.

The *reference* of a run is its consolidated state (full weights and full optimizer tensors, FQN-keyed)
written with our own pickle-free safetensors writer, so a process at another world size can compare
against it bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_resumable.data.elastic import ElasticSampler
from hf_resumable.format.rng import derive_seed
from hf_resumable.format.safetensors_io import read_safetensors, write_safetensors

from helpers.tiny_models import tiny_gpt2, tiny_llama

SEED = 1234
DATASET_LEN = 22  # 2 ranks x batch 2 -> 4 per global step; the last step of an epoch is short (2 samples)
BATCH_SIZE = 2
SEQ_LEN = 8
# Llama with an odd vocabulary: the embedding rows split unevenly across 2 ranks (64 + 63).
MODELS = {"gpt2": lambda: tiny_gpt2(seed=0), "llama": lambda: tiny_llama(seed=0, vocab_size=127)}
REFERENCE_FILE = "reference.safetensors"
REFERENCE_GROUPS_FILE = "reference_param_groups.json"


def build(kind: str, *, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model (weights from ``seed``) and its AdamW."""
    model = MODELS[kind]()
    if seed:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed)
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sample(index: int, vocab: int) -> torch.Tensor:
    """Sample ``index`` of the synthetic data set (a function of the index only)."""
    generator = torch.Generator().manual_seed(derive_seed(SEED, "sample", index))
    return torch.randint(3, vocab, (SEQ_LEN,), generator=generator)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler, steps: int) -> list[int]:
    """``steps`` optimizer steps on the sampler's batches; returns the data set indices this rank trained on."""
    vocab = model.config.vocab_size
    seen: list[int] = []
    batches = iter(sampler)
    model.train()
    for _ in range(steps):
        indices = next(batches)
        seen += indices
        ids = torch.stack([sample(i, vocab) for i in indices])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return seen


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Consolidated FQN-keyed weights and optimizer tensors (collective under FSDP2; full on rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    tensors = {f"model/{k}": v for k, v in weights.items()}
    for fqn, fields in optim.get("state", {}).items():
        tensors.update({f"optim/{fqn}/{key}": value for key, value in fields.items()})
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
              for g in optim.get("param_groups", [])]
    return tensors, groups


def write_reference(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    is_main: bool) -> None:
    """Rank 0 (``is_main``) writes the full state as the reference; under torch.distributed every rank returns only
    once it is written (another rank's ``compare_to_reference`` may come next, before any collective)."""
    tensors, groups = full_state(model, optimizer)
    if is_main:
        write_safetensors(directory / REFERENCE_FILE, sorted(tensors.items()), fsync=False)
        (directory / REFERENCE_GROUPS_FILE).write_text(json.dumps(groups, default=list))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def compare_to_reference(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Every tensor (and param group) that differs from the reference, bitwise; [] when all are equal."""
    expected = read_safetensors(directory / REFERENCE_FILE)
    got, groups = full_state(model, optimizer)
    problems = [f"{k}: keys differ" for k in sorted(set(expected) ^ set(got))]
    for key in sorted(set(expected) & set(got)):
        if expected[key].dtype != got[key].dtype or not torch.equal(expected[key], got[key]):
            problems.append(f"{key}: values differ")
    if json.loads(json.dumps(groups, default=list)) != json.loads((directory / REFERENCE_GROUPS_FILE).read_text()):
        problems.append("param_groups differ")
    return problems
