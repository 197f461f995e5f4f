"""Where a run's processes live: the launchers (local ``--nproc`` on torch's elastic agent, torchrun's ranks as
they come, Ray actors), placement across nodes, and process lifetime. :func:`start` is the one door: the
driver (strop/loop.py) never knows which launcher started it. Nothing below ``strop/cluster`` imports the
training or serving layers."""

from __future__ import annotations

import os
import sys


class LaunchError(ValueError):
    """The launch asked for cannot be: a problem of the command line or config, phrased for the user."""


def start(cfg, argv: list[str], nproc: int = 1) -> int | None:
    """Start the run's processes as the config and command line say, wait for them and return the run's exit
    code; None when this process is itself the run or one of its ranks (one local process, a rank of
    ``--nproc`` or torchrun, a Ray trainer actor: RANK is set) and trains now. ``argv``: the command line
    every rank runs."""
    from strop.parallel.runtime import parallel_layout

    on_ray = cfg.cluster.launcher == "ray" and "RANK" not in os.environ
    if on_ray and nproc > 1:
        raise LaunchError("--nproc starts local ranks; with cluster.launcher=ray set cluster.trainer_ranks")
    try:
        world = cfg.cluster.trainer_ranks if on_ray else int(os.environ.get("WORLD_SIZE", nproc))
        parallel_layout(world, cfg.parallel.context_parallel_size, cfg.parallel.tensor_parallel_size)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if on_ray:
        return _on_ray(cfg, argv)
    if nproc > 1:
        from strop.cluster.local import launch
        from strop.cluster.process import stop_on_signals

        argv = secrets_to_environment(cfg, argv)  # a rank's command line is visible to every user (ps)
        os.environ["STROP_LAUNCHER_PID"] = str(os.getpid())  # the ranks die with this process, SIGKILL included
        with stop_on_signals():  # SIGTERM: the ranks are stopped (each closes what it started) before this exits
            return launch(nproc, argv)
    if "STROP_LAUNCHER_PID" in os.environ:  # a rank started by --nproc
        from strop.cluster.process import die_with_parent

        die_with_parent(int(os.environ.pop("STROP_LAUNCHER_PID")))
    return None


def _on_ray(cfg, argv: list[str]) -> int:
    """The run's ranks and engines as Ray actors (strop.cluster.ray_cluster); this process places, watches and
    stops them."""
    from strop.cluster.placement import PlacementError
    from strop.cluster.process import stop_on_signals
    from strop.cluster.ray_cluster import ClusterError, launch

    argv = secrets_to_environment(cfg, argv)  # the actors get them in their environment
    try:
        with stop_on_signals():
            return launch(cfg, argv)
    except (ClusterError, PlacementError) as exc:
        print(f"strop train: error: {exc}", file=sys.stderr)
        return 1


def secrets_to_environment(cfg, argv: list[str]) -> list[str]:
    """``argv`` without secret options (``--engine.token=...`` / ``--engine.token ...``); their values
    go to the environment variables the ranks read them from (strop.config.secret_fields)."""
    from strop.config import secret_fields

    fields = secret_fields()
    out, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0].removeprefix("--")
        if skip:
            skip = False
        elif name in fields:
            skip = "=" not in arg  # the value is the next argument
        else:
            out.append(arg)
    for name, env in fields.items():
        value = cfg
        for part in name.split("."):
            value = getattr(value, part)
        if value is not None:
            os.environ[env] = value.get_secret_value()
    return out
