"""Only the optional C extension lives here; all metadata is in setup.cfg.

``hf_resumable._fastcopy`` (non-temporal copies for async-save staging) is optional: without a C
compiler the build skips it and the library falls back to ``memmove``.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hf_resumable._fastcopy", ["hf_resumable/_fastcopy.c"], optional=True)])
