import pytest

from hf_resumable.errors import UnsafeIndexError
from hf_resumable.format.sharding import build_index, parse_index, parse_size, plan_shards


def test_parse_size_units():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size(10) == 10
    for bad in ("lots", "-1MB", 0, "5XB", True):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_plan_is_greedy_in_key_order_with_oversized_tensor_alone():
    plan = plan_shards({"a": 400, "b": 400, "big": 5000, "c": 100, "d": 950}, max_shard_size=1000)
    assert plan.filename_to_names == {
        "model-00001-of-00004.safetensors": ("a", "b"),
        "model-00002-of-00004.safetensors": ("big",),
        "model-00003-of-00004.safetensors": ("c",),
        "model-00004-of-00004.safetensors": ("d",),
    }
    assert plan.total_size == 6850
    assert plan.name_to_filename["d"] == "model-00004-of-00004.safetensors"


def test_single_shard_still_uses_numbered_name_and_exact_index():
    plan = plan_shards({"w": 4, "b": 2}, max_shard_size="1KB", filename_pattern="optimizer{suffix}.safetensors")
    assert build_index(plan, metadata={"format": "pt"}) == {
        "metadata": {"total_size": 6, "format": "pt"},
        "weight_map": {"b": "optimizer-00001-of-00001.safetensors", "w": "optimizer-00001-of-00001.safetensors"},
    }


def test_empty_state_gives_one_empty_shard():
    plan = plan_shards({}, max_shard_size=10)
    assert plan.filename_to_names == {"model-00001-of-00001.safetensors": ()}


def test_pattern_needs_suffix():
    with pytest.raises(ValueError, match="suffix"):
        plan_shards({"a": 1}, max_shard_size=10, filename_pattern="model.safetensors")


@pytest.mark.parametrize(
    "name",
    ["../evil.safetensors", "/etc/passwd.safetensors", "a/../../b.safetensors", "C:/x.safetensors",
     "a\\b.safetensors", "model.bin", "", "./model.safetensors"],
)
def test_parse_index_rejects_unsafe_names(name):
    with pytest.raises(UnsafeIndexError):
        parse_index({"weight_map": {"w": name}}, source="idx")


def test_parse_index_keeps_unknown_metadata_and_groups_by_file():
    index = parse_index({"metadata": {"total_size": 3, "custom": 1},
                         "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}})
    assert index.metadata["custom"] == 1
    assert index.group_by_file() == {"m-2.safetensors": ["a", "c"], "m-1.safetensors": ["b"]}
    assert index.group_by_file(["b"]) == {"m-1.safetensors": ["b"]}


def test_parse_index_rejects_non_index():
    with pytest.raises(UnsafeIndexError, match="weight_map"):
        parse_index(["not", "an", "index"])
