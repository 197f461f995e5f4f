"""The run directory, where every output of a run goes: named (``runs/<timestamp>`` unless ``run.dir``),
refused when another run's outputs are there, created once every rank is ready (strop.setup); its
``run.log`` holds the lines the run shows (strop.observe.logs)."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from strop.config import Config
from strop.observe.logs import attach_run_log


ENGINE_LOGS = "engines"  # launched servers' output, <port>.log (strop.setup_remote), written before the rest


def check_run_dir(cfg: Config) -> None:
    """Refuse an existing, non-empty run directory: a run never writes over another's outputs. Launched servers'
    logs alone (what a start that failed leaves) are no outputs: a run there adds its own beside them."""
    if cfg.run.dir and Path(cfg.run.dir).exists() and not all(map(_server_logs, Path(cfg.run.dir).iterdir())):
        raise FileExistsError(f"run.dir={cfg.run.dir!r} already exists and is not empty; choose a new one")


def _server_logs(path: Path) -> bool:
    return (
        path.name == ENGINE_LOGS
        and path.is_dir()
        and not path.is_symlink()
        and all(f.suffix == ".log" and f.is_file() and not f.is_symlink() for f in path.iterdir())
    )


def make_run_dir(cfg: Config, create: bool = True, resume: bool = False) -> Path:
    """The run directory (``runs/<timestamp>`` unless run.dir is set); ``create=False`` only names it.
    ``resume``: the existing run.dir, written into again."""
    if resume:
        if not cfg.run.dir or not (Path(cfg.run.dir) / "config.yaml").is_file():
            raise FileNotFoundError(f"resume: {cfg.run.dir!r} is not a strop run directory (no config.yaml)")
        if create:
            attach_run_log(cfg.run.dir)  # appended to: the resumed run's lines follow the first's
        return Path(cfg.run.dir)
    check_run_dir(cfg)
    if cfg.run.dir:
        run_dir = Path(cfg.run.dir)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / stamp
        n = 1
        while run_dir.exists():
            run_dir, n = Path("runs") / f"{stamp}-{n}", n + 1
        if not create:
            cfg.run.dir = str(run_dir)  # the same name when it is created
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
        attach_run_log(run_dir)  # from here on, every line the terminal shows is in run_dir/run.log too
    return run_dir
