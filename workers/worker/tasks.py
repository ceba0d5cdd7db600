"""Jobs that ask for something other than generated text: a prompt's tokens counted (`tokenize`) or
token ids turned back into text (`detokenize`), with vLLM's /tokenize and /detokenize answers, which
never enter the engine's batch (the tokenizer answers them, off the event loop); and a prompt's
embedding (`embed`), computed in the engine's batch beside generation (streamer/pooling.py). Each is
answered with one `done` event holding its `result`."""

from __future__ import annotations

from typing import Any

import anyio

from clients.events import done_event, result_event
from streamer.errors import QueueFullError
from streamer.pooling import PoolingParams
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


async def answer_embed(engine: Engine, answers: Answers, run: RunningJob) -> None:
    """Answer an embed job: its vector and prompt tokens, an error the request caused (too long, a
    `dimensions` the model cannot give), or `abort` when cancelled while in the engine."""
    job, options = run.job, run.job.options
    prompt = {"prompt_token_ids": job.prompt_token_ids} if job.prompt_token_ids is not None else job.prompt
    params = PoolingParams(options.get("pooling"), options.get("normalize", True), options.get("dimensions"))
    backoff_s = 0.05
    while True:
        try:
            out = await engine.embed(prompt, params, job.id, job.priority, job.session or None)
            break
        except QueueFullError:  # admission raced with other load: the job waits, still ours
            await anyio.sleep(backoff_s)
            backoff_s = min(1.0, backoff_s * 2)
        except ValueError as e:  # empty, too long for the model, ids outside the vocabulary, dimensions
            await answers.fail(run, "invalid_request", str(e))
            return
    if out.error is not None:
        await answers.fail(run, out.error_code or "internal", f"the engine could not run this request: {out.error}")
    elif out.embedding is None:  # aborted (cancelled)
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        answers.emit(run, [done_event(job.id, run.next_seq, ["abort"], usage)])
    else:
        run.tokens = len(out.prompt_token_ids)
        result = {"embedding": out.embedding, "prompt_tokens": run.tokens}
        answers.emit(run, [result_event(job.id, run.next_seq, result, run.tokens)])


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
