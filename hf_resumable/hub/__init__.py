"""Move sharded models and committed training checkpoints to and from the Hugging Face Hub.

Everything goes through ``huggingface_hub`` (one ``upload_folder`` commit per push), except
:func:`resumable_download`, which issues ranged ``GET``s itself because ``huggingface_hub`` deletes partial downloads
when a process dies. Downloads are index first and check each shard against the record :func:`push_sharded` wrote.
See docs/hub-and-lazy.md.

Example:

```python
>>> from hf_resumable.hub import push_sharded, download_shards  # doctest: +SKIP
>>> push_sharded(model, "me/tiny-gpt2", max_shard_size="50MB")  # doctest: +SKIP
>>> folder = download_shards("me/tiny-gpt2", prefixes=["transformer.h.0."])  # doctest: +SKIP
```
"""

from ._common import HfUrl, HubSnapshot, parse_hf_url, read_index_file, shard_record
from .checkpoints import PushedCheckpoint, find_latest_hub_checkpoint, pull_checkpoint, push_checkpoint
from .download import resumable_download
from .models import download_shards, push_sharded, write_sharded_model
from .uploader import CheckpointUploader

__all__ = [
    "HfUrl",
    "HubSnapshot",
    "read_index_file",
    "shard_record",
    "write_sharded_model",
    "PushedCheckpoint",
    "CheckpointUploader",
    "parse_hf_url",
    "push_sharded",
    "download_shards",
    "resumable_download",
    "pull_checkpoint",
    "push_checkpoint",
    "find_latest_hub_checkpoint",
]
