"""Settings of one gateway process (`streamer gateway` flags map onto these)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from workers.gateway.keys_file import TenantLimits
from workers.redis_options import DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_TIMEOUT_S

# The chat page ships in the client package: clients/web/.
WEB_ROOT = Path(__file__).resolve().parents[2] / "clients" / "web"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_max_connections: int = DEFAULT_MAX_CONNECTIONS  # bound of the pool; more commands wait
    redis_pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S  # longest wait for a free connection
    prefix: str = "llm"
    cluster: bool = False  # Redis is a cluster (`streamer gateway` finds out at start)
    request_shards: int = 1  # request streams jobs are spread over (as the workers')
    priority_lanes: tuple[int, ...] = ()  # cutoffs of the urgent lanes (docs/scheduling.md)
    routing: str = "cache_load"  # clients/routing.py POLICIES; "shared": never route to one worker
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    # Tenants of the keys file (tenants.py): name -> limits, and key -> tenant name. A key that is not
    # in `key_tenants` has no tenant: its jobs are untagged and unlimited.
    tenants: dict[str, TenantLimits] = field(default_factory=dict)
    key_tenants: dict[str, str] = field(default_factory=dict)
    # Without keys the gateway only listens on a loopback address, unless this says it may serve anyone.
    insecure_no_auth: bool = False
    allowed_origins: tuple[str, ...] = ()  # empty: same origin only; "*": any
    max_frame_bytes: int = 1 << 20  # larger frames get an `error` frame
    max_inflight: int = 16  # requests streaming at once per connection
    # Longest `prompt_token_ids` pushed; 0: the longest context a live worker announces (`max_model_len`
    # in its heartbeat), no check while none does.
    max_prompt_tokens: int = 0
    max_connections: int = 10000  # open WebSockets; more are refused with HTTP 503
    # OpenAI API requests are refused with 429 while the request streams hold this many entries (0: no bound).
    max_queued_jobs: int = 10000
    max_file_bytes: int = 64 << 20  # largest file uploaded to /v1/files (413 past it): files live in Redis
    # The share of the live workers' seats the Batch API's lines may keep busy (batch_runner.py): the
    # rest stay free for interactive jobs.
    batch_seat_share: float = 0.5
    send_queue_bytes: int = 4 << 20  # per connection, beyond what the socket buffers hold
    cancel_grace_s: float = 10.0  # a closed socket's requests are cancelled after this, unless resumed
    request_ttl_s: float = 3600.0  # lifetime of the gateway's id claims and cancel markers
    idle_poll_s: float = 5.0  # a watched request silent this long has its stream re-read
    status_every_s: float = 1.0  # `status` frames (queue place, prompt progress) for requests asking
    close_timeout_s: float = 5.0
    # A request's headers must arrive within this of the connection opening (or the previous answer):
    # slow-loris clients are cut off (http_protocol.py).
    header_timeout_s: float = 10.0
    web_root: Path = field(default=WEB_ROOT)

    def __post_init__(self) -> None:
        if not 0 < self.batch_seat_share <= 1:
            raise ValueError(f"batch_seat_share must be above 0 and at most 1, not {self.batch_seat_share}")
        unknown = sorted(set(self.key_tenants.values()) - set(self.tenants))
        if unknown:
            raise ValueError(f"key_tenants names tenants that are not in tenants: {unknown}")
        # A key with a tenant is a key: accepted even when the caller listed it only there.
        missing = tuple(k for k in self.key_tenants if k not in self.api_keys)
        if missing:
            object.__setattr__(self, "api_keys", (*self.api_keys, *missing))

    def tenant_of(self, key: str | None) -> str:
        """The tenant of an API key that authenticated a request ("": none)."""
        return self.key_tenants.get(key or "", "")

    @property
    def hard_frame_limit(self) -> int:
        """Frames past max_frame_bytes still get a polite error; past this, reading them at all is the
        attack, and websockets closes the socket with 1009."""
        return max(4 * self.max_frame_bytes, 1 << 16)

    @property
    def open_to_all(self) -> bool:
        """Listening beyond this machine with no API key: anyone who reaches the port may use it."""
        return not self.api_keys and not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost). Any other name, and
    the wildcards ("", 0.0.0.0, ::), may be reachable from elsewhere."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
