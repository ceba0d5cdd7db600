"""The chat page in a real headless Chromium (Debian's `chromium`, driven by Playwright; no browser
download), against the gateway, the real worker and Redis."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Page, async_playwright
from redis_worker_helpers import long_context_checkpoint, read_events, running_worker, tokens_of, wait_for
from test_gateway import config

from workers.gateway.server import running_gateway

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Records the answer's text length and state at every animation frame where either changed: what
# the user saw, paint by paint.
PAINT_PROBE = """
window.__paints = [];
(function tick() {
  const all = document.querySelectorAll('.msg.assistant');
  const el = all[all.length - 1];
  if (el) {
    const sample = { len: el.querySelector('.text').textContent.length, state: el.dataset.state || '' };
    const last = window.__paints[window.__paints.length - 1];
    if (!last || last.len !== sample.len || last.state !== sample.state) window.__paints.push(sample);
  }
  requestAnimationFrame(tick);
})();
"""



@asynccontextmanager
async def chromium_page(tmp_path: Path, **options: Any) -> AsyncIterator[tuple[Browser, Page]]:
    """A headless Chromium and a page in it, closed after the block; when the block fails, a
    screenshot of the page is left in `tmp_path` (failure.png)."""
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        page = await browser.new_page(**options)
        try:
            yield browser, page
        except BaseException:
            await page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            raise
        finally:
            await browser.close()


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "the browser test needs Chromium: apt-get install chromium (see .ci/install)"
    return path


async def settings(page: Page, **values: str) -> None:
    for name, value in values.items():
        await page.fill(f"#{name}", value)


async def ask(page: Page, prompt: str) -> None:
    await page.fill("#prompt", prompt)
    await page.press("#prompt", "Enter")


async def last_answer(page: Page) -> tuple[str, str, str]:
    """(request id, state, text) of the newest assistant message: the text as the model wrote it (the
    page shows it rendered as Markdown)."""
    return await page.evaluate("""() => {
        const all = document.querySelectorAll('.msg.assistant');
        const el = all[all.length - 1];
        return [el.dataset.id, el.dataset.state, el.dataset.answer];
    }""")


@pytest.mark.anyio
async def test_page_streams_stops_and_resumes_after_reload(llama_ckpt: Path, redis_url: str,
                                                           tmp_path: Path) -> None:
    async with running_worker(llama_ckpt, redis_url) as worker, running_gateway(config(redis_url)) as gw, \
            chromium_page(tmp_path, viewport={"width": 1100, "height": 720}) as (browser, page):
        page_errors: list[str] = []
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        await page.add_init_script(PAINT_PROBE)
        await page.goto(gw.url)
        await page.wait_for_selector("#status[data-status]")
        # Long enough (greedy, EOS ignored) that stop lands mid-answer.
        await settings(page, max_tokens="900", temperature="0", extra='{"ignore_eos": true}')
        aborted_before = worker.engine.stats()["num_requests_aborted"]
        await ask(page, "Tell me about paged attention")
        # Several different paints while the answer is still streaming, then stop.
        await page.wait_for_function(
            "() => window.__paints.filter(p => p.state === 'streaming' && p.len > 0).length >= 3", timeout=30000)
        await page.click("#stop")
        await page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=15000)
        paints = await page.evaluate("window.__paints")
        streaming = [p["len"] for p in paints if p["state"] == "streaming" and p["len"] > 0]
        assert len(set(streaming)) >= 2, paints
        rid, _, text = await last_answer(page)
        events = read_events(redis_url, rid)
        assert events[-1]["finish_reason"] == "abort" and len(tokens_of(events)) < 900
        assert text == "".join(e["text"] for e in events)
        assert "stopped" in await page.inner_text(".msg.assistant .meta")
        assert (await page.inner_text("#ttft")) != "–" and (await page.inner_text("#tps")) != "–"
        # The worker's own stats: the request was aborted and its KV blocks are free again.
        await wait_for(lambda: worker.engine.stats()["num_requests_aborted"] == aborted_before + 1,
                       timeout=10)
        await wait_for(lambda: worker.engine.stats()["kv_blocks_used"] == 0, timeout=10)

        # A reload mid-answer: the page resumes the same request and ends with all of it.
        await settings(page, max_tokens="400")
        await ask(page, "And again, please")
        # The second answer's own text, not a paint left over from the first answer.
        await page.wait_for_function("""() => {
            const all = document.querySelectorAll('.msg.assistant');
            const el = all[all.length - 1];
            return all.length === 2 && el.dataset.state === 'streaming'
                && el.querySelector('.text').textContent.length > 0;
        }""", timeout=30000)
        rid2, _, _ = await last_answer(page)
        await page.reload()
        await page.wait_for_selector(f".msg.assistant[data-id='{rid2}'][data-state=done]", timeout=30000)
        _, _, text2 = await last_answer(page)
        events2 = read_events(redis_url, rid2)
        # What was written before the reload came back as a replay: not in tokens/s, no TTFT.
        replayed = int(await page.get_attribute(f".msg.assistant[data-id='{rid2}']", "data-replayed"))
        assert 0 < replayed <= len(tokens_of(events2))
        assert await page.inner_text("#ttft") == "–"
        # "length": 400 tokens, or fewer when the history (the first answer is in the chat
        # template) leaves less room in the tiny model's 1024 positions.
        assert events2[-1]["finish_reason"] == "length"
        assert 0 < len(tokens_of(events2)) == events2[-1]["usage"]["completion_tokens"] <= 400
        assert text2 == "".join(e["text"] for e in events2)
        assert await page.locator(".msg.user").count() == 2  # the conversation survived the reload

        # A gateway that needs an API key: the page's key setting opens the socket.
        async with running_gateway(config(redis_url, api_keys=("page-key",))) as locked:
            page = await browser.new_page()
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            await page.goto(locked.url)
            await settings(page, token="page-key", max_tokens="5")
            await ask(page, "Hi")
            await page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30000)
            assert await page.get_attribute("#status", "data-status") == "open"
        assert page_errors == []


@pytest.mark.anyio
async def test_page_says_online_on_load_and_when_no_worker_serves(llama_ckpt: Path, redis_url: str,
                                                                   tmp_path: Path) -> None:
    """The badge is the truth from the first second: "online" with a worker, "no worker" without one,
    and a message sent meanwhile says it waits in the queue (then is answered once a worker starts)."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    await r.delete("llm:heartbeats")
    await r.aclose()
    async with running_gateway(config(redis_url)) as gw, chromium_page(tmp_path) as (browser, page):
        await page.goto(gw.url)
        await page.wait_for_selector("#status[data-status=no-worker]", timeout=10000)
        assert await page.inner_text("#status") == "no worker"
        assert "streamer worker" in await page.get_attribute("#status", "title")
        await settings(page, max_tokens="4", temperature="0", extra='{"ignore_eos": true}')
        await ask(page, "Anyone there?")
        await page.wait_for_function(
            "() => (document.querySelector('.msg.assistant .meta')?.textContent || '').includes('no worker')",
            timeout=10000)
        assert "waits in the queue" in await page.inner_text(".msg.assistant .meta")
        async with running_worker(llama_ckpt, redis_url):
            await page.wait_for_selector(".msg.assistant[data-state=done]", timeout=30000)
            await page.wait_for_selector("#status[data-status=open]", timeout=10000)
            assert await page.inner_text("#status") == "online"
            fresh = await browser.new_page()
            await fresh.goto(gw.url)  # a page loaded while a worker serves says so before any message
            await fresh.wait_for_selector("#status[data-status=open]", timeout=10000)
            assert await fresh.inner_text("#status") == "online"


@pytest.mark.anyio
async def test_a_message_too_long_for_the_context_does_not_break_the_chat(llama_ckpt: Path, redis_url: str,
                                                                          tmp_path: Path) -> None:
    """A message the worker refuses as too long is shown as refused and never sent again: the next
    message is answered (before, every follow-up failed the same way until "New chat"). Long history
    is trimmed from the oldest turn to fit the model's 1024 positions."""
    async with running_worker(llama_ckpt, redis_url), running_gateway(config(redis_url)) as gw, \
            chromium_page(tmp_path) as (browser, page):
        await page.goto(gw.url)
        await page.wait_for_selector("#status[data-status=open]", timeout=15000)
        await settings(page, max_tokens="8", temperature="0", extra='{"ignore_eos": true}')
        await ask(page, "paged attention " * 900)  # thousands of tokens: over the context
        await page.wait_for_selector(".msg.assistant[data-state=error]", timeout=30000)
        meta = await page.inner_text(".msg.assistant[data-state=error] .meta")
        assert "invalid_request" in meta and "left out of the conversation" in meta
        for n in range(3):  # each answered: the refused message is not in their context
            await ask(page, f"Short question number {n}?")
            await page.wait_for_selector(f".msg.assistant[data-state=done] >> nth={n}", timeout=30000)
        # A long but acceptable history: older turns are left out instead of the prompt overflowing.
        for n in range(4):
            await ask(page, f"Another fairly long message {n}: " + "tokens and blocks " * 60)
            await page.wait_for_selector(f".msg.assistant[data-state=done] >> nth={3 + n}", timeout=30000)
        metas = await page.locator(".msg.assistant .meta").all_inner_texts()
        assert any("left out to fit the model's context" in m for m in metas), metas
        assert await page.locator(".msg.assistant[data-state=error]").count() == 1


async def wait_for_meta(page: Page, pattern: str, timeout_ms: int) -> None:
    """Until the newest message's meta line matches the (JavaScript) regular expression."""
    await page.wait_for_function(
        "(p) => new RegExp(p).test(document.querySelector('.msg.assistant:last-child .meta')?.textContent || '')",
        arg=pattern, timeout=timeout_ms)


@pytest.mark.anyio
async def test_page_shows_the_queue_place_and_the_prompt_progress(redis_url: str, tmp_path: Path) -> None:
    """Before its first token a message says where it is: behind another job in the queue, then its
    long prompt's progress (before: "waiting for a worker…" for the whole prefill)."""
    import redis.asyncio as aioredis

    from clients.protocol import encode_job

    ckpt = long_context_checkpoint(tmp_path / "long")
    r = aioredis.Redis.from_url(redis_url)
    # One sequence at a time and 16-token chunks: an 8000-token prompt keeps the worker busy for seconds.
    engine = {"max_num_seqs": 1, "max_num_batched_tokens": 16, "num_kv_blocks": 1100}
    async with running_worker(ckpt, redis_url, engine=engine, progress_every_s=0.05), \
            running_gateway(config(redis_url, status_every_s=0.1)) as gw, chromium_page(tmp_path) as (browser, page):
        await page.goto(gw.url)
        await page.wait_for_selector("#status[data-status=open]", timeout=15000)
        await settings(page, max_tokens="4", temperature="0", extra='{"ignore_eos": true}')
        busy = {"id": "busy", "prompt_token_ids": [3 + i % 400 for i in range(8000)], "params": {"max_tokens": 1}}
        await r.xadd("llm:requests", encode_job(busy))
        await ask(page, "Am I next?")
        await wait_for_meta(page, "queued: next in line", 15000)
        await page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60000)
        await ask(page, "paged attention " * 1000)
        await wait_for_meta(page, r"processing the prompt: \d+% \([\d,]+ / [\d,]+ tokens\)", 30000)
        await page.wait_for_selector(".msg.assistant[data-state=done] >> nth=1", timeout=90000)
        assert "processing" not in await page.inner_text(".msg.assistant:last-child .meta")
    await r.aclose()
