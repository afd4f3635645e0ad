import socket
from typing import Any

from aoprim._readbuf import ReadBuffer
from typing_extensions import Self, final

@final
class TransportReader:
    def __new__(cls, transport: Any, sock: socket.socket | None, rbuf: ReadBuffer) -> Self: ...
    def __call__(self, *args: Any, **kwargs: Any) -> None: ...
    # an instance's is "SocketTransport._read_ready" (asyncio's handle repr names the callback)
    __qualname__: str
    def set_protocol(self, protocol: Any) -> None: ...
    @property
    def transport(self) -> Any: ...
    @property
    def protocol(self) -> Any: ...
    @property
    def buffered(self) -> bool: ...
    sock: socket.socket | None
    conn_lost: int
