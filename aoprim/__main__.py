"""``python -m aoprim serve --app echo`` / ``python -m aoprim loadgen ...`` (see aoprim.server.cli)."""
import sys

from aoprim.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
