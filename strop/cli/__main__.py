"""``python -m strop.cli ...``: the ``strop`` command (each ``--nproc`` rank runs it so)."""

import sys

from strop.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
