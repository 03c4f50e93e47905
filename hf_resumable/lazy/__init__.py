"""Lazy access to sharded safetensors weights: a read-only state dict, shard-by-shard loading, layer streaming.

Three tools, all index first (``model.safetensors.index.json`` or a single ``model.safetensors``):

- :class:`LazyStateDict`: a ``Mapping[str, torch.Tensor]`` whose names, shapes and dtypes come from the safetensors
  headers; a tensor is read (``safetensors.safe_open``, mmap) when it is accessed, and for a Hub repo only the shards
  actually touched are downloaded.
- :func:`load_lazily`: fill a model (also one built on the meta device) shard by shard, reading each tensor straight
  into the parameter's memory, so at most one shard's worth of pages is in flight beyond the model's own weights.
  Strictness is decided **once**, against all shards, before anything is read.
- :class:`StreamingModel` / :func:`stream_forward`: run a model that lives on the meta device within a memory budget
  (``max_memory``): a model that fits is loaded whole, otherwise its blocks are read from the shards as they run
  (:func:`plan_residency`), the next one on a background thread while the current one computes; ``generate`` works.

Example:

```python
>>> from accelerate import init_empty_weights  # doctest: +SKIP
>>> with init_empty_weights():  # doctest: +SKIP
...     model = AutoModelForCausalLM.from_config(config)
>>> missing, unexpected = load_lazily(model, "me/tiny-llama")  # doctest: +SKIP
```
"""


from ._load import LoadPlan, load_lazily, plan_load
from ._residency import ResidencyPlan, plan_residency
from ._stream import StreamingModel, stream_forward
from ._weights import LazyStateDict, TensorMeta

__all__ = ["TensorMeta", "LazyStateDict", "LoadPlan", "plan_load", "load_lazily", "ResidencyPlan", "plan_residency",
           "StreamingModel", "stream_forward"]
