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


# Keyed by the module's name in bench/mutation.py's TARGETS.
EQUIVALENT: dict[str, tuple[Equivalent, ...]] = {
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
