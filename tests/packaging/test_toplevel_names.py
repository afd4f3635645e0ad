"""What ``aoprim``'s top level holds: the primitives, and nothing of the server.

The top level exports the primitives (the README's list); the server's compiled parts live in
``aoprim.server`` beside the code that uses them, the asyncio loop's in ``aoprim.aio``, the
bench command's in ``aoprim.benchmarks``.  The server's names the top level used to export
still resolve for one release (PEP 562 ``__getattr__``), each with a DeprecationWarning that
names its import from its home, and loaded only then: ``import aoprim`` loads no part of the
server's receive path.
"""
import importlib
import json
import os
import subprocess
import sys

import pytest

import aoprim

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(aoprim.__file__)))

PRIMITIVES = {"AtomicInt", "RefCount", "SpinLock", "MPMCQueue", "SPSCQueue", "SlabPool", "Slot",
              "BlockTable", "SendBatch", "FlushGroup", "Full", "Empty", "PoolExhausted",
              "RefCountError", "Closed", "get_include"}

# each deprecated top-level name -> the module it is imported from
MOVED = {
    **dict.fromkeys(("Receiver", "RX_EOF", "RX_ERROR", "RX_TOO_LARGE", "RX_HANDLER",
                     "RX_PROXY", "RX_PROXY_ERROR"), "aoprim.server._receiver"),
    "RxArena": "aoprim.server._rxbuf",
    "ProxyParser": "aoprim.server._proxyproto",
    "EpollCore": "aoprim.server._eloop",
    "EpollTimer": "aoprim.server._eloop",
    "TLSConn": "aoprim.server._tls",
    "TLSFlush": "aoprim.server._tls",
}

# compiled module -> the package it lives in
HOMES = {
    "_receiver": "aoprim.server", "_rxbuf": "aoprim.server", "_eloop": "aoprim.server",
    "_tls": "aoprim.server",
    "_proxyproto": "aoprim.server",
    "_aioloop": "aoprim.aio", "_aiotransport": "aoprim.aio", "_aiowrite": "aoprim.aio",
    "_readbuf": "aoprim.aio",
    "_benchcore": "aoprim.benchmarks",
}
TOP = ("_atomic", "_spinlock", "_mpmc", "_spsc", "_slab", "_blocktable", "_sendbatch",
       "_flushgroup")


def test_the_top_level_exports_the_primitives_only():
    assert set(aoprim.__all__) == PRIMITIVES
    assert len(aoprim.__all__) == len(PRIMITIVES)
    for name in aoprim.__all__:
        assert getattr(aoprim, name) is not None
    assert aoprim.__version__


def test_dir_lists_the_public_names_and_not_the_deprecated_ones():
    listed = dir(aoprim)
    assert PRIMITIVES <= set(listed)
    assert not set(MOVED) & set(listed)


def test_import_aoprim_loads_nothing_of_the_server():
    # a fresh interpreter: this process has long imported the server
    code = "import json, sys, aoprim; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": PKG_PARENT}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout)
    assert "aoprim._atomic" in loaded                         # the check sees aoprim's modules
    server = [m for m in loaded if m.startswith("aoprim.server")
              or m.rsplit(".", 1)[-1] in ("_receiver", "_rxbuf", "_eloop", "_tls", "_proxyproto")]
    assert not server, f"`import aoprim` loaded {server}"
    assert "ssl" not in loaded


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_deprecated_name_warns_with_its_new_import_and_is_the_same_object(name):
    home = MOVED[name]
    with pytest.warns(DeprecationWarning) as caught:
        old = getattr(aoprim, name)
    (w,) = caught
    assert f"from {home} import {name}" in str(w.message)
    assert w.filename == __file__                 # reported at the caller's line
    assert old is getattr(importlib.import_module(home), name)


def test_from_import_of_a_deprecated_name_warns_too():
    with pytest.warns(DeprecationWarning, match=r"from aoprim\.server\._eloop import EpollCore"):
        from aoprim import EpollCore
    from aoprim.server._eloop import EpollCore as new
    assert EpollCore is new


def test_every_access_warns():
    for _ in range(2):
        with pytest.warns(DeprecationWarning):
            aoprim.RX_EOF


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        aoprim.NoSuchName
    assert not hasattr(aoprim, "_receiver")


def _folder_of(package):
    return os.path.dirname(os.path.abspath(importlib.import_module(package).__file__))


@pytest.mark.parametrize("mod", sorted(HOMES))
def test_each_compiled_module_lives_beside_its_users(mod):
    m = importlib.import_module(f"{HOMES[mod]}.{mod}")
    assert os.path.dirname(os.path.abspath(m.__file__)) == _folder_of(HOMES[mod])
    assert m.__name__ == f"{HOMES[mod]}.{mod}"


@pytest.mark.parametrize("mod", TOP)
def test_the_primitives_stay_at_the_top(mod):
    m = importlib.import_module(f"aoprim.{mod}")
    assert os.path.dirname(os.path.abspath(m.__file__)) == _folder_of("aoprim")
