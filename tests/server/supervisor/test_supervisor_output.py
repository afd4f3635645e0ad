"""--procs N: the supervisor's stdout at its edges (aoprim/server/supervisor.py, docs/server.md
"--procs N", *Output*).

- A write that fails for a moment (a full disk: ``ENOSPC``; ``EIO``) drops what waited, counted,
  and the next lines are written again once the stream takes them: only a stream that is gone
  (``EPIPE``, a closed fd) is given up.
- At a stop, what the children printed last is written to a reader that is slow but alive,
  until it is all out or ``stop_timeout`` is up.
- A stdout that cannot be opened again with a file description of the supervisor's own (a
  pipe or terminal of another user: ``EACCES``) is written by a thread of its own: a stalled
  reader never blocks the supervisor.
- Output a child ends without a newline (it died in the middle of a line) is passed on with a
  newline added, so that no other line is glued to it.
"""
import errno
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from aoprim.server.supervisor import Supervisor, _Output

from server_support import HOST, wait_for
from test_supervisor import alive, run_supervisor
from test_supervisor_edges import close_pipe, unread

CHILD = textwrap.dedent("""
    import os, signal, sys, time

    mode, port, status = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def bye(signum, frame):
        if mode == "tail":                 # its last output: more than a pipe holds
            for i in range(1500):
                os.write(1, b"tail %d %04d " % (os.getpid(), i) + b"x" * 90 + b"\\n")
        os.write(status, b"stopped\\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
    if mode == "chatty":                   # 2 MB of output before it says "ready"
        for i in range(2000):
            os.write(1, b"%04d " % i + b"x" * 995 + b"\\n")
    if mode == "nonl":                     # output without a final newline
        os.write(1, b"<\\x00\\x01tail>")
    if mode == "line":                     # one whole line
        os.write(1, b"whole %d\\n" % os.getpid())
    os.write(status, b"ready\\n")
    if mode == "nonl":
        sys.exit(3)                        # (a crash: restarted, its output passed on)
    while True:
        time.sleep(60)
""")


@pytest.fixture
def child_script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def argv_of(script, *modes):
    calls = []

    def child_argv(port, status_fd):
        mode = modes[min(len(calls), len(modes) - 1)]
        calls.append(mode)
        return [sys.executable, script, mode, str(port), str(status_fd)]
    return child_argv


# -- a write that fails for a moment ---------------------------------------------------------

def _tmpfs(size):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root and mount(8) for a tmpfs of its own")
    path = tempfile.mkdtemp()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True)
    if r.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    return path


@pytest.mark.timeout(60)
def test_a_disk_full_for_a_moment_drops_those_lines_only(caplog):
    """ENOSPC gave the stdout up for good: every later line was dropped, although the disk
    had room again."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    mnt = _tmpfs("64k")
    out = None
    try:
        with open(os.path.join(mnt, "out.log"), "w") as f:
            out = _Output(f)
            out.open()
            out.write(b"before\n")
            filler = os.path.join(mnt, "filler")
            with open(filler, "wb") as g:          # another program fills the disk
                try:
                    g.write(b"x" * (1 << 20))
                    g.flush()
                except OSError as e:
                    assert e.errno == errno.ENOSPC
            out.write(b"while-full-1 " + b"." * 8192 + b"\n")
            out.write(b"while-full-2 " + b"." * 8192 + b"\n")
            os.remove(filler)                       # room again
            out.write(b"after\n")
            assert not out.lost
            out.close()
        with open(os.path.join(mnt, "out.log"), "rb") as f:
            data = f.read()
        assert data.startswith(b"before\n") and data.endswith(b"after\n"), data[-200:]
        assert "unusable" not in caplog.text, caplog.text
        assert caplog.text.count("No space left on device") == 1, caplog.text   # said once
        assert re.search(r"stdout takes output again: 2 lines of the server processes' "
                         r"output were dropped", caplog.text), caplog.text
    finally:
        if out is not None:
            out.close()
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)


@pytest.mark.timeout(60)
def test_a_stream_that_fails_every_write_is_still_tried_and_the_loss_counted(caplog):
    """/dev/full (every write ENOSPC): each line is tried, dropped and counted; the stream
    is never taken for gone."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    with open("/dev/full", "w") as f:
        out = _Output(f)
        out.open()
        for i in range(5):
            out.write(b"line %d\n" % i)
        assert not out.lost
        out.close()
    assert "unusable" not in caplog.text, caplog.text
    assert caplog.text.count("No space left on device") == 1, caplog.text
    assert re.search(r"stdout was not read to the end: 5 lines of the server processes' "
                     r"output were dropped", caplog.text), caplog.text


# -- a slow reader at a stop -------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_slow_reader_gets_the_last_output_at_a_stop(child_script, caplog):
    """At a stop the supervisor wrote only what the pipe took at that instant and dropped
    the rest ("N bytes not written"), although the reader was alive, a moment behind."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    sup = Supervisor(argv_of(child_script, "tail"), 2, HOST, 0, stdout=out, stop_timeout=20)
    got = bytearray()
    done = threading.Event()
    ready = []

    def reader():
        # a reader behind by the children's whole stop: it reads nothing until both
        # children have exited, then everything, to the supervisor's end
        wait_for(lambda: ready and not any(alive(pid) for _, _, pid in sup.spawned),
                 timeout=60, what="both children gone")
        while not done.is_set() or unread(r):
            if unread(r):
                got.extend(os.read(r, 65536))
            else:
                done.wait(0.01)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        def stop_when():
            if len(sup.spawned) == 2 and all(c.ready for c in sup._children):
                ready.append(True)
                return True
            return False
        assert run_supervisor(sup, stop_when) == 0, caplog.text
        done.set()
        t.join(30)
        assert not t.is_alive()
        tails = re.findall(rb"tail (\d+) (\d{4}) x{90}\n", bytes(got))
        assert len(tails) == 3000, (len(tails), caplog.text)
        for _, _, pid in sup.spawned:                # each child's lines whole, in order
            assert [int(i) for p, i in tails if int(p) == pid] == list(range(1500))
        assert "not written" not in caplog.text and "dropped" not in caplog.text
    finally:
        done.set()
        t.join(10)
        close_pipe(r, out)


@pytest.mark.timeout(120)
def test_a_stalled_reader_at_a_stop_is_waited_for_stop_timeout_at_most(child_script, caplog):
    """The wait for a reader at a stop is bounded: a reader that never reads costs
    stop_timeout, and what it did not take is counted."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    sup = Supervisor(argv_of(child_script, "tail"), 1, HOST, 0, stdout=out, stop_timeout=1)
    sent = []
    try:
        rc = run_supervisor(sup, lambda: sup._children[0].ready and
                            not sent.append(time.monotonic()))
        took = time.monotonic() - sent[0]
        assert rc == 0, caplog.text
        assert took < 10, took
        assert re.search(r"stdout was not read to the end: \d+ lines of the server "
                         r"processes' output were dropped and [1-9]\d* bytes not written",
                         caplog.text), caplog.text
    finally:
        close_pipe(r, out)


# -- a stdout that cannot be opened again ------------------------------------------------------

def _refuse_reopening_fds(monkeypatch):
    """What a pipe of another user gives: reopening it through /proc/self/fd is refused
    (EACCES), so the supervisor cannot get a non-blocking file description of its own."""
    real_open = os.open

    def refusing_open(path, *args, **kw):
        if isinstance(path, str) and path.startswith("/proc/self/fd/"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *args, **kw)
    monkeypatch.setattr(os, "open", refusing_open)


@pytest.mark.timeout(120)
def test_a_stdout_of_another_user_never_blocks_the_supervisor(child_script, caplog,
                                                              monkeypatch):
    """/proc/self/fd/1 refused (EACCES: a pipe another user made, as `sudo -u`, `docker run
    --user` give): the supervisor fell back to blocking writes, and a stalled reader held
    it -- SIGTERM was acted on only once the reader read."""
    caplog.set_level(logging.INFO, logger="aoprim.server")
    _refuse_reopening_fds(monkeypatch)
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    sup = Supervisor(argv_of(child_script, "chatty"), 2, HOST, 0, stdout=out,
                     stop_timeout=5)
    drained = []
    done = threading.Event()

    def unblock():
        # the safety net of this test only: if the supervisor still runs 30 s on, read the
        # pipe so that it can end (and the test fails below)
        if done.wait(30):
            return
        while unread(r) or not done.is_set():
            if unread(r):
                drained.append(os.read(r, 65536))
            else:
                done.wait(0.05)
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    try:
        # (or once the safety net read: a supervisor blocked in its write gets there then)
        rc = run_supervisor(sup, lambda: (unread(r) >= 60000 or drained) and
                            len(sup.spawned) == 2 and all(c.ready for c in sup._children))
        done.set()
        t.join(10)
        assert not drained, "the supervisor stopped only once the test read its stdout"
        assert rc == 0, caplog.text
        assert caplog.text.count("stdout is not being read") == 1, caplog.text
        assert not any(alive(pid) for _, _, pid in sup.spawned)
    finally:
        done.set()
        t.join(10)
        close_pipe(r, out)


@pytest.mark.timeout(60)
def test_a_stdout_of_another_user_gets_every_line_in_order(child_script, monkeypatch):
    """The same stdout, read: nothing lost, nothing reordered."""
    _refuse_reopening_fds(monkeypatch)
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    got = bytearray()
    done = threading.Event()

    def reader():
        while not done.is_set() or unread(r):
            if unread(r):
                got.extend(os.read(r, 65536))
            else:
                done.wait(0.005)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    sup = Supervisor(argv_of(child_script, "chatty"), 1, HOST, 0, stdout=out)
    try:
        assert run_supervisor(sup, lambda: b"listening on" in got) == 0
        done.set()
        t.join(30)
        lines = bytes(got).split(b"\n")
        numbered = [int(x[:4]) for x in lines if re.match(rb"\d{4} x", x)]
        assert numbered == list(range(2000))
        assert all(len(x) == 1000 for x in lines if re.match(rb"\d{4} x", x))
    finally:
        done.set()
        t.join(10)
        close_pipe(r, out)


# -- output without a final newline ------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_dead_childs_unfinished_line_is_ended_with_a_newline(child_script):
    """The piece a child left without a newline when it died (``os._exit``, an OOM kill in
    the middle of a write) was passed on as it was, and the next line -- another child's,
    or its restart's -- was glued to it: one output line holding two processes' records."""
    out = io.StringIO()
    sup = Supervisor(argv_of(child_script, "nonl", "line"), 1, HOST, 0, stdout=out,
                     backoff=0.01)
    assert run_supervisor(sup, lambda: "whole" in out.getvalue()) == 0
    lines = out.getvalue().splitlines(keepends=True)
    assert lines.count("<\x00\x01tail>\n") == 1, lines      # its bytes as they were, ended
    assert [line for line in lines if "whole" in line] == \
        ["whole %d\n" % sup.spawned[1][2]], lines
    assert all(line.endswith("\n") for line in lines), lines
