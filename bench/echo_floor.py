"""The floor echo server (a minimal Python epoll loop); it lives in the package now:
aoprim/benchmarks/echo_floor.py.  This wrapper keeps ``python bench/echo_floor.py`` working."""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "aoprim", "benchmarks", "echo_floor.py"), run_name="__main__")
