"""Distributed engines through both front doors: refused before step 1, or resumed bit for bit (FSDP2, ZeRO-1/2).

* DeepSpeed ZeRO-3 and ZeRO-Offload (through ``ResumableAccelerator`` and ``TrainingArguments.deepspeed``),
  Megatron-LM and FSDP1 are refused with :class:`UnsupportedEngineError` (also a ``NotImplementedError``) when the
  accelerator is built or ``train()`` starts: no step runs, no checkpoint directory appears, and the refusal of a
  configured DeepSpeed run never imports deepspeed.
* FSDP2 (2 gloo ranks on CPU under torchrun, accelerate's FSDP code paths turned on by
  ``engine_fixtures.install_cpu_engines``): a run held after a committed checkpoint, SIGKILLed as a whole job and
  rerun with the same command ends with every rank's parameter pieces, optimizer state and logged losses
  bit-identical to the uninterrupted run, through ``ResumableAccelerator`` (background saves) and ``ResumableTrainer``,
  with accelerate's SHARDED and FULL state-dict types (hf_resumable writes per-rank pieces for both).
* DeepSpeed ZeRO-1/2 (2 gloo ranks on DeepSpeed's CPU accelerator, a torch AdamW): the same, through both front
  doors; every rank's partitions of the fp32 master weights and of the Adam moments are compared bit for bit. In one
  process, a ZeRO-2 engine's partitions round-trip through save_checkpoint / load_checkpoint.
* ZeRO weights equal to their fp32 master weights cast are recorded as given by them, not stored, and loaded from
  them; a weight that differs (written outside the optimizer) is stored, blocking or async.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate.utils import DeepSpeedPlugin, DistributedType, MegatronLMPlugin
from transformers import TrainerCallback, TrainingArguments

from hf_resumable.errors import UnsupportedEngineError
from hf_resumable.integrations._engines import check_accelerate_state
from hf_resumable.integrations.accelerate import ResumableAccelerator
from hf_resumable.integrations.trainer import ResumableTrainer

from helpers.accelerate_runs import _fresh_accelerate_state  # noqa: F401 - autouse: a fresh accelerate state
from helpers.engine_fixtures import build_model
from helpers.engine_runs import (
    ACCELERATE_WORKER,
    TRAINER_WORKER,
    _reference,
    _resume_accelerate_bit_exact,
    _resume_trainer_bit_exact,
    accelerate_reference,  # noqa: F401 - a module fixture
    trainer_reference,  # noqa: F401 - a module fixture
)

RANKS = (0, 1)
_EXTENDED = pytest.mark.extended  # a further variant of a guarantee make test proves once (make test-all)


# ------------------------------------------------------------------ refused before step 1 (in process)


_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
_OFFLOAD_PARAM = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}


@pytest.mark.parametrize("plugin", [dict(hf_ds_config=_OFFLOAD), dict(hf_ds_config=_OFFLOAD_PARAM)],
                         ids=["offload", "zero3-offload-param"])
def test_accelerate_deepspeed_is_refused_when_built(tmp_path, plugin):
    with pytest.raises(UnsupportedEngineError, match=r"DeepSpeed ZeRO-Offload runs.*ZeRO-1/2/3 without offload") \
            as caught:
        ResumableAccelerator(deepspeed_plugin=DeepSpeedPlugin(**plugin), checkpoint_dir=tmp_path / "ck",
                             handle_preemption=False)
    assert isinstance(caught.value, NotImplementedError)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM"])
def test_accelerate_engines_enabled_by_the_environment_are_refused(tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    with pytest.raises(UnsupportedEngineError, match="DeepSpeed|Megatron-LM"):
        ResumableAccelerator(checkpoint_dir=tmp_path / "ck", handle_preemption=False)


def test_accelerate_megatron_plugin_is_refused(tmp_path):
    with pytest.raises(UnsupportedEngineError, match="Megatron-LM"):
        ResumableAccelerator(megatron_lm_plugin=MegatronLMPlugin(), checkpoint_dir=tmp_path / "ck",
                             handle_preemption=False)


def test_engine_of_accelerate_state():
    def fsdp1(**plugin) -> SimpleNamespace:
        return SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=SimpleNamespace(fsdp_version=1,
                                                                                                  **plugin))

    for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):  # replica groups: refused
        with pytest.raises(UnsupportedEngineError, match=f"FSDP1 {strategy} runs"):
            check_accelerate_state(fsdp1(sharding_strategy=f"ShardingStrategy.{strategy}"))
    for state_dict_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):  # checkpoints read the sharded state dict
        check_accelerate_state(fsdp1(state_dict_type=f"StateDictType.{state_dict_type}",
                                     sharding_strategy="ShardingStrategy.FULL_SHARD"))
    check_accelerate_state(SimpleNamespace(distributed_type=DistributedType.FSDP,
                                           fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    check_accelerate_state(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU))
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                deepspeed_plugin=SimpleNamespace(zero_stage=None,
                                                                 deepspeed_config={"zero_optimization": {"stage": 0}}))
    with pytest.raises(UnsupportedEngineError, match="DeepSpeed ZeRO-0"):
        check_accelerate_state(deepspeed)
    for stage in (1, 2, 3):
        check_accelerate_state(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                               deepspeed_plugin=SimpleNamespace(zero_stage=stage)))


def test_deepspeed_configs_are_decided_from_the_config(tmp_path):
    from hf_resumable.integrations._engines import check_trainer_engine

    def state(config: dict) -> SimpleNamespace:
        plugin = SimpleNamespace(zero_stage=config["zero_optimization"]["stage"], deepspeed_config=config)
        return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=plugin)

    zero0 = {"zero_optimization": {"stage": 0}}
    path = tmp_path / "ds_config.json"  # TrainingArguments(deepspeed=) takes a JSON file too
    path.write_text(json.dumps(zero0))
    with pytest.raises(UnsupportedEngineError, match="DeepSpeed ZeRO-0 runs"):
        check_trainer_engine(SimpleNamespace(deepspeed=str(path)), state(zero0))
    nvme = {"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme"}}}
    with pytest.raises(UnsupportedEngineError, match="DeepSpeed ZeRO-Offload runs"):
        check_trainer_engine(SimpleNamespace(deepspeed=nvme), state(nvme))
    for stage in (1, 2, 3):  # supported, also with offload explicitly off
        config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "none"}}}
        check_trainer_engine(SimpleNamespace(deepspeed=config), state(config))


def test_deepspeed_optimizers_other_than_zero_1_2_3_are_refused():
    from hf_resumable.integrations._deepspeed import checkpoint_optimizer

    adamw = torch.optim.AdamW([torch.zeros(2, requires_grad=True)])
    bf16 = type("BF16_Optimizer", (), {"__module__": "deepspeed.runtime.bf16_optimizer"})()
    bf16.optimizer = adamw  # what DeepSpeed picks for ZeRO-1 in bf16: its own partitions, not ZeRO-1/2's
    with pytest.raises(UnsupportedEngineError, match=r"DeepSpeed \(with its BF16_Optimizer\) runs"):
        checkpoint_optimizer(SimpleNamespace(optimizer=bf16))  # inside accelerate's wrapper
    zero3 = SimpleNamespace(fp32_partitioned_groups_flat=[], sub_group_to_group_id={}, optimizer=adamw,
                            offload_optimizer=False, offload_param=True)  # what ZeRO-3 with offload_param sets
    with pytest.raises(UnsupportedEngineError, match="DeepSpeed ZeRO-Offload runs"):
        checkpoint_optimizer(SimpleNamespace(optimizer=zero3))
    assert checkpoint_optimizer(SimpleNamespace(optimizer=adamw)) is adamw  # no DeepSpeed: the torch optimizer


class _CountSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps += 1


@pytest.mark.parametrize("zero, engine", [({"stage": 0}, "DeepSpeed ZeRO-0"),
                                          (_OFFLOAD["zero_optimization"], "DeepSpeed ZeRO-Offload")],
                         ids=["zero0", "offload"])
def test_trainer_deepspeed_is_refused_when_train_starts(tmp_path, zero, engine):
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, max_steps=2, save_steps=1,
                             report_to=[], disable_tqdm=True)
    # TrainingArguments(deepspeed=...) builds DeepSpeed's state; a configured run is what train() sees.
    args.deepspeed = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto"}
    counter = _CountSteps()
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}] * 8
    trainer = ResumableTrainer(model=build_model(), args=args, train_dataset=rows, callbacks=[counter])
    with pytest.raises(UnsupportedEngineError, match=rf"{engine} runs.*'version': 2") as caught:
        trainer.train()
    assert isinstance(caught.value, NotImplementedError)
    assert counter.steps == 0 and trainer.state.global_step == 0
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# ------------------------------------------------------------------ torchrun jobs


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", pytest.param("FULL_STATE_DICT", marks=_EXTENDED)])
def test_accelerate_fsdp2_killed_after_a_commit_resumes_bit_exact(tmp_path, accelerate_reference, state_dict_type):
    _resume_accelerate_bit_exact(tmp_path / "run", accelerate_reference, ["--state-dict-type", state_dict_type])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", pytest.param("FULL_STATE_DICT", marks=_EXTENDED)])
def test_trainer_fsdp2_killed_after_a_commit_resumes_bit_exact(tmp_path, trainer_reference, state_dict_type):
    _resume_trainer_bit_exact(tmp_path / "run", trainer_reference, ["--state-dict-type", state_dict_type])


# `make test` proves each ZeRO stage with partitions of its own once and each front door once: ZeRO-3 (parameters
# partitioned too) through the Trainer here, ZeRO-2 through the Accelerator in test_check.py (its ZeRO-2 loop,
# SIGKILLed and rerun under torchrun, compared bit for bit). The other pairs and ZeRO-1 (the same partitions as
# ZeRO-2, gradients not partitioned) run in `make test-all`.
_DEFAULT_DEEPSPEED = {("trainer", 3)}
DEEPSPEED_CASES = [(door, stage) if (door, stage) in _DEFAULT_DEEPSPEED
                   else pytest.param(door, stage, marks=_EXTENDED) for door in ("accelerate", "trainer")
                   for stage in (1, 2, 3)]


# per front door: its worker, its kill-and-resume check, where its checkpoints go
_FRONT_DOORS = {"accelerate": (ACCELERATE_WORKER, _resume_accelerate_bit_exact, "checkpoints"),
                "trainer": (TRAINER_WORKER, _resume_trainer_bit_exact, "")}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("front_door, stage", DEEPSPEED_CASES)
def test_deepspeed_killed_after_a_commit_resumes_bit_exact(tmp_path, tmp_path_factory, front_door, stage):
    worker, resume_bit_exact, checkpoints = _FRONT_DOORS[front_door]
    options = ["--engine", "deepspeed", "--zero-stage", str(stage)]
    reference = _reference(tmp_path_factory, worker, tuple(options))
    resume_bit_exact(tmp_path / "run", reference, options)
    # every rank wrote its own partitions of the fp32 master weights and of the Adam moments (in the last checkpoint)
    # and, under ZeRO-3, of every parameter
    layout = json.loads((tmp_path / "run" / checkpoints / "checkpoint-5" / "sharded_layout.json").read_text())
    assert layout["optimizer_document"]["class"] == f"DeepSpeedZero{stage}/AdamW"
    for rank in RANKS:
        names = layout["optimizer"]["pieces"][f"sharded/optimizer-rank{rank:05d}-of-00002.safetensors"]
        assert {name.rpartition("/")[2] for name in names} >= {"fp32", "exp_avg", "exp_avg_sq"}, names
    # the weights equal their fp32 master weights cast (ZeRO-1/2: whole, ZeRO-3: each rank's partitions of the
    # flattened weights), so they are described, given by their masters, and not stored; the ranks split the rest
    tensors = layout["model"]["tensors"]
    assert tensors["transformer.h.0.attn.c_attn.weight"]["master"] == "transformer.h.0.attn.c_attn.weight"
    assert layout["layout_version"] == 2
    stored = [name for pieces in layout["model"]["pieces"].values() for name in pieces]
    assert sorted(stored) == sorted(set(stored)) == sorted(name for name, described in tensors.items()
                                                            if "master" not in described)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", pytest.param("FULL_STATE_DICT", marks=_EXTENDED)])
@pytest.mark.parametrize("front_door", ["trainer", pytest.param("accelerate", marks=_EXTENDED)])  # FSDP2 has both
def test_fsdp1_killed_after_a_commit_resumes_bit_exact(tmp_path, tmp_path_factory, front_door, state_dict_type):
    """FSDP1 (``use_orig_params``, GPT2Block wrapped): checkpoints hold FSDP1's sharded state dict whatever
    ``state_dict_type`` accelerate is set to, so a FULL_STATE_DICT run equals the SHARDED_STATE_DICT reference."""
    worker, resume_bit_exact, checkpoints = _FRONT_DOORS[front_door]
    reference = _reference(tmp_path_factory, worker, ("--version", "1"))
    resume_bit_exact(tmp_path / "run", reference, ["--version", "1", "--state-dict-type", state_dict_type])
    # every rank wrote its own chunk of dim 0 of every weight and every Adam moment (FSDP1's sharded state dict)
    layout = json.loads((tmp_path / "run" / checkpoints / "checkpoint-5" / "sharded_layout.json").read_text())
    assert layout["model"]["tensors"]["transformer.wpe.weight"]["shape"] == [64, 32]  # the weights' own shapes
    for kind in ("model", "optimizer"):
        pieces = layout[kind]["pieces"]
        want = {"model": "transformer.wpe.weight", "optimizer": "state/transformer.wpe.weight/exp_avg"}[kind]
        assert [pieces[f"sharded/{kind}-rank{rank:05d}-of-00002.safetensors"][want] for rank in RANKS] == [
            {"offset": [0, 0], "shape": [32, 32]}, {"offset": [32, 0], "shape": [32, 32]}]


@pytest.fixture
def one_rank_group():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_save_checkpoint_of_an_fsdp2_model_writes_its_pieces(tmp_path, one_rank_group):
    """The one save picks the piece layout for an FSDP2 model (no twin to choose); a state dict of its DTensors holds
    no record of their pieces and is refused, naming the fix."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    from hf_resumable import load_checkpoint, save_checkpoint
    from hf_resumable.constants import LAYOUT_FILE
    from hf_resumable.errors import UnsupportedStateError

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        return model

    model = build(0)
    with pytest.raises(UnsupportedStateError, match="DTensor parameters.*Pass the module itself"):
        save_checkpoint(tmp_path / "state-dict", model=model.state_dict())
    assert not (tmp_path / "state-dict").exists()
    save_checkpoint(tmp_path / "checkpoint-1", model=model)
    assert (tmp_path / "checkpoint-1" / LAYOUT_FILE).is_file()
    other = build(1)
    load_checkpoint(tmp_path / "checkpoint-1", model=other, restore_rng=False)
    for (name, saved), (_, loaded) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(saved.full_tensor(), loaded.full_tensor()), name


def _zero_engine(stage: int, sub_groups: bool = False) -> torch.nn.Module:
    """A ZeRO engine over a tiny MLP; with ``sub_groups``, two param groups (weights, biases without decay) and, under
    ZeRO-3, sub-groups of at most 16 elements (several per param group)."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    zero = {"stage": stage, **({"sub_group_size": 16} if sub_groups else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    params = list(model.parameters())
    if sub_groups:
        params = [{"params": [p for p in params if p.dim() == 2]},
                  {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=config)
    return engine


def _step(engine: torch.nn.Module) -> None:
    engine.backward(engine(torch.ones(2, 4)).square().sum())
    engine.step()


def _master(engine: torch.nn.Module) -> torch.Tensor:
    """The engine's flat partitions of the fp32 master weights, concatenated."""
    zero = engine.optimizer
    return torch.cat(getattr(zero, "fp32_partitioned_groups_flat", getattr(zero, "single_partition_of_fp32_groups",
                                                                             None)))


def _moments(engine: torch.nn.Module) -> torch.Tensor:
    """The base optimizer's Adam moments over the engine's flat partitions, concatenated."""
    zero = engine.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", getattr(zero, "single_partition_of_fp32_groups", None))
    return torch.cat([zero.optimizer.state[flat][key] for flat in flats for key in ("exp_avg", "exp_avg_sq")])


@pytest.mark.slow
@pytest.mark.parametrize("stage, sub_groups", [(2, False), (3, False), (3, True)], ids=["2", "3", "3-subgroups"])
def test_zero_partitions_round_trip_in_one_process(tmp_path, monkeypatch, one_rank_group, stage, sub_groups):
    """save_checkpoint / load_checkpoint of a ZeRO-2/3 engine's partitions, before the first step
    (master weights only) and after one; the reloaded engine steps exactly as the saving one. ZeRO-3 steps its
    torch optimizer once per sub-group: the step hook still counts engine steps."""
    for name, value in {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # what torchrun sets, which DeepSpeed reads
    ops = pytest.importorskip("deepspeed.ops")
    monkeypatch.setitem(ops.__compatible_ops__, "deepspeed_shm_comm", False)  # no JIT build of a CPU op
    from deepspeed.utils import groups

    monkeypatch.setattr(groups, "_WORLD_GROUP", None)  # DeepSpeed caches the world group of a previous test
    from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
    from hf_resumable.integrations._deepspeed import checkpoint_optimizer, register_step_hook

    saving = _zero_engine(stage, sub_groups)
    if sub_groups:
        assert len(saving.optimizer.fp32_partitioned_groups_flat) > len(saving.optimizer.optimizer.param_groups) == 2
    steps = []
    register_step_hook(saving.optimizer, lambda *args: steps.append(1))
    for step in (0, 1):
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=saving.module,
                        optimizer=checkpoint_optimizer(saving.optimizer), step=step, layout="pieces")
        loading = _zero_engine(stage, sub_groups)
        if step:  # the fresh engine's master weights differ from the saved ones until the load
            assert not torch.equal(_master(saving), _master(loading))
        load_checkpoint(tmp_path / f"checkpoint-{step}", model=loading.module,
                        optimizer=checkpoint_optimizer(loading.optimizer))
        _step(saving)
        _step(loading)
        for engine in (saving, loading):
            states = checkpoint_optimizer(engine.optimizer).state.values()
            assert states and all(state["step"].item() == step + 1 for state in states)
        assert len(steps) == step + 1
        for one, other in zip(saving.module.parameters(), loading.module.parameters()):
            assert torch.equal(one, other)  # under ZeRO-3 these tiny parameters are kept gathered (persistent)
            if stage == 3:
                assert torch.equal(one.ds_tensor, other.ds_tensor)
        assert torch.equal(_master(saving), _master(loading))
    # the weights (ZeRO-3: the partitions) equal their masters cast: described, given by the masters, not stored
    layout = json.loads((tmp_path / "checkpoint-1" / "sharded_layout.json").read_text())
    assert layout["layout_version"] == 2 and not layout["model"]["pieces"]
    assert {d["master"] for d in layout["model"]["tensors"].values()} == {"0.weight", "0.bias", "1.weight", "1.bias"}
    _weight_differing_from_its_master_is_stored(tmp_path, saving, stage, sub_groups)
    # outside the engine: into a plain model, and consolidated (ZeRO-3's flattened partitions get their shapes back)
    from safetensors.torch import load_file

    from hf_resumable.checkpoint import consolidate_checkpoint

    save_checkpoint(tmp_path / "checkpoint-2", model=saving.module,
                    optimizer=checkpoint_optimizer(saving.optimizer), step=2, layout="pieces")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    load_checkpoint(tmp_path / "checkpoint-2", model=plain, restore_rng=False)
    consolidate_checkpoint(tmp_path / "checkpoint-2", tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    for (name, want), got in zip(saving.module.named_parameters(), plain.parameters()):
        assert torch.equal(got, want) and torch.equal(exported[name], want), name


def _weight_differing_from_its_master_is_stored(tmp_path: Path, saving: Any, stage: int, sub_groups: bool) -> None:
    """A weight (ZeRO-3: a partition) written outside the optimizer, no longer its master cast, is stored, and
    loaded as stored."""
    from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
    from hf_resumable.integrations._deepspeed import checkpoint_optimizer

    def held(module: torch.nn.Module) -> torch.Tensor:
        return module.weight.ds_tensor if stage == 3 else module.weight

    from hf_resumable import wait_for_pending_saves
    from hf_resumable.checkpoint.background._step_gate import step_gate

    from helpers.staging_probe import copy_after_next_step

    # an async save copies the masters and moments, and checks the weights against the masters, on other threads;
    # the engine's next step (its base optimizer's) waits for both: the checkpoint holds the state at the save
    base = saving.optimizer.optimizer
    master, moments = _master(saving).clone(), _moments(saving).clone()
    with copy_after_next_step(base) as stepping:
        save_checkpoint(tmp_path / "async", model=saving.module, optimizer=checkpoint_optimizer(saving.optimizer),
                        step=3, blocking=False, layout="pieces")
        assert not step_gate(base).is_open
        _step(saving)  # through the gate, once the copy is over
    wait_for_pending_saves()
    assert stepping.is_set() and step_gate(base).is_open and not torch.equal(_master(saving), master)
    assert not json.loads((tmp_path / "async" / "sharded_layout.json").read_text())["model"]["pieces"]
    loading = _zero_engine(stage, sub_groups)
    load_checkpoint(tmp_path / "async", model=loading.module,
                    optimizer=checkpoint_optimizer(loading.optimizer))
    assert torch.equal(_master(loading), master) and torch.equal(_moments(loading), moments)
    weight = held(saving.module[1])
    original = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    for blocking in (True, False):
        path = tmp_path / f"differs-{blocking}"
        save_checkpoint(path, model=saving.module, optimizer=checkpoint_optimizer(saving.optimizer), step=3,
                        blocking=blocking, layout="pieces")
        wait_for_pending_saves()
        layout = json.loads((path / "sharded_layout.json").read_text())
        assert "1.weight" in layout["model"]["pieces"]["sharded/model-rank00000-of-00001.safetensors"]
        loading = _zero_engine(stage, sub_groups)
        load_checkpoint(path, model=loading.module, optimizer=checkpoint_optimizer(loading.optimizer))
        assert torch.equal(held(loading.module[1]), weight)
        assert torch.equal(held(loading.module[0]), held(saving.module[0]))
    with torch.no_grad():
        weight.copy_(original)


def test_fsdp1_sharded_tensors_are_stored_as_dtensor_pieces(one_rank_group):
    """FSDP1's ShardedTensor (one chunk of dim 0 per rank) becomes a DTensor piece over the same bytes, and a loaded
    piece is copied back into the ShardedTensor FSDP1's load reads."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    from hf_resumable.checkpoint.pieces._dtensor import local_box
    from hf_resumable.checkpoint.pieces._sharded_tensors import as_dtensors, into_sharded_tensors

    local = torch.arange(12.0).reshape(4, 3)
    sharded = init_from_local_shards([Shard(local, ShardMetadata([0, 0], [4, 3], "rank:0/cpu"))], [4, 3])
    originals: dict = {}
    state = as_dtensors({"w": sharded, "b": torch.ones(2)}, device=torch.device("cpu"), originals=originals)
    assert originals == {"w": sharded} and torch.equal(state["b"], torch.ones(2))
    assert state["w"].shape == (4, 3) and local_box(state["w"]).offset == (0, 0)
    assert state["w"].to_local().data_ptr() == local.data_ptr()  # no copy
    loaded = into_sharded_tensors({"w": state["w"] * 2, "b": state["b"]}, originals)
    assert loaded["w"] is sharded
    assert torch.equal(sharded.local_shards()[0].tensor, torch.arange(12.0).reshape(4, 3) * 2)


def test_a_flattened_weight_whose_view_does_not_fit_is_corrupt():
    from hf_resumable.checkpoint.pieces._piece_reader import Section
    from hf_resumable.errors import CorruptCheckpointError

    section = {"tensors": {"w": {"dtype": "F32", "shape": [12], "view": [4, 3]}},
               "pieces": {"sharded/model-rank00000-of-00001.safetensors": {"w": {"offset": [0], "shape": [12]}}}}
    assert Section.from_json(section, source="x").views == {"w": (4, 3)}
    section["tensors"]["w"]["view"] = [4, 4]
    with pytest.raises(CorruptCheckpointError, match="not the flattened view"):
        Section.from_json(section, source="x")


def test_plain_tensors_are_split_across_the_ranks_and_a_disagreement_commits_nothing(monkeypatch):
    """ZeRO-1/2's whole weights (plain tensors every rank holds): each rank writes whole tensors of a plan all ranks
    compute alike, balanced by bytes, every tensor once; ranks that disagree are refused before the commit."""
    from hf_resumable._tuning import SPLIT_REPLICAS_ENV
    from hf_resumable.checkpoint.commit._replicas import plan_replica_writers, split_replicas
    from hf_resumable.checkpoint.pieces._piece_layout import (
        check_coverage,
        collect_local_state,
        piece_report,
        plain_sizes,
        section_from_reports,
    )
    from hf_resumable.errors import CheckpointMismatchError

    weight = torch.zeros(6)
    state = {"big": weight, "alias": weight, "mid": torch.zeros(4), "small": torch.zeros(3)}
    tied = {"alias": "big"}
    assert plain_sizes(state, tied) == {"big": 24, "mid": 16, "small": 12}
    owners = plan_replica_writers(plain_sizes(state, tied), 2, split=split_replicas())
    assert owners == {"big": 0, "mid": 1, "small": 1}

    def section(plans: list[dict[str, int]]) -> dict:
        locals_ = [collect_local_state(state, rank=rank, tied=tied, owners=plan) for rank, plan in enumerate(plans)]
        reports = [piece_report(f"rank{rank}", local) for rank, local in enumerate(locals_)]
        return section_from_reports(locals_[0].tensors, reports)

    split = section([owners, owners])
    assert split["pieces"] == {"rank0": {"big": {"offset": [0], "shape": [6]}},
                               "rank1": {"mid": {"offset": [0], "shape": [4]}, "small": {"offset": [0], "shape": [3]}}}
    check_coverage(split, source="layout")
    with pytest.raises(CheckpointMismatchError, match=r"do not cover them exactly once \(\['mid'\]\)"):
        check_coverage(section([{**owners, "mid": 0}, owners]), source="layout")  # written twice
    with pytest.raises(CheckpointMismatchError, match=r"\['small'\]"):
        check_coverage(section([{**owners, "small": 1}, {**owners, "small": 0}]), source="layout")  # by no rank
    monkeypatch.setenv(SPLIT_REPLICAS_ENV, "0")
    assert not split_replicas()
    assert plan_replica_writers(plain_sizes(state, tied), 2, split=split_replicas()) == {}


@pytest.mark.slow
def test_zero3_saves_reuse_the_partitions_pieces_until_a_load_replaces_them(tmp_path, monkeypatch, one_rank_group):
    """A ZeRO-3 engine's saves build each partition's DTensor piece once (every ``ds_tensor``, every sub-group's
    master weights and moments) and reuse it while the engine steps in place; a load copies into the parameters' and
    masters' partitions (their pieces kept) and replaces the moments (theirs rebuilt, the old ones let go)."""
    for name, value in {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # what torchrun sets, which DeepSpeed reads
    ops = pytest.importorskip("deepspeed.ops")
    monkeypatch.setitem(ops.__compatible_ops__, "deepspeed_shm_comm", False)  # no JIT build of a CPU op
    from deepspeed.utils import groups
    from torch.distributed.tensor import DTensor

    monkeypatch.setattr(groups, "_WORLD_GROUP", None)  # DeepSpeed caches the world group of a previous test
    import gc

    from hf_resumable import wait_for_pending_saves
    from hf_resumable.checkpoint import load_checkpoint, save_checkpoint
    from hf_resumable.checkpoint.pieces import _partitioned
    from hf_resumable.integrations._deepspeed import checkpoint_optimizer

    built, from_local = [], DTensor.from_local
    monkeypatch.setattr(DTensor, "from_local", staticmethod(lambda *a, **k: built.append(1) or from_local(*a, **k)))
    engine = _zero_engine(3, sub_groups=True)
    sub_groups = len(engine.optimizer.fp32_partitioned_groups_flat)
    parameters = list(engine.module.parameters())

    def save(step: int, *, blocking: bool) -> int:
        """DTensors built by one save."""
        before = len(built)
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=engine.module, layout="pieces",
                        optimizer=checkpoint_optimizer(engine.optimizer), step=step, blocking=blocking)
        wait_for_pending_saves()
        return len(built) - before

    _step(engine)  # the moments exist
    assert save(0, blocking=True) == len(parameters) + 3 * sub_groups  # weights; fp32 masters, exp_avg, exp_avg_sq
    _step(engine)
    assert save(1, blocking=False) == 0 and save(2, blocking=True) == 0
    entries = len(_partitioned._PIECES)
    load_checkpoint(tmp_path / "checkpoint-1", model=engine.module,
                    optimizer=checkpoint_optimizer(engine.optimizer))
    assert save(3, blocking=True) == 2 * sub_groups  # the loaded moments are new tensors
    gc.collect()
    assert len(_partitioned._PIECES) == entries  # the replaced moments' pieces went with them
    before = len(built)
    pieces = _partitioned.partitioned_state(engine.module, dict(engine.module.named_parameters()))
    assert len(built) == before
    for parameter, piece in zip(parameters, pieces.values()):  # they view the loaded partitions
        assert piece.to_local().data_ptr() == parameter.ds_tensor.data_ptr()
        assert torch.equal(piece.to_local(), parameter.ds_tensor.view(-1)[:parameter.ds_numel])
