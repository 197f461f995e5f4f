"""The one door to a run's processes: :func:`start` starts them as the config and command line say (local
``--nproc`` ranks, torchrun's ranks as they come, Ray actors), or tells the caller that it is a rank itself.
The driver (strop/loop.py) never knows which launcher started it."""

from __future__ import annotations

import os
import sys
from typing import Callable

from strop.cluster import local, ray_cluster
from strop.cluster.placement import PlacementError
from strop.config import secret_fields
from strop.parallel.dims import ParallelDims
from strop.process import die_with_parent, stop_on_signals


class LaunchError(ValueError):
    """The launch asked for cannot be: a problem of the command line or config, phrased for the user."""


def start(cfg, argv: list[str], nproc: int, command: list[str], main: Callable[[list[str]], int]) -> int | None:
    """Start the run's processes as the config and command line say, wait for them and return the run's exit
    code; None when this process is itself the run or one of its ranks (one local process, a rank of
    ``--nproc`` or torchrun, a Ray trainer actor: RANK is set) and trains now. ``argv``: the command line
    every rank runs. The front door hands down the program a rank runs, which nothing here imports:
    ``command`` starts one as a process of its own (``--nproc``), ``main`` runs one in this process (a Ray
    actor); each is followed by ``argv``."""
    on_ray = cfg.cluster.launcher == "ray" and "RANK" not in os.environ
    if on_ray and nproc > 1:
        raise LaunchError("--nproc starts local ranks; with cluster.launcher=ray set cluster.trainer_ranks")
    try:
        world = cfg.cluster.trainer_ranks if on_ray else int(os.environ.get("WORLD_SIZE", nproc))
        ParallelDims.from_config(cfg.parallel, world)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if on_ray:
        return _on_ray(cfg, argv, main)
    if nproc > 1:
        argv = secrets_to_environment(cfg, argv)  # a rank's command line is visible to every user (ps)
        os.environ["STROP_LAUNCHER_PID"] = str(os.getpid())  # the ranks die with this process, SIGKILL included
        with stop_on_signals():  # SIGTERM: the ranks are stopped (each closes what it started) before this exits
            return local.launch(nproc, argv, command)
    if "STROP_LAUNCHER_PID" in os.environ:  # a rank started by --nproc
        die_with_parent(int(os.environ.pop("STROP_LAUNCHER_PID")))
    return None


def _on_ray(cfg, argv: list[str], main: Callable[[list[str]], int]) -> int:
    """The run's ranks and engines as Ray actors (strop.cluster.ray_cluster); this process places, watches and
    stops them."""
    argv = secrets_to_environment(cfg, argv)  # the actors get them in their environment
    try:
        with stop_on_signals():
            return ray_cluster.launch(cfg, argv, main)
    except (ray_cluster.ClusterError, PlacementError) as exc:
        print(f"strop train: error: {exc}", file=sys.stderr)  # the command's last line, as its other errors
        return 1


def secrets_to_environment(cfg, argv: list[str]) -> list[str]:
    """``argv`` without secret options (``--engine.token=...`` / ``--engine.token ...``); their values
    go to the environment variables the ranks read them from (strop.config.secret_fields)."""
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
