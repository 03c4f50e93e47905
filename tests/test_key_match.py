"""One key matcher, one tied-weight detector: the regular load, the sharded (resharding) load and lazy loading give
the same verdict, in the same words, on the same checkpoint and the same mismatching model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
from hf_resumable.checkpoint.state._model import find_aliases, match_keys
from hf_resumable.errors import CheckpointMismatchError
from hf_resumable.lazy import load_lazily

from helpers.hub_fixtures import on_meta
from helpers.tiny_models import tiny_gpt2

PATHS = {
    "regular": lambda path, model, strict: load_checkpoint(path, model=model, strict=strict, restore_rng=False),
    "sharded": lambda path, model, strict: load_checkpoint(path, model=model, strict=strict,
                                                           restore_rng=False),
    "lazy": lambda path, model, strict: load_lazily(model, path, strict=strict),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("key_match") / "checkpoint-1"
    save_checkpoint(path, model=tiny_gpt2(), step=1, rng=False)  # one model.safetensors, lm_head tied to wte
    return path


def _verdicts(checkpoint: Path, build, *, strict: bool) -> dict[str, str]:
    """Each path's error message, without the source it names (each names the file or directory it read)."""
    found = {}
    for name, load in PATHS.items():
        with pytest.raises(CheckpointMismatchError) as caught:
            load(checkpoint, build(), strict)
        message = str(caught.value)
        assert " does not fit the model (" in message, (name, message)
        found[name] = message.split(" does not fit the model ", 1)[1]
    return found


@pytest.mark.parametrize("variant, counts, example", [
    ({"n_layer": 3}, "12 problem(s): missing keys (12)", "transformer.h.2.attn.c_attn.weight: missing from the"),
    ({"n_layer": 1}, "12 problem(s): unexpected keys (12)", "transformer.h.1.mlp.c_fc.bias: in the checkpoint but"),
    ({"n_embd": 16}, "29 problem(s): shape mismatches (29)", "lm_head.weight: checkpoint [128, 32] vs model [128,"),
])
def test_the_three_load_paths_give_one_verdict(checkpoint: Path, variant: dict, counts: str, example: str) -> None:
    verdicts = _verdicts(checkpoint, lambda: tiny_gpt2(**variant), strict=True)
    assert verdicts["regular"] == verdicts["sharded"] == verdicts["lazy"], verdicts
    assert verdicts["regular"].startswith(f"({counts}") and example in verdicts["regular"], verdicts["regular"]


def test_shape_mismatches_refused_even_when_not_strict_by_all_three(checkpoint: Path) -> None:
    verdicts = _verdicts(checkpoint, lambda: tiny_gpt2(n_embd=16), strict=False)
    assert verdicts["regular"] == verdicts["sharded"] == verdicts["lazy"]
    assert "strict=False skips missing/unexpected keys, not mismatches" in verdicts["regular"]


def test_not_strict_all_three_load_the_same_weights(checkpoint: Path) -> None:
    reference = tiny_gpt2().state_dict()
    loaded = {}
    for name, load in PATHS.items():
        model = tiny_gpt2(seed=7, n_layer=3)
        fresh = model.transformer.h[2].attn.c_attn.weight.clone()
        load(checkpoint, model, False)
        loaded[name] = model.state_dict()
        assert torch.equal(model.transformer.h[2].attn.c_attn.weight, fresh)  # missing: left as it was
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    for state in loaded.values():
        for key, value in reference.items():
            assert torch.equal(state[key], value), key


def test_one_tied_weight_detector_on_real_meta_and_saved_models() -> None:
    model = tiny_gpt2()
    expected = {"lm_head.weight": "transformer.wte.weight"}
    assert find_aliases(model.state_dict()) == expected  # detached entries: one storage
    assert find_aliases(model.state_dict(keep_vars=True)) == expected  # the parameters themselves
    meta = on_meta(model)
    meta.tie_weights()  # what load_lazily does first
    assert find_aliases(meta.state_dict(keep_vars=True)) == expected  # no storage: the same object
    # two meta tensors of one shape are not one tensor (their storage pointers are all 0)
    assert find_aliases({"a": torch.empty(3, device="meta"), "b": torch.empty(3, device="meta")}) == {}
    untied = tiny_gpt2(tie_word_embeddings=False)
    assert find_aliases(untied.state_dict()) == {}
    state = model.state_dict()
    state["copy"] = state["transformer.wte.weight"].clone()  # equal values, other bytes: not an alias
    assert "copy" not in find_aliases(state)


def test_match_keys_fills_aliases_and_the_models_own_ties() -> None:
    spec = (torch.float32, (4, 2))
    stored = {"wte": spec}
    # the checkpoint's record fills an alias, which must have the stored tensor's shape
    assert match_keys({"wte": spec, "head": spec}, stored, tied={"head": "wte"}).sources == {"wte": ["wte", "head"]}
    wrong = match_keys({"wte": spec, "head": (torch.float32, (2, 4))}, stored, tied={"head": "wte"})
    assert [m.name for m in wrong.mismatched] == ["head"] and not wrong.fits(strict=False)
    # the expected side's own tie covers an unrecorded alias; without it, it is missing
    assert match_keys({"wte": spec, "head": spec}, stored, shared={"head": "wte"}).missing == []
    assert match_keys({"wte": spec, "head": spec}, stored).missing == ["head"]
    # a recorded alias nothing expects is unexpected; a dtype difference counts unless told otherwise
    assert match_keys({"wte": spec}, stored, tied={"head": "wte"}).unexpected == ["head"]
    assert match_keys({"wte": (torch.bfloat16, (4, 2))}, stored).mismatched[0].kind == "dtype"
    assert match_keys({"wte": (torch.bfloat16, (4, 2))}, stored, compare_dtype=False).fits(strict=True)


def test_a_tied_checkpoint_fills_an_untied_model_the_same_way_on_all_three(checkpoint: Path) -> None:
    # The checkpoint stores wte once and records lm_head.weight as its alias; each path reads that record.
    wte = tiny_gpt2().transformer.wte.weight.detach()
    for name, load in PATHS.items():
        model = tiny_gpt2(seed=3, tie_word_embeddings=False)
        load(checkpoint, model, True)
        assert model.lm_head.weight is not model.transformer.wte.weight, name
        assert torch.equal(model.lm_head.weight, wte) and torch.equal(model.transformer.wte.weight, wte), name
