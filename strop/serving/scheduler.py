"""The embedded engine's batching: the continuous loop of the fast decoder (requests admitted at each
step, finished rows answered, a pause holding or retracting the running batch), the static batches
of the fallback path, and the hand-over of decoded tokens to listening requests. A mixin of
:class:`strop.serving.embedded.EmbeddedEngine`, whose state it reads (the queue, the locks, the pause)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import torch

from strop.openmp import release_threads
from strop.serving.batch import Batch, Row
from strop.serving.request import PendingRequest
from strop.serving.moe import row_routes
from strop.serving.speculative import align
from strop.types import Completion, SamplingParams

log = logging.getLogger("strop.engine")


class BatchScheduler:
    """How requests become batches and rows (see :class:`strop.serving.embedded.EmbeddedEngine`)."""

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let every coroutine started in this tick enqueue first
        for _ in range(40 if self.batch_wait_s else 0):  # requests still arriving: let them join this batch
            seen = len(self._pending)
            if seen >= self.max_batch_size:
                break
            await asyncio.sleep(self.batch_wait_s)
            if len(self._pending) == seen:
                break
        if self._fast is not None:
            return await self._run_continuous()
        while self._pending and self._paused is None:  # (a static batch runs to its end before a pause holds)
            batch = self._pending[: self.max_batch_size]
            self._pending = self._pending[self.max_batch_size :]
            try:
                results = await self._decode_static(batch)
                if isinstance(results, Exception) and len(batch) > 1:  # find whom it concerns: each alone
                    # (a request whose listener already has tokens fails: they cannot be taken back)
                    results = [await self._decode_static([r]) if not r.emitted else results for r in batch]
                    results = [r if isinstance(r, Exception) else r[0] for r in results]
            except asyncio.CancelledError:  # cancelled: so are the requests it carried, then stop
                self._abort_gen += 1  # the decode thread stops at its next step
                for r in batch + self._pending:
                    r.future.cancel()
                self._pending = []
                raise
            for r, c in zip(batch, results if isinstance(results, list) else [results] * len(batch)):
                self._settle(r, c)

    async def _decode_static(self, batch: list[PendingRequest]) -> list[Completion] | Exception:
        """One static batch through :meth:`_decode`; an engine error is returned, not raised."""
        loop = asyncio.get_running_loop()

        def listener(r: PendingRequest):  # the decode thread hands each token to the event loop, in order
            return (
                None
                if r.on_token is None
                else (r.top_logprobs, lambda *token: loop.call_soon_threadsafe(self._emit_one, r, *token))
            )

        try:
            async with self._busy:
                return await self._off_loop(
                    self._locked,
                    self._decode,
                    [r.prompt_ids for r in batch],
                    [r.sampling for r in batch],
                    [r.request_id for r in batch],
                    [listener(r) for r in batch],
                )
        except Exception as exc:
            return exc

    async def _run_continuous(self) -> None:
        """Decode until no row runs and nothing waits: each step first admits waiting requests
        (up to ``max_batch_size`` running rows; none while a weight load or abort_all waits),
        then decodes one token for every running row and answers the rows that finished."""
        async with self._busy:
            batch = self._held or Batch(
                self._fast, self._sample_rows, pad_token_id=self.pad_token_id, should_abort=self._should_abort
            )
            self._held = None
            admitted: list[Row] = []
            try:
                while True:
                    if self._paused is not None:  # stop after the step that ran, rows kept (see _hold)
                        self._hold(batch)
                        break
                    admit = []
                    if not self._draining:
                        room = self.max_batch_size - batch.live
                        admit, self._pending = self._pending[:room], self._pending[room:]
                    if not admit and not batch.live:
                        break
                    admitted = self._rows(admit)
                    finished, failed = await self._off_loop(
                        self._locked, self._advance, batch, [r.owner.prompt_ids for r in admitted], admitted
                    )
                    admitted = []
                    self._emit(batch.rows + finished)  # before any row is answered
                    for row in finished:
                        self._answer(row)
                    for row, exc in failed:
                        self._settle(row.owner, exc)
            except asyncio.CancelledError:  # cancelled: so are the requests it carried, then stop
                self._abort_gen += 1
                for r in [row.owner for row in batch.rows + admitted if row.owner is not None] + self._pending:
                    r.future.cancel()
                self._pending = []
                raise
            except Exception as exc:  # a decode step failed: it concerned every row it carried
                for row in batch.rows + admitted:  # finished in the failed step or not: none was answered
                    if row.owner is not None:
                        self._settle(row.owner, exc)
            finally:
                # idle or paused: free the fused and packed weights until the next batch (never under
                # a running generate_batch; kept where the engine releases nothing when idle: strop serve)
                if not self._pending or self._paused:
                    # and the engine thread's OpenMP pool: the trainer's works while this one waits (strop.openmp)
                    self._worker.submit(release_threads)
                    if self.release_idle and self._lock.acquire(blocking=False):
                        try:
                            self._fast.release()
                        finally:
                            self._lock.release()
        self._kick()  # requests that arrived while the last rows finished

    def _rows(self, requests: list[PendingRequest]) -> list[Row]:
        """A row per request; a request whose row cannot be built fails alone (never lost)."""
        rows = []
        for r in requests:
            try:
                rows.append(self._row(r.prompt_ids, r.sampling, r.request_id, owner=r))
            except Exception as exc:
                self._settle(r, exc)
        return rows

    def _advance(self, batch: Batch, prompts: list[list[int]], rows: list[Row]):
        """Admit ``rows``, then decode one step. Returns (rows that finished, [(row, error)] of rows
        that could not be admitted)."""
        spec = self._spec
        if spec is not None:
            for row, prompt in zip(rows, prompts):  # every response joins its prompt's history
                spec.follow(row, prompt)
            if rows and not batch.live:  # a busy period starts: it speculates only if its size lets drafts pay
                align(batch)
                batch.speculating = spec.drafts_at(len(rows))
            # not speculating, it decodes as an engine without speculation does (its kernels, its tokens)
            self._fast.batch_invariant = self.batch_invariant or batch.speculating
        if spec is None or not batch.speculating:
            finished, failed = self._admit(batch, prompts, rows)
            done = batch.step()
            if spec is not None:
                spec.count_plain(batch.live + len(done))
            return finished + done, failed
        if rows:  # joining rows assume one write column (strop.serving.speculative)
            align(batch)
        finished, failed = self._admit(batch, prompts, rows)
        return finished + spec.round(batch), failed

    def _admit(self, batch: Batch, prompts: list[list[int]], rows: list[Row]):
        """``batch.admit``; when it fails for several rows, each is admitted alone so the error
        fails only the request it concerns (admission changes the batch only after prefill and
        sampling succeeded)."""
        try:
            return batch.admit(prompts, rows), []
        except Exception as exc:
            if len(rows) == 1:
                return [], [(rows[0], exc)]
        finished, failed = [], []
        for prompt, row in zip(prompts, rows):
            row.token_ids.clear()  # a failed admission may have recorded a first token
            row.logprobs.clear()
            row.top_logprobs.clear()
            row.finish = None
            done, bad = self._admit(batch, [prompt], [row])
            finished += done
            failed += bad
        return finished, failed

    def _emit(self, rows: list[Row]) -> None:
        """Hand each listening request the tokens its row decoded since the last call."""
        for row in rows:
            req = row.owner
            if req is not None and req.on_token is not None:
                for i in range(req.emitted, len(row.token_ids)):
                    self._emit_one(
                        req, row.token_ids[i], row.logprobs[i], row.top_logprobs[i] if req.top_logprobs else None
                    )

    def _emit_one(self, req: PendingRequest, token: int, logprob: float, top: dict[int, float] | None) -> None:
        req.emitted += 1
        try:
            req.on_token(token, logprob, top)
        except Exception:  # the listener's fault, never the batch's: it hears nothing more
            log.exception("embedded engine: a token listener failed; it is dropped")
            req.on_token = None

    def _answer(self, row: Row) -> None:
        owner = row.owner
        self._settle(
            owner,
            owner.completion(row.token_ids, row.logprobs, row.finish, self.weight_version, row_routes(row.routes)),
        )

    def _kick(self) -> None:
        if (
            (self._pending or self._held is not None)
            and self._paused is None
            and (self._flush_task is None or self._flush_task.done())
        ):
            self._flush_task = asyncio.ensure_future(self._flush())

    def _hold(self, batch: Batch) -> None:
        """Park the running batch for a pause. Rows to abort end now (keeping their tokens); the
        others wait for :meth:`resume`: ``retract`` puts them back at the head of the queue as
        their prompt plus the tokens so far (prefilled again, on the weights current then: SGLang
        retracts the same way), ``in_place`` keeps the batch with its KV cache (computed on the
        weights before the pause, as SGLang's in_place reuses it)."""
        live = [r for r in batch.rows if r.finish is None]
        for r in live:
            if self._should_abort(r):
                r.finish = "abort"
                self._answer(r)
        live = [r for r in live if r.finish is None]
        if not live:
            return
        if self._paused == "retract":
            self._pending[:0] = [self._retracted(r) for r in live]
        else:
            self._held = batch

    def _retracted(self, row: Row, version: int | None = None) -> PendingRequest:
        """The row back as a request: its prompt plus its tokens so far, sampled by weights ``version`` (the
        current ones unless given)."""
        req = row.owner
        version = self.weight_version if version is None else version
        return PendingRequest(
            req.prompt_ids + row.token_ids,
            replace(req.sampling, max_new_tokens=(req.sampling.max_new_tokens - len(row.token_ids))),
            req.future,
            req.request_id,
            req.done_ids + row.token_ids,
            req.done_logprobs + row.logprobs,
            row.generator,
            req.on_token,
            req.top_logprobs,
            done_versions=req.done_versions + [version] * len(row.token_ids),
        )  # (its tokens so far were handed over already)

    def _row(self, prompt_ids, sampling: SamplingParams, request_id=None, owner=None) -> Row:
        generator = owner.generator if owner is not None else None
        if generator is None:  # an unseeded row's own numbers, drawn from the engine's generator as it joins: its
            # tokens never depend on which rows sample beside it (speculation samples them in other company)
            seed = sampling.seed
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator)) if seed is None else seed
            generator = torch.Generator().manual_seed(seed)
        return Row(
            owner=owner,
            sampling=sampling,
            budget=min(sampling.max_new_tokens, self.context_window - len(prompt_ids)),
            stops=set(sampling.stop_token_ids or self.default_stop_token_ids),
            generator=generator,
            request_id=request_id,
            abort_gen=self._abort_gen,
        )

    def _should_abort(self, row: Row) -> bool:
        return self._abort_gen != row.abort_gen or (row.request_id is not None and row.request_id in self._aborted_ids)

    def _sample_rows(self, logits: torch.Tensor, rows: list[Row], block_lse: torch.Tensor | None = None):
        dev = logits.device
        t = torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=dev)
        p = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=dev)
        k = torch.tensor([min(r.sampling.top_k, logits.shape[-1]) for r in rows], dtype=torch.long, device=dev)
        want = [r.owner.top_logprobs if r.owner is not None else 0 for r in rows]
        if not any(want):  # the usual case: no alternatives computed
            return self._sample(logits, t, p, k, [r.generator for r in rows], block_lse=block_lse)
        tokens, logprobs, (values, ids) = self._sample(
            logits, t, p, k, [r.generator for r in rows], max(want), block_lse=block_lse
        )
        for r, n, v, i in zip(rows, want, values.tolist(), ids.tolist()):  # one entry per token recorded
            r.top_logprobs.append(dict(zip(i[:n], v[:n])) if n else None)
        return tokens, logprobs
