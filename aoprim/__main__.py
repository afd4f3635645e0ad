"""``python -m aoprim serve|loadgen|bench ...``: the command line of aoprim.cli."""
import sys

from aoprim.cli import main

if __name__ == "__main__":
    sys.exit(main())
