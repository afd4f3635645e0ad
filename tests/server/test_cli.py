"""The command line: python -m aoprim serve / loadgen, as subprocesses."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import tempfile

import pytest

from aoprim.server import Handler, Server

from proc_support import end, signal_masks
from server_support import HOST, frame, read_frame, recv_exact

# A neutral working directory by default; test_serve_from_the_checkout_root covers the
# README's own command, run where the README is.
CWD = tempfile.gettempdir()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server(*args, cwd=CWD):
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST,
                          "--port", "0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        out, err = p.communicate(timeout=10)
        raise AssertionError(f"server did not start: {line!r} {err}")
    host, port = line.split()[-1].rsplit(":", 1)
    assert host.removeprefix("[").removesuffix("]") == HOST     # IPv6 comes bracketed
    return p, int(port)


def stop(p, sig):
    p.send_signal(sig)
    out, err = p.communicate(timeout=20)
    return p.returncode, out, err


@pytest.mark.parametrize("backend", ["selectors", "epoll"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_echo_answers_and_exits_0_on_signal(sig, backend):
    p, port = start_server("--app", "echo", "--backend", backend, "--stats-json")
    try:
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"hello cli")
            assert recv_exact(s, 9) == b"hello cli"
            rc, out, err = stop(p, sig)     # a client is still connected
        assert rc == 0, err
        assert "Traceback" not in err
        assert "shutting down" in err
        stats = json.loads(out.split("stats ", 1)[1])
        assert stats["frames_in"] >= 1 and stats["connections_total"] == 1
    finally:
        end(p)


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "aoprim")),
                    reason="not run from a source checkout")
def test_serve_from_the_checkout_root():
    """The README's main job, `python -m aoprim serve --app echo`, run in the checkout root:
    there sys.path starts with the checkout, whose aoprim/ has no compiled extensions; the
    package must still serve from the installed build."""
    p, port = start_server("--app", "echo", cwd=ROOT)
    try:
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"from the root")
            assert recv_exact(s, 13) == b"from the root"
        rc, out, err = stop(p, signal.SIGINT)
        assert rc == 0 and "Traceback" not in err, err
    finally:
        end(p)


def test_serve_chat_framed_with_workers():
    p, port = start_server("--app", "chat", "--framing", "u16", "--workers", "2",
                           "--max-frame", "1000", "--idle-timeout", "30",
                           "--max-connections", "10")
    try:
        a = socket.create_connection((HOST, port), timeout=10)
        b = socket.create_connection((HOST, port), timeout=10)
        # a was accepted before b; b's frame reaching a proves both are registered
        b.sendall(frame(b"hi from b"))
        assert read_frame(a) == b"hi from b"
        a.sendall(frame(b"to everyone"))
        assert read_frame(b) == b"to everyone"
        a.close()
        b.close()
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "Traceback" not in err
    finally:
        end(p)


def test_serve_procs_supervises_and_forwards_shutdown():
    p, port = start_server("--app", "echo", "--procs", "2", "--stats-json")
    try:
        socks = [socket.create_connection((HOST, port), timeout=10) for _ in range(8)]
        for i, s in enumerate(socks):
            s.sendall(b"p%d" % i)
            assert recv_exact(s, len(b"p%d" % i)) == b"p%d" % i
        for s in socks:
            s.close()
        rc, out, err = stop(p, signal.SIGINT)
        assert rc == 0, err
        assert "Traceback" not in err
        assert out.count("stats ") == 2          # both children shut down cleanly
    finally:
        end(p)


def test_uring_backend_is_a_clear_error():
    # refused by the server (unavailable here) or by the parser (no longer offered)
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--port", "0", "--backend",
                        "uring"], capture_output=True, text=True, timeout=30, cwd=CWD)
    assert r.returncode == 2
    assert ("io_uring backend is unavailable" in r.stderr
            or "invalid choice: 'uring'" in r.stderr), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("procs", [1, 2])
def test_loadgen_against_the_cli_server(procs):
    p, port = start_server("--app", "echo", "--framing", "u16")
    try:
        r = subprocess.run([sys.executable, "-m", "aoprim", "loadgen", "--host", HOST,
                            "--port", str(port), "--conns", "4", "--size", "64", "--pipeline",
                            "8", "--duration", "1.5", "--warmup", "0.2", "--framing", "u16",
                            "--procs", str(procs), "--json", "--cpu-pid", str(p.pid)],
                           capture_output=True, text=True, timeout=60, cwd=CWD)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["errors"] == [] and res["msgs"] > 0 and res["conns"] == 4
        assert res["p50_us"] is not None and res["p99_us"] >= res["p50_us"]
        assert res["server_cpu"]["cpu_us_per_msg"] >= 0
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0
    finally:
        end(p)


def test_loadgen_catches_a_corrupted_echo():
    class Corrupt(Handler):
        def __init__(self):
            self.n = 0

        def on_read(self, session, data):
            self.n += 1
            b = bytearray(data)
            if self.n == 20:
                b[len(b) // 2] ^= 0xFF
            session.send(b)

    srv = Server(Corrupt(), HOST, 0).start()
    try:
        r = subprocess.run([sys.executable, "-m", "aoprim", "loadgen", "--host", HOST,
                            "--port", str(srv.address[1]), "--conns", "1", "--size", "100",
                            "--duration", "0.5", "--warmup", "0", "--json"],
                           capture_output=True, text=True, timeout=60, cwd=CWD)
        res = json.loads(r.stdout)
        assert r.returncode == 1
        assert any("differ" in e for e in res["errors"])
    finally:
        srv.shutdown()


# -- serve MODULE:HANDLER --------------------------------------------------------------------

USER_MODULE = """
import os
from aoprim.server import Handler

class Shout(Handler):
    def on_read(self, session, data):
        session.send(bytes(data).upper())

class Greeter(Handler):
    def __init__(self, greeting=b"hi "):
        self.greeting = greeting

    def on_read(self, session, data):
        session.send(self.greeting + bytes(data))

def make_greeter():
    return Greeter(b"made ")

shout = Shout()

class Duck:                      # not a Handler, but has the three hooks
    def on_connect(self, session):
        pass
    def on_read(self, session, data):
        session.send(b"quack")
    def on_close(self, session, exc):
        pass

duck = Duck()

class PerInstance(Handler):      # its on_read is set per instance
    def __init__(self):
        self.on_read = self._read
    def _read(self, session, data):
        session.send(b"mine")

class AsyncEcho(Handler):
    async def on_read(self, session, data):
        session.send(data)

class Tools:
    class Nested(Handler):
        def on_read(self, session, data):
            session.send(b"nested")

NUMBER = 42

def returns_number():
    return 42

def raises():
    raise RuntimeError("no config file")

class NeedsArgs(Handler):
    def __init__(self, required):
        pass

class Misspelt(Handler):
    def on_reed(self, session, data):
        session.send(data)

def make_misspelt():
    return Misspelt()
"""


@pytest.fixture
def app_dir(tmp_path):
    """A folder holding the user's module (usermod.py), a broken one and a package."""
    (tmp_path / "usermod.py").write_text(USER_MODULE)
    (tmp_path / "brokenmod.py").write_text("x = 1 / 0\n")
    (tmp_path / "depmod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "game.py").write_text(USER_MODULE)
    return tmp_path


def _talk(port, payload):
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return out
            out += chunk


@pytest.mark.parametrize("spec, payload, reply", [
    ("usermod:Shout", b"hello", b"HELLO"),               # a Handler subclass: instantiated
    ("usermod:shout", b"again", b"AGAIN"),               # a Handler instance: as is
    ("usermod:make_greeter", b"you", b"made you"),       # a factory
    ("usermod:Duck", b"?", b"quack"),                    # a class with the hooks
    ("usermod:duck", b"?", b"quack"),                    # an object with the hooks: as is
    ("usermod:PerInstance", b"?", b"mine"),              # on_read set in __init__
    ("usermod:Tools.Nested", b"?", b"nested"),           # a dotted attribute
    ("userpkg.game:Shout", b"pkg", b"PKG"),              # a module in a package
])
def test_serve_the_users_handler_from_the_current_directory(app_dir, spec, payload, reply):
    p, port = start_server(spec, "--log-level", "WARNING", "--stats-json", cwd=str(app_dir))
    try:
        assert _talk(port, payload) == reply
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "Traceback" not in err, err
        assert json.loads(out.split("stats ", 1)[1])["frames_in"] == 1
    finally:
        end(p)


def test_serve_the_users_handler_from_app_dir(app_dir):
    p, port = start_server("usermod:Shout", "--app-dir", str(app_dir), cwd=CWD)
    try:
        assert _talk(port, b"dir") == b"DIR"
        assert stop(p, signal.SIGINT)[0] == 0
    finally:
        end(p)


def test_serve_the_users_handler_with_procs(app_dir):
    p, port = start_server("usermod:Shout", "--procs", "2", "--stats-json", cwd=str(app_dir))
    try:
        for i in range(6):
            assert _talk(port, b"p%d" % i) == b"P%d" % i
        rc, out, err = stop(p, signal.SIGINT)
        assert rc == 0 and "Traceback" not in err, err
        assert out.count("stats ") == 2
    finally:
        end(p)


@pytest.mark.parametrize("args, message", [
    (["usermod"], "'usermod' is not MODULE:HANDLER"),
    (["usermod:"], "'usermod:' is not MODULE:HANDLER"),
    ([":Shout"], "':Shout' is not MODULE:HANDLER"),
    (["no_such_module_xyz:H"], "no module named 'no_such_module_xyz'"),
    (["userpkg.nope:H"], "no module named 'userpkg.nope'"),
    (["usermod:Missing"], "module 'usermod' has no attribute 'Missing'"),
    (["usermod:NUMBER"], "usermod:NUMBER: handler object of type int has no callable "
                         "on_connect, on_read, on_close"),
    (["usermod:returns_number"], "usermod:returns_number(): handler object of type int has "
                                 "no callable on_connect"),
    (["usermod:raises"], "usermod:raises() raised RuntimeError: no config file"),
    (["usermod:NeedsArgs"], "usermod:NeedsArgs: Server() instantiates a handler class with no "
                            "arguments; NeedsArgs needs arguments (required): pass an instance"),
    (["usermod:Misspelt"], "usermod:Misspelt: Misspelt does not define on_read(self, session, "
                           "data) (on_reed looks like a misspelt on_read)"),
    (["usermod:make_misspelt"], "usermod:make_misspelt(): Misspelt does not define on_read"),
    (["usermod:Handler"], "usermod:Handler: the base class Handler itself drops every byte"),
    (["usermod:AsyncEcho"], "usermod:AsyncEcho: AsyncEcho.on_read is a coroutine function"),
    (["brokenmod:H"], "importing 'brokenmod' failed: ZeroDivisionError"),
    (["depmod:H"], "No module named 'no_such_dependency_xyz'"),
    (["usermod:Shout", "--app", "echo"], "not both"),
    (["usermod:Shout", "--app", "chat", "--procs", "2"], "not both"),
    (["usermod", "--procs", "2"], "'usermod' is not MODULE:HANDLER"),
])
def test_a_handler_that_cannot_be_served_is_one_line_and_exit_2(app_dir, args, message):
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port", "0",
                        *args], capture_output=True, text=True, timeout=30, cwd=str(app_dir))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("aoprim: "), r.stderr
    assert message in lines[0]
    assert "listening on" not in r.stdout


@pytest.mark.parametrize("args, line", [
    (["serve", "--port", "70000"],
     "aoprim: --port: port must be in 0..65535 (0 picks a free one), not 70000"),
    (["serve", "--port", "abc"], "aoprim: --port: not a port number: 'abc'"),
    (["serve", "--workers", "x"], "aoprim: --workers: invalid int value: 'x'"),
    (["serve", "--no-such-flag"], "aoprim: unrecognized arguments: --no-such-flag"),
    (["loadgen", "--port", "1", "--no-such-flag"],
     "aoprim: unrecognized arguments: --no-such-flag"),
])
def test_an_option_argparse_refuses_is_one_line_and_exit_2(args, line):
    r = subprocess.run([sys.executable, "-m", "aoprim", *args], capture_output=True,
                       text=True, timeout=30, cwd=CWD)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [line]


def test_help_still_shows_the_usage():
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--help"],
                       capture_output=True, text=True, timeout=30, cwd=CWD)
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith("usage: python -m aoprim serve ") and "--port PORT" in r.stdout


def test_every_serve_flag_shows_its_default_in_help():
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--help"],
                       capture_output=True, text=True, timeout=30, cwd=CWD)
    assert r.returncode == 0
    opts = r.stdout.split("options:", 1)[1]
    # one entry per flag: from its "  --flag" line to the next one
    entries = ["--" + e for e in opts.split("\n  --")[1:]]
    flags = [e.split()[0] for e in entries]
    assert {"--app", "--app-dir", "--host", "--port", "--framing", "--workers", "--procs",
            "--max-frame", "--idle-timeout", "--frame-timeout", "--max-connections",
            "--max-pending", "--backend", "--log-level"} <= set(flags)
    for e in entries:
        assert "(default: " in " ".join(e.split()), e
    assert "MODULE:HANDLER" in r.stdout


def test_the_installed_command_also_imports_from_the_current_directory(app_dir, tmp_path_factory):
    """The `aoprim` console script does not put the current directory on sys.path (as
    `python -m` does); serve puts it there, as uvicorn does."""
    bindir = tmp_path_factory.mktemp("bin")
    script = bindir / "aoprim_cmd.py"            # stands in for the installed `aoprim` script
    script.write_text("import sys\nfrom aoprim.server.cli import main\nsys.exit(main())\n")
    p = subprocess.Popen([sys.executable, str(script), "serve", "--host", HOST, "--port", "0",
                          "usermod:Shout"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=str(app_dir))
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on "), p.stderr.read() if p.poll() is not None else line
        assert _talk(int(line.rsplit(":", 1)[1]), b"cmd") == b"CMD"
        assert stop(p, signal.SIGTERM)[0] == 0
    finally:
        end(p)


def test_the_load_generator_is_a_tool_not_part_of_the_server():
    import importlib.util

    from aoprim.tools import loadgen
    assert callable(loadgen.run) and callable(loadgen.proc_cpu)
    assert importlib.util.find_spec("aoprim.server.loadgen") is None


# -- the supervisor validates once; a killed supervisor; what serve imports -----------------

def test_procs_bad_setting_is_printed_once_and_no_child_starts():
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port", "0",
                        "--procs", "3", "--max-frame", "0"],
                       capture_output=True, text=True, timeout=60, cwd=CWD)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("aoprim:")]
    assert lines == ["aoprim: max_frame must be >= 1, not 0"], r.stderr
    assert "started server process" not in r.stderr and "listening" not in r.stdout


@pytest.mark.parametrize("procs", [1, 4])
def test_a_handler_no_child_can_import_is_said_once_for_every_child(procs):
    """A typo in MODULE:HANDLER fails in each of the N children alike: the supervisor says
    it once (each child tells it on its status pipe instead of printing it), and the
    siblings that failed the same way before the stop reached them are no stop gone wrong."""
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "nosuchmod_typo:H", "--host",
                        HOST, "--port", "0", "--procs", str(procs)],
                       capture_output=True, text=True, timeout=60, cwd=CWD)
    assert r.returncode == 2, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "cannot import 'nosuchmod_typo'" in ln]
    assert said == [said[0]] and said[0].startswith("aoprim: cannot import"), r.stderr
    assert "while stopping" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_children_of_a_killed_supervisor_exit_without_a_traceback():
    p, port = start_server("--app", "echo", "--procs", "2")
    try:
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"x")
            assert recv_exact(s, 1) == b"x"
        p.kill()                        # SIGKILL: the children get PR_SET_PDEATHSIG
        # stderr is shared with the children: EOF once the last of them has exited
        out, err = p.communicate(timeout=30)
    finally:
        end(p)
    assert "shutting down" in err       # the children did stop
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def _imports_of(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=CWD)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


HEAVY = ("asyncio", "ssl", "aoprim.benchmarks", "aoprim.benchmarks.cli",
         "aoprim.tools.loadgen")


def test_import_aoprim_server_does_not_load_asyncio_or_ssl():
    got = _imports_of("import sys, aoprim.server; "
                      f"print(*[m for m in {HEAVY!r} if m in sys.modules])")
    assert got == set()
    got = _imports_of("import sys; from aoprim.server import ProtocolHandler; "
                      "print(*[m for m in ('asyncio',) if m in sys.modules])")
    assert got == {"asyncio"}           # ... until the adapter is used


def test_serve_does_not_import_the_benchmarks_or_the_load_generator():
    # parse a serve command line as main() does, up to the server (a refused port)
    code = ("import sys; from aoprim.server import cli; "
            "rc = cli.main(['serve', '--port', '1', '--max-frame', '0']); "
            f"print(*[m for m in {HEAVY!r} if m in sys.modules]); print('rc%d' % rc)")
    got = _imports_of(code)
    assert got == {"rc2"}


def test_serve_defaults_are_the_settings_defaults():
    import dataclasses

    from aoprim.server import Settings
    from aoprim.server.cli import build_parser
    a = build_parser().parse_args(["serve"])
    for f in dataclasses.fields(Settings):
        if hasattr(a, f.name) and f.name not in ("backlog",):
            assert getattr(a, f.name) == f.default, f.name
    assert a.proxy_header_timeout == Settings().proxy_header_timeout


def test_listening_is_printed_once_the_loop_runs():
    """'listening on' was printed before serve_forever() started the loop, whose signal
    wake-up pipe then appeared: a reader counting the server's fds raced it."""
    p, port = start_server("--app", "echo")
    try:
        fds = len(os.listdir(f"/proc/{p.pid}/fd"))
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"x")
            assert recv_exact(s, 1) == b"x"
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{p.pid}/fd")) != fds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(f"/proc/{p.pid}/fd")) == fds
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "Traceback" not in err
    finally:
        end(p)


FORKER = '''
import os, sys
from aoprim.server import Handler

class Forker(Handler):
    """Forks per request; the child ends with sys.exit(status), the parent answers with the
    child's exit status as the handler's own waitpid() saw it."""
    def on_read(self, session, data):
        pid = os.fork()
        if pid == 0:
            sys.exit(int(bytes(data)))
        _, st = os.waitpid(pid, 0)
        session.send(str(os.waitstatus_to_exitcode(st)).encode())
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["selectors", "epoll"])
def test_a_handlers_fork_ending_with_sys_exit_exits_with_its_own_status(tmp_path, backend):
    # the fork's SystemExit is the fork's own exit, not a handler stopping the server:
    # its status is the one it asked for, and it logs nothing of the server's
    (tmp_path / "forkmod.py").write_text(FORKER)
    p, port = start_server("forkmod:Forker", "--app-dir", str(tmp_path), "--backend", backend)
    try:
        for status in (b"0", b"3"):
            with socket.create_connection((HOST, port), timeout=10) as c:
                c.sendall(status)
                assert c.recv(16) == status
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "raised SystemExit" not in err and "Traceback" not in err, err
    finally:
        end(p)


# -- a supervised child's usage error; a usage error with a handler's thread running ------

def _serve_run(tmp_path, spec, *args, timeout=30):
    """``serve SPEC`` from ``tmp_path`` until it exits: (exit status, stderr); a process
    that has not exited within ``timeout`` seconds is killed, and that is the test's
    failure."""
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", spec, "--app-dir",
                          str(tmp_path), "--host", HOST, "--port", "0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=CWD,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"serve {spec} {args} did not exit within {timeout} s: "
                             f"{err[-2000:]}") from None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", [
    "ошибка конфигурации: поле не задано; " * 40,      # 1480 chars, 8.9 KB as \uXXXX JSON
    "".join(f"field required: setting_{i}; " for i in range(120)),   # 3000+ ASCII chars
], ids=["cyrillic", "ascii"])
def test_a_childs_long_usage_message_is_printed_whole_and_once(tmp_path, text):
    """A --procs child sends its usage error on the status pipe: a long one (a localized
    configuration error, a list of missing settings) arrives whole, once for both
    children."""
    (tmp_path / "longmsg.py").write_text(f"raise RuntimeError({text!r})\n", encoding="utf-8")
    rc, err = _serve_run(tmp_path, "longmsg:H", "--procs", "2")
    assert rc == 2, err
    said = [ln for ln in err.splitlines() if ln.startswith("aoprim: importing 'longmsg'")]
    assert len(said) == 1, err[-3000:]
    assert said[0].endswith(f"RuntimeError: {text} ({tmp_path / 'longmsg.py'}:1)"), said[0][-300:]


@pytest.mark.timeout(120)
def test_a_usage_message_with_an_undecodable_character_reads_as_with_procs_1(tmp_path):
    """A message holding a lone surrogate (a file name that is not UTF-8) is printed by the
    supervisor as ``serve`` alone prints it (Python's stderr: a backslash escape), not as
    ``?``."""
    (tmp_path / "oddname.py").write_text('raise RuntimeError("no such file: x\\udcffy")\n')
    said = {}
    for procs in ("1", "2"):
        rc, err = _serve_run(tmp_path, "oddname:H", "--procs", procs)
        assert rc == 2, err
        said[procs] = [ln for ln in err.splitlines() if ln.startswith("aoprim: importing")]
    assert len(said["2"]) == 1 and said["2"] == said["1"], said
    assert "no such file: x\\udcffy" in said["1"][0], said


def test_a_usage_message_over_the_bound_is_cut_with_a_mark():
    """What a child sends is at most _USAGE_MAX bytes of UTF-8 JSON, cut at a character
    with a mark that says how much was left out."""
    from aoprim.server.cli import _USAGE_MAX, _usage_word
    from aoprim.server.supervisor import USAGE
    for text in ("é" * 20000, "x" * 40000, "\U0001F600" * 9000, "\udcff" * 5000):
        word = _usage_word(text)
        assert len(word) <= _USAGE_MAX and word.startswith(USAGE)
        said = json.loads(word[len(USAGE):])
        kept, mark = said.split(" ... ")
        assert text.startswith(kept) and len(kept) > 1000, (len(kept), mark)
        assert mark == f"({len(text) - len(kept)} more characters cut)"
    short = "no module named 'приложение'"
    assert _usage_word(short) == USAGE + json.dumps(short, ensure_ascii=False).encode()


LINGERING = '''
import threading, time
# a configuration watcher: not a daemon, so the interpreter waits for it at exit
threading.Thread(target=time.sleep, args=(45,), name="config-watcher").start()

class Handler:
    def on_connect(self, session): pass
    def on_read(self, session, data): pass
    def on_close(self, session, reason): pass
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("procs", [1, 2])
def test_a_usage_error_exits_though_the_handlers_import_left_a_thread_running(tmp_path,
                                                                               procs):
    """A usage error (a typo in the handler's name) after the module started a non-daemon
    thread: one ``aoprim:`` line and exit 2, without waiting for that thread."""
    (tmp_path / "watcher.py").write_text(LINGERING)
    rc, err = _serve_run(tmp_path, "watcher:Hnadler", "--procs", str(procs), timeout=30)
    assert rc == 2, err
    said = [ln for ln in err.splitlines() if ln.startswith("aoprim: ")]
    assert said[0] == "aoprim: module 'watcher' has no attribute 'Hnadler'", err
    assert sum("has no attribute" in ln for ln in said) == 1, err
    assert "Traceback" not in err, err


SLOW_IMPORT = '''
import signal, sys, threading

def watch():
    # (the stop signals go to the main thread: one the kernel hands to this thread cannot
    # wake a main thread blocked in a wait -- CPython runs handlers on the main thread only)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    threading.Event().wait()

threading.Thread(target=watch, name="watcher").start()   # not a daemon
print("loading", flush=True)
import time
time.sleep(60)                         # a long import (a model loading)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("procs", [1, 2])
def test_a_stop_while_the_handler_loads_exits_though_its_import_left_a_thread(tmp_path, procs):
    """SIGTERM while the handler's module still loads, after it started a non-daemon thread:
    the process exits 0 at once instead of waiting for that thread for ever (``--procs``:
    each child alike, and the supervisor with them)."""
    (tmp_path / "slowload.py").write_text(SLOW_IMPORT)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "slowload:H", "--app-dir",
                          str(tmp_path), "--host", HOST, "--port", "0", "--procs", str(procs),
                          "--stop-timeout", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=CWD,
                         start_new_session=True)
    try:
        for _ in range(procs):
            assert p.stdout.readline() == "loading\n"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0 and "Traceback" not in err, err


def _threads_of(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("Threads:")).split()[1])


@pytest.mark.timeout(60)
def test_serve_without_workers_is_one_thread_until_its_stop():
    """``serve --workers 0`` runs in one thread (CPython 3.12+ warns at each fork a handler
    makes in a process with more: ``This process ... is multi-threaded``); its stop still
    has its bound (the watchdog's thread starts at the stop)."""
    p, port = start_server("--app", "echo", "--workers", "0")
    try:
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"x")
            assert recv_exact(s, 1) == b"x"
            assert _threads_of(p.pid) == 1
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "Traceback" not in err, err
    finally:
        end(p)


FORKS = '''
import os, resource, time

def _waiting_fork():
    """A fork that waits; its exit status says what a stop signal did to it: killed by
    SIGTERM (-15), SIGHUP (-1), SIGQUIT (-3), KeyboardInterrupt (5), or any other exception
    (7)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))    # (SIGQUIT's default: no core)
        try:
            os.write(w, b"!")       # its own code runs: the fork's set-up is done
            time.sleep(60)
        except KeyboardInterrupt:
            os._exit(5)
        except BaseException:
            os._exit(7)
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    return pid

AT_IMPORT = _waiting_fork()         # forked before serve_forever runs

class Forks:
    """``import``: the fork made at import; ``fork``: a new fork; ``wait PID``: its exit
    status."""
    def on_connect(self, session): pass
    def on_close(self, session, reason): pass
    def on_read(self, session, data):
        cmd = bytes(data).split()
        if cmd[0] == b"import":
            session.send(str(AT_IMPORT).encode())
        elif cmd[0] == b"fork":
            session.send(str(_waiting_fork()).encode())
        else:
            _, st = os.waitpid(int(cmd[1]), 0)
            session.send(str(os.waitstatus_to_exitcode(st)).encode())
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, -signal.SIGTERM),
                                         (signal.SIGINT, 5),
                                         (signal.SIGHUP, -signal.SIGHUP),
                                         (signal.SIGQUIT, -signal.SIGQUIT)])
def test_a_process_forked_from_serve_acts_on_stop_signals_as_a_python_program(
        tmp_path, sig, status):
    """A process forked from the serving process -- by its module's import or by a handler
    -- dies of SIGTERM, SIGHUP and SIGQUIT and gets KeyboardInterrupt at SIGINT, as a plain
    Python program, and never a stop of serve's own (serve takes SIGHUP and SIGQUIT as
    SIGTERM from its start, before the module is imported)."""
    if sig in (signal.SIGHUP, signal.SIGQUIT) and signal.getsignal(sig) == signal.SIG_IGN:
        pytest.skip(f"{sig.name} is ignored in this run (nohup): serve keeps it so")
    (tmp_path / "forks.py").write_text(FORKS)
    p, port = start_server("forks:Forks", "--app-dir", str(tmp_path))
    try:
        for cmd in (b"import", b"fork"):
            with socket.create_connection((HOST, port), timeout=10) as c:
                c.sendall(cmd)
                pid = int(c.recv(16))
            # the kernel's view: SIGTERM has its default action (a Python handler can miss
            # a signal that lands while the process is inside a C call that retries, such
            # as a Pool worker's sem_wait), and neither signal is left blocked
            mask = signal_masks(pid)
            bits = {s: 1 << (s - 1) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                              signal.SIGQUIT)}
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                assert not mask["SigCgt"] & bits[s], (cmd, s, mask)
            assert not mask["SigBlk"] & sum(bits.values()), (cmd, mask)
            os.kill(pid, sig)
            with socket.create_connection((HOST, port), timeout=10) as c:
                c.sendall(b"wait %d" % pid)
                assert int(c.recv(16)) == status, cmd
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "Traceback" not in err and "ERROR" not in err, err
    finally:
        end(p)


POOL = '''
import multiprocessing

pool = multiprocessing.get_context("fork").Pool(2)      # at import: CPU work offloaded

class Pooled:
    def on_connect(self, session): pass
    def on_close(self, session, reason): pass
    def on_read(self, session, data):
        session.send(str(pool.apply(pow, (2, int(bytes(data))))).encode())
'''


@pytest.mark.timeout(90)
def test_procs_stop_with_a_pool_made_at_import_is_clean(tmp_path):
    """``--procs 2`` whose module makes a ``fork`` multiprocessing Pool at import: SIGTERM
    stops each child cleanly, the Pool's own finalizer ending its workers (killed at the
    same moment, a worker holding the Pool's queue lock hung the child's exit until
    --stop-timeout), and the supervisor exits 0."""
    (tmp_path / "pooled.py").write_text(POOL)
    p, port = start_server("pooled:Pooled", "--app-dir", str(tmp_path), "--procs", "2",
                           "--stop-timeout", "20")
    try:
        for _ in range(4):
            with socket.create_connection((HOST, port), timeout=10) as c:
                c.sendall(b"8")
                assert c.recv(16) == b"256"
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0, err
        assert "did not stop" not in err and "Traceback" not in err, err
    finally:
        end(p)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("stats", [[], ["--stats-json"]], ids=["plain", "stats-json"])
def test_stdout_on_a_full_disk_costs_the_lines_not_the_service(stats):
    """stdout on a full disk (/dev/full: every write fails with ENOSPC): one WARNING,
    serving goes on, and a SIGTERM is a clean stop -- exit 0, no traceback (the stats line
    raised out of main, exit 1; the 'listening on' line was a loop callback's error)."""
    with socket.socket() as probe:          # a free port (stdout cannot tell it)
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    with open("/dev/full", "wb") as full:
        p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--app", "echo",
                              "--host", HOST, "--port", str(port), *stats], stdout=full,
                             stderr=subprocess.PIPE, text=True, cwd=CWD)
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            if "stdout cannot be written" in line:
                break
        assert lines and "WARNING" in lines[-1] and "No space left" in lines[-1], lines
        with socket.create_connection((HOST, port), timeout=10) as c:     # serving
            c.sendall(b"ping")
            assert recv_exact(c, 4) == b"ping"
        p.send_signal(signal.SIGTERM)
        err = "".join(lines) + p.stderr.read()
        assert p.wait(30) == 0, err
    finally:
        end(p)
        p.stderr.close()
    assert "Traceback" not in err and "ERROR" not in err, err


@pytest.mark.parametrize("flag", ["--idle-timeout", "--frame-timeout"])
@pytest.mark.parametrize("value, ok", [("0", False), ("0.0", False), ("-1", False),
                                       ("inf", False), ("nan", False), ("soon", False),
                                       ("none", True), ("off", True), ("2.5", True)])
def test_a_session_limit_is_seconds_above_0_or_none(flag, value, ok):
    """As Server() takes them: a number of seconds above 0, or no limit ('none' / 'off');
    0 in any spelling is refused with one line naming the value, not taken as 'none'."""
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", flag, value, "--help"],
                       capture_output=True, text=True, timeout=30, cwd=CWD)
    if ok:
        assert r.returncode == 0 and r.stderr == "", r.stderr
        return
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line, r.stderr
    assert line.startswith(f"aoprim: {flag}: ") and repr(value) in line, line


def _serve_with(dispositions):
    def preexec():
        for sig, how in dispositions.items():
            signal.signal(sig, how)
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                          "0", "--stats-json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=CWD, preexec_fn=preexec)
    line = p.stdout.readline()
    assert line.startswith("listening on "), line
    return p, int(line.rsplit(":", 1)[1])


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_serve_alone_stops_cleanly_on_sighup_and_sigquit(sig):
    """As a --procs supervisor does (and as SIGTERM): a clean stop, its stats, exit 0 --
    not the default action's death (SIGQUIT: a core file)."""
    p, _ = _serve_with({signal.SIGHUP: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL})
    try:
        rc, out, err = stop(p, sig)
        assert rc == 0, err
        assert f"received {sig.name}: shutting down" in err and "stats " in out, err
    finally:
        end(p)


def test_serve_alone_keeps_a_sighup_ignored_at_its_start():
    """nohup: a SIGHUP ignored when serve starts stays ignored; it serves on."""
    p, port = _serve_with({signal.SIGHUP: signal.SIG_IGN})
    try:
        p.send_signal(signal.SIGHUP)
        for _ in range(3):
            with socket.create_connection((HOST, port), timeout=10) as c:
                c.sendall(b"still")
                assert recv_exact(c, 5) == b"still"
        rc, out, err = stop(p, signal.SIGTERM)
        assert rc == 0 and "received SIGHUP" not in err, err
    finally:
        end(p)


def test_the_fork_signal_hooks_leave_the_parents_mask_as_it_was():
    """The hooks that give a fork plain SIGINT/SIGTERM block both across the fork and
    unblock them after: set up twice (serve run twice in one process), the parent must not
    be left with them blocked."""
    code = ("import os, signal\n"
            "from aoprim.server import cli\n"
            "cli._plain_signals_in_forks(); cli._plain_signals_in_forks()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=30, cwd=CWD)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
