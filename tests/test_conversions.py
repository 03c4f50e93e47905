"""The stock-Trainer behaviour :mod:`hf_resumable.conversions.stock` mirrors without importing the Trainer.

The converter rebuilds the Trainer's optimizer groups (weight decay / no weight decay) and reads the stock pickles
with the Trainer's ``weights_only`` allow-list. Both are written out in the converter (conversions/ sits below
integrations/, the only layer that imports ``transformers.Trainer``); these tests fail as soon as the Trainer's own
rule changes, so the copy cannot drift silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_pt_utils import safe_globals

from hf_resumable.conversions._pickle import numpy_globals
from hf_resumable.conversions.stock import _decay_parameter_names

from helpers.tiny_models import tiny_bert, tiny_gpt2, tiny_llama


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.foo = nn.LayerNorm(4)  # excluded by type, whatever its name
        self.scale_norm = nn.Parameter(torch.ones(4))
        self.normalizer = nn.Parameter(torch.ones(4))  # "norm" only as a whole name part or with "_" before it
        self.RMSNorm_gain = nn.Parameter(torch.ones(4))  # names are compared lower-cased


class _Odd(nn.Module):
    """Shared and nested modules, a LayerNorm at the top, a parameter directly on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.again = self.block  # the same module under a second name
        self.norm = nn.Linear(4, 4)
        self.stack = nn.Sequential(_Block(), nn.LayerNorm(4), nn.Linear(4, 4, bias=False))
        self.bias_correction = nn.Parameter(torch.ones(1))
        self.root = nn.Parameter(torch.ones(1))


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama, tiny_bert, _Odd, lambda: nn.LayerNorm(4)],
                         ids=["gpt2", "llama", "bert", "odd", "layernorm-root"])
def test_decay_split_is_the_trainers(build):
    model = build()
    ours = _decay_parameter_names(model)
    assert ours == set(Trainer.get_decay_parameter_names(None, model))
    named = {name for name, _ in model.named_parameters()}
    assert ours & named, "nothing decays: the comparison would be vacuous"


def test_pickle_allow_list_is_the_trainers():
    always = set(torch.serialization.get_safe_globals())  # what torch and its importers allow process-wide
    with safe_globals():
        theirs = set(torch.serialization.get_safe_globals()) - always
    with torch.serialization.safe_globals(numpy_globals()):
        ours = set(torch.serialization.get_safe_globals()) - always
    assert ours == theirs and theirs
