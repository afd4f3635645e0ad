"""Wrong arguments to aoprim.server: each line marked ``# E: <code>`` must be reported by
``mypy --strict`` with that error code, and nothing else may be (tests/packaging/test_typing.py)."""
from __future__ import annotations

from aoprim.server import FrameDecoder, Handler, Server, Session, serve_protocol


class Echo(Handler):
    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        session.send(data)


Server(Echo(), port="eighty")  # E: arg-type
Server(Echo(), host=8080)  # E: arg-type
Server(Echo(), max_frme=1024)  # E: call-arg
Server(Echo(), idle_timeout="5s")  # E: arg-type
Server(Echo(), framing="u16", workers=2.5)  # E: arg-type
Server(Echo(), ssl=True)  # E: arg-type
Server(print)  # E: arg-type
srv = Server(Echo())
srv.broadcast("text")  # E: arg-type
srv.shutdown(timeout="soon")  # E: arg-type
serve_protocol(Echo)  # E: arg-type
FrameDecoder("u16").feed("text")  # E: arg-type
