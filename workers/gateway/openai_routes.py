from __future__ import annotations

from typing import Any


class OpenAIRoutes:
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
    def routes(self) -> list[Any]:
        return []
