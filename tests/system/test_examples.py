"""Every example of the README and docs/protocol.md runs as written, against a live stack (redis-server
and a real worker on the tiny Llama), with `R` set to the Redis URL as the README says: redis-cli,
the Python client, plain redis-py, Node.js (node-redis from npm, installed by .ci/install) and Ruby
(Debian's ruby-redis). Each must end by itself and print the answer's text."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest
from redis_worker_helpers import ROOT, running_worker

README = (ROOT / "README.md").read_text()
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
NODE_MODULES = ROOT / ".ci" / "npm" / "node_modules"


def block_after(text: str, heading: str, lang: str) -> str:
    """The first ```lang code block after `heading`."""
    at = text.index(heading)
    match = re.compile(rf"^```{lang}\n(.*?)^```$", re.S | re.M).search(text, at)
    assert match, f"no {lang} block after {heading!r}"
    return match.group(1)


EXAMPLES = {
    "README redis-cli": ("sh", block_after(README, "**redis-cli**", "sh")),
    "README Python client": ("python", block_after(README, "**Python** (the client", "python")),
    "README Node.js": ("node", block_after(README, "**Node.js**", "js")),
    "README Ruby": ("ruby", block_after(README, "**Ruby**", "ruby")),
    "protocol.md redis-py": ("python", block_after(PROTOCOL, "### Python (redis-py", "python")),
    "protocol.md Node.js": ("node", block_after(PROTOCOL, "### Node.js (node-redis 4)", "js")),
}


def command(kind: str, code: str, tmp_path: Path) -> list[str]:
    if kind == "sh":
        return ["bash", "-euo", "pipefail", "-c", code]
    if kind == "python":
        return [sys.executable, "-c", code]
    if kind == "ruby":
        return ["ruby", "-e", code]
    assert (NODE_MODULES / "redis").is_dir(), "node-redis is missing: run .ci/install (npm install redis@4)"
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)  # the script's folder resolves `import "redis"`
    script = tmp_path / "example.mjs"
    script.write_text(code)
    return ["node", str(script)]


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(EXAMPLES))
async def test_example_runs_as_written(name: str, llama_ckpt: Path, redis_url: str, tmp_path: Path) -> None:
    kind, code = EXAMPLES[name]
    assert "What is the capital of France?" in code and "messages" in code  # a chat, not a raw prompt
    env = {**os.environ, "R": redis_url, "PYTHONPATH": str(ROOT)}
    async with running_worker(llama_ckpt, redis_url):
        proc = await asyncio.create_subprocess_exec(*command(kind, code, tmp_path), cwd=tmp_path, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, (out.decode(), err.decode())
    assert out.strip(), err.decode()
    if kind == "sh":  # redis-cli prints the entries it read: the answer's events
        assert b'"type":"token"' in out, out.decode()


@pytest.mark.anyio
async def test_the_redis_cli_example_can_run_twice(llama_ckpt: Path, redis_url: str, tmp_path: Path) -> None:
    """A fixed id would be refused the second time (duplicate_id, dead-lettered) and XREAD would replay
    the first answer: the example makes a fresh id each run."""
    _, code = EXAMPLES["README redis-cli"]
    env = {**os.environ, "R": redis_url}
    outputs = []
    async with running_worker(llama_ckpt, redis_url):
        for _ in range(2):
            proc = await asyncio.create_subprocess_exec("bash", "-euo", "pipefail", "-c", code, cwd=tmp_path, env=env,
                                                        stdout=asyncio.subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 90)
            assert proc.returncode == 0
            outputs.append(re.findall(rb'"id":"([0-9a-f]{32})"', out))
    assert outputs[0] and outputs[1] and set(outputs[0]).isdisjoint(outputs[1])
