"""Jobs that ask for something other than generated text: a prompt's tokens counted (`tokenize`) or
token ids turned back into text (`detokenize`), with vLLM's /tokenize and /detokenize answers. They
never enter the engine's batch: the tokenizer answers them, off the event loop."""

from __future__ import annotations

from typing import Any

from clients.events import result_event
from workers.worker.answers import Answers
from workers.worker.engine import Engine
from workers.worker.state import RunningJob


async def answer_task(engine: Engine, answers: Answers, run: RunningJob) -> None:
    """Answer a tokenize or detokenize job with one `done` event holding its `result`."""
    job = run.job
    try:
        result = await (_tokenize(engine, run) if job.task == "tokenize" else _detokenize(engine, run))
    except ValueError as e:  # messages without a chat template, ids outside the vocabulary
        await answers.fail(run, "invalid_request", str(e))
        return
    answers.emit(run, [result_event(job.id, run.next_seq, result)])


async def _tokenize(engine: Engine, run: RunningJob) -> dict[str, Any]:
    job, options = run.job, run.job.options
    chat = job.messages is not None
    ids = await engine.tokenize(job.prompt, job.messages, job.tools,
                                # vLLM's defaults: special tokens for a text; a chat template adds its own
                                add_special_tokens=options.get("add_special_tokens", not chat),
                                add_generation_prompt=options.get("add_generation_prompt", True),
                                continue_final_message=options.get("continue_final_message", False))
    result: dict[str, Any] = {"count": len(ids), "max_model_len": int(engine.stats().get("max_model_len", 0)),
                              "tokens": ids}
    if options.get("return_token_strs"):
        result["token_strs"] = engine.token_texts(ids)
    return result


async def _detokenize(engine: Engine, run: RunningJob) -> dict[str, Any]:
    return {"prompt": await engine.detokenize(run.job.prompt_token_ids or [])}
