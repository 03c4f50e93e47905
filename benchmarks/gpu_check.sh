#!/usr/bin/env bash
# The GPU check in one go (benchmarks/gpu_check.py says what it runs): the CUDA test tier, then the GPU benchmarks,
# each time-boxed, every figure appended to <out>/gpu_check.jsonl.
#
#   benchmarks/gpu_check.sh --out DIR             # on the GPU machine (default: $OUT)
#   benchmarks/gpu_check.sh --dry-run --out DIR   # the same flow on the CPU, tiny sizes
#
# PYTHON picks the interpreter (default: the repository's .venv, else python3). WHEELS names a folder of wheels
# to install first (pip --no-index --no-deps into /tmp/site, put on PYTHONPATH): for a machine whose image lacks
# some of the project's requirements and cannot reach a registry (docs/benchmarks.md lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
if [ -n "${WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
