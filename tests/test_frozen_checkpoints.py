"""Checkpoints that cost what changed: frozen parameters (a PEFT base, a frozen embedding, a bitsandbytes-quantized
base) are recorded, not stored, and checked against the live model on load.

Real tiny transformers models, real PEFT, real bitsandbytes (CPU), the real huggingface_hub client against the
local fake Hub, a real SeaweedFS server for s3://. The process-level SIGKILL tests are in tests/test_peft_resume.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_resumable.checkpoint import load_checkpoint, open_checkpoint, read_manifest, save_checkpoint, verify_checkpoint
from hf_resumable.checkpoint.pieces import _frozen
from hf_resumable.constants import FROZEN_RECORD_FILE, MODEL_INDEX_FILE, TRAINABLE_INDEX_FILE
from hf_resumable.errors import (
    BaseMismatchError,
    BaseNotStoredError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    FormatVersionError,
)

from helpers.hub_fixtures import _hub_server, hub, hub_env, new_repo_id  # noqa: F401 - fixtures
from helpers.tiny_models import assert_same_optimizer, assert_same_state, tiny_gpt2, tiny_llama, train_steps
from helpers.zygote import run as run_process

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

IDS = torch.arange(3, 19).reshape(1, -1)


@pytest.fixture(scope="module")
def gpt2_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base") / "gpt2"
    tiny_gpt2(n_embd=64).save_pretrained(path)
    return path


def lora(base: Path | torch.nn.Module, **config) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base) if isinstance(base, Path) else base
    torch.manual_seed(0)
    options = dict(r=2, target_modules=["c_attn"], lora_dropout=0.1, task_type="CAUSAL_LM")
    options.update(config)
    return get_peft_model(model, LoraConfig(**options))


def trained(model: torch.nn.Module, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_steps(model, optimizer, steps=steps)
    return model, optimizer


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def tensor_bytes(checkpoint: Path) -> int:
    return sum(r.size for n, r in read_manifest(checkpoint).files.items() if n.endswith(".safetensors"))


def record_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / FROZEN_RECORD_FILE).read_text())


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ LoRA
def test_lora_checkpoint_stores_only_the_trainable_part_and_resumes_exactly(gpt2_base: Path, tmp_path: Path):
    model, optimizer = trained(lora(gpt2_base))
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    save_checkpoint(tmp_path / "full", model=model, optimizer=optimizer, rng=False, standalone=True)
    files = set(read_manifest(tmp_path / "c").files)
    assert {TRAINABLE_INDEX_FILE, FROZEN_RECORD_FILE, "adapter_model.safetensors", "adapter_config.json"} <= files
    assert MODEL_INDEX_FILE not in files and "model.safetensors" not in files and "config.json" not in files
    adapter_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # adapter once (adapter_model.safetensors) + AdamW's two moments: no base, no second copy of the adapter
    assert tensor_bytes(tmp_path / "c") < 3 * adapter_bytes + 8192
    assert tensor_bytes(tmp_path / "full") > 20 * tensor_bytes(tmp_path / "c")
    # the record: every frozen tensor with dtype, shape and fingerprints, the tied LM head, where the base came from
    record = record_of(tmp_path / "c")
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert set(record["tensors"]) | set(record["tied"]) == frozen
    assert record["tied"] == {"base_model.model.lm_head.weight": "base_model.model.transformer.wte.weight"}
    wte = record["tensors"]["base_model.model.transformer.wte.weight"]
    assert wte["dtype"] == "F32" and wte["shape"] == [128, 64] and len(wte["xxh3_128"]) == 32
    assert record["source"]["name_or_path"] == str(gpt2_base) and record["source"]["kind"] == "local"
    assert record["source"]["model_class"] == "GPT2LMHeadModel"
    # the same base: bit-exact resume of model and optimizer
    resumed = lora(gpt2_base)
    resumed_optimizer = optimizer_for(resumed)
    load_checkpoint(tmp_path / "c", model=resumed, optimizer=resumed_optimizer, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())
    assert_same_optimizer(optimizer, resumed_optimizer)
    assert verify_checkpoint(tmp_path / "c", full=True).ok


def test_lora_checkpoint_is_a_peft_adapter_and_from_pretrained_loads_base_plus_adapter(gpt2_base: Path,
                                                                                       tmp_path: Path):
    model, optimizer = trained(lora(gpt2_base))
    model.eval()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    model.save_pretrained(tmp_path / "peft-own")  # what PEFT itself writes
    ours, theirs = load_file(tmp_path / "c" / "adapter_model.safetensors"), load_file(
        tmp_path / "peft-own" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        expected = model(IDS).logits
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(gpt2_base), tmp_path / "c").eval()
        assert torch.equal(adapter(IDS).logits, expected)
        # no config.json, as in a stock Trainer checkpoint of a PEFT model: transformers follows
        # adapter_config.json to the base and puts the adapter on top
        whole = AutoModelForCausalLM.from_pretrained(tmp_path / "c").eval()
        assert torch.equal(whole(IDS).logits, expected)


def test_modules_to_save_are_stored_resumed_and_in_the_adapter(tmp_path: Path):
    base = tmp_path / "llama"
    tiny_llama().save_pretrained(base)
    model, optimizer = trained(lora(base, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    record = record_of(tmp_path / "c")
    assert "base_model.model.lm_head.original_module.weight" in record["tensors"]  # the frozen original
    index = json.loads((tmp_path / "c" / TRAINABLE_INDEX_FILE).read_text())
    assert index["metadata"]["hf_resumable_renamed"]["base_model.model.lm_head.weight"] == (
        "base_model.model.lm_head.modules_to_save.default.weight")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "c")
    trained_head = model.state_dict()["base_model.model.lm_head.modules_to_save.default.weight"]
    assert torch.equal(adapter.state_dict()["base_model.model.lm_head.modules_to_save.default.weight"], trained_head)
    resumed = lora(base, target_modules=["q_proj"], modules_to_save=["lm_head"])
    resumed_optimizer = optimizer_for(resumed)
    load_checkpoint(tmp_path / "c", model=resumed, optimizer=resumed_optimizer, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())
    assert_same_optimizer(optimizer, resumed_optimizer)


def test_another_base_is_refused_before_anything_is_written(gpt2_base: Path, tmp_path: Path):
    model, optimizer = trained(lora(gpt2_base))
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    other = lora(tiny_gpt2(seed=5, n_embd=64))
    other_optimizer = optimizer_for(other)
    train_steps(other, other_optimizer, steps=1)
    before = snapshot(other)
    before_optimizer = [v.clone() for s in other_optimizer.state.values() for v in s.values()]
    with pytest.raises(BaseMismatchError, match=r"transformer\.h\.0\.attn\.c_attn\.base_layer\.weight: its bytes "
                                                r"differ") as caught:
        load_checkpoint(tmp_path / "c", model=other, optimizer=other_optimizer, restore_rng=False)
    assert str(gpt2_base) in str(caught.value) and "standalone" in str(caught.value)
    assert isinstance(caught.value, CheckpointMismatchError) and isinstance(caught.value, ValueError)
    assert_same_state(before, other.state_dict())  # nothing was written
    after_optimizer = [v for s in other_optimizer.state.values() for v in s.values()]
    assert len(after_optimizer) == len(before_optimizer) and all(map(torch.equal, before_optimizer, after_optimizer))
    # another dtype of the same base
    half = lora(AutoModelForCausalLM.from_pretrained(gpt2_base, dtype=torch.bfloat16))
    with pytest.raises(BaseMismatchError, match=r"c_attn.base_layer.weight: the checkpoint's base has F32 "
                                                r"\[64, 192\], the model has BF16"):
        load_checkpoint(tmp_path / "c", model=half, restore_rng=False)
    # the base without the adapter: the adapter's tensors are missing, the recorded base_layer names too
    with pytest.raises(CheckpointMismatchError, match="not in the model"):
        load_checkpoint(tmp_path / "c", model=AutoModelForCausalLM.from_pretrained(gpt2_base), restore_rng=False)


class _Frozen(torch.nn.Module):
    """A frozen 256x256 layer (256 KiB, sampled) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 4)
        self.body.requires_grad_(False)


def test_quick_check_samples_bytes_and_full_check_reads_every_byte(tmp_path: Path):
    model = _Frozen()
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    gap_start = _frozen.SAMPLE_BYTES
    window = (model.body.weight.numel() * 4 - _frozen.SAMPLE_BYTES) // (_frozen.SAMPLE_WINDOWS - 1)
    unsampled = (gap_start + window) // 2 // 4  # an element between the first two sampled windows
    changed = _Frozen()
    with torch.no_grad():
        changed.body.weight.view(-1)[unsampled] += 1.0
        changed.body.bias[0] += 1.0  # small tensors are sampled whole
    with pytest.raises(BaseMismatchError, match="body.bias: its bytes differ") as caught:
        load_checkpoint(tmp_path / "c", model=changed, restore_rng=False)
    assert "body.weight" not in str(caught.value)  # documented limit: the quick check samples large tensors
    with pytest.raises(BaseMismatchError, match=r"body.weight: its bytes differ \(xxh3-128"):
        load_checkpoint(tmp_path / "c", model=changed, restore_rng=False, verify="full")
    load_checkpoint(tmp_path / "c", model=_Frozen(), restore_rng=False, verify="full")


def test_fingerprints_are_computed_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls: list[int] = []
    real = _frozen._full_hash
    large = _frozen.SAMPLE_WINDOWS * _frozen.SAMPLE_BYTES // 4  # float32 elements hashed whole as their sample
    monkeypatch.setattr(_frozen, "_full_hash", lambda t: (t.numel() > large and calls.append(t.numel())) or real(t))
    monkeypatch.setattr(_frozen, "_CACHE", {})
    model = _Frozen()
    save_checkpoint(tmp_path / "c1", model=model, rng=False)
    assert calls == [256 * 256]  # the one tensor larger than the sample
    save_checkpoint(tmp_path / "c2", model=model, rng=False)
    assert calls == [256 * 256]  # cached: only the sample was hashed again
    assert record_of(tmp_path / "c1") == record_of(tmp_path / "c2")
    with torch.no_grad():
        model.body.weight.add_(1.0)  # in place: a version bump
    save_checkpoint(tmp_path / "c3", model=model, rng=False)
    assert len(calls) == 2
    model.body.weight.data.mul_(2.0)  # through .data: no version bump, seen by the sample
    save_checkpoint(tmp_path / "c4", model=model, rng=False)
    assert len(calls) == 3
    hashes = [record_of(tmp_path / c)["tensors"]["body.weight"]["xxh3_128"] for c in ("c2", "c3", "c4")]
    assert len(set(hashes)) == 3
    assert record_of(tmp_path / "c3")["tensors"]["body.bias"] == record_of(tmp_path / "c2")["tensors"]["body.bias"]


# ------------------------------------------------------------------------------------------------ frozen embedding
def test_full_finetune_with_a_frozen_embedding(tmp_path: Path):
    base = tmp_path / "base"
    tiny_gpt2(n_embd=64).save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    model.get_input_embeddings().requires_grad_(False)  # tied to lm_head: both frozen
    model, optimizer = trained(model)
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    index = json.loads((tmp_path / "c" / TRAINABLE_INDEX_FILE).read_text())
    assert "transformer.wte.weight" not in index["weight_map"] and "transformer.h.0.attn.c_attn.weight" in (
        index["weight_map"])
    assert record_of(tmp_path / "c")["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert (tmp_path / "c" / "config.json").is_file()
    with pytest.raises(OSError, match="no file named model.safetensors"):  # never a half-random model
        AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    resumed = AutoModelForCausalLM.from_pretrained(base)
    resumed.get_input_embeddings().requires_grad_(False)
    resumed_optimizer = optimizer_for(resumed)
    load_checkpoint(tmp_path / "c", model=resumed, optimizer=resumed_optimizer, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())
    assert_same_optimizer(optimizer, resumed_optimizer)
    # standalone: a whole model again, loadable by from_pretrained
    save_checkpoint(tmp_path / "s", model=model, optimizer=optimizer, rng=False, standalone=True)
    assert "model.safetensors" in read_manifest(tmp_path / "s").files
    assert_same_state(model.state_dict(), AutoModelForCausalLM.from_pretrained(tmp_path / "s").state_dict())


# ------------------------------------------------------------------------------------------------ quantized bases
@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_quantized_base_on_cpu(tmp_path: Path, bits: int):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is a test dependency (setup.cfg [test])")
    from transformers import BitsAndBytesConfig

    base = tmp_path / "base"
    tiny_llama(hidden_size=64, intermediate_size=128).save_pretrained(base)
    quantization = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_compute_dtype=torch.float32) if bits == 4
                    else BitsAndBytesConfig(load_in_8bit=True))

    def build():
        return lora(AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, device_map="cpu"),
                    target_modules=["q_proj", "v_proj"])

    model, optimizer = trained(build())
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    record = record_of(tmp_path / "c")
    assert record["source"]["quantization"]["quant_method"] == "bitsandbytes"
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer."
    recorded = {name[len(q_proj):] for name in record["tensors"] if name.startswith(q_proj)}
    assert recorded == ({"weight", "weight.absmax", "weight.quant_map", "weight.quant_state.bitsandbytes__nf4"}
                        if bits == 4 else {"weight", "SCB", "weight_format"})  # quantization state: frozen too
    assert record["tensors"][q_proj + "weight"]["dtype"] == ("U8" if bits == 4 else "I8")
    resumed = build()
    resumed_optimizer = optimizer_for(resumed)
    load_checkpoint(tmp_path / "c", model=resumed, optimizer=resumed_optimizer, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())
    assert_same_optimizer(optimizer, resumed_optimizer)
    unquantized = lora(AutoModelForCausalLM.from_pretrained(base), target_modules=["q_proj", "v_proj"])
    with pytest.raises(BaseMismatchError, match="the model has F32"):
        load_checkpoint(tmp_path / "c", model=unquantized, restore_rng=False)


# ------------------------------------------------------------------------------------------------ consumers
def test_tools_that_need_a_whole_model_say_so(gpt2_base: Path, tmp_path: Path):
    from hf_resumable.checkpoint import load_checkpoint
    from hf_resumable.hub import push_sharded
    from hf_resumable.lazy import LazyStateDict

    model, optimizer = trained(lora(gpt2_base))
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    for call in (lambda: LazyStateDict.from_pretrained(tmp_path / "c"),
                 lambda: push_sharded(tmp_path / "c", "user/never-created")):
        with pytest.raises(BaseNotStoredError, match="holds only the trainable part.*hf-resumable export"):
            call()
    resumed = lora(gpt2_base)  # the one load checks the base against the record instead of needing it stored
    load_checkpoint(tmp_path / "c", model=resumed, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())


@pytest.mark.slow
def test_inspect_reshard_and_cli_on_a_trainable_only_checkpoint(gpt2_base: Path, tmp_path: Path):
    from hf_resumable.checkpoint.summary import summarize_checkpoint
    from hf_resumable.conversions.stock import reshard_checkpoint

    model, optimizer = trained(lora(gpt2_base))
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False)
    summary = summarize_checkpoint(tmp_path / "c")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert summary.verified and summary.parameter_count == trainable and summary.frozen_parameter_count == frozen
    assert str(gpt2_base) in summary.frozen_base and "not stored" in summary.format_table()
    reshard_checkpoint(tmp_path / "c", max_shard_size="1KB", output=tmp_path / "r")  # the trainable part is kept
    resumed = lora(gpt2_base)
    load_checkpoint(tmp_path / "r", model=resumed, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())
    cli = [sys.executable, "-m", "hf_resumable"]
    shown = run_process([*cli, "inspect", str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "frozen base" in shown.stdout
    pushed = run_process([*cli, "push", str(tmp_path / "c"), "user/x"], capture_output=True, text=True,
                            timeout=120)
    assert pushed.returncode == 2 and "holds only the trainable part" in pushed.stderr
    assert len(pushed.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.slow
def test_export_merged_and_unmerged(gpt2_base: Path, tmp_path: Path):
    model, optimizer = trained(lora(gpt2_base))
    model.eval()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False,
                    processing_class=None, extra_files={"tokenizer_config.json": "{}"})
    with torch.no_grad():
        expected = model(IDS).logits
    cli = [sys.executable, "-m", "hf_resumable", "export", str(tmp_path / "c")]
    for name, extra in (("unmerged", []), ("merged", ["--merge"])):
        done = run_process([*cli, "--output", str(tmp_path / name), *extra], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        files = {p.name for p in (tmp_path / name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= files
        assert ("adapter_model.safetensors" in files) == (name == "unmerged")
        assert not files & {"manifest.json", "training_state.json", FROZEN_RECORD_FILE,
                            "optimizer.safetensors.index.json"}
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()(IDS).logits
        assert torch.allclose(got, expected, atol=1e-5) and (name == "merged" or torch.equal(got, expected))
    wrong = tmp_path / "other-base"
    tiny_gpt2(seed=9, n_embd=64).save_pretrained(wrong)
    done = run_process([*cli, "--output", str(tmp_path / "x"), "--base", str(wrong)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "its bytes differ" in done.stderr
    assert not (tmp_path / "x").exists()


def test_export_of_a_model_without_recorded_source_needs_a_base(tmp_path: Path):
    from hf_resumable.conversions.export import ExportError, export_model

    model = tiny_gpt2(n_embd=64)  # built from a config: no name_or_path
    model.get_input_embeddings().requires_grad_(False)
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    with pytest.raises(ExportError, match="pass the base model"):
        export_model(tmp_path / "c", tmp_path / "out")
    tiny_gpt2(n_embd=64).save_pretrained(tmp_path / "base")
    export_model(tmp_path / "c", tmp_path / "out", base=tmp_path / "base")
    assert_same_state(model.state_dict(), AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict())


# ------------------------------------------------------------------------------------------------ records
def test_malformed_frozen_records_are_refused():
    record = _frozen.build_record({"w": torch.ones(3)}, {}, {"name_or_path": "x"}).to_json()
    assert _frozen.FrozenRecord.from_json(json.loads(json.dumps(record)), source="r").tensors["w"].shape == (3,)
    for change, match in [
        (lambda d: d.update(version=3), None),  # 2: per-piece records of sharded checkpoints
        (lambda d: d["tensors"]["w"].update(dtype="F99"), "dtype"),
        (lambda d: d["tensors"]["w"].update(shape=[-1]), "shape"),
        (lambda d: d["tensors"]["w"].update(xxh3_128="zz"), "hex"),
        (lambda d: d.update(tied={"w": "w"}), "tied"),
        (lambda d: d.update(tied={"a": "missing"}), "tied"),
        (lambda d: d.update(sample={"windows": 1, "window_bytes": 1}), "sample"),
    ]:
        bad = json.loads(json.dumps(record))
        change(bad)
        error = FormatVersionError if match is None else CorruptCheckpointError
        with pytest.raises(error, match=match or "newer"):
            _frozen.FrozenRecord.from_json(bad, source="r")


@pytest.mark.slow
def test_a_save_hook_that_writes_the_adapter_file_keeps_it(gpt2_base: Path, tmp_path: Path):
    model, optimizer = trained(lora(gpt2_base))
    model.save_pretrained(tmp_path / "hook")  # what an accelerate save hook typically writes
    written = (tmp_path / "hook" / "adapter_model.safetensors").read_bytes()
    save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, rng=False,
                    extra_files={"adapter_model.safetensors": written})
    assert (tmp_path / "c" / "adapter_model.safetensors").read_bytes() == written
    resumed = lora(gpt2_base)
    load_checkpoint(tmp_path / "c", model=resumed, restore_rng=False)  # the adapter tensors went to trainable-*
    assert_same_state(model.state_dict(), resumed.state_dict())


def test_open_checkpoint_exposes_the_record(gpt2_base: Path, tmp_path: Path):
    model, _ = trained(lora(gpt2_base))
    save_checkpoint(tmp_path / "c", model=model, rng=False)
    opened = open_checkpoint(tmp_path / "c")
    assert opened._trainable is not None and opened._trainable.record.source["name_or_path"] == str(gpt2_base)


# ------------------------------------------------------------------------------------------------ remote copies
@pytest.mark.slow
def test_hub_pushes_upload_the_trainable_part_only(gpt2_base: Path, tmp_path: Path, hub):  # noqa: F811
    from hf_resumable.hub import pull_checkpoint, push_checkpoint

    model, optimizer = trained(lora(gpt2_base))
    base_bytes = sum(p.stat().st_size for p in gpt2_base.glob("*.safetensors"))
    repo = new_repo_id("frozen")
    sent = []
    for step in (1, 2):
        train_steps(model, optimizer, steps=1, seed=step)
        save_checkpoint(tmp_path / f"checkpoint-{step}", model=model, optimizer=optimizer, rng=False)
        hub.clear_log()
        pushed = push_checkpoint(tmp_path / f"checkpoint-{step}", repo)
        sent.append(sum(r.bytes_received for r in hub.log))
    local = sum(r.size for r in read_manifest(tmp_path / "checkpoint-2").files.values())
    assert max(sent) < local + 20_000 and local * 10 < base_bytes, (sent, local, base_bytes)
    pulled = pull_checkpoint(pushed.url, local_dir=tmp_path / "pulled")
    resumed = lora(gpt2_base)
    load_checkpoint(pulled, model=resumed, restore_rng=False)
    assert_same_state(model.state_dict(), resumed.state_dict())
