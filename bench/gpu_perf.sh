#!/usr/bin/env bash
# Issue 27's decode check on a GPU, as one command: the GPU's own limits (bf16 and fp32 matmul, read
# bandwidth), then HF `generate` against strop's engine at batch 1, 32 and 64 and on the GRPO case, in bf16
# and in fp32, each as a fraction of the GPU's decode bound (bench/engine.py --device cuda).
#
#   bash bench/gpu_perf.sh [--model DIR]     # DIR: SmolLM2-135M's config and tokenizer (random weights do for
#                                           # speed), as bench/gpu_check.py's first GPU run carried it
# Dry run on a machine without a GPU:
#   DEVICE=cpu bash bench/gpu_perf.sh --batch 1 --new-tokens 8 --repeats 1
#
# Not here yet: CUDA graphs for the decode step (issue 27 item 4; built and tested only where a GPU is lent)
# and TRL's GRPOTrainer on the GPU (item 5; its wheels, with pyarrow's, have to be carried to the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE=${DEVICE:-cuda}
"$PY" bench/limits.py "$DEVICE"
for dtype in bfloat16 float32; do
    "$PY" bench/engine.py --device "$DEVICE" --dtype "$dtype" --no-vllm "$@"
done
