"""How both APIs (`/ws` `resume` frames, session.py; OpenAI streams, openai/routes.py) take a request
back: check it is the caller's, check the position the client holds, and stop the grace-period cancel
here and on every other gateway. The caller then watches the request from its next seq."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from clients.errors import ProtocolError
from clients.numbers import is_int
from workers.gateway.hub import Hub
from workers.gateway.tenants import may_access
from workers.gateway.watch import FINAL_TYPES


@dataclass(frozen=True)
class ResumePoint:
    rid: str
    last_seq: int  # the request's last event written so far; -1 when none is
    finished: bool  # that event ends the request

    def check_position(self, after: int) -> None:
        """`invalid_request` for a position past the last event: nobody can have received a seq that
        is not written yet, so the client's state is not this request's (a wrong id, events that
        expired), and waiting for that seq could take forever."""
        if after > self.last_seq:
            raise ProtocolError("invalid_request", f"position {after} is beyond request {self.rid!r}'s last "
                                f"event (seq {self.last_seq}); resume after an event you received", self.rid)


async def check_known(hub: Hub, caller: str, rid: str) -> None:
    """`unknown_request` for an id with no job, and for another tenant's request: to a stranger it
    does not exist."""
    if not await hub.known(rid) or not may_access(caller, await hub.owner(rid)):
        raise ProtocolError("unknown_request", f"no request {rid!r} (never submitted, or expired)", rid)


async def begin_resume(hub: Hub, keep: Callable[[str], None], caller: str, rid: str) -> ResumePoint:
    """Take `rid` (namespaced) back for `caller`; where it stands. Raises ProtocolError
    `unknown_request`."""
    await check_known(hub, caller, rid)
    # Before reading anything: a grace-period cancel firing meanwhile would end the request under us.
    keep(rid)
    await hub.announce_resume(rid)
    last = await hub.last_event(rid)
    last_seq = last.get("seq") if last is not None else None
    last_seq = last_seq if is_int(last_seq) else -1
    return ResumePoint(rid, last_seq, last is not None and last.get("type") in FINAL_TYPES)
