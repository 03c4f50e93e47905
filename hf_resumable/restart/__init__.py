"""Restarts that skip the imports: ``hf-resumable run -- python train.py ...`` starts the command again when its
process dies, forked from a standby interpreter that has already run the script's import statements.

Example:

```python
>>> from hf_resumable.restart import RestartOptions, run_with_restarts
>>> run_with_restarts(["python", "train.py"], RestartOptions(max_restarts=5))  # doctest: +SKIP
0
```
"""

from ._plan import WarmStart, leading_imports, plan_warm_start
from ._supervisor import RESTARTS_ENV, WARM_ENV, RestartOptions, run_with_restarts

__all__ = ["RESTARTS_ENV", "WARM_ENV", "RestartOptions", "WarmStart", "leading_imports", "plan_warm_start",
           "run_with_restarts"]
