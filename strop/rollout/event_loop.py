"""The run's one event loop, in a thread of its own: rollout goes on while the trainer works."""

from __future__ import annotations

import asyncio
import threading

from strop.openmp import ReleasingThreadPool, release_threads


class EventLoopThread:
    """An asyncio loop running in a daemon thread; the caller's thread hands it coroutines with :meth:`run`."""

    def __init__(self, timeout_s: float, name: str = "strop-rollout"):
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        # work handed to threads (asyncio.to_thread) frees their OpenMP pools after it (strop.openmp)
        self.loop.set_default_executor(ReleasingThreadPool(thread_name_prefix=f"{name}-pool"))
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float | None = None):
        """Run ``coroutine`` in the loop and wait for its result, at most ``timeout_s`` (default: the
        one given at start). A wait that ends without the result (time out, a signal) cancels the coroutine."""
        timeout_s = timeout_s or self.timeout_s
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        release_threads()  # the caller waits: its OpenMP pool would only slow the engine's down (strop.openmp)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (or it finished just now)
                return future.result()
            future.cancel()
            raise TimeoutError(
                f"{coroutine.__qualname__} did not finish within {timeout_s:g}s in the run's event loop"
            ) from None
        except BaseException:
            future.cancel()  # a signal while waiting: the coroutine stops too
            raise

    def close(self, timeout_s: float) -> None:
        """Stop the loop and wait at most ``timeout_s`` for its thread; the loop is closed once the thread ended."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=timeout_s)
        if not self.thread.is_alive():
            self.loop.close()
