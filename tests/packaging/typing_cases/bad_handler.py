"""A handler whose hooks do not match Handler's, and sends of what is not bytes-like: each
line marked ``# E: <code>`` must be reported with that code, nothing else."""
from __future__ import annotations

from aoprim import SlabPool
from aoprim.server import Handler, Session


class TextHandler(Handler):
    def on_read(self, session: Session, data: str) -> None:  # E: override
        session.send(data)  # E: arg-type

    def on_close(self, session: Session) -> None:  # E: override
        session.send(42)  # E: arg-type
        session.send(SlabPool().acquire())
        session.peer_address  # E: attr-defined


class Echo(Handler):
    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        session.send(data)


Echo(1)  # E: call-arg
