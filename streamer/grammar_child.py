"""The compile process of streamer/grammar_compile.py, run as a script (`python grammar_child.py`):
it imports xgrammar and nothing of streamer, so it starts in the time xgrammar takes to import.

Lines of JSON on stdin and stdout. The first line in is the serialized xgrammar TokenizerInfo; the
child answers {"ready": true}. Then each line in is {"method": ..., "source": ...} and each line out
is {"ok": <the compiled grammar, serialized>} or {"error": <why it does not compile>}.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

NICE = 10  # a long compile takes the CPU the engine's steps leave, not theirs


def main() -> None:
    with contextlib.suppress(OSError):  # not allowed here: compile at the normal priority
        os.nice(NICE)
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
    # One thread: the parent bounds how many compiles run at once by how many children it starts.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        method, source = request["method"], request["source"]
        try:
            if method == "json_schema":
                compiled = compiler.compile_json_schema(source, any_whitespace=False)
            elif method == "regex":
                compiled = compiler.compile_regex(source)
            else:
                compiled = compiler.compile_grammar(source)
        except Exception as e:  # xgrammar reports a bad schema or grammar as RuntimeError/ValueError
            text = str(e).strip()
            reply({"error": text.splitlines()[0] if text else type(e).__name__})
            continue
        reply({"ok": compiled.serialize_json()})


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
