"""aoprim's version: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``, parsed statically: building never
imports aoprim) and ``aoprim.__version__`` re-exports it.  PEP 440; a ``.devN`` suffix
between releases.
"""
__version__ = "0.2.0.dev0"
