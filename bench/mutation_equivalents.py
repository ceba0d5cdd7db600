"""Surviving mutants judged equivalent: the module behaves the same, or differs only where nothing can
observe it. `python -m bench.mutation MODULE --survivors` marks each with its reason, so that a rerun
shows at a glance which survivors are new. docs/testing.md tells the longer story per module.

An entry names the function (a method by its own name) and the changed line as the mutant has it
(stripped); a surviving mutant is listed when its diff adds exactly that line in that function."""

from __future__ import annotations

from typing import NamedTuple


class Equivalent(NamedTuple):
    function: str
    line: str
    why: str


_FRAME_ID = "_handle answers with the frame's own id when the error names none: the same id"
_SAME_ID = "the refused request's id and the frame's are the same id, or both absent"
_JSON = "the tenant-renamed event is the same JSON to any reader"
_DUMPS = 'text = json.dumps({**event, "id": shown}, '
# Keyed by the module's name in bench/mutation.py's TARGETS.
EQUIVALENT: dict[str, tuple[Equivalent, ...]] = {
    "session": (
        Equivalent("_check_room", "None)", _FRAME_ID),
        Equivalent("_check_room", ")", _FRAME_ID),
        Equivalent("_check_room", '"per connection: wait for one to finish or cancel one", None)', _FRAME_ID),
        Equivalent("_check_room", '"per connection: wait for one to finish or cancel one", )', _FRAME_ID),
        Equivalent("_resume", '"received; -1 replays from the start)", None)', _FRAME_ID),
        Equivalent("_resume", '"received; -1 replays from the start)", )', _FRAME_ID),
        Equivalent("_resume", 'raise ProtocolError("already_finished", f"request {rid!r} finished at seq {last_seq}", '
                   'None)', _FRAME_ID),
        Equivalent("_resume", 'raise ProtocolError("already_finished", f"request {rid!r} finished at seq {last_seq}", '
                   ')', _FRAME_ID),
        Equivalent("_handle", 'return self.error(readable_id(frame), "bad_json", f"frame is not JSON: {e}"[:201])',
                   "the JSON decoder's messages are far shorter than 200 characters"),
        Equivalent("_handle", "self.error(self._client_id(e.request_id) and rid, e.code, e.message, extra)", _SAME_ID),
        Equivalent("_handle", "self.error(self._client_id(e.request_id) and rid, e.code, e.message)", _SAME_ID),
        Equivalent("_handle", "self.error(self._client_id(None) or rid, e.code, e.message)", _SAME_ID),
        Equivalent("_generate", 'e.request_id = ""', "_handle then falls back to the frame's id, None as well"),
        Equivalent("_generate", "await self._watch(rid, 0, catch_up=None)  # before the job exists: no token is missed",
                   "None is falsy, as False"),
        Equivalent("__init__", "self.closing = None", "None is falsy, as False"),
        Equivalent("__init__", 'tenant: str = "XXXX") -> None:', "the server always passes the tenant"),
        Equivalent("run", "await asyncio.gather(return_exceptions=True)", "the tasks are cancelled either way"),
        Equivalent("_watch", _DUMPS + 'ensure_ascii=None, separators=(",", ":"))', _JSON),
        Equivalent("_watch", _DUMPS + 'ensure_ascii=False, separators=None)', _JSON),
        Equivalent("_watch", _DUMPS + 'separators=(",", ":"))', _JSON),
        Equivalent("_watch", _DUMPS + 'ensure_ascii=False, )', _JSON),
        Equivalent("_watch", _DUMPS + 'ensure_ascii=True, separators=(",", ":"))', _JSON),
    ),
}


def function_of(mutant: str) -> str:
    """`workers.worker.intake.xǁIntakeǁ_read_loop__mutmut_37` -> `_read_loop`;
    `clients.resume.x_resume_state__mutmut_2` -> `resume_state`."""
    name = mutant.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    return name.rsplit("ǁ", 1)[-1] if "ǁ" in name else name.removeprefix("x_")


def equivalent(module: str, mutant: str, diff: str) -> str | None:
    """Why this surviving mutant (its `mutmut show` diff) is equivalent, or None if it is not listed."""
    function = function_of(mutant)
    added = {line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")}
    return next((e.why for e in EQUIVALENT.get(module, ()) if e.function == function and e.line in added), None)
