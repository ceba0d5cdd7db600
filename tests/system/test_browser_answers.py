"""How the chat page shows an answer (issue 42), in a real headless Chromium against the gateway and
Redis. The worker is played by the test, as in test_gateway.py (a heartbeat, the jobs read from
`llm:requests`, events written as the wire contract says), so an answer can be exactly what each
case needs: hostile Markdown, nothing at all, a long prompt's progress, a usage count."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from playwright.async_api import Page
from test_browser import ask, chromium_page, settings, wait_for_meta
from test_gateway import NAMES, config, emit, wait_jobs
from test_gateway_limits import beat

from clients.events import done_event, token_event
from workers.gateway.server import running_gateway

# Everything a model could write to get markup or script into the page, with Markdown the page renders.
HOSTILE = ('Look: <img src=x onerror="window.__pwned = 1"> and <script>window.__pwned = 2</script>\n'
           "[click me](javascript:window.__pwned=3) or [docs](https://example.com/a?b=1&c=<2>) "
           "**bold** and `x<b>y</b>`\n"
           '```html\n<iframe src="javascript:window.__pwned=4"></iframe>\n```\n'
           "- one <svg onload=window.__pwned=5>\n- two")


class FakeWorker:
    """Answers the page's jobs by hand: `next_job()` is the newest job's id, `answer()` its events."""

    def __init__(self, r: aioredis.Redis) -> None:
        self.r, self.seen = r, 0

    async def next_job(self) -> str:
        await beat(self.r, "w1", max_model_len=1000)  # alive, with a 1000-token context
        self.seen += 1
        return (await wait_jobs(self.r, self.seen, timeout=10))[-1].id

    async def answer(self, rid: str, pieces: list[str], prompt_tokens: int = 1) -> None:
        events = [token_event(rid, seq, 0, [seq], text) for seq, text in enumerate(pieces)]
        events.append(done_event(rid, len(pieces), ["stop"], {"prompt_tokens": prompt_tokens,
                                                             "completion_tokens": len(pieces), "cached_tokens": 0}))
        await emit(self.r, rid, events)


@asynccontextmanager
async def page_with_fake_worker(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[Page, FakeWorker]]:
    r = aioredis.Redis.from_url(redis_url)
    await r.delete(NAMES.requests)
    await beat(r, "w1", max_model_len=1000)
    try:
        async with running_gateway(config(redis_url, status_every_s=0.1)) as gw, \
                chromium_page(tmp_path) as (_, page):
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(gw.url)
            await page.wait_for_selector("#status[data-status=open]", timeout=15000)
            await settings(page, max_tokens="8")
            yield page, FakeWorker(r)
            assert errors == []
    finally:
        await r.aclose()


async def newest(page: Page, script: str) -> Any:
    """`script` evaluated with `el`, the newest assistant message."""
    return await page.evaluate(f"() => {{ const all = document.querySelectorAll('.msg.assistant'); "
                               f"const el = all[all.length - 1]; return {script}; }}")


@pytest.mark.anyio
async def test_markdown_is_rendered_and_no_html_from_the_model_gets_in(redis_url: str, tmp_path: Path) -> None:
    async with page_with_fake_worker(redis_url, tmp_path) as (page, worker):
        await ask(page, "Say something nasty")
        rid = await worker.next_job()
        # In pieces, so the page renders half-written markup (an open fence) on the way.
        await worker.answer(rid, [HOSTILE[i:i + 7] for i in range(0, len(HOSTILE), 7)])
        await page.wait_for_selector(".msg.assistant[data-state=done]", timeout=10000)
        await page.wait_for_timeout(300)  # an onerror or onload would have run by now
        assert await page.evaluate("window.__pwned") is None
        assert await page.locator(".msg img, .msg script, .msg iframe, .msg svg").count() == 0
        hrefs = await page.eval_on_selector_all(".msg.assistant a", "links => links.map(a => a.href)")
        assert hrefs == ["https://example.com/a?b=1&c=%3C2%3E"]  # the javascript: link stays text
        text = await newest(page, "el.querySelector('.text').textContent")
        assert '<img src=x onerror="window.__pwned = 1">' in text and "[click me](javascript:" in text
        assert await newest(page, "el.querySelector('strong').textContent") == "bold"
        assert await newest(page, "[...el.querySelectorAll('code')].map(c => c.textContent)") == [
            "x<b>y</b>", '<iframe src="javascript:window.__pwned=4"></iframe>']
        assert await newest(page, "el.querySelectorAll('li').length") == 2
        assert await newest(page, "el.dataset.answer") == HOSTILE
        await page.reload()  # the answer kept in the page's storage renders the same way, as safely
        await page.wait_for_selector(".msg.assistant strong", timeout=10000)
        assert await page.locator(".msg img, .msg script, .msg iframe, .msg svg").count() == 0
        assert await page.evaluate("window.__pwned") is None


@pytest.mark.anyio
async def test_an_empty_answer_says_so_and_a_long_prompt_shows_its_progress(redis_url: str,
                                                                             tmp_path: Path) -> None:
    """Before: an empty bubble with only its metadata; and "preparing the prompt…" with no sign of
    time passing for the minute a long prompt takes on a CPU."""
    async with page_with_fake_worker(redis_url, tmp_path) as (page, worker):
        await ask(page, "a long question " * 100)
        rid = await worker.next_job()
        progress = {"state": "prefill", "computed": 2000, "total": 5000, "worker": "w1"}
        await worker.r.set(NAMES.progress(rid), json.dumps(progress), px=60_000)
        await wait_for_meta(page, r"^processing the prompt: 40% \(2,000 / 5,000 tokens\) · \d+ s$", 10000)
        await wait_for_meta(page, r"· [2-9] s$", 10000)  # the time waited goes on
        await worker.answer(rid, [])
        await page.wait_for_selector(".msg.assistant[data-state=done]", timeout=10000)
        assert await newest(page, "el.querySelector('.text').textContent") == \
            "(empty answer: the model ended it before writing any text)"
        assert "processing" not in await newest(page, "el.querySelector('.meta').textContent")
        await page.reload()
        await page.wait_for_selector(".msg.assistant.empty-answer", timeout=10000)


@pytest.mark.anyio
async def test_earlier_messages_are_left_out_only_when_they_do_not_fit(redis_url: str, tmp_path: Path) -> None:
    """The page estimates a conversation's tokens from its characters at the ratio the worker counted
    for the last prompt: a long message that fits no longer makes every later one leave out the
    messages before it (before: a fixed guess of 0.5 token per character, twice this tokenizer's)."""
    async with page_with_fake_worker(redis_url, tmp_path) as (page, worker):
        long = "word " * 240  # 1,200 characters: 300 tokens here, 604 at the old guess
        await ask(page, long)
        await worker.answer(await worker.next_job(), ["ok"], prompt_tokens=300)
        await page.wait_for_selector(".msg.assistant[data-state=done]", timeout=10000)
        await ask(page, long)  # 300 + 300 tokens and the answer between: fits 1000 - 8
        await worker.answer(await worker.next_job(), ["ok"], prompt_tokens=606)
        await page.wait_for_selector(".msg.assistant[data-state=done] >> nth=1", timeout=10000)
        assert "left out" not in await newest(page, "el.querySelector('.meta').textContent")
        await ask(page, "word " * 800)  # 1,000 tokens alone: everything before it is left out
        await worker.answer(await worker.next_job(), ["ok"], prompt_tokens=1000)
        await page.wait_for_selector(".msg.assistant[data-state=done] >> nth=2", timeout=10000)
        metas = await page.locator(".msg.assistant .meta").all_inner_texts()
        assert ["left out" in m for m in metas] == [False, False, True], metas
        assert metas[2].startswith("4 earlier messages left out to fit the model's context")
