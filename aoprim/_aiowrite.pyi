from typing import Any, Callable
from typing_extensions import Self, disjoint_base

@disjoint_base
class TransportWriter:
    def __new__(cls, transport: Any, add: Callable[[Any], int], selector: Any) -> Self: ...
    def write(self, data: Any) -> None: ...
    @property
    def transport(self) -> Any: ...
    fast: bool
    high: int
