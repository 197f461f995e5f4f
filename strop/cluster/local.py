"""The local launcher: ``strop train --nproc N`` starts N ranks of ``strop train`` on this machine.

The ranks run under torch's own launcher (``torch.distributed.launcher.api.elastic_launch``, what
``torchrun`` runs), one node, no restarts: its agent starts the ranks with RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT, stops the others when one fails (SIGTERM, then SIGKILL),
forwards SIGTERM / SIGINT / SIGHUP to them, and sends a worker's stderr to a file (``redirects``) or
nowhere (``local_ranks_filter``). What strop adds: only rank 0 talks on the terminal, and the failed
rank's stderr tail and exit code are printed (torch's summary reads only ``@record`` error files).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import uuid

STOP_GRACE_S = 5  # a rank stopped with SIGTERM is killed after this long


def launch(nproc: int, argv: list[str], command: list[str] | None = None, poll_s: float = 0.5) -> int:
    """``strop train --nproc N``: start N local ranks of ``strop train`` and wait for all; the exit code
    of the rank that failed first, 128 + the signal when the launcher was stopped, else 0.

    Rank 0 keeps the terminal; the other ranks' stdout is dropped and their stderr goes to files
    (a pipe nobody drains blocks a worker that writes more than its buffer). ``command`` replaces
    ``python -m strop.cli train`` (tests); ``poll_s`` is how often the ranks are checked.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    class Logs(DefaultLogsSpecs):
        """Remembers where each rank's stderr went, to print the failed rank's tail."""

        def reify(self, envs):
            self.dest = super().reify(envs)
            return self.dest

    command = command or [sys.executable, "-m", "strop.cli", "train"]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # strop says what failed
    with tempfile.TemporaryDirectory(prefix="strop-ranks-") as tmp:
        logs = Logs(log_dir=tmp, redirects={r: Std.ERR if r else Std.NONE for r in range(nproc)},
                    local_ranks_filter={0})
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
                              max_restarts=0, monitor_interval=poll_s, logs_specs=logs,
                              shutdown_timeout=STOP_GRACE_S)
        try:
            elastic_launch(config, command[0])(*command[1:], *argv)
        except SignalException as exc:  # the agent has stopped the ranks
            return 128 + exc.sigval
        except ChildFailedError as exc:
            first, failure = exc.get_first_failure()  # torch's order: the earliest, the first seen on a tie
            if first > 0:  # rank 0's stderr is on the terminal already
                tail = open(logs.dest.stderrs[first], "rb").read()[-3000:].decode(errors="replace")
                print(f"strop: rank {first} failed (exit code {failure.exitcode}):\n{tail}", file=sys.stderr)
            stopped = sorted(r for r in exc.failures if r != first)
            if stopped:
                print(f"strop: stopped rank(s) {stopped} after rank(s) [{first}] failed", file=sys.stderr)
            return failure.exitcode
    return 0
