"""Small differences from asyncio: those matched (the messages of ``writelines()`` refused
after ``write_eof()`` or during a ``sendfile()``) and those kept and documented in
docs/aio.md's list of differences (``nest_asyncio.apply(loop)`` refused; a ``socket.socket``
subclass passed as ``sock=`` has its ``send``/``recv`` overrides bypassed, as on uvloop).

Each scenario runs on asyncio's loop (asserted too), uvloop and aoprim.aio.
"""
import asyncio
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

try:
    import uvloop
except ImportError as exc:  # pragma: no cover - depends on the venv
    uvloop = None
    _UVLOOP_WHY = f"uvloop not importable: {exc}"

import aoprim.aio

KINDS = ("asyncio", "uvloop", "aoprim")
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "aio.md"
# asyncio 3.12+'s selector transport has its own writelines() (its own messages)
OWN_WRITELINES = "writelines" in vars(asyncio.selector_events._SelectorSocketTransport)


def new_loop(kind):
    if kind == "asyncio":
        return asyncio.new_event_loop()
    if kind == "uvloop":
        if uvloop is None:
            pytest.skip(_UVLOOP_WHY)
        return uvloop.new_event_loop()
    return aoprim.aio.new_event_loop()


def _differences():
    """docs/aio.md's section listing what differs from asyncio."""
    text = DOCS.read_text()
    start = text.index("## What a peer or a caller can observe that differs from asyncio")
    return text[start:text.index("\n## ", start + 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_writelines_after_write_eof_message(kind):
    loop = new_loop(kind)

    async def main():
        a, b = socket.socketpair()
        try:
            tr, _ = await loop.create_connection(asyncio.Protocol, sock=a)
            tr.write_eof()
            with pytest.raises(RuntimeError) as info:
                tr.writelines([b"x"])
            tr.close()
            return str(info.value)
        finally:
            b.close()

    try:
        msg = loop.run_until_complete(main())
    finally:
        loop.close()
    if kind == "uvloop" or OWN_WRITELINES:
        assert msg == "Cannot call writelines() after write_eof()"
    else:                   # asyncio 3.11: WriteTransport.writelines joins, then write()s
        assert msg == "Cannot call write() after write_eof()"


@pytest.mark.parametrize("kind", ["asyncio", "aoprim"])    # (uvloop: no native sendfile)
def test_writelines_during_sendfile_message(kind, tmp_path):
    loop = new_loop(kind)
    path = tmp_path / "f.bin"
    path.write_bytes(b"y" * 1000)

    async def main():
        with socket.create_server(("127.0.0.1", 0)) as lsock:
            cli = socket.create_connection(lsock.getsockname())
            srv, _ = lsock.accept()
            srv.setblocking(False)
            try:
                tr, _ = await loop.connect_accepted_socket(asyncio.Protocol, srv)
                with open(path, "rb") as f:
                    task = asyncio.ensure_future(loop.sendfile(tr, f))
                    while tr.is_reading() and not task.done():    # sendfile started
                        await asyncio.sleep(0)
                    with pytest.raises(RuntimeError) as info:
                        tr.writelines([b"x"])
                    assert await asyncio.wait_for(task, 10) == 1000
                tr.close()
                return str(info.value)
            finally:
                cli.close()

    try:
        msg = loop.run_until_complete(main())
    finally:
        loop.close()
    if OWN_WRITELINES:
        assert msg == "unable to writelines; sendfile is in progress"
    else:
        assert msg == "unable to write; sendfile is in progress"


def test_nest_asyncio_refusal_is_documented_with_its_message(tmp_path):
    pytest.importorskip("nest_asyncio", reason="nest_asyncio is not installed")
    # nest_asyncio.apply() patches asyncio itself for the whole process: in a child
    code = ("import nest_asyncio, aoprim.aio\n"
            "loop = aoprim.aio.new_event_loop()\n"
            "try:\n"
            "    nest_asyncio.apply(loop)\n"
            "except ValueError as e:\n"
            "    print(e)\n"
            "finally:\n"
            "    loop.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.strip()
    assert msg.startswith("Can't patch loop of type") and "nest_asyncio is not supported" in msg
    diff = _differences()
    assert "nest_asyncio.apply(loop)" in diff and "ValueError" in diff
    assert "nest_asyncio is not supported" in diff


class _CountingSocket(socket.socket):
    """A socket.socket subclass overriding the calls a transport could send and receive by."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = []

    def send(self, *a, **k):
        self.calls.append("send")
        return super().send(*a, **k)

    def sendmsg(self, *a, **k):
        self.calls.append("sendmsg")
        return super().sendmsg(*a, **k)

    def recv(self, *a, **k):
        self.calls.append("recv")
        return super().recv(*a, **k)

    def recv_into(self, *a, **k):
        self.calls.append("recv_into")
        return super().recv_into(*a, **k)


@pytest.mark.parametrize("kind", KINDS)
def test_socket_subclass_overrides_are_bypassed_as_documented(kind):
    loop = new_loop(kind)
    s1, peer = socket.socketpair()
    sock = _CountingSocket(s1.family, s1.type, fileno=s1.detach())
    peer.settimeout(10)

    async def main():
        got = loop.create_future()

        class Proto(asyncio.Protocol):
            def data_received(self, data):
                if not got.done():
                    got.set_result(data)

        tr, _ = await loop.create_connection(Proto, sock=sock)
        tr.write(b"hello")
        await loop.run_in_executor(None, lambda: peer.sendall(b"pong"))
        data = await asyncio.wait_for(got, 10)
        tr.close()
        return data

    try:
        data = loop.run_until_complete(main())
        assert peer.recv(100) == b"hello"
    finally:
        loop.close()
        peer.close()
        sock.close()
    assert data == b"pong"
    if kind == "asyncio":
        assert "send" in sock.calls and "recv" in sock.calls, sock.calls
    else:               # the overrides are not called (docs/aio.md, differences)
        assert sock.calls == [], sock.calls
    diff = _differences()
    assert "socket.socket" in diff and "subclass" in diff and "sock=" in diff


async def _write_rounds_to_a_closed_peer():
    """write()+drain() rounds in one task step to a peer that closed without reading, then
    rounds one iteration apart, then close(): what each raised."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        return await _rounds(ls)


async def _rounds(ls):
    r, w = await asyncio.open_connection("127.0.0.1", ls.getsockname()[1])
    c, _ = ls.accept()
    c.close()                       # FIN now; the peer's kernel resets what arrives next
    await asyncio.sleep(0.1)
    seen = []

    async def round_(data):
        try:
            w.write(data)
            await w.drain()
            seen.append("ok")
        except Exception:           # (uvloop: RuntimeError once its handle is closed)
            seen.append("error")
    for _ in range(3):
        await round_(b"x" * 100)
    for _ in range(3):
        await asyncio.sleep(0.05)
        await round_(b"y")
    w.close()
    try:
        await w.wait_closed()
        seen.append("closed ok")
    except (ConnectionResetError, BrokenPipeError):
        seen.append("closed with the error")
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_write_errors_surface_after_the_iteration_as_documented(kind):
    # docs/aio.md, difference 1: the rounds of one task step all pass on aoprim.aio (one
    # sendmsg at the iteration's end); the error reaches drain() within the next rounds and
    # wait_closed() as on asyncio, whose second drain() already raises
    assert "all succeed even if the peer" in _differences()
    loop = new_loop(kind)
    try:
        seen = loop.run_until_complete(_write_rounds_to_a_closed_peer())
    finally:
        loop.close()
    if kind == "aoprim":
        assert seen[:3] == ["ok", "ok", "ok"], seen
    else:
        assert seen[:2] == ["ok", "error"], seen
    assert "error" in seen[3:6] and seen[-1] == "closed with the error", seen
