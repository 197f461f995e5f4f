"""The embedded engine's weights: loads from the trainer in one call (:meth:`WeightUpdates.update_weights`),
and from outside (strop serve's SGLang routes) a pause (SGLang's three modes) and a weight-update session
(:meth:`WeightUpdates.begin_update` ... :meth:`WeightUpdates.end_update`) that holds the model across
several bucket receives, so no row ever decodes on half-updated weights; the session's receipt is
:class:`strop.serving.receipt.ReceiptSession`'s. Also the engine's scoring between batches (the weight
probe, an echoed prompt's logprobs) and its checksum. A mixin of
:class:`strop.serving.embedded.EmbeddedEngine`, whose state it reads (the locks, the queue, the pause)."""

from __future__ import annotations

import torch

import asyncio
import time

from strop.serving.probe import prompt_logprobs, reference_logprobs
from strop.serving.receipt import ReceiptSession
from strop.serving.request import PAUSE_MODES, SessionError
from strop.serving.sampling import GREEDY_BELOW
from strop.types import SamplingParams
from strop.wire.buckets import manifest_of
from strop.wire.digest import state_checksum, tensor_digest
from strop.wire.group import receive_bucket
from strop.wire.weights import in_buckets


class WeightUpdates:
    """Weight loads, the pause and the update session (see :class:`strop.serving.embedded.EmbeddedEngine`)."""

    def _load(self, fn, *args):
        """A weight load; the fast decoder's fused and packed copies, stale now, are freed and rebuilt at the
        next forward (a broadcast into the parameters does not bump their version counters)."""
        self._weights_epoch += 1  # (before: a load that fails midway may have written some tensors)
        try:
            fn(*args)
        finally:
            if self._fast is not None:
                self._fast.release()

    async def _drained(self, fn, *args):
        """Run ``fn(*args)`` off the event loop once no batch runs, admitting nothing meanwhile."""
        self._draining += 1
        try:
            async with self._busy:
                return await self._off_loop(self._locked, fn, *args)
        finally:
            self._draining -= 1
            self._kick()

    async def update_weights(self, state_dict, version: int | None = None, strict: bool = True) -> int:
        """Copy ``state_dict`` into the engine's model between batches (device to device when the
        trainer shares this process's device: nothing goes through host memory). ``strict=False``
        loads a subset (the delta form). Running rows finish on the old weights first; requests
        that arrive meanwhile wait and decode on the new ones."""
        await self._drained(self._stopping, self._load, self._copy_in, state_dict, strict)
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    def _stopping(self, fn, *args):
        """``fn(*args)`` with no row decoding, counted in :attr:`stopped_seconds` (unless a pause counts it)."""
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if self._stopped_at is None:
                self.stopped_seconds += time.perf_counter() - t

    def _copy_in(self, state_dict, strict: bool) -> None:
        """``load_state_dict``; sharded weights (strop.parallel.gather) a bucket at a time, as gathered; with
        ``shared``, only the tensors that are not already the engine's own (none, from the trainer)."""
        own = self.model.state_dict()
        if strict and set(own) != set(state_dict):  # (before anything is copied: the old weights stay whole)
            raise RuntimeError(
                f"weight update: missing {sorted(set(own) - set(state_dict))[:5]}, "
                f"unexpected {sorted(set(state_dict) - set(own))[:5]}"
            )
        if not hasattr(state_dict, "gather"):
            if self.shared:
                state_dict = {k: t for k, t in state_dict.items() if k not in own or t.data_ptr() != own[k].data_ptr()}
            self.model.load_state_dict(state_dict, strict=False)
            return
        for part in in_buckets(state_dict, list(state_dict), self.update_bucket_bytes):
            self.model.load_state_dict(part, strict=False)

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's tensors by name, each once (an alias such as a tied lm_head dropped, as
        :func:`strop.wire.buckets.manifest_of` drops it): what a trainer sends."""
        named = self.model.state_dict()
        return {name: named[name] for name, _, _ in manifest_of(named)}

    async def pause(self, mode: str = "abort") -> None:
        """Stop decoding until :meth:`resume`; requests that arrive meanwhile wait (never refused) and
        decode after it. The modes, SGLang's and vLLM's:

        - ``abort``: every running and queued request ends now (finish_reason abort, tokens kept);
        - ``wait`` (vLLM): returns once the requests already running or queued have finished;
        - ``keep`` (vLLM) and ``in_place`` (SGLang): the running batch stops after its current step and
          continues after :meth:`resume`, its KV cache kept;
        - ``retract`` (SGLang): the running rows go back to the queue as prompt plus tokens so far.

        A batch kept across a weight load is recomputed on the new weights at :meth:`resume` (its KV
        cache is never reused): no token decodes on a cache computed with other weights. Pausing again
        while paused is no error (``abort`` aborts what waits). Returns once no batch runs.

        Only :meth:`resume` ends a pause; there is no deadline, because resuming on its own could
        serve weights a dead trainer left half-updated. A trainer that dies paused leaves the
        engine paused (``/health`` says so) until the next trainer's update resumes it or an
        operator resumes it; waiting clients meet their own timeouts."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: one of {', '.join(PAUSE_MODES)}")
        if mode == "wait" and self._paused is None:
            await self._drain_in_flight()
        if self._stopped_at is None:
            self._stopped_at = time.perf_counter()
        self._paused = mode
        if mode == "abort":
            await self.abort_all()
        elif self._session is None:  # (a session holds the model: no batch runs)
            async with self._busy:  # the running batch stops at its next step
                pass
            if self._held is not None and self._held_epoch is None:
                self._held_epoch, self._held_version = self._weights_epoch, self.weight_version

    async def _drain_in_flight(self) -> None:
        """vLLM's ``wait``: let what runs or waits now finish; what arrives from now waits in ``_parked``."""
        self._gate = True
        try:
            while self._pending or self._held is not None or (self._flush_task and not self._flush_task.done()):
                await asyncio.sleep(0.005)
        except BaseException:  # cancelled: no pause was taken
            self.resume()
            raise

    def resume(self) -> None:
        """End a pause: held and waiting requests decode on the weights current now. A held batch whose
        weights changed since it stopped goes back to the queue as prompt plus tokens so far (its KV cache
        holds the old weights' keys and values), continuing where it stopped."""
        batch, epoch, self._held_epoch = self._held, self._held_epoch, None
        if batch is not None and epoch != self._weights_epoch:
            live = [r for r in batch.rows if r.finish is None]
            self._pending[:0] = [self._retracted(r, self._held_version) for r in live]
            self._held = None
        if self._stopped_at is not None:
            self.stopped_seconds += time.perf_counter() - self._stopped_at
            self._stopped_at = None
        self._paused, self._gate = None, False
        self._pending.extend(self._parked)
        self._parked = []
        self._kick()

    def forget_held_cache(self) -> None:
        """The held batch's KV cache is not to be reused (vLLM's ``reset_running_requests``): it is
        recomputed at :meth:`resume`, as after a weight load."""
        self._held_epoch = -1

    @property
    def in_flight(self) -> int:
        """Requests not answered yet (running, held, queued or waiting for a pause to end)."""
        return self._in_flight

    @property
    def paused(self) -> str | None:
        return self._paused

    @property
    def updating(self) -> bool:
        return self._session is not None

    async def begin_update(self) -> None:
        """Open a weight-update session: wait for the running batch to end (none runs while
        paused), then hold the model, admitting and decoding nothing, until :meth:`end_update`,
        across any number of :meth:`receive_bucket` calls. One session at a time."""
        if self._session is not None:
            raise SessionError("a weight update is already open (end_weight_update first)")
        self._session = "opening"
        self._draining += 1
        try:
            await self._busy.acquire()
        except BaseException:  # cancelled while waiting: nothing is held
            self._session = None
            self._draining -= 1
            self._kick()
            raise
        self._session = "open"
        self._receipt = ReceiptSession()  # every byte the session receives, in order: the update's receipt

    async def receive_bucket(self, group, bucket) -> None:
        """Receive one broadcast bucket (:class:`strop.wire.buckets.Bucket`, checked against the
        model by the caller) into the model's tensors inside the open session; a lone tensor goes
        straight into its parameter. Buckets are received one at a time, in the trainer's order."""
        if self._session != "open":
            raise SessionError("must run between begin_weight_update() and end_weight_update()")
        if self._receiving:
            raise SessionError(
                "another bucket is being received: buckets pair with the trainer's broadcasts "
                "in order, send them one at a time"
            )
        self._receiving = True
        try:
            await self._off_loop(self._locked, self._load, self._receive, group, bucket, self.weights())
        finally:
            self._receiving = False

    async def score(self, ids: list[int]) -> list[float]:
        """The logprob of each token of ``ids`` after the first, given the ones before it, under the current
        weights (temperature 1), between batches: the weight probe's engine side."""
        return await self._drained(reference_logprobs, self.model, list(ids)) if len(ids) > 1 else []

    async def prompt_logprobs(
        self, ids: list[int], temperature: float = 1.0, top_logprobs: int = 0
    ) -> tuple[list[float], list[dict[int, float] | None]]:
        """The logprob of each token of ``ids`` after the first given the ones before it, and (with
        ``top_logprobs``) the most likely tokens at each of those positions, ``{token_id: logprob}``
        (else None): an echoed prompt's logprobs. The distribution is the one sampled tokens are
        scored under, logits / ``temperature`` (1 when greedy), on the current weights, between batches."""
        self.check(ids, SamplingParams(temperature=temperature, max_new_tokens=1), top_logprobs)
        if len(ids) < 2:
            return [], []
        t = 1.0 if temperature < GREEDY_BELOW else temperature
        return await self._drained(prompt_logprobs, self.model, list(ids), t, top_logprobs)

    async def zero_weights(self) -> None:
        """Set every weight to zero, between batches (vLLM's ``/weight_checker`` reset: the start of a
        corrupt-then-restore check). Refused for an engine sharing the trainer's own tensors."""
        if self.shared:
            raise SessionError("this engine computes with the trainer's own tensors: zeroing them would zero those")

        def zero(weights):
            for t in weights.values():
                t.zero_()

        await self._drained(self._load, zero, self.weights())

    async def tensor_digests(self) -> dict[str, str]:
        """A digest per tensor held (:func:`strop.wire.digest.tensor_digest`), keyed as vLLM keys its one
        worker's: ``dp0:pp0:pcp0:tp0:`` + name."""

        def digests(weights):
            return {f"dp0:pp0:pcp0:tp0:{n}": tensor_digest(t) for n, t in weights.items()}

        return await self._off_loop(self._locked, digests, self.weights())

    async def weights_checksum(self) -> str:
        """:func:`strop.wire.digest.state_checksum` of :meth:`weights`, in a thread, between decode steps."""
        return await self._off_loop(self._locked, state_checksum, self.weights())

    def _receive(self, group, bucket, into: dict[str, torch.Tensor]) -> None:
        for name, t in receive_bucket(group, bucket, self.device, into=into, digest=self._receipt.digest):
            if t.data_ptr() != into[name].data_ptr():  # a view of the flat buffer (not received in place)
                into[name].copy_(t)
        self._receipt.bucket(bucket.names, bucket.nbytes)

    def end_update(self) -> str:
        """Close the session: batches run again (on held and waiting requests once not paused). Returns the
        digest of every byte the session received (:class:`strop.wire.digest.StreamDigest`)."""
        if self._session != "open":
            raise SessionError("no weight update is open (begin_weight_update first)")
        self._session = None
        self._draining -= 1
        self._busy.release()
        self._kick()
        return self._receipt.checksum()
