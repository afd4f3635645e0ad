"""Built-in Layer 3 apps for the command line: ``echo`` and ``chat``."""
from .handler import Handler

__all__ = ["Echo", "Chat", "APPS"]


class Echo(Handler):
    """Send every frame back to its sender."""

    def on_read(self, session, data):
        session.send(data)


class Chat(Handler):
    """Broadcast every frame to all the other sessions (one shared buffer for all of them)."""

    def on_read(self, session, data):
        session.server.broadcast(data, exclude=session)


APPS = {"echo": Echo, "chat": Chat}
