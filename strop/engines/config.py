"""The ``engine`` section: the rollout engine, in process or HTTP servers behind the router, and how weights
reach it (strop/engines/, strop/sync/). Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from strop.configbase import Section, secret


DECODER_OPTIONS = ("speculative", "cpu_kernels", "compile_attention", "compile_step")  # strop's decoder's own


class EngineConfig(Section):
    kind: Literal["embedded", "strop", "sglang", "vllm"] = Field(
        "embedded",
        description="where rollouts are generated: 'embedded' (in this process), 'strop' (strop serve "
        "servers), 'sglang' (SGLang servers; same native API) or 'vllm' (vLLM OpenAI servers started with "
        "--logprobs-mode processed_logprobs, and VLLM_SERVER_DEV_MODE=1 for weight reloads)",
    )
    urls: list[str] = Field(
        default_factory=list,
        description="server URLs (kind strop / sglang / vllm), e.g. "
        '["http://127.0.0.1:30000"]; several go behind strop\'s router. Each must answer at start (any HTTP '
        "answer, within 3 seconds), or the run stops before any model loads, naming it",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the embedded engine's weights: 'auto' = model.dtype; 'bfloat16' decodes in bf16 while "
        "the trainer keeps model.dtype (fp32 weights and AdamW state), each update cast on the way in: on CPUs with "
        "bf16 matmul (avx512_bf16, AMX) the rollout is about 2.3x faster here; the logprob gap between engine and "
        "trainer grows to bf16's rounding and is reported every step (train_rollout_logprob_abs_diff). Remote "
        "servers choose their own dtype (engine.launch_args, engine.sync_dtype)",
    )
    launch: int = Field(
        0,
        ge=0,
        description="start this many servers for the run (and stop them at the end) "
        "instead of urls: kind=strop: strop serve processes (here, or Ray engine actors with "
        "cluster.launcher=ray); kind=vllm / sglang: vLLM or SGLang servers, as Ray engine actors only",
    )
    launch_args: list[str] = Field(
        default_factory=list,
        description="extra arguments for launched servers, e.g. "
        '["--threads=1"] (strop serve) or ["--dtype", "bfloat16"] (vLLM)',
    )
    launch_command: list[str] = Field(
        default_factory=list,
        description="kind=vllm / sglang: the program that "
        "starts one server (default: this Python's -m vllm.entrypoints.openai.api_server"
        ' / -m sglang.launch_server), e.g. ["/opt/vllm/bin/python", "-m", '
        '"vllm.entrypoints.openai.api_server"]; strop adds the model, host, port and '
        "what its client needs",
    )
    launch_env: dict[str, str] = Field(
        default_factory=dict,
        description='environment variables for launched servers, e.g. {VLLM_CPU_KVCACHE_SPACE: "2"}',
    )
    fast_decode: bool = Field(
        True,
        description="embedded engine and strop serve: decode Llama-family models with "
        "strop's KV-cache decoder (shared prompt prefixes, continuous batching); false uses "
        "transformers' forward with static batches",
    )
    speculative: int = Field(
        0,
        ge=0,
        le=16,
        description="embedded engine and launched strop serve: draft up to this many tokens per row from the "
        "rollout's history (the prompt, the group's other responses, earlier responses to the prompt) and verify "
        "them in one forward pass; exact (tokens and logprobs bitwise those without it, so a batch that drafts "
        "decodes with the batch-invariant kernels) and used only at batch sizes where it measures faster; a batch "
        "that starts with more than 32 rows decodes as without it (docs/engine.md). 0: off",
    )
    cpu_kernels: Literal["auto", "mkl", "onednn", "plain"] = Field(
        "auto",
        description="embedded engine and launched strop serve, on a CPU: the kernel the kv-cache decoder's linear "
        "layers run: 'mkl' (oneMKL's packed sgemm, float32), 'onednn' (oneDNN's packed matmul, float32 and "
        "bfloat16; on a CPU without bf16 instructions, bfloat16 weights are packed as a float32 copy and computed "
        "in float32), 'plain' (F.linear); 'auto' = MKL on Intel CPUs in float32, else oneDNN. The start line names "
        "the kernel and the CPU; bench/linear_kernels.py times each here (docs/engine.md)",
    )
    compile_attention: bool = Field(
        False,
        description="embedded engine and launched strop serve, on a CPU: the kv-cache decoder's attention over the "
        "cache compiled by Inductor (torch.compile, at the first step of 32 rows or more, the time in the log; steps "
        "of fewer rows keep the fused kernel) instead of PyTorch's fused kernel: measured 1.00-1.17x more decoded "
        "tokens per second at 32-64 rows on an AMD EPYC, and it keeps "
        "the attention probabilities in float32 under bfloat16 weights; needs a C++ compiler (without one it says "
        "why and runs the fused kernel). Batch-invariant steps (rollout.exact_logprobs, speculation's rounds) "
        "attend row by row and do not use it (docs/engine.md)",
    )
    compile_step: bool = Field(
        False,
        description="embedded engine and launched strop serve, on a CPU: the kv-cache decoder's whole decode step "
        "(norms, rotary embedding, attention, residuals and activation between the packed linear layers) compiled by "
        "Inductor into one graph, at the first step of 32 rows or more (the time in the log; steps of fewer rows run "
        "as without it): measured 1.03-1.16x the decoded tokens per second of compile_attention in float32 and "
        "bfloat16 at 32-64 rows on an AMD EPYC, a cold compile 85-87 s (4-6 s with Inductor's cache warm); dense Llama, Qwen2/3 and Mistral layers (MoE layers "
        "are refused); needs a C++ compiler (without one it says why and runs the decoder's own step); its attention "
        "is a C kernel of strop's, built once with the machine's C compiler into ~/.cache/strop/kernels "
        "(STROP_KERNEL_CACHE), else Inductor's loops. "
        "Batch-invariant steps (rollout.exact_logprobs, speculation's rounds) do not use it (docs/engine.md)",
    )
    share_weights: bool | None = Field(
        None,
        description="embedded engine, rollout.mode=sync, one process: decode from the trainer's own parameters "
        "instead of a copy of them (as TRL's generate does): one copy of the weights less in memory and no copy at "
        "an update. Unset: whenever that holds (and the fast decoder runs, engine.dtype is the model's); true where "
        "it cannot is refused naming why; false keeps the engine's own copy",
    )
    token: SecretStr | None = secret(
        "STROP_ENGINE_TOKEN",
        "bearer token sent to the remote servers (strop serve "
        "--token); launched servers require it, or a fresh one per run when unset",
    )
    timeout_s: float = Field(600.0, gt=0, description="seconds one HTTP request may take")
    retries: int = Field(
        2,
        ge=0,
        description="retries of one request on the same server (with backoff) before "
        "the router re-issues it to another",
    )
    health_interval_s: float = Field(
        2.0,
        gt=0,
        description="how often the router probes its engines: down ones "
        "for re-admission, healthy ones for the weight version they report (a restart)",
    )
    affinity: bool = Field(False, description="keep the requests of one sample on one engine (multi-turn)")
    sync_dir: str | None = Field(
        None,
        description="where weights are written for remote engines to load "
        "(default: <run dir>/weights; must be readable by the servers)",
    )
    sync: Literal["auto", "disk", "delta", "broadcast", "adapter"] = Field(
        "auto",
        description="how new weights reach remote engines: 'broadcast' (a process group of the trainer's "
        "rank 0 and the servers, through SGLang's update_weights_from_distributed; vLLM through strop's worker "
        "extension), 'disk' (safetensors written atomically and reloaded), 'delta' (through disk, only the tensors "
        "that changed, each checked by its digest; kind strop), 'adapter' (model.lora_rank > 0: each version's "
        "LoRA adapter alone, merged by strop serve, loaded at run time by vLLM and SGLang; docs/lora.md). "
        "'auto': the adapter for LoRA, else broadcast where the engine takes it, disk otherwise; the run prints "
        "which and why",
    )
    sync_bucket_bytes: int = Field(
        64 << 20,
        ge=1 << 20,
        description="largest bucket of a weight update, in bytes: "
        "broadcast: a flat bucket (the extra memory on either side); disk and delta: "
        "what is read (under FSDP or tensor parallel: gathered) per write. A single "
        "larger tensor travels alone",
    )
    sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="broadcast: process-group backend (auto: nccl when the trainer is on cuda, else gloo)"
    )
    sync_pause: Literal["abort", "retract", "in_place", "wait", "keep"] = Field(
        "abort",
        description="broadcast: how each server pauses generation during an update (SGLang and strop "
        "serve: abort, retract, in_place; vLLM: abort, wait, keep). strop's own requests are drained first "
        "(rollout.partial), so this concerns other clients' requests",
    )
    sync_probe: bool = Field(
        True,
        description="after every weight update, score a fixed short token sequence on "
        "each engine and with the trainer's weights: a difference over sync_probe_tolerance "
        "fails the step naming the engine (every engine kind; off under dp_mode=fsdp)",
    )
    sync_probe_tolerance: float = Field(
        1e-3,
        gt=0,
        description="largest logprob difference the probe accepts "
        "(fp32 engines agree within ~1e-5; bfloat16 engines need ~0.05)",
    )
    verify_updates: Literal["off", "first", "every"] = Field(
        "off",
        description="a corrupt-then-restore check of the weight transport: before the first weight update "
        "('first'; 'every': before each one) every engine's weights are overwritten with seeded noise, then the "
        "update runs through the run's transport, and each tensor every engine then holds must equal the "
        "trainer's bit for bit, or the step fails naming the engine, the transport and the first tensor that "
        "differs. The embedded engine and strop serve (engine.sync disk, delta or broadcast); each check costs "
        "a noise load, digests of every tensor on both sides and (delta) a full update (docs/serving.md)",
    )
    colocate: bool = Field(
        False,
        description="run the engines on the trainer's GPU and update them in place "
        "(CUDA IPC, memory released while training); refused for now, see docs/serving.md",
    )
    sync_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="broadcast: cast the weights to this dtype on the trainer's side (the engine's dtype "
        "when it differs from the trainer's, e.g. bfloat16 servers of an fp32 trainer)",
    )

    @model_validator(mode="after")
    def _check_engine(self):
        if self.kind == "embedded" and (self.urls or self.launch):
            raise ValueError("engine.urls / engine.launch need engine.kind='strop', 'sglang' or 'vllm'")
        if self.kind != "embedded" and not self.urls and not self.launch:
            raise ValueError(f"engine.kind={self.kind!r} needs engine.urls or engine.launch=N")
        if self.launch_command and self.kind not in ("vllm", "sglang"):
            raise ValueError(
                "engine.launch_command is the program of launched vLLM or SGLang servers (engine.kind="
                "'vllm' or 'sglang'); strop serve is started as this Python's `strop serve`"
            )
        if self.launch and self.urls:
            raise ValueError("give engine.urls or engine.launch, not both")
        if self.sync == "delta" and self.kind != "strop":
            raise ValueError(
                f"engine.sync='delta' needs strop serve servers (engine.kind='strop'): it loads a file of "
                f"only the changed tensors, which {self.kind} cannot check tensor by tensor; use "
                "engine.sync='broadcast' or 'disk'"
            )
        if self.colocate:
            raise ValueError(
                "engine.colocate: the in-place update of an engine sharing the trainer's GPU (SGLang's "
                "update_weights_from_tensor over CUDA IPC with release/resume_memory_occupation, vLLM's "
                "IPC transfer with sleep/wake_up) needs a GPU, and strop has not run it on one yet: it is "
                "refused rather than shipped untested. On CPU it cannot exist (no CUDA IPC; vLLM refuses "
                "sleep mode). Use engine.sync='broadcast' with the engines on their own devices"
            )
        pauses = {"vllm": ("abort", "wait", "keep")}.get(self.kind, ("abort", "retract", "in_place"))
        if self.sync_pause not in pauses:
            raise ValueError(
                f"engine.sync_pause={self.sync_pause!r} is not a pause mode of {self.kind} servers: "
                f"use one of {', '.join(pauses)}"
            )
        return self
