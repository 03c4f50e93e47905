"""The FQN state-dict cache of sharded saves (checkpoint/_fqn_state.py): always torch's answer, torch's walk skipped
only while the model's tree and the optimizer's parameters are provably those of a call that was checked.

Every test compares against ``torch.distributed.checkpoint.state_dict``'s own functions on real modules and
optimizers, across the structure changes that must invalidate the cache (a wrapper that renames, a replaced
submodule, a new param group, another model); the FSDP2 path is covered end to end by
tests/test_distributed_async.py (a param group added between two async saves, the checkpoint reloaded).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from hf_resumable.checkpoint import _fqn_state
from hf_resumable.checkpoint._fqn_state import model_state_dict, optimizer_state_dict
from hf_resumable.checkpoint._pieces import _optimizer_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def torch_calls(monkeypatch):
    """How often torch's own functions ran (the slow path)."""
    calls = {"model": 0, "optimizer": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dcp_state_dict, "get_model_state_dict", counted("model", get_model_state_dict))
    monkeypatch.setattr(dcp_state_dict, "get_optimizer_state_dict", counted("optimizer", get_optimizer_state_dict))
    return calls


def _same_model_state(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].data_ptr() == theirs[key].data_ptr() and torch.equal(ours[key], theirs[key]), key


def _same_optimizer_state(ours: dict, theirs: dict) -> None:
    assert list(ours["state"]) == list(theirs["state"])
    for fqn, fields in theirs["state"].items():
        assert list(ours["state"][fqn]) == list(fields)
        for key, value in fields.items():
            assert ours["state"][fqn][key] is value, (fqn, key)
    assert ours["param_groups"] == theirs["param_groups"]


def test_a_plain_model_is_answered_like_torch_and_its_walk_is_learned_once(torch_calls):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    for _ in range(3):
        _same_model_state(model_state_dict(model), get_model_state_dict(model))
        _same_optimizer_state(optimizer_state_dict(model, optimizer), get_optimizer_state_dict(model, optimizer))
    assert torch_calls == {"model": 1, "optimizer": 1}  # the first call learned; the next two skipped torch's walk
    _step(model, optimizer)  # values change in place, the structure does not: still torch's answer
    _same_optimizer_state(optimizer_state_dict(model, optimizer), get_optimizer_state_dict(model, optimizer))
    assert torch_calls["optimizer"] == 1


def test_keep_vars_gives_the_live_parameters_on_the_fast_path_and_is_learned_like_the_detached_answer(torch_calls):
    """Saves ask for ``keep_vars``: the parameters themselves (no detach per entry), proven against torch's detached
    answer once, as the default call is."""
    model = _model()
    first = model_state_dict(model, keep_vars=True)  # learned: torch's answer, detached
    _same_model_state(first, get_model_state_dict(model))
    again = model_state_dict(model, keep_vars=True)
    assert torch_calls["model"] == 1
    assert list(again) == list(first)
    assert all(again[name] is param for name, param in model.named_parameters())
    assert not any(entry.requires_grad for entry in model_state_dict(model).values())  # the default: detached
    assert torch_calls["model"] == 1


def test_a_wrapper_that_renames_keys_is_never_cached():
    model = _model()
    compiled = torch.compile(model)  # state_dict() says "_orig_mod.0.weight", torch's FQN is "0.weight"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    for _ in range(2):
        ours = model_state_dict(compiled)
        assert list(ours) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        _same_model_state(ours, get_model_state_dict(compiled))
        _same_optimizer_state(optimizer_state_dict(compiled, optimizer), get_optimizer_state_dict(compiled, optimizer))
    assert compiled not in _fqn_state._MODELS


def test_a_checkpoint_wrapper_added_between_calls_is_seen(torch_calls):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    model_state_dict(model), optimizer_state_dict(model, optimizer)
    model[0] = checkpoint_wrapper(model[0])  # new module names ("0._checkpoint_wrapped_module"): the tree changed
    _same_model_state(model_state_dict(model), get_model_state_dict(model))
    _same_optimizer_state(optimizer_state_dict(model, optimizer), get_optimizer_state_dict(model, optimizer))
    assert torch_calls == {"model": 2, "optimizer": 2}


def test_a_replaced_submodule_and_a_new_param_group_are_named_afresh(torch_calls):
    model = _model()
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    _step(model, optimizer)
    assert optimizer_state_dict(model, optimizer)["param_groups"][0]["params"] == ["0.weight", "0.bias"]
    # A new group over parameters the optimizer did not list before.
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 1e-3})
    _step(model, optimizer)
    ours = optimizer_state_dict(model, optimizer)
    assert [group["params"] for group in ours["param_groups"]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    _same_optimizer_state(ours, get_optimizer_state_dict(model, optimizer))
    # The same class under the same name (the tree's names and classes are unchanged), new parameter objects.
    model[2] = torch.nn.Linear(8, 2)
    replaced = model_state_dict(model)
    assert replaced["2.weight"].data_ptr() == model[2].weight.data_ptr()
    _same_model_state(replaced, get_model_state_dict(model))
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, fresh)
    _same_optimizer_state(optimizer_state_dict(model, fresh), get_optimizer_state_dict(model, fresh))


def test_one_optimizer_over_two_models_follows_the_model_it_is_asked_about():
    model, other = _model(), torch.nn.Sequential(torch.nn.Identity(), _model())  # other names it "1.0.weight"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    other[1] = model
    for _ in range(2):
        assert optimizer_state_dict(model, optimizer)["param_groups"][0]["params"][0] == "0.weight"
        assert optimizer_state_dict(other, optimizer)["param_groups"][0]["params"][0] == "1.0.weight"


def test_an_optimizer_that_has_not_stepped_is_left_without_state():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        state = _optimizer_state(model, optimizer)
        assert state["state"] == {} and not optimizer.state
        assert state["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
