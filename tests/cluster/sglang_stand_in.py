"""A stand-in for ``python -m sglang.launch_server``, whose build needs a GPU: it takes the command line strop's
SGLang engine actor gives SGLang (``--model-path``, ``--host``, ``--port``, ``--config`` holding the API key, then
``engine.launch_args``), writes what it received to $STAND_IN_RECORD, and runs ``strop serve``, which answers the
SGLang routes strop's SGLang client uses, with that key as its token. The flags themselves are checked against
SGLang 0.5.23's wheel in tests/serving/test_sglang_wheel.py."""

import argparse
import json
import os
import stat
import sys
from pathlib import Path

import yaml

parser = argparse.ArgumentParser(prog="sglang.launch_server stand-in")
for flag in ("--model-path", "--host", "--port", "--config"):
    parser.add_argument(flag, required=True)
args, rest = parser.parse_known_args()
config = yaml.safe_load(Path(args.config).read_text())
Path(os.environ["STAND_IN_RECORD"]).write_text(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "config": args.config,
            "config_mode": stat.S_IMODE(os.stat(args.config).st_mode),
            "config_keys": sorted(config),
        }
    )
)
os.environ["STROP_SERVE_TOKEN"] = config["api-key"]
os.execv(
    sys.executable,
    [
        sys.executable,
        "-m",
        "strop.cli",
        "serve",
        f"--model-path={args.model_path}",
        f"--host={args.host}",
        f"--port={args.port}",
        *rest,
    ],
)
