"""Weights are read in place, but with load_state_dict semantics (issue 13, item 9).

A model that takes part in its own (de)serialization (overrides ``load_state_dict`` or
``_load_from_state_dict``, registers state-dict hooks, holds lazy or resizable buffers) must resume as
transformers' stock Trainer resumes it: through its ``load_state_dict``. The reference here is
``transformers.trainer_utils.load_sharded_checkpoint`` (what the stock Trainer calls for a sharded
safetensors checkpoint: ``model.load_state_dict(shard, strict=False)`` per shard).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2LMHeadModel
from transformers.trainer_utils import load_sharded_checkpoint

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
from hf_resumable.checkpoint.state._model import load_state_dict_reason
from hf_resumable.errors import CheckpointMismatchError

from helpers.tiny_models import VOCAB, assert_same_state, tiny_gpt2, tiny_llama, train_steps


def _stock(model: torch.nn.Module, path) -> torch.nn.Module:
    load_sharded_checkpoint(model, path, strict=False)
    return model


def _save(tmp_path, model, name="checkpoint-1"):
    save_checkpoint(tmp_path / name, model=model, rng=False, max_shard_size="32KB")
    return tmp_path / name


class ScaledOnLoad(GPT2LMHeadModel):
    """Overrides load_state_dict: stores weights halved, doubles them back on load (a format migration)."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.load_calls = getattr(self, "load_calls", 0) + 1
        state_dict = {k: v * 2 if k.endswith("ln_f.weight") else v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


@pytest.mark.slow
def test_a_model_overriding_load_state_dict_goes_through_it(tmp_path):
    model = tiny_gpt2()
    path = _save(tmp_path, model)
    ours, stock = ScaledOnLoad(model.config), ScaledOnLoad(model.config)
    assert load_state_dict_reason(ours, ours.state_dict(keep_vars=True)) == "the model (ScaledOnLoad) overrides " \
                                                                             "load_state_dict"
    load_checkpoint(path, model=ours, restore_rng=False)
    assert ours.load_calls == 1
    assert torch.equal(ours.transformer.ln_f.weight, model.transformer.ln_f.weight * 2)
    assert_same_state(_stock(stock, path).state_dict(), ours.state_dict())
    assert ours.lm_head.weight.data_ptr() == ours.transformer.wte.weight.data_ptr()  # still tied


class RunningCount(torch.nn.Module):
    """A buffer that grows during training, resized by _load_from_state_dict to the stored shape."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("history", torch.zeros(0))

    def observe(self, value: float) -> None:
        self.history = torch.cat([self.history, torch.tensor([value])])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        stored = state_dict.get(prefix + "history")
        if stored is not None:
            self.history = torch.empty_like(stored)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class WithHistory(torch.nn.Module):
    def __init__(self, resizable: bool = True) -> None:
        super().__init__()
        self.lm = tiny_llama()
        self.count = RunningCount() if resizable else torch.nn.Module()
        if not resizable:
            self.count.register_buffer("history", torch.zeros(0))


def test_a_buffer_that_changed_shape_during_training_resumes_through_load_from_state_dict(tmp_path):
    model = WithHistory()
    for value in (0.5, 1.5, 2.5):
        model.count.observe(value)
    path = _save(tmp_path, model)
    ours, stock = WithHistory(), WithHistory()
    load_checkpoint(path, model=ours, restore_rng=False)
    assert torch.equal(ours.count.history, torch.tensor([0.5, 1.5, 2.5]))
    assert_same_state(_stock(stock, path).state_dict(), ours.state_dict())
    assert_same_state(model.state_dict(), ours.state_dict())


def test_a_buffer_that_changed_shape_without_a_resizing_module_is_refused_as_stock_refuses(tmp_path):
    model = WithHistory(resizable=False)
    model.count.history = torch.arange(3.0)
    path = _save(tmp_path, model)
    ours = WithHistory(resizable=False)
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(CheckpointMismatchError, match=r"count\.history.*\[3\].*\[0\]"):
        load_checkpoint(path, model=ours, restore_rng=False)
    assert_same_state(before, ours.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch for count.history"):
        _stock(WithHistory(resizable=False), path)


@pytest.mark.slow
def test_load_state_dict_pre_and_post_hooks_run(tmp_path):
    model = tiny_gpt2()
    path = _save(tmp_path, model)
    calls = []

    def build():
        fresh = tiny_gpt2(seed=3)

        def pre(module, state_dict, prefix, *args):
            calls.append("pre")
            key = prefix + "weight"
            if key in state_dict:  # the stock loader calls load_state_dict once per shard
                state_dict[key] = state_dict[key] + 1  # e.g. a stored-format migration

        fresh.transformer.ln_f.register_load_state_dict_pre_hook(pre)
        fresh.register_load_state_dict_post_hook(lambda module, keys: calls.append("post"))
        return fresh

    ours = build()
    load_checkpoint(path, model=ours, restore_rng=False)
    assert calls == ["pre", "post"]
    assert torch.equal(ours.transformer.ln_f.weight, model.transformer.ln_f.weight + 1)
    assert_same_state(_stock(build(), path).state_dict(), ours.state_dict())


def test_a_piece_checkpoint_goes_through_the_models_own_load_too(tmp_path):
    """The piece reader reads a plain model's weights in place only when nothing of the model's own runs on load:
    with a load_state_dict hook it goes through the model's load_state_dict, as a whole-tensor load does."""
    model = tiny_gpt2()
    save_checkpoint(tmp_path / "pieces", model=model, rng=False, layout="pieces")
    calls = []
    fresh = tiny_gpt2(seed=3)
    fresh.register_load_state_dict_post_hook(lambda module, keys: calls.append("post"))
    load_checkpoint(tmp_path / "pieces", model=fresh, restore_rng=False)
    assert calls == ["post"]
    assert_same_state(model.state_dict(), fresh.state_dict())
    plain = tiny_gpt2(seed=3)  # and in place without one: the same weights
    load_checkpoint(tmp_path / "pieces", model=plain, restore_rng=False)
    assert_same_state(model.state_dict(), plain.state_dict())


def test_state_dict_hooks_that_return_copies_take_the_load_state_dict_path(tmp_path):
    def build(seed):
        model = tiny_gpt2(seed=seed)

        def as_copies(module, state_dict, prefix, local_metadata):  # e.g. a quantization wrapper
            for key in list(state_dict):
                if key.startswith(prefix) and key.endswith("ln_f.weight"):
                    state_dict[key] = state_dict[key].detach().clone()

        model.register_state_dict_post_hook(as_copies)
        return model

    model = build(0)
    path = _save(tmp_path, model)
    ours = build(1)
    reason = load_state_dict_reason(ours, ours.state_dict(keep_vars=True))
    assert reason is not None and "state_dict_hooks" in reason
    load_checkpoint(path, model=ours, restore_rng=False)
    assert torch.equal(ours.transformer.ln_f.weight, model.transformer.ln_f.weight)  # not lost in a copy
    assert_same_state(model.state_dict(), ours.state_dict())


class LazyHead(torch.nn.Module):
    """Lazy modules materialize their shapes from the checkpoint through a load_state_dict pre-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_gpt2()
        self.head = torch.nn.LazyLinear(4)


def test_lazy_modules_are_materialized_as_stock_does(tmp_path):
    model = LazyHead()
    model.head(torch.zeros(2, 32))  # materialize
    path = _save(tmp_path, model)
    ours, stock = LazyHead(), LazyHead()
    load_checkpoint(path, model=ours, restore_rng=False)
    assert ours.head.weight.shape == (4, 32)
    assert_same_state(model.state_dict(), ours.state_dict())
    assert_same_state(_stock(stock, path).state_dict(), ours.state_dict())


class RefusesHalfway(GPT2LMHeadModel):
    """A model whose own load logic fails after it has already copied some tensors."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        with torch.no_grad():
            self.transformer.wte.weight.copy_(state_dict["transformer.wte.weight"])
            self.transformer.h[0].attn.c_attn.weight.data = torch.zeros(3)  # and replaced one
        raise RuntimeError("unsupported checkpoint revision")


def test_a_model_whose_load_state_dict_fails_is_put_back_bitwise(tmp_path):
    model = tiny_gpt2()
    path = _save(tmp_path, model)
    ours = RefusesHalfway(tiny_gpt2(seed=5).config)
    before = copy.deepcopy(ours.state_dict())
    attn = ours.transformer.h[0].attn.c_attn.weight
    with pytest.raises(CheckpointMismatchError, match="unsupported checkpoint revision"):
        load_checkpoint(path, model=ours, restore_rng=False)
    assert_same_state(before, ours.state_dict())
    assert ours.transformer.h[0].attn.c_attn.weight is attn


def test_strictness_on_the_load_state_dict_path_is_load_state_dicts(tmp_path):
    model = tiny_gpt2()
    path = _save(tmp_path, model)
    deeper = ScaledOnLoad(tiny_gpt2(n_layer=3).config)
    before = copy.deepcopy(deeper.state_dict())
    with pytest.raises(CheckpointMismatchError, match=r"Missing key\(s\).*transformer\.h\.2"):
        load_checkpoint(path, model=deeper, restore_rng=False)
    assert_same_state(before, deeper.state_dict())
    load_checkpoint(path, model=deeper, restore_rng=False, strict=False)
    assert torch.equal(deeper.transformer.h[1].mlp.c_fc.weight, model.transformer.h[1].mlp.c_fc.weight)


def test_plain_transformers_models_are_read_in_place_without_load_state_dict(tmp_path, monkeypatch):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=1)
    path = _save(tmp_path, model)
    calls = []
    original = torch.nn.Module.load_state_dict
    monkeypatch.setattr(torch.nn.Module, "load_state_dict",
                        lambda self, *a, **k: calls.append(type(self).__name__) or original(self, *a, **k))
    fresh = tiny_llama(seed=2)
    assert load_state_dict_reason(fresh, fresh.state_dict(keep_vars=True)) is None
    pointers = [p.data_ptr() for p in fresh.parameters()]
    load_checkpoint(path, model=fresh, restore_rng=False)
    assert calls == [] and pointers == [p.data_ptr() for p in fresh.parameters()]
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert VOCAB == fresh.config.vocab_size
