"""docs/openai.md's examples run as a user runs them: the first Python block under a section's heading,
as a separate `python -c` process against a real gateway and worker, with only the gateway's address
changed. The tests that call it check what the example printed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from redis_worker_helpers import running_worker
from test_gateway import config

from workers.gateway.server import running_gateway

OPENAI_DOCS = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
DOCS_BASE_URL = "http://127.0.0.1:8000/v1"  # the address the docs' examples are written against


def example_code(heading: str) -> str:
    """The first ```python block after `heading` in docs/openai.md."""
    docs = OPENAI_DOCS.read_text()
    start = docs.index("```python\n", docs.index(heading)) + len("```python\n")
    return docs[start:docs.index("```\n", start)]


async def run_docs_example(heading: str, ckpt: Path, redis_url: str, timeout: float = 120) -> str:
    """Run the example under `heading` against a worker on `ckpt` and a gateway, both on `redis_url`;
    fails the test unless it exits 0; returns what it printed."""
    async with running_worker(ckpt, redis_url), running_gateway(config(redis_url)) as gw:
        code = example_code(heading).replace(DOCS_BASE_URL, gw.url + "v1")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, err.decode()
    return out.decode()
