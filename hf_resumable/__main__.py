"""``python -m hf_resumable`` runs the ``hf-resumable`` command line."""

import sys

from .cli import main

sys.exit(main())
