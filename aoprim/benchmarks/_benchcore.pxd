# cython: language_level=3
"""aoprim.benchmarks._benchcore declares no C API: it is the benchmark command's compiled loop
module (see _benchcore.pyx).  This file exists so that every compiled module ships a .pxd."""
