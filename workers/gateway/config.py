"""Settings of one gateway process (`streamer gateway` flags map onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# The chat page ships in the client package: clients/web/.
WEB_ROOT = Path(__file__).resolve().parents[2] / "clients" / "web"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests)
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "llm"
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    allowed_origins: tuple[str, ...] = ()  # empty: same origin only; "*": any
    max_frame_bytes: int = 1 << 20  # larger frames get an `error` frame
    max_inflight: int = 16  # requests streaming at once per connection
    max_connections: int = 10000  # open WebSockets; more are refused with HTTP 503
    send_queue_bytes: int = 4 << 20  # per connection, beyond what the socket buffers hold
    cancel_grace_s: float = 10.0  # a closed socket's requests are cancelled after this, unless resumed
    request_ttl_s: float = 3600.0  # lifetime of the gateway's id claims and cancel markers
    idle_poll_s: float = 5.0  # a watched request silent this long has its stream re-read
    close_timeout_s: float = 5.0
    web_root: Path = field(default=WEB_ROOT)

    @property
    def hard_frame_limit(self) -> int:
        """Frames past max_frame_bytes still get a polite error; past this, reading them at all is the
        attack, and websockets closes the socket with 1009."""
        return max(4 * self.max_frame_bytes, 1 << 16)
