"""The embedded engine: in-process batched generation with a KV cache.

For Llama-family models (the embedded default included) it runs
:mod:`strop.serving.kvdecode`: a preallocated KV cache, the prompt of a group
prefilled once and shared by its samples, and continuous batching: requests
that arrive while a batch decodes join it at the next step, rows that finish
leave it, up to ``max_batch_size`` rows at once. Other models fall back to
Hugging Face's forward with a ``DynamicCache`` and static batches (prompts
left-padded, finished rows dropped); ``decode_path`` says which one runs.

Weight updates from outside (``strop serve``'s SGLang routes) use two states. A pause
(:meth:`pause`, SGLang's three modes) decides what happens to requests: none decodes until
:meth:`resume`, new ones wait. A weight-update session (:meth:`begin_update` ...
:meth:`end_update`) holds the model across several bucket receives, so no row ever decodes on
half-updated weights.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from strop.serving.engine_weights import WeightUpdates
from strop.serving.batch import Batch
from strop.serving.kvdecode import LlamaDecoder, unsupported_reason
from strop.serving.request import SEED_RANGE, PendingRequest, PromptTooLongError, RequestError, TokenListener
from strop.serving.sampling import sample
from strop.serving.scheduler import BatchScheduler
from strop.serving.attention import eager
from strop.serving.attention_kernel import isa
from strop.serving.compiled_step import CompiledStepDecoder, attention_reason
from strop.serving.cpu_kernels import describe as describe_kernel
from strop.serving.moe import row_routes
from strop.serving.speculative import Speculator, describe_speculation
from strop.serving.static_batch import decode_static
from strop.types import Completion, SamplingParams

EARLY_ABORT_S = 30.0  # an abort for a request not (yet) queued or running is remembered this long
EARLY_ABORT_MAX = 4096  # and at most this many such aborts
CLOSE_WAIT_S = 60.0  # close() waits this long for a running step to end the engine thread


class EmbeddedEngine(BatchScheduler, WeightUpdates):
    """The engine: the request API (generate, abort, checks) here; batching in
    :class:`strop.serving.scheduler.BatchScheduler`; weight loads, the pause and the update session in
    :class:`strop.serving.engine_weights.WeightUpdates`; sampling in :mod:`strop.serving.sampling`."""

    update_bucket_bytes = 64 << 20  # a sharded trainer's weights are gathered this much at a time into the engine

    def __init__(
        self,
        model,
        *,
        pad_token_id: int,
        default_stop_token_ids: list[int] = (),
        max_batch_size: int = 64,
        context_window: int | None = None,
        seed: int = 0,
        batch_wait_s: float = 0.0,
        fast_decode: bool = True,
        shared: bool = False,
        batch_invariant: bool = False,
        speculative: int = 0,
        cpu_kernels: str = "auto",
        compile_attention: bool = False,
        compile_step: bool = False,
        release_idle: bool = True,
    ):
        """``batch_wait_s``: before a batch starts, wait while requests keep arriving (each wait this long, at most
        40) so requests sent together over a network form one batch. ``fast_decode=False`` forces the fallback path
        (Hugging Face forward, static batches), the engine as it was before :mod:`strop.serving.kvdecode`.
        ``shared``: ``model`` is the trainer's own module (engine.share_weights): its train/eval mode stays the
        trainer's (the fast decoder, which ``shared`` needs, reads the weights, never the mode), and an update that
        hands back these very tensors copies nothing. ``batch_invariant``: a request's tokens and logprobs are
        bitwise the same alone and in any batch (:mod:`strop.serving.invariant`), at a cost in throughput.
        ``speculative``: draft up to this many tokens per row from the prompt's other responses and verify them in
        one forward pass (:mod:`strop.serving.speculative`; exact: a busy period that drafts runs the
        batch-invariant kernels; one that starts with more rows than drafts pay for decodes as without
        speculation; 0: off). ``cpu_kernels``: the fast decoder's linear-layer kernel
        (:mod:`strop.serving.cpu_kernels`; auto: this CPU's pick). ``compile_attention``: its decode steps'
        attention compiled (:mod:`strop.serving.attention`); ``compile_step``: its whole decode steps compiled
        (:mod:`strop.serving.compiled_step`). ``release_idle``: free the fast decoder's fused and packed weights
        whenever the engine goes idle (beside a trainer: the weights change before the next batch anyway, and the
        trainer gets the memory); False (strop serve) keeps them while the weights stay unchanged, until a load."""
        self.shared, self.release_idle = shared, release_idle
        self.model = model if shared else model.eval()
        self.pad_token_id = pad_token_id
        self.default_stop_token_ids = list(default_stop_token_ids)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.context_window = context_window or getattr(model.config, "max_position_embeddings", 2048)
        self.weight_version = 0
        self.generator = torch.Generator().manual_seed(seed)
        self._pending: list[PendingRequest] = []
        self._flush_task: asyncio.Task | None = None
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._abort_gen = 0  # abort_all bumps it; a decode started before the bump stops at its next step
        # requests aborted one by one (abort(request_id)) -> when: dropped when the request ends or
        # arrives, and after EARLY_ABORT_S when it never does
        self._aborted_ids: dict[str, float] = {}
        self._lock = threading.Lock()  # one batch at a time touches the model (taken off the event loop only)
        # all of the engine's model work off the event loop runs on this one thread (see _off_loop)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strop-engine")
        self._busy = asyncio.Lock()  # the event loop's side: one batch or weight load at a time
        # transformers renamed past_key_values to cache (5.x); pass whichever this model takes
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._draining = 0  # weight loads and abort_all waiting: admit nothing new until they ran
        self._paused: str | None = None  # a PAUSE_MODES entry while paused: no row decodes
        self._held: Batch | None = None  # the batch an in_place pause stopped, rows and KV cache kept
        self._weights_epoch = 0  # counts weight loads: a held batch whose KV predates one is recomputed
        self._held_epoch: int | None = None  # the epoch the held batch's KV cache was computed in
        self._held_version = 0  # the weight version the held batch decoded with
        self.stopped_seconds = 0.0  # time no row could decode for a pause or a weight load (engine_weights)
        self._stopped_at: float | None = None  # when the pause now running began
        self._gate = False  # a pause in wait mode is draining: requests arriving now wait in _parked
        self._parked: list[PendingRequest] = []
        self._in_flight = 0  # generate() calls not answered yet
        self._session: str | None = None  # "opening" / "open": a weight-update session (holds _busy)
        self._receiving = False  # a bucket of the session is being received
        self._receipt = None  # the open session's ReceiptSession (strop.serving.receipt)
        # batch invariance: the fast decoder's own mode; the fallback decodes each request alone. Speculation
        # switches the decoder to it for the busy periods that draft (scheduler._advance)
        self.batch_invariant = batch_invariant
        self._fast, self._spec, self.decode_path = build_decoder(
            model, fast_decode, shared, batch_invariant, speculative, cpu_kernels, (compile_attention, compile_step)
        )
        self.records_routes = self._fast is not None and bool(self._fast.routed)  # MoE: Completion.routed_experts

    # ---- the async interface -------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        on_token: TokenListener | None = None,
        top_logprobs: int = 0,
    ) -> Completion:
        """Generate for one prompt; concurrent calls are decoded together. ``request_id`` lets
        :meth:`abort` end this request alone. A bad request raises :class:`RequestError` here,
        before it can reach (and fail) a batch.

        ``on_token(token_id, logprob, top)`` is called on the event loop for each token as it is
        decoded (every token before this call returns; the fallback path's static batches call it
        as their steps run too). ``top`` is ``{token_id: logprob}`` of the ``top_logprobs`` most
        likely tokens at that position, under the same distribution as ``logprob`` (the logits
        divided by the temperature, 1 when greedy); None when ``top_logprobs`` is 0, and only then
        is nothing extra computed."""
        self.check(prompt_ids, sampling, top_logprobs)
        if request_id is not None and self._aborted_ids.pop(request_id, None) is not None:
            return Completion([], [], "abort", self.weight_version)  # aborted before it arrived
        future = asyncio.get_running_loop().create_future()
        (self._parked if self._gate else self._pending).append(
            PendingRequest(
                list(prompt_ids),
                sampling,
                future,
                request_id,
                on_token=on_token,
                top_logprobs=top_logprobs if on_token is not None else 0,
            )
        )
        self._kick()
        self._in_flight += 1
        try:
            return await future
        finally:
            self._in_flight -= 1

    async def close(self) -> None:
        """End the engine's thread, and with it the OpenMP team it holds: a program that runs again in this
        process (a notebook, a test suite) would otherwise keep one idle team per run, and once a process
        holds more teams than the machine has CPUs, libgomp stops spinning between regions (strop.openmp).
        Returns once the thread has ended (the step it runs finishes; queued work is cancelled), or after
        ``CLOSE_WAIT_S`` while a step still runs."""
        self._worker.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in list(self._worker._threads):  # (no pool thread to join it: that would keep one)
            while thread.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on the engine's own thread. Every piece of model work the event loop hands off
        (decode steps, whole batches, weight loads, checksums) runs on the same thread: on a CPU each
        thread that calls torch gets its own OpenMP team, and ``asyncio.to_thread`` spreads calls over a
        pool, whose idle teams then spin against the working one on the same cores (measured on 2
        cores: a 64-row rollout through :meth:`generate` took 1.2-2.6x as long as on one thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, functools.partial(fn, *args))

    def _settle(self, req: PendingRequest, outcome: Completion | BaseException) -> None:
        """Answer one request (a Completion, or the error that concerns it alone)."""
        self._aborted_ids.pop(req.request_id, None)
        if req.future.done():
            return
        if isinstance(outcome, BaseException):
            req.future.set_exception(outcome)
        else:
            req.future.set_result(outcome)

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    async def abort(self, request_id: str) -> bool:
        """End one request with finish_reason 'abort' (queued: at once; running: at its next decode
        step, keeping the tokens it has; not arrived yet: when it arrives, within EARLY_ABORT_S)."""
        for r in self._pending:
            if r.request_id == request_id:
                self._pending.remove(r)
                self._settle(r, r.completion([], [], "abort", self.weight_version))
                return True
        if self._abort_held(request_id):
            return True
        now = time.monotonic()
        self._aborted_ids.pop(request_id, None)
        self._aborted_ids[request_id] = now  # insertion order is time order: the oldest come first
        while self._aborted_ids:
            oldest, when = next(iter(self._aborted_ids.items()))
            if now - when <= EARLY_ABORT_S and len(self._aborted_ids) <= EARLY_ABORT_MAX:
                break
            del self._aborted_ids[oldest]  # (a request still running after that long finishes as it would)
        return True

    async def abort_all(self) -> None:
        """Finish every running, held and queued request with finish_reason 'abort'."""
        self._abort_gen += 1
        pending, self._pending, self._parked = self._pending + self._parked, [], []
        for r in pending:
            self._settle(r, r.completion([], [], "abort", self.weight_version))
        # wait for the running batch to notice (a session holds the model: none runs); nothing is
        # held or left set if this wait is cancelled
        if self._session is None:
            await self._drained(lambda: None)
        self._abort_held()

    def _abort_held(self, request_id: str | None = None) -> bool:
        """End the held batch's rows (all, or the one of ``request_id``) as aborted, keeping their tokens."""
        batch, found = self._held, False
        for i, row in enumerate(batch.rows if batch is not None else []):
            if row.finish is None and (request_id is None or row.request_id == request_id):
                row.finish, batch.start[i] = "abort", batch.col  # as Batch.step ends a row
                self._answer(row)
                found = True
        if batch is not None and not batch.live:
            self._held = None
        return found

    async def health(self) -> bool:
        return True

    # ---- the batched decode loop ---------------------------------------------------------
    def check(self, prompt_ids: list[int], sampling: SamplingParams, top_logprobs: int = 0) -> None:
        """Raise :class:`RequestError` for a request :meth:`generate` would refuse (what a server checks
        before it answers a stream's first byte)."""
        self._check_length(prompt_ids, sampling)
        self._check_request(prompt_ids, sampling)
        if not 0 <= top_logprobs <= self.vocab_size:
            raise RequestError(f"top_logprobs {top_logprobs} must be in [0, {self.vocab_size}] (the vocabulary)")

    def _check_length(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("empty prompt: a request needs at least one token")
        if len(prompt_ids) >= self.context_window:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context window is {self.context_window}"
            )

    def _check_request(self, prompt_ids: list[int], s: SamplingParams) -> None:
        """Every id in the vocabulary and every sampling value in range (what would otherwise fail
        inside a batch: an id indexes the embedding, a seed seeds a torch.Generator)."""
        bad = next((i for i, t in enumerate(prompt_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"input_ids[{bad}] = {prompt_ids[bad]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        if s.seed is not None and not SEED_RANGE[0] <= s.seed < SEED_RANGE[1]:
            raise RequestError(f"seed {s.seed} is outside [{SEED_RANGE[0]}, {SEED_RANGE[1]})")
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise RequestError(f"temperature {s.temperature} must be finite and >= 0")
        if not 0 < s.top_p <= 1:
            raise RequestError(f"top_p {s.top_p} must be in (0, 1]")
        if s.top_k < 0 or s.max_new_tokens < 1:
            raise RequestError(f"top_k {s.top_k} must be >= 0 (0: off) and max_new_tokens {s.max_new_tokens} >= 1")

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        samplings: SamplingParams | list[SamplingParams],
        request_ids: list[str | None] | None = None,
    ) -> list[Completion]:
        if isinstance(samplings, SamplingParams):
            samplings = [samplings] * len(prompts)
        for p, s in zip(prompts, samplings):
            self._check_length(p, s)
        with self._lock:
            if self._fast is None:
                return self._decode(prompts, samplings, request_ids or [None] * len(prompts))
            return self._decode_fast(prompts, samplings, request_ids or [None] * len(prompts))

    def _decode_fast(self, prompts, samplings, request_ids) -> list[Completion]:
        """All rows through one continuous batch: up to ``max_batch_size`` run at once and a
        waiting row takes the place of one that finished at the next step."""
        version = self.weight_version
        rows = [self._row(p, s, rid) for p, s, rid in zip(prompts, samplings, request_ids)]
        batch = Batch(self._fast, self._sample_rows, pad_token_id=self.pad_token_id, should_abort=self._should_abort)
        waiting = list(range(len(rows)))
        while waiting or batch.live:
            room = self.max_batch_size - batch.live
            take, waiting = waiting[:room], waiting[room:]
            self._advance(batch, [prompts[i] for i in take], [rows[i] for i in take])
        if self.release_idle:
            self._fast.release()
        return [Completion(r.token_ids, r.logprobs, r.finish, version, None, row_routes(r.routes)) for r in rows]

    def _decode(
        self,
        prompts: list[list[int]],
        samplings: list[SamplingParams],
        request_ids: list[str | None],
        listeners: list | None = None,
    ) -> list[Completion]:
        """The fallback path's static batch (:func:`strop.serving.static_batch.decode_static`)."""
        return decode_static(self, prompts, samplings, request_ids, listeners)

    def take_speculation_stats(self) -> dict[str, float]:
        """Speculation's metrics since the last call (:meth:`Speculator.take_stats`; {} without it)."""
        return self._spec.take_stats() if self._spec is not None else {}

    def _sample(self, logits, temperature, top_p, top_k, generators, top_n: int = 0, block_lse=None):
        """:func:`strop.serving.sampling.sample` with the engine's generator for rows without their own."""
        return sample(logits, temperature, top_p, top_k, generators, self.generator, top_n, block_lse)


def build_decoder(model, fast_decode, shared, batch_invariant, speculative: int, kernels: str, compiled: tuple):
    """An engine's fast decoder (None: the fallback runs), its speculator (or None) and the start line's words on
    how it decodes; what cannot run as asked is refused here, naming why. ``compiled``: (compile_attention,
    compile_step)."""
    reason = unsupported_reason(model) if fast_decode else "fast_decode=False"
    if shared and reason is not None:
        raise ValueError(f"an engine sharing the trainer's weights needs the fast decoder: {reason}")
    if reason is not None and kernels != "auto":
        raise ValueError(f"cpu_kernels={kernels!r} chooses the kv-cache decoder's kernel, which is off: {reason}")
    device = next(model.parameters()).device
    for name, what, asked in zip(("compile_attention", "compile_step"), ("attention", "decode step"), compiled):
        if asked and reason is not None:
            raise ValueError(f"{name} compiles the kv-cache decoder's {what}, which is off: {reason}")
        if asked and device.type != "cpu":
            raise ValueError(f"{name} is built for CPUs; on {device} the fused kernels are the fast ones")
        if asked and batch_invariant:
            raise ValueError(f"{name}: batch-invariant steps attend row by row (uncompiled); it would not run")
    fast = None
    if reason is None:
        kind = CompiledStepDecoder if compiled[1] else LlamaDecoder
        fast = kind(model, batch_invariant=batch_invariant, kernels=kernels, compiled=compiled[0])
    if fast is not None and fast.routed and (batch_invariant or speculative):
        raise ValueError(
            "batch-invariant decoding (rollout.exact_logprobs) and speculation are not built for routed-expert "
            "(MoE) models yet: an expert computes the tokens of every row that chose it in one call"
        )
    spec = Speculator(speculative) if speculative and reason is None else None
    return fast, spec, describe_decoder(fast, reason, speculative, shared)


def describe_decoder(fast: LlamaDecoder | None, reason: str | None, speculative: int, shared: bool) -> str:
    """The engine's start line's words on how it decodes (``reason``: why the fast decoder does not run)."""
    path = (
        "kv-cache decoder (shared prefixes, continuous batching)"
        if reason is None
        else f"transformers forward with DynamicCache, static batches ({reason})"
    )
    path += describe_speculation(speculative, reason is None)
    if shared:
        path += ", from the trainer's own weights (engine.share_weights: no copy)"
    if isinstance(fast, CompiledStepDecoder):
        why = attention_reason(fast)
        attention = f"its attention Inductor's ({why})" if why else f"its attention strop's C kernel ({isa()})"
        path += f"; decode step compiled from {fast.from_rows} rows (Inductor, at the first such step; {attention})"
    if fast is not None and fast.attend is not eager:
        path += f"; decode attention compiled from {fast.attend.from_rows} rows (Inductor, at the first such step)"
    return path + ("; " + describe_kernel(fast.kernel, fast.dtype) if fast is not None else "")
