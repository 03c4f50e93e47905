"""File names, patterns and state keys of the hf_resumable checkpoint format.

Constants that name files include the extension. Names that Hugging Face tools read are spelled
exactly as they expect them (``model.safetensors``, or ``model.safetensors.index.json`` with
``model-00001-of-00003.safetensors``), so ``transformers.AutoModel.from_pretrained(checkpoint_dir)`` works on
our checkpoints.
"""

from __future__ import annotations

import re

# Version of the on-disk layout. Bump on any incompatible change; readers refuse newer versions. What each version
# changed (1 and 2 still load and verify): docs/format.md#file-records-and-hashes.
FORMAT_VERSION = 3
# Value of the "format" field of the manifest: tells our checkpoints apart from anything else.
FORMAT_NAME = "hf_resumable"

# Model weights, readable by transformers / huggingface_hub.
MODEL_INDEX_FILE = "model.safetensors.index.json"
MODEL_FILE_PATTERN = "model{suffix}.safetensors"
# Un-sharded weights file (transformers and huggingface_hub write it when everything fits in one shard; so does
# save_checkpoint, with TIED_KEY as a JSON string in its header metadata instead of in an index).
SINGLE_MODEL_FILE = "model.safetensors"
# Index metadata key: {shard file: {"size": int, "xxh3_128": str}} ({"size", "sha256"} before format version 2;
# transformers ignores unknown metadata keys).
SHARDS_KEY = "hf_resumable_shards"
# Index metadata key recording tied / shared tensors that were stored once: {dropped: kept}.
TIED_KEY = "hf_resumable_tied"
# Index metadata key: format version of what push_sharded wrote.
INDEX_VERSION_KEY = "hf_resumable_format_version"
# The trainable part of a checkpoint that references its frozen base, named so that no tool takes it for a whole
# model (docs/format.md#a-checkpoint-of-a-model-with-frozen-parameters).
TRAINABLE_INDEX_FILE = "trainable.safetensors.index.json"
TRAINABLE_FILE_PATTERN = "trainable{suffix}.safetensors"
# Index metadata key of TRAINABLE_INDEX_FILE: {name in the file: state-dict name} for tensors stored under another
# name (a PEFT adapter's tensors are stored once, in adapter_model.safetensors, under PEFT's names).
RENAMED_KEY = "hf_resumable_renamed"
# What the frozen parameters are instead of their bytes: names, dtypes, shapes, xxh3-128 fingerprints (whole and
# sampled), tied aliases, and where the base came from (local path or Hub repo id + revision).
FROZEN_RECORD_FILE = "frozen_base.json"
# Version of that document; readers refuse newer ones.
FROZEN_RECORD_VERSION = 1
# Keys of the frozen record.
FROZEN_KEY_VERSION = "version"  # int, FROZEN_RECORD_VERSION
FROZEN_KEY_HASH = "hash"  # "xxh3-128"
FROZEN_KEY_SAMPLE = "sample"  # {"windows": int, "window_bytes": int}: how sample_xxh3_128 was taken
FROZEN_KEY_TENSORS = "tensors"  # {name: {"dtype", "shape", "xxh3_128", "sample_xxh3_128"}}
FROZEN_KEY_TIED = "tied"  # {alias: name in tensors}
FROZEN_KEY_SOURCE = "source"  # {"name_or_path", "kind", "revision", "commit", "quantization", "model_class"}
# The model config save_pretrained writes (a checkpoint of a PEFT model that does not store its base has none, as
# PEFT's own save: from_pretrained(checkpoint) then loads the base named in adapter_config.json, plus the adapter).
CONFIG_FILE = "config.json"
# PEFT's adapter files, where PeftModel.from_pretrained(base, checkpoint_dir) looks for them.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
# Optimizer tensors, keyed by parameter name ("state/<param name>/<key>").
OPTIMIZER_INDEX_FILE = "optimizer.safetensors.index.json"
OPTIMIZER_FILE_PATTERN = "optimizer{suffix}.safetensors"
# Progress cursor, scheduler, scaler, optimizer param groups and user extras (JSON, no pickle).
TRAINING_STATE_FILE = "training_state.json"
# Tensors found inside scheduler / scaler / progress / extra state (rare) are stored here.
STATE_TENSORS_FILE = "training_state.safetensors"
# Written by transformers.Trainer and by our Trainer integration (progress, epoch, log history), as upstream names it.
TRAINER_STATE_FILE = "trainer_state.json"
# Per-rank RNG states as byte tensors ("rng/rank-00000.safetensors").
RNG_DIR = "rng"
RNG_FILE_PATTERN = "rank-{rank:05d}.safetensors"
# Per-rank data-loader positions (JSON), written by the integrations.
DATA_STATE_DIR = "data"
DATA_STATE_FILE_PATTERN = "rank-{rank:05d}.json"
# Sharded (per-rank) checkpoints, e.g. FSDP2: rank 0 writes the layout (JSON: every tensor's dtype, global
# shape and which file holds which piece); each rank writes its pieces under SHARDED_DIR.
LAYOUT_FILE = "sharded_layout.json"
SHARDED_DIR = "sharded"
PIECE_FILE_PATTERN = "{kind}-rank{rank:05d}-of-{world_size:05d}.safetensors"
# safetensors header metadata key of each piece file: {name: {"offset": [...], "global_shape": [...]}} (JSON).
PIECES_METADATA_KEY = "hf_resumable_pieces"
# Version of the layout document; readers refuse newer ones.
LAYOUT_VERSION = 1
# Keys of the layout document.
LAYOUT_KEY_VERSION = "layout_version"  # int, LAYOUT_VERSION
LAYOUT_KEY_WORLD_SIZE = "world_size"  # int, ranks that wrote the pieces
LAYOUT_KEY_MODEL = "model"  # section for model weights, or null
LAYOUT_KEY_OPTIMIZER = "optimizer"  # section for optimizer tensors, or null
LAYOUT_KEY_OPTIMIZER_DOC = "optimizer_document"  # {"class", "param_groups", "non_tensor_state"} or null
# Written last; its presence (and validity) is what makes a directory a committed checkpoint.
MANIFEST_FILE = "manifest.json"
# Inside a checkpoint committed before its files reached the disk (durability "deferred"): {"boot_id", "durable"},
# replaced atomically, never removed (docs/architecture.md, deferred durability).
DURABILITY_FILE = ".durability"

# Directory naming. "checkpoint-<step>" keeps transformers' get_last_checkpoint regex working.
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-(\d+)$")
# Owned sibling names (the owner's host hash, pid and start time are part of the name; see
# checkpoint/commit/_owner.py): a checkpoint being written, renamed into place on commit;
TMP_PREFIX = ".tmp-"
# a checkpoint being removed (renamed away first, so a half-deleted directory never looks like a checkpoint);
TRASH_PREFIX = ".trash-"
# a reader's pin on a checkpoint (an empty file): retention does not remove a pinned checkpoint;
PIN_PREFIX = ".pin-"
# a remover's announcement that it is about to remove a checkpoint (an empty file; see checkpoint/commit/_pins.py).
REMOVING_PREFIX = ".removing-"
# Seconds after which a pin no longer protects a checkpoint, even if its reader is still alive.
PIN_TTL = 600.0

# Other files of a model directory, as save_pretrained and the Hub name them.
GENERATION_CONFIG_FILE = "generation_config.json"
README_FILE = "README.md"  # the model card
# Regular expressions over the weight files a save writes (the single file or the shards of the pattern).
MODEL_FILES_RE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
TRAINABLE_FILES_RE = re.compile(r"^trainable(-\d+-of-\d+)?\.safetensors$")
OPTIMIZER_FILES_RE = re.compile(r"^optimizer(-\d+-of-\d+)?\.safetensors$")

# Stock layouts: files other tools write, which hf_resumable recognizes, converts (the only pickle reads, in
# conversions/) or refuses, spelled as upstream spells them.
# transformers.Trainer's checkpoint-<step>: weights (safetensors, or pickled), trainer_state.json (TRAINER_STATE_FILE),
STOCK_PICKLED_WEIGHTS_FILE = "pytorch_model.bin"
STOCK_PICKLED_WEIGHTS_INDEX_FILE = "pytorch_model.bin.index.json"
STOCK_PICKLED_ADAPTER_FILE = "adapter_model.bin"
# and, pickled, the optimizer, scheduler, GradScaler and per-rank RNG state (rng_state.pth on one process).
STOCK_OPTIMIZER_FILE = "optimizer.pt"
STOCK_SCHEDULER_FILE = "scheduler.pt"
STOCK_SCALER_FILE = "scaler.pt"
STOCK_RNG_FILE = "rng_state.pth"
STOCK_RNG_FILE_GLOB = "rng_state_*.pth"
# Suffixes of pickle files: never written by hf_resumable, never read outside conversions/.
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# DeepSpeed's save_checkpoint (the Trainer's checkpoint-<step> with deepspeed=): a text file naming the tag, the
# tag's directory, the pickled module/engine state of model-parallel rank 0, and each data-parallel rank's pickled
# ZeRO-1/2 optimizer partition ("bf16_" prefixed under bf16).
STOCK_DEEPSPEED_LATEST_FILE = "latest"
STOCK_DEEPSPEED_TAG_RE = re.compile(r"^global_step(\d+)$")
STOCK_DEEPSPEED_MODEL_FILE = "mp_rank_00_model_states.pt"
STOCK_DEEPSPEED_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# torch.distributed.checkpoint's FileSystemWriter (accelerate's FSDP SHARDED_STATE_DICT save_state): a pickled
# Metadata (read only by hf_resumable's restricted unpickler), and raw tensor bytes per writer.
STOCK_DCP_METADATA_FILE = ".metadata"
STOCK_DCP_DATA_SUFFIX = ".distcp"
STOCK_ACCELERATE_FSDP_MODEL_DIR_RE = re.compile(r"^pytorch_model_fsdp_(\d+)$")
STOCK_ACCELERATE_FSDP_OPTIMIZER_DIR_RE = re.compile(r"^optimizer_(\d+)$")
# transformers' save_pretrained(distributed_checkpoint=True): torch's HuggingFaceStorageWriter(save_distributed=True)
# writes one safetensors file per writing rank (shard-<rank + 1>-model-<k>-of-<n>), each tensor's box offset in the
# header metadata under DCP_SHARDING_INFO; save_optimizer_distributed writes a FileSystemWriter directory beside it.
STOCK_DCP_HF_SHARD_RE = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
STOCK_DCP_HF_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
STOCK_DCP_HF_OFFSETS_KEY = "saved_offsets"
STOCK_DCP_HF_OPTIMIZER_DIR = "optimizer"  # where the optimizer's DCP directory is looked for, besides the model's
# accelerate's save_state: ProjectConfiguration(automatic_checkpoint_naming=True) names
# <project_dir>/checkpoints/checkpoint_<i>, and the files it writes there (pickle, except the model weights).
AUTOMATIC_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
STOCK_ACCELERATE_FILES_RE = re.compile(r"^(random_states_\d+\.pkl|optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|"
                                       r"scaler\.pt|sampler(_\d+)?\.bin|dl_state_dict(_\d+)?\.bin|"
                                       r"custom_checkpoint_\d+\.pkl|pytorch_model(_\d+)?\.bin|"
                                       r"model(_\d+)?\.safetensors)$")

# safetensors header metadata we write into every shard.
SAFETENSORS_METADATA = {"format": "pt"}
# Largest safetensors header we accept (the safetensors library uses 100 MB as well).
MAX_HEADER_SIZE = 100_000_000
# Largest JSON file (index, manifest, state) we parse.
MAX_JSON_SIZE = 256 * 1024 * 1024
# Suffixes of the partial file and its sidecar that resumable Hub downloads keep between attempts.
PART_SUFFIX = ".part"
SIDECAR_SUFFIX = ".part.json"

# Default shard size for training checkpoints: small enough that shard-at-a-time loading
# bounds memory, unlike transformers v5's 50GB export default.
DEFAULT_MAX_SHARD_SIZE = "2GB"

# Keys of training_state.json.
STATE_KEY_FORMAT_VERSION = "format_version"  # int, equals FORMAT_VERSION
STATE_KEY_PROGRESS = "progress"  # dict: the TrainingState progress cursor
STATE_KEY_SCHEDULER = "scheduler"  # encoded lr_scheduler.state_dict() or null
STATE_KEY_SCALER = "scaler"  # encoded GradScaler.state_dict() or null
STATE_KEY_OPTIMIZER = "optimizer"  # {"class", "param_groups", "non_tensor_state"} or null
STATE_KEY_EXTRA = "extra"  # dict of user / integration state (encoded JSON)

# Safetensors tensor-name prefix for optimizer state: f"state/{param_name}/{key}".
OPTIMIZER_STATE_PREFIX = "state/"
# Safetensors tensor-name prefix for tensors found inside param groups: f"param_groups/{i}/{key}".
OPTIMIZER_GROUP_PREFIX = "param_groups/"
