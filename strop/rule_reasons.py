"""Why a setting cannot work, said once: read by the rules table (strop/rules.py) and by the code that
applies the setting (setup decides whether the engine shares the trainer's weights; the trainer's modules
refuse LoRA beside tensor parallel)."""

from __future__ import annotations

# why LoRA is refused beside tensor parallel (here and in strop.train.modules)
LORA_NOT_SPLIT = (
    "LoRA adapters train on data-parallel and context-parallel ranks, not tensor-parallel ones: tensor "
    "parallel splits the named linear layers, which LoRA has wrapped in adapter layers whose A and B "
    "matrices it does not split. Use tensor_parallel_size=1, or full fine-tuning (model.lora_rank=0)"
)


def why_not_shared(cfg, world: int = 1) -> str | None:
    """Why the embedded engine cannot decode from the trainer's own parameters (engine.share_weights),
    or None: it decodes while nothing else changes them, from the same numbers, in one process."""
    e = cfg.engine
    if e.kind != "embedded":
        return f"engine.kind={e.kind!r} runs in servers of its own"
    if e.verify_updates != "off":
        return (
            f"engine.verify_updates={e.verify_updates!r} overwrites the engine's weights with noise: shared, they "
            "would be the trainer's own"
        )
    if cfg.rollout.mode != "sync":
        return (
            f"rollout.mode={cfg.rollout.mode!r} generates while the trainer changes its weights: the engine "
            "needs a copy that changes only at an update"
        )
    if e.dtype not in ("auto", cfg.model.dtype):
        return f"engine.dtype={e.dtype!r} decodes from a {e.dtype} copy of the {cfg.model.dtype} weights"
    if not e.fast_decode:
        return "engine.fast_decode=false runs the model's own forward, which would run in the trainer's train mode"
    if cfg.data.samples:
        return f"data.samples={cfg.data.samples!r} replays samples: there is no engine"
    if cfg.model.lora_rank:
        return (
            f"model.lora_rank={cfg.model.lora_rank}: the trainer's linear layers hold LoRA adapters; the engine "
            "decodes the merged weights from a copy of its own"
        )
    if world > 1:
        return f"{world} processes split or replicate the trainer's weights; the engine on rank 0 needs them whole"
    return None


def why_no_speculation(cfg) -> str:
    """Why engine.speculative cannot run with ``cfg`` ('' when it can): it is strop's own decoder's, and exact
    only on the batch-invariant kernels, which are fast in fp32 only."""
    e = cfg.engine
    if e.kind in ("vllm", "sglang"):
        return (
            f"engine.kind={e.kind!r} servers speculate their own way: pass their flags in engine.launch_args "
            "(vLLM --speculative-config, SGLang --speculative-algorithm) and leave engine.speculative at 0"
        )
    if e.kind == "strop" and not e.launch:
        return (
            "servers at engine.urls keep the flags they were started with: start them with strop serve --speculative N"
        )
    if not e.fast_decode:
        return "engine.fast_decode=false decodes with the model's own forward, which has no draft verification"
    dtype = cfg.model.dtype if e.dtype == "auto" else e.dtype
    if dtype != "float32":
        return (
            f"it decodes on the batch-invariant kernels, which in {dtype} compute one row at a time (slower than "
            "decoding without drafts): use float32 weights for the engine"
        )
    return ""


def _not_strops_decoder(e, what: str, flag: str) -> str:
    """Why a setting of strop's own kv-cache decoder (its ``what``, strop serve's ``flag``) would not reach the
    decoder that runs with the ``engine`` section ``e`` ('' when it would)."""
    if e.kind in ("vllm", "sglang"):
        return f"engine.kind={e.kind!r} servers run their own {what}"
    if e.kind == "strop" and not e.launch:
        return f"servers at engine.urls keep the {what} they were started with: start them with strop serve {flag}"
    if not e.fast_decode:
        return "engine.fast_decode=false decodes with the model's own forward"
    return ""


def why_not_compiled(cfg, what: str) -> str:
    """Why engine.compile_attention=true (``what``: 'attention') or engine.compile_step=true ('step') would not
    compile what decodes with ``cfg`` ('' when it would)."""
    why = _not_strops_decoder(cfg.engine, "decode step" if what == "step" else what, f"--compile-{what}")
    if not why and cfg.rollout.exact_logprobs:
        return "rollout.exact_logprobs=true decodes every step batch-invariant, each row attending alone (uncompiled)"
    return why


def why_no_cpu_kernels(cfg) -> str:
    """Why engine.cpu_kernels (not 'auto') would not be what runs with ``cfg`` ('' when it is): it chooses the kernel
    of strop's own kv-cache decoder on a CPU (strop.serving.cpu_kernels)."""
    e, kernel = cfg.engine, cfg.engine.cpu_kernels
    why = _not_strops_decoder(e, "kernels", "--cpu-kernels")
    if why:
        return why + ("" if e.fast_decode else " (F.linear)")
    dtype = cfg.model.dtype if e.dtype == "auto" else e.dtype
    if kernel == "mkl" and dtype != "float32":
        return f"MKL's packed sgemm computes float32 only, and the engine's weights are {dtype}: use onednn or plain"
    return ""


def why_no_routing_replay(cfg) -> str:
    """Why algo.routing_replay cannot replay the engine's routes with ``cfg`` ('' when it can): the engine records
    them (strop's decoder; vLLM and SGLang servers started with --enable-return-routed-experts), and the trainer's
    routers must see one token per route."""
    e, p = cfg.engine, cfg.parallel
    if not e.fast_decode and e.kind in ("embedded", "strop") and (e.kind == "embedded" or e.launch):
        return "engine.fast_decode=false decodes with the model's own forward, which records no routes"
    for name, n in (
        ("tensor_parallel_size", p.tensor_parallel_size),
        ("context_parallel_size", p.context_parallel_size),
    ):
        if n > 1:
            return f"parallel.{name}={n} splits a sequence's tokens across ranks; replay maps routes to whole rows"
    return ""


def tools_setting(c) -> str:
    """The multi-turn tools a config turns on, as the setting that names them ('' for none)."""
    return (
        f"tools.enabled={c.tools.enabled}"
        if c.tools.enabled
        else f"plugins.tools={c.plugins.tools!r}"
        if c.plugins.tools
        else ""
    )


def other_generation(c) -> str:
    """What generates a sample other than the agent proxy, as the setting that names it ('' for nothing)."""
    p = c.plugins
    return (
        tools_setting(c)
        or (f"plugins.generate={p.generate!r}" if p.generate else "")
        or (f"plugins.rollout={p.rollout!r}" if p.rollout else "")
    )


def adapter_sync(c) -> bool:
    """Whether weights reach servers as a LoRA adapter alone (engine.sync='adapter', or 'auto' with LoRA)."""
    e = c.engine
    return e.sync == "adapter" or (e.sync == "auto" and bool(c.model.lora_rank) and e.kind != "embedded")


def agent_rewards(c) -> bool:
    return bool(c.plugins.agent) and c.agent.reward == "session"


def shared_prefix_off(c) -> str:
    """Why a shared-prefix row (strop.parallel.prefix) cannot be used with ``c`` ('' when it can)."""
    if c.parallel.context_parallel_size > 1:
        return (
            f"parallel.context_parallel_size={c.parallel.context_parallel_size} splits rows by tokens with its own "
            "block-diagonal mask, which has no place for a prefix shared by several samples"
        )
    if c.model.attn_implementation == "flash_attention_2":
        return "model.attn_implementation='flash_attention_2' takes no (L, L) mask, which the shared row needs"
    return ""
