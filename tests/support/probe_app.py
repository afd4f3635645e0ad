"""Echo and chat handlers that can be asked about the server they run in (for tests that run
``python -m aoprim serve probe_app:ProbeEcho --app-dir tests``; no tests in here).

- A u16 frame that starts with ``PROBE`` is not echoed or broadcast: the server's
  ``stats()`` plus this handler's own counts come back, as JSON, to that session only.
- The handler counts ``on_connect`` and ``on_close`` per session, and an ``on_read`` that
  arrives after its session's ``on_close``; at exit it prints one ``probe {...}`` line with
  the totals and every session whose ``on_close`` did not run exactly once.
"""
import atexit
import json
import sys
import threading

from aoprim.server.apps import Chat, Echo

PROBE = b"\x00PROBE"

__all__ = ["ProbeEcho", "ProbeChat", "PROBE"]


class _Probe:
    def __init__(self):
        self._lock = threading.Lock()
        self.connects = 0
        self.closes = {}            # session id -> on_close calls
        self.read_after_close = 0
        atexit.register(self._report)

    def _counts(self):
        with self._lock:
            bad = {sid: n for sid, n in self.closes.items() if n != 1}
            return {"connects": self.connects, "closed_sessions": len(self.closes),
                    "close_calls": sum(self.closes.values()), "not_once": bad,
                    "read_after_close": self.read_after_close}

    def _report(self):
        print("probe " + json.dumps(self._counts()), flush=True)
        sys.stdout.flush()

    def on_connect(self, session):
        with self._lock:
            self.connects += 1

    def on_close(self, session, exc):
        with self._lock:
            self.closes[session.id] = self.closes.get(session.id, 0) + 1

    def _intercept(self, session, data):
        """True if ``data`` was a probe (answered here)."""
        if len(data) < len(PROBE) or bytes(data[:len(PROBE)]) != PROBE:
            with self._lock:
                if session.id in self.closes:
                    self.read_after_close += 1
            return False
        loop = session.server.loop

        def answer():                   # stats() on the loop thread, where it is exact
            d = session.server.stats()
            d["probe"] = self._counts()
            session.send(json.dumps(d).encode())
        if loop.in_loop_thread():
            answer()
        else:
            loop.call_soon_threadsafe(answer)
        return True


class ProbeEcho(_Probe, Echo):
    def on_read(self, session, data):
        if not self._intercept(session, data):
            session.send(data)


class ProbeChat(_Probe, Chat):
    def on_read(self, session, data):
        if not self._intercept(session, data):
            session.server.broadcast(data, exclude=session)
