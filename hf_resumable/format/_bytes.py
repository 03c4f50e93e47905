"""A tensor's bytes as a flat ``uint8`` tensor: what byte-exact comparisons and fingerprints of tensors read.

Example:

```python
>>> import torch
>>> from hf_resumable.format._bytes import tensor_bytes
>>> tensor_bytes(torch.tensor([1.0])).tolist()
[0, 0, 128, 63]
```
"""

from __future__ import annotations

import torch

__all__ = ["tensor_bytes"]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as raw bytes, flat ``uint8`` on its device: a view when it is contiguous, else a copy.
    Compared with ``torch.equal``, NaNs with the same bits are equal, and -0.0 and 0.0 are not."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
