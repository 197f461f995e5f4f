"""On-policy distillation's teacher behind a server: the logprobs an engine gives the student's own tokens
(``strop serve`` and SGLang: ``input_token_logprobs``; vLLM: ``prompt_logprobs``), at temperature 1.

The teacher scores the student's token ids, so both must share a tokenizer: before the run starts the
teacher's ``/tokenize`` (strop serve, SGLang and vLLM all answer it) must give a probe text the ids the
student's tokenizer gives it, or the run is refused (:meth:`RemoteTeacher.check_tokenizer`)."""

from __future__ import annotations

import asyncio

from strop.config import ConfigError
from strop.engines.sglang import SGLangEngine
from strop.engines.vllm import VLLMEngine
from strop.types import Sample
from strop.wire.errors import EngineRefusedError, EngineRequestError, EngineUnavailable

# the probe's fixed part: words, digits, code, runs of spaces and newlines, accents and other scripts
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. 0123456789 3.14159 -42 1e-5\n"
    "def f(x):\n    return {'a': [x, x ** 2]}  # comment\n\t\n  \n"
    "naïve café Ærøskøbing, Ελληνικά, русский, 中文字符, 日本語, 한국어, العربية, हिन्दी, 🙂👍\n"
)
PROBE_PIECES = 256  # tokens of the student's vocabulary, evenly spread over its ids, added to the probe as text


def probe_text(tokenizer) -> str:
    """The text whose ids the teacher's tokenizer must reproduce: the fixed part, every added and special token
    of the student's (so one the teacher lacks is seen), and the text of tokens spread over its whole vocabulary
    (so a vocabulary that differs anywhere, not only in common words, is seen), one per line."""
    vocab = len(tokenizer)
    step = max(1, vocab // PROBE_PIECES)
    added = sorted(tokenizer.get_added_vocab())
    pieces = [tokenizer.decode([i]) for i in range(0, vocab, step)] + [tokenizer.decode([vocab - 1])]
    return PROBE_TEXT + "\n".join(added + pieces)


class RemoteTeacher:
    """Scores a step's samples on the server at ``url`` (``kind`` strop, sglang or vllm): for each sample the
    teacher's logprob of every response token given everything before it. ``token``: the server's bearer token
    (``algo.distill_teacher_token``), sent on every request as strop's engine clients send theirs. Called from
    the trainer's thread, which holds no event loop of its own: each call runs its requests, all at once, on a
    short-lived one."""

    def __init__(self, url: str, kind: str = "strop", *, token: str | None = None, timeout_s: float = 600.0):
        self.url, self.kind, self.timeout_s = url, kind, timeout_s
        self._token = token  # (never in repr: it is a secret)

    def __repr__(self) -> str:
        return f"RemoteTeacher({self.kind} at {self.url})"

    def _client(self):
        return (VLLMEngine if self.kind == "vllm" else SGLangEngine)(
            self.url, timeout_s=self.timeout_s, token=self._token
        )

    def __call__(self, samples: list[Sample]) -> list[list[float]]:
        return asyncio.run(self._score(samples))

    async def _score(self, samples: list[Sample]) -> list[list[float]]:
        client = self._client()
        try:  # a sequence's logprob j is that of token j + 1: the response's start at len(prompt) - 1
            scored = await asyncio.gather(*[client.score(s.prompt_ids + s.response_ids) for s in samples])
        finally:
            await client.close()
        return [lp[len(s.prompt_ids) - 1 :] for s, lp in zip(samples, scored)]

    def check_tokenizer(self, tokenizer, student: str = "the student") -> None:
        """Refuse (a ConfigError naming the teacher's URL and the first difference) a teacher whose tokenizer
        gives :func:`probe_text` other ids than ``tokenizer``, the student's (named ``student``), or that cannot
        be asked (unreachable, or refusing strop's token)."""
        text = probe_text(tokenizer)
        mine = tokenizer.encode(text, add_special_tokens=False)
        where = f"algo.distill_teacher_url={self.url}"
        try:
            theirs = asyncio.run(self._tokenize(text))
        except (EngineUnavailable, EngineRequestError) as exc:
            hint = (
                ": give its token as algo.distill_teacher_token (best as the environment variable STROP_TEACHER_TOKEN)"
                if isinstance(exc, EngineRefusedError) and exc.status in (401, 403)
                else ""
            )
            raise ConfigError(
                f"{where}: the teacher's tokenizer could not be compared with the student's ({exc}){hint}"
            ) from None
        if theirs == mine:
            return
        k = next((j for j, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
        piece = tokenizer.decode(mine[k : k + 1]) if k < len(mine) else "(the end of the text)"
        raise ConfigError(
            f"{where} has another tokenizer than {student}: a probe text is {len(theirs)} tokens for the teacher "
            f"and {len(mine)} for the student; they first differ at token {k}: the teacher's id "
            f"{theirs[k] if k < len(theirs) else '(none)'}, the student's "
            f"{mine[k] if k < len(mine) else '(none)'} ({piece!r}). A teacher scores the student's token ids, so "
            "both must share a tokenizer"
        )

    async def _tokenize(self, text: str) -> list[int]:
        """The teacher's ids of ``text`` (``POST /tokenize``, the same request for strop serve, SGLang and vLLM)."""
        client = self._client()
        try:
            out = await client._call(
                "POST", "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60
            )
        finally:
            await client.close()
        ids = out.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise EngineRequestError(f"{self.url}/tokenize: no list of token ids in the answer: {str(out)[:200]}")
        return ids
