"""Lazy access to sharded safetensors weights: a read-only state dict, shard-by-shard loading, layer streaming.

:class:`LazyStateDict` reads a tensor when it is accessed, :func:`load_lazily` fills a model shard by shard
(strictness decided once, against all shards), :class:`StreamingModel` / :func:`stream_forward` run a model within a
memory budget. All read the index first. See docs/hub-and-lazy.md#lazy-loading and docs/streamed-inference.md.

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
