"""The stats at shutdown, reported once: one short line for a reader in the log
(``stats.summary``); the whole ``stats()`` dict as a JSON line on the command line's stdout
only when asked (``--stats-json``, for programs)."""
import json
import logging
import signal
import socket

import pytest

from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS
from aoprim.server.stats import summary

from proc_support import end
from server_support import HOST, make_server, recv_exact, wait_for  # noqa: F401


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _stats(**over):
    st = {"connections": 0, "connections_total": 0, "frames_in": 0, "frames_out": 0,
          "bytes_in": 0, "bytes_out": 0, "handler_errors": 0, "closes": {},
          "live_sessions": 0, "rx_slots_in_use": 0, "tx_slots_in_use": 0}
    st.update(over)
    return st


@pytest.mark.parametrize("over, line", [
    ({}, "0 connections; frames 0 in, 0 out; 0 B in, 0 B out"),
    ({"connections_total": 1, "frames_in": 3, "frames_out": 2, "bytes_in": 1023,
      "bytes_out": 1024, "closes": {"eof": 1}},
     "1 connection; frames 3 in, 2 out; 1023 B in, 1.0 KiB out; closed: eof 1"),
    ({"connections_total": 12, "frames_in": 340, "frames_out": 340,
      "bytes_in": 5 * 2**20 + 2**19, "bytes_out": 3 * 2**30, "handler_errors": 2,
      "closes": {"eof": 9, "handler": 2, "reset": 2}},
     "12 connections; frames 340 in, 340 out; 5.5 MiB in, 3.0 GiB out; 2 handler errors; "
     "closed: eof 9, handler 2, reset 2"),
    ({"connections_total": 2, "live_sessions": 1, "rx_slots_in_use": 3},
     "2 connections; frames 0 in, 0 out; 0 B in, 0 B out; still held: live_sessions 1, "
     "rx_slots_in_use 3"),
])
def test_summary_is_one_short_line(over, line):
    assert summary(_stats(**over)) == line


def test_the_server_logs_its_stats_once_as_a_short_line(make_server, caplog):
    caplog.set_level(logging.INFO, logger="aoprim.server")
    srv = make_server(Echo())
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(b"hello")
        assert recv_exact(s, 5) == b"hello"
    wait_for(lambda: srv.stats()["connections"] == 0, what="the session to close")
    srv.shutdown()
    stopped = [r.getMessage() for r in caplog.records if "server stopped" in r.getMessage()]
    assert stopped == ["aoprim server stopped: 1 connection; frames 1 in, 1 out; 5 B in, "
                       "5 B out; closed: eof 1"]


def _serve_one_echo(backend, *flags):
    """``python -m aoprim serve --app echo FLAGS``: one echo, then SIGINT; (stdout, stderr)."""
    import test_cli as cli_t
    p, port = cli_t.start_server("--app", "echo", "--backend", backend, *flags)
    try:
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(b"ping")
            assert recv_exact(s, 4) == b"ping"
        rc, out, err = cli_t.stop(p, signal.SIGINT)
    finally:
        end(p)
    assert rc == 0, err
    return out, err


def _one_summary_line(err):
    stopped = [ln for ln in err.splitlines() if "server stopped" in ln]
    assert len(stopped) == 1, err
    assert "1 connection; frames 1 in, 1 out; 4 B in, 4 B out" in stopped[0]
    assert "{" not in err and "rx_slots_in_use" not in err     # the dict is not logged
    assert len(stopped[0]) < 200


def test_the_cli_reports_the_stats_once_as_the_logs_short_line(backend):
    out, err = _serve_one_echo(backend)
    _one_summary_line(err)
    assert "stats" not in out and "{" not in out, out
    assert out.splitlines()[1:] == []           # "listening on ..." only (read by start_server)


def test_the_cli_prints_the_json_line_only_when_asked(backend):
    out, err = _serve_one_echo(backend, "--stats-json")
    _one_summary_line(err)
    stats_lines = [ln for ln in out.splitlines() if ln.startswith("stats ")]
    assert len(stats_lines) == 1
    assert json.loads(stats_lines[0][6:])["frames_in"] == 1


@pytest.mark.parametrize("flags, lines", [((), 0), (("--stats-json",), 2)],
                         ids=["default", "stats-json"])
def test_procs_children_follow_the_flag(flags, lines):
    import test_cli as cli_t
    p, port = cli_t.start_server("--app", "echo", "--procs", "2", *flags)
    try:
        rc, out, err = cli_t.stop(p, signal.SIGINT)
    finally:
        end(p)
    assert rc == 0, err
    assert sum(ln.startswith("stats ") for ln in out.splitlines()) == lines, out
    assert len([ln for ln in err.splitlines() if "server stopped" in ln]) == 2, err
