"""``python -m aoprim serve [MODULE:HANDLER | --app echo|chat] ...`` and
``python -m aoprim loadgen ...`` (see aoprim.server.cli and aoprim.tools.loadgen)."""
import sys

from aoprim.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
