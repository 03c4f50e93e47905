"""The demo's training process (moved to :mod:`hf_resumable.demo.train`; this import path keeps working)."""

import os  # noqa: F401 - tests patch demo_train.os.kill

from .demo._common import *  # noqa: F401,F403
from .demo.train import *  # noqa: F401,F403
from .demo.train import __all__, main  # noqa: F401
