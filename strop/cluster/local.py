"""The local launcher: ``strop train --nproc N`` starts N ranks of ``strop train`` on this machine.

The ranks run under torch's own launcher (``torch.distributed.launcher.api.elastic_launch``, the agent
``torchrun`` runs) on one node with no restarts. Its agent sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, stops the other ranks when one fails (SIGTERM, SIGKILL after
``STOP_GRACE_S``), passes SIGTERM / SIGINT / SIGHUP on to the ranks, and sends each rank's streams to
the terminal, a file (``redirects``) or nowhere (``local_ranks_filter``). strop adds what torch leaves
out: the failed rank's stderr tail (torch's summary shows only ``@record`` error files) and an end of
the ranks when the launcher is SIGKILLed (their parent-death signal: ``STROP_LAUNCHER_PID`` in strop.cluster).
"""

from __future__ import annotations

import logging
import tempfile
import uuid

log = logging.getLogger(__name__)

STOP_GRACE_S = 5  # a rank stopped with SIGTERM is killed after this long


def launch(nproc: int, argv: list[str], command: list[str], poll_s: float = 0.5) -> int:
    """``strop train --nproc N``: start N local ranks of ``strop train`` and wait for all; the exit code
    of the rank that failed first, 128 + the signal when the launcher was stopped, else 0.

    Rank 0 keeps the terminal; the other ranks' stdout is dropped and their stderr goes to files
    (a pipe nobody drains blocks a worker that writes more than its buffer). ``command``: what a rank runs
    (handed down from the front door: ``python -m strop.cli train``), followed by ``argv``; ``poll_s`` is how
    often the ranks are checked.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    class Logs(DefaultLogsSpecs):
        """Remembers where each rank's stderr went, to print the failed rank's tail."""

        def reify(self, envs):
            self.dest = super().reify(envs)
            return self.dest

    from strop.observe.logs import console

    console()  # what failed reaches the terminal from Python too, as from `strop train`
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # strop says what failed
    with tempfile.TemporaryDirectory(prefix="strop-ranks-") as tmp:
        logs = Logs(
            log_dir=tmp, redirects={r: Std.ERR if r else Std.NONE for r in range(nproc)}, local_ranks_filter={0}
        )
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            local_addr="127.0.0.1",
            max_restarts=0,
            monitor_interval=poll_s,
            logs_specs=logs,
            shutdown_timeout=STOP_GRACE_S,
        )
        try:
            elastic_launch(config, command[0])(*command[1:], *argv)
        except SignalException as exc:  # the agent has stopped the ranks
            return 128 + exc.sigval
        except ChildFailedError as exc:
            first, failure = exc.get_first_failure()  # torch's order: the earliest, the first seen on a tie
            tail = ""
            if first > 0:  # rank 0's stderr is on the terminal already
                tail = ":\n" + open(logs.dest.stderrs[first], "rb").read()[-3000:].decode(errors="replace")
            log.error(f"strop: rank {first} failed ({_how(failure)}){tail}")
            others = [f"rank {r} ({_how(f)})" for r, f in sorted(exc.failures.items()) if r != first]
            if others:  # stopped by the agent, or failed on their own a moment later
                log.warning(f"strop: then ended: {', '.join(others)}")
            return failure.exitcode
    return 0


def _how(failure) -> str:
    return f"exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.signal_name()
