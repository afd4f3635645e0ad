"""The asyncio baseline echo servers; they live in the package now:
aoprim/benchmarks/echo_asyncio.py (``--loop asyncio|uvloop|aio``).  This wrapper keeps
``python bench/echo_asyncio.py --port 0 --framing raw|u16 [--uvloop]`` working."""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "aoprim", "benchmarks", "echo_asyncio.py"), run_name="__main__")
