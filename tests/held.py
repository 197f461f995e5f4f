"""A decode step held mid-generation: proves a stream sent a token before the generation ended, with
no timing (strop serve's and the agent proxy's streaming tests)."""

import threading


class HeldStep:
    """Within ``with``, the ``at``-th call of ``owner.name`` (an engine's decode step) waits until
    :meth:`release` (at most ``limit_s``: :attr:`timed_out` is then set). A client that reads a
    token while it waits and then releases it shows the token went out before the generation's
    end; one that reads its first token only after ``timed_out`` shows it did not."""

    def __init__(self, owner, name: str, at: int = 5, limit_s: float = 20.0):
        self.owner, self.name, self.at, self.limit_s = owner, name, at, limit_s
        self.calls, self.released, self.timed_out = 0, threading.Event(), threading.Event()
        self.step = getattr(owner, name)

    def _held(self, *args, **kw):
        self.calls += 1
        if self.calls == self.at and not self.released.wait(self.limit_s):
            self.timed_out.set()
        return self.step(*args, **kw)

    def release(self) -> None:
        self.released.set()

    def __enter__(self) -> "HeldStep":
        setattr(self.owner, self.name, self._held)
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        setattr(self.owner, self.name, self.step)
