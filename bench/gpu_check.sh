#!/usr/bin/env bash
# The GPU check of the trainer issue, as one command: quickstart steps on cuda in fp32 and
# bf16 autocast, logprob gap per step, step time, peak GPU memory. About 3 minutes on one GPU.
# On a machine without a GPU: bash bench/gpu_check.sh --device cpu --steps 2 --eval-size 16
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" bench/gpu_check.py "$@"
