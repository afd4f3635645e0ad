"""The asyncio servers of bench/aio_compare.py and bench/aio_callgrind.py: the same code on
every loop.  The servers live in the package (``aoprim/benchmarks/aio_servers.py``, which
``python -m aoprim bench --only aio`` runs too); this script runs that module.

    python bench/aio_servers.py --loop asyncio|uvloop|rloop|aoprim --app APP [--port 0]

Apps: raw, proto-u16, streams-u16, streams-raw, aiohttp (see the module's docstring).
"""
import sys

from aoprim.benchmarks.aio_servers import main

if __name__ == "__main__":
    sys.exit(main())
