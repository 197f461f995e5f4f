"""The ``strop`` command (the console entry point ``strop = strop.cli:main``; ``python -m strop.cli``):
strop.cli.commands parses the line and runs a command; strop.cli.train holds ``strop train`` and
``strop rollout``, strop.cli.common what they share."""

from strop.cli.commands import (
    check_plugin_main,
    export_main,
    main,
    plot_main,
    proxy_main,
    rollout_main,
    serve_main,
    train_main,
)

__all__ = [
    "check_plugin_main",
    "export_main",
    "main",
    "plot_main",
    "proxy_main",
    "rollout_main",
    "serve_main",
    "train_main",
]
