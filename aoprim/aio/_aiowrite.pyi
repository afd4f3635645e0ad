from typing import Any

from aoprim._sendbatch import SendBatch
from typing_extensions import Self, disjoint_base

SEND_NOW: int

@disjoint_base
class SleepFlag:
    sleeping: bool

@disjoint_base
class TransportWriter:
    def __new__(cls, transport: Any, batch: SendBatch, sleep: SleepFlag) -> Self: ...
    def write(self, data: Any) -> None: ...
    def writelines(self, items: Any) -> None: ...
    def over_high(self) -> None: ...
    @property
    def transport(self) -> Any: ...
    fast: bool
    high: int
    blocked: bool
