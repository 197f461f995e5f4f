"""A streamed answer's text, token by token: what strop serve's and the agent proxy's streams show.

- :class:`IncrementalDecoder`: the text of a growing list of token ids, a piece per token, decoded
  incrementally (vLLM's scheme): each piece comes from decoding the few tokens since the last
  emitted piece, never the whole prefix again, so n tokens cost O(n) decoding in all.
- :class:`StreamedText`: that text as a client may see it while it streams: text that could still
  be the start of a stop string waits for the tokens after it, and the text ends where the first
  stop string starts (as :func:`strop.serving.openai.cut_at_stops` cuts the whole answer).
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDecoder:
    """``push`` a token, get the text it adds. A character split across tokens, or the space a
    tokenizer drops at the start of a decode, needs the tokens around it, so each decode covers the
    tokens since the last emitted piece (``ids[start:]``) and the piece is what it adds to the
    decode of the tokens already emitted from there (``ids[start:read]``). A piece is empty while a
    character is incomplete (U+FFFD) or a token adds nothing (a skipped special token).

    Where a tokenizer's decoding is prefix-stable, the pieces join to ``decode(ids)``; the caller
    that must match the whole decode compares once at the end (one decode, not one per token)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._start = self._read = 0
        self._before: str | None = ""  # decode(ids[start:read]), kept until the window moves

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self._before is None:
            self._before = self.decode(self.ids[self._start : self._read])
        now = self.decode(self.ids[self._start :])
        if len(now) <= len(self._before) or now.endswith("\ufffd"):  # (U+FFFD: a character not yet whole)
            return ""
        piece = now[len(self._before) :]
        self._start, self._read, self._before = self._read, len(self.ids), None
        self.text += piece
        return piece


class StreamedText:
    """One answer's text for a stream: ``push`` each token; ``ready`` is how much of ``text`` may be
    shown now; ``stop_at`` is where the first stop string starts once one was decoded (the answer
    ends there: tokens after it are not the answer's). Stop strings are searched in the new text
    and the few characters before it only, so the whole stream costs O(n)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decoder = IncrementalDecoder(decode)
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # a stop string's start, not yet complete
        self.stop_at: int | None = None

    @property
    def text(self) -> str:
        return self.decoder.text

    def push(self, token: int) -> None:
        if self.stop_at is not None:
            return
        before = len(self.decoder.text)
        self.decoder.push(token)
        text = self.decoder.text
        # a stop string first found now ends in the new text, so it starts at most len(s) - 1 before it
        hits = [i for s in self.stops if (i := text.find(s, max(before - len(s) + 1, 0))) >= 0]
        if hits:
            self.stop_at = min(hits)

    @property
    def ready(self) -> int:
        return self.stop_at if self.stop_at is not None else max(len(self.decoder.text) - self.hold, 0)
