"""`params.structured_outputs`: what a request's output must match (vLLM's name and shape).

Exactly one of
  json         a JSON Schema (an object, or its JSON text)
  json_object  true: any JSON object
  regex        a regular expression the whole output matches
  choice       a list of strings: the output is one of them
  grammar      an EBNF (GBNF) grammar whose `root` rule the output matches
Only the shape is checked here (no grammar engine is imported to build SamplingParams); compiling
happens when the engine takes the request (streamer/grammar.py), and a spec that does not compile
is refused then, naming what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# In a JSON Schema: keywords whose value maps names to subschemas (the names are not keywords), and
# keywords whose value is data, not a schema (nothing in it is a keyword or a `$ref`).
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
MAX_SPEC_BYTES = 64 * 1024  # a schema is limited by size (and compile time), not by nesting depth
MAX_CHOICES = 1024


def check_spec(spec: Any) -> dict[str, Any]:
    """The spec, normalised (a JSON-text schema parsed); ValueError saying what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError("structured_outputs must be an object with one of: " + ", ".join(KINDS))
    given = [k for k in KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown structured_outputs field(s): {', '.join(map(str, unknown))}; "
                         f"expected one of {', '.join(KINDS)}")
    if len(given) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                         f"{', '.join(given) or 'none'}")
    kind = given[0]
    value = spec[kind]
    if len(json.dumps(value)) > MAX_SPEC_BYTES:
        raise ValueError(f"structured_outputs.{kind} is over {MAX_SPEC_BYTES} bytes")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON Schema (an object)")
    elif kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be true")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    elif kind == "choice":
        _check_choice(value)
    return {kind: value}


def _check_choice(value: Any) -> None:
    ok = isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
    if not ok or not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"structured_outputs.choice must be a list of 1-{MAX_CHOICES} non-empty strings")


def spec_key(spec: dict[str, Any]) -> str:
    """One canonical text per spec: the compile cache's key."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))
