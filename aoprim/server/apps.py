"""Built-in Layer 3 apps for the command line: ``echo`` and ``chat``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .handler import Handler

if TYPE_CHECKING:
    from .session import Session

__all__ = ["Echo", "Chat", "APPS"]


class Echo(Handler):
    """Send every frame back to its sender."""

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        session.send(data)


class Chat(Handler):
    """Broadcast every frame to all the other sessions (one shared buffer for all of them)."""

    def on_read(self, session: Session, data: memoryview | bytes) -> None:
        session.server.broadcast(data, exclude=session)


APPS: dict[str, type[Handler]] = {"echo": Echo, "chat": Chat}
