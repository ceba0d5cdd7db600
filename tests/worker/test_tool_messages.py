"""Chat messages in the shapes tool use needs (text parts, an assistant's tool calls, tool results) and
function definitions (`tools`), rendered by the checkpoint's chat template exactly as transformers'
apply_chat_template(tools=...) renders them, through Redis and a worker too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from redis_worker_helpers import running_worker
from transformers import AutoTokenizer

from clients.protocol import decode_job, encode_job
from clients.redis_client import AsyncClient
from streamer import EngineConfig, LLMEngine

# A Hermes/Qwen-style template: tools in the system turn, calls in <tool_call>, results as tool turns.
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]},
        "when": {"type": "object", "properties": {"day": {"type": "object", "properties": {
            "offset": {"type": "integer"}}}}}}}}}]
# As an OpenAI client sends them: text parts, arguments as JSON text, content null on a call.
MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]


@pytest.fixture(scope="module")
def tool_ckpt(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "ckpt"
    shutil.copytree(llama_ckpt, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def expected_ids(ckpt: Path) -> list[int]:
    """transformers' own rendering of the normalised messages (what the protocol hands the template)."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    messages = decode_job(encode_job({"id": "x", "messages": MESSAGES, "tools": TOOLS})).messages
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and '"arguments": {"city": "Oslo"}' in text and "Weather in Oslo?" in text
    return tok(text, add_special_tokens=False).input_ids


def test_the_engine_renders_tools_and_tool_turns_as_transformers_does(tool_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tool_ckpt), dtype="float32", num_kv_blocks=64))
    messages = decode_job(encode_job({"id": "x", "messages": MESSAGES, "tools": TOOLS})).messages
    assert engine.render_chat(messages, TOOLS) == expected_ids(tool_ckpt)
    # Without tools the template leaves the system turn out.
    assert len(engine.render_chat(messages)) < len(expected_ids(tool_ckpt))


@pytest.mark.anyio
async def test_a_job_with_tools_and_tool_turns_is_answered_from_that_prompt(tool_ckpt: Path,
                                                                           redis_url: str) -> None:
    async with running_worker(tool_ckpt, redis_url), AsyncClient(redis_url) as client:
        params = {"max_tokens": 3, "ignore_eos": True}
        rid = await client.submit(messages=MESSAGES, params=params)
        tools_rid = await client.submit(messages=MESSAGES, tools=TOOLS, params=params)
        plain = [e async for e in client.stream(rid)]
        with_tools = [e async for e in client.stream(tools_rid)]
    assert with_tools[-1]["type"] == "done" and with_tools[-1]["usage"]["prompt_tokens"] == len(expected_ids(tool_ckpt))
    assert plain[-1]["usage"]["prompt_tokens"] < with_tools[-1]["usage"]["prompt_tokens"]
