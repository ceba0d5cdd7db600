"""One job on the Redis worker: checks, admission into the engine, and engine outputs relayed as events.

Each job runs in its own task (started by intake.py) that owns its engine stream; the task is
cancelled, not answered, when this worker loses the job (shutdown, taken over), so another worker
resumes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import anyio

from clients.errors import ProtocolError
from clients.events import done_event, token_event
from clients.loras import lookup
from clients.protocol import Job
from streamer import RequestOutput, SamplingParams
from streamer.errors import EngineDeadError, GrammarError, QueueFullError
from streamer.lora import LoRARequest
from workers.worker import job_trace
from workers.worker.accounting import Accounting
from workers.worker.answers import Answers
from workers.worker.attempts import Attempts
from workers.worker.config import WorkerConfig
from workers.worker.engine import Engine
from workers.worker.metrics import WorkerMetrics
from workers.worker.state import Delivery, RunningJob, WorkerState
from workers.worker.tasks import answer_embed, answer_task
from workers.worker.tool_calls import ToolCalls, family, sampling_params

log = logging.getLogger("streamer.worker")
OutputStream = AsyncGenerator[RequestOutput, None]


class JobRunner:
    """The task of one job, from its checks to its last event (answered through `Answers`)."""

    def __init__(self, engine: Engine, config: WorkerConfig, state: WorkerState, answers: Answers,
                 attempts: Attempts, metrics: WorkerMetrics, accounting: Accounting) -> None:
        self.engine, self.cfg, self.state, self.answers, self.attempts = engine, config, state, answers, attempts
        self.metrics, self.accounting = metrics, accounting
        self._family: str | None = None  # the checkpoint's tool-call format (tool_calls.py), once known
        self._family_known = False

    async def run(self, d: Delivery) -> None:
        """The task of one delivery (intake started it after `WorkerState.job_read`)."""
        try:
            if d.error is not None:
                await self.answers.reject(d, d.error)
            else:
                run = await self._serve(d)
                if run is not None:
                    self.accounting.finished(run.job, run.tokens, d.charged_to, d.charged, run.answer)
        except anyio.get_cancelled_exc_class():
            raise  # shutdown or lost ownership: no answer, another worker resumes it
        except EngineDeadError as e:  # not the job's fault: leave it unacked for a healthy worker
            log.error("request %s: engine is dead (%s); stopping this worker", d.request_id, e)
            self.state.engine_error = e
            self.state.request_stop()
        except Exception as e:
            log.exception("request %s (entry %s) failed", d.request_id, d.entry_id)
            try:
                await self.answers.finish_with_error(d, "internal", f"worker error: {e}")
                if d.job is not None and d.ours:  # answered: its tenant's slot is free
                    self.accounting.finished(d.job, 0, d.charged_to, d.charged, None)
            except Exception:  # never let one job's failure take the others down
                log.exception("request %s (entry %s): could not report the failure", d.request_id,
                              d.entry_id)
        finally:
            if not d.admitted:
                self.state.admitted()
            d.trace.end()
            self.state.job_ended(d.entry_id, d.request_id)

    async def _serve(self, d: Delivery) -> RunningJob | None:
        """Answer a decoded job; returns it when this delivery answered it (None: a duplicate, or
        answered before)."""
        job, entry_id, state = d.job, d.entry_id, d.state
        assert job is not None
        if not d.ours:
            await self.answers.dead_letter(entry_id, d.fields, ProtocolError(
                "duplicate_id", f"id {job.id!r} is already used by another request", job.id))
            await self.answers.ack(d.stream, entry_id)
            return None
        if state.finished:  # answered before, only the ack was lost
            await self.answers.ack(d.stream, entry_id)
            return None
        d.trace = job_trace.start(job, _pushed_as(d), d.deliveries, self.cfg.consumer, state.next_seq)
        run = RunningJob(job, entry_id, state.next_seq, d.fields, stream=d.stream, epoch=d.epoch, trace=d.trace)
        deliveries = d.deliveries
        if deliveries > self.cfg.max_deliveries:
            await self.answers.fail(run, "too_many_deliveries",
                             f"job was delivered {deliveries} times without finishing")
            return run
        if d.suspect and d.previous.alone:
            await self.answers.fail(run, "crashed_worker", "the job was running alone in the engine when its "
                                    "worker died, before any output: it is not handed to another worker")
            return run
        if d.suspect:
            log.warning("request %s: its worker died while it entered the engine; running it alone", job.id)
        if job.task == "embed":
            await self._embed(run, d)
            return run
        if job.task != "generate":
            await answer_task(self.engine, self.answers, run)
            return run
        try:
            # The checkpoint's defaults under what the job sets, with what its tool_choice constrains.
            params = SamplingParams.from_dict({**self.engine.sampling_defaults(), **sampling_params(job)})
        except (TypeError, ValueError) as e:
            await self.answers.fail(run, "invalid_params", str(e))
            return run
        resume = state.resume_token_ids(params.n)
        if job.deadline is not None and resume is None and time.time() * 1000 > job.deadline:
            self.answers.emit(run, [], error=ProtocolError("expired", "the deadline passed before the job started"))
            return run
        if d.cancelled or self.state.take_cancel(job.id):
            self.answers.emit(run, [done_event(job.id, run.next_seq, ["abort"] * params.n, _usage(0, 0, 0))])
            self.metrics.finished(["abort"] * params.n)
            return run
        self.state.running[job.id] = run
        with run.scope:
            await self._generate(run, params, d, resume)
        return run

    async def _generate(self, run: RunningJob, params: SamplingParams, d: Delivery,
                        resume: list[list[int]] | None) -> None:
        prompt = await self._prompt(run)
        if prompt is None:
            return
        tools = await self._tool_calls(run.job, prompt, params, resume)
        await self.state.enter_engine(d.suspect)
        try:
            await self.attempts.record_start(run.job.id, run.epoch, run.next_seq, alone=d.suspect)
            run.trace.prefill()
            started = await self._admit(run, prompt, params, resume)
        finally:
            d.admitted = True
            self.state.admitted()
            self.state.proven(d.suspect)
        if started is not None:
            self.accounting.started(run.job)
            run.trace.decoding()
            stream, first = started
            try:
                await self._relay(run, params, d, stream, first, tools)
            finally:
                await stream.aclose()  # aborts the request in the engine unless it finished

    async def _embed(self, run: RunningJob, d: Delivery) -> None:
        """An embed job enters the engine as generation does (its turn, its attempt recorded, cancellable
        while it runs) and is answered by tasks.py."""
        if d.cancelled or self.state.take_cancel(run.job.id):
            self.answers.emit(run, [done_event(run.job.id, run.next_seq, ["abort"], _usage(0, 0, 0))])
            return
        self.state.running[run.job.id] = run
        with run.scope:
            await self.state.enter_engine(d.suspect)
            try:
                await self.attempts.record_start(run.job.id, run.epoch, run.next_seq, alone=d.suspect)
                run.trace.prefill()
                await answer_embed(self.engine, self.answers, run)
            finally:
                d.admitted = True
                self.state.admitted()
                self.state.proven(d.suspect)

    async def _prompt(self, run: RunningJob) -> Any:
        """The job's prompt as the engine takes it; None when the job was answered with an error."""
        job = run.job
        if job.prompt_token_ids is not None:
            return {"prompt_token_ids": job.prompt_token_ids}
        if job.messages is None:
            return job.prompt
        try:
            return await self.engine.render_chat(job.messages, job.tools)
        except ValueError as e:  # e.g. the checkpoint has no chat template
            await self.answers.fail(run, "invalid_request", str(e))
            return None

    async def _tool_calls(self, job: Job, prompt: Any, params: SamplingParams,
                          resume: list[list[int]] | None) -> ToolCalls | None:
        """The parsers of a job whose output is read as tool calls; a resumed job's are brought to where
        the text it already sent left them, so its stream goes on as it would have."""
        if job.tools is None:
            return None
        if not self._family_known:
            self._family, self._family_known = family(self.cfg.tool_call_parser, self.engine.chat_template()), True
        tools = ToolCalls.for_job(job, self._family)
        for sample, token_ids in enumerate(resume or []):
            if tools is not None and token_ids:
                tools.replay(sample, await self.engine.output_text(prompt.token_ids, token_ids, params))
        return tools

    async def _admit(self, run: RunningJob, prompt: Any, params: SamplingParams,
                     resume: list[list[int]] | None) -> tuple[OutputStream, RequestOutput] | None:
        """Hand the job to the engine: (output stream, first output), or None when it was answered
        instead (rejected by the engine, or its deadline passed before it started)."""
        job = run.job
        deadline = job.deadline if resume is None else None  # a resumed job has started already
        lora = None
        if job.lora:
            # Read from the registry for every job: an adapter added or removed takes effect at once.
            entry = await lookup(self.answers.redis, self.cfg.names, job.lora)
            if entry is None:
                await self.answers.fail(run, "invalid_request", f"unknown LoRA adapter {job.lora!r}: register it "
                                        "with `streamer lora add NAME PATH` (see `streamer lora list`)")
                return None
            lora = LoRARequest(entry.name, entry.path)
        backoff_s = 0.05
        while True:
            stream = self.engine.generate(prompt, params, job.id, priority=job.priority,
                                          resume_token_ids=resume, session=job.session or None, lora_request=lora)
            try:
                first = await self._first_output(stream, deadline)
            except QueueFullError:  # admission raced with other load: the job waits, still ours
                await anyio.sleep(backoff_s)
                backoff_s = min(1.0, backoff_s * 2)
                continue
            except GrammarError as e:  # its structured_outputs spec does not compile
                await self.answers.fail(run, "invalid_params", str(e))
                return None
            except ValueError as e:  # prompt too long for the model and the like
                await self.answers.fail(run, "invalid_request", str(e))
                return None
            except BaseException:
                # Interrupted while the engine was taking it: make sure it does not run unwatched.
                self.engine.abort(job.id)
                raise
            if first is None:
                self.engine.abort(job.id)
                self.answers.emit(run, [], error=ProtocolError("expired", "the deadline passed before the job started"))
                return None
            return stream, first

    async def _first_output(self, stream: OutputStream, deadline_ms: int | None) -> RequestOutput | None:
        """The stream's first output; None when `deadline_ms` passes first."""
        if deadline_ms is None:
            return await anext(stream)
        with anyio.move_on_after(max(0.0, deadline_ms / 1000 - time.time())):
            return await anext(stream)
        return None

    async def _relay(self, run: RunningJob, params: SamplingParams, d: Delivery, stream: OutputStream,
                     out: RequestOutput, tools: ToolCalls | None) -> None:
        """Engine outputs -> events, one event per sample per step, until the request finishes."""
        job, state = run.job, d.state
        emitted = {k: len(v) for k, v in state.token_ids.items()}  # counts include a resumed run's
        answer_text = ""  # the first sample's text generated here
        reasons: dict[int, str] = {}
        observed = self.metrics.request(_pushed_as(d), fresh=state.next_seq == 0)
        while True:
            if out.error is not None:  # the engine ran everyone else's step without this request
                self.metrics.finished(["error"] * params.n)
                if out.error_code is not None:  # its own fault (a grammar over its budget): said as it is
                    await self.answers.fail(run, out.error_code, out.error)
                else:
                    await self.answers.fail(run, "internal", f"the engine could not run this request: {out.error}")
                return
            events, new_tokens, text = self._token_events(run, out, tools, emitted, reasons)
            answer_text += text
            observed.output(out, new_tokens)
            if out.finished:
                usage = _usage(len(out.prompt_token_ids), sum(emitted.values()), out.num_cached_tokens)
                # Samples are n, or beam_width beams (which arrive whole, in the last output).
                count = max(params.n, 1 + max([*reasons, *emitted], default=0))
                finish_reasons = [reasons.get(k, "abort") for k in range(count)]
                events.append(done_event(job.id, run.next_seq + len(events), finish_reasons, usage))
                run.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
                # A resumed run's answer began elsewhere: its text here is only a part of it.
                run.answer = None if state.token_ids else answer_text
                run.trace.finished(usage, finish_reasons)
                self.answers.emit(run, events)
                observed.finished(out, finish_reasons, params, emitted)
                return
            if events:
                self.answers.emit(run, events, final=False)
            out = await anext(stream, None)
            if out is None:
                raise RuntimeError("engine stream ended without a finished output")

    def _token_events(self, run: RunningJob, out: RequestOutput, tools: ToolCalls | None, emitted: dict[int, int],
                      reasons: dict[int, str]) -> tuple[list[dict[str, Any]], int, str]:
        """One output's token events (one per sample with something new), how many tokens they hold, and
        the first sample's new text as the model wrote it (tool calls included: what its next turn holds)."""
        events, new_tokens, text0 = [], 0, ""
        for c in out.outputs:
            finished = c.finish_reason is not None
            # With tools, the text of calls goes out as tool-call deltas, and a parser may hold text back.
            text, calls = (c.text, None) if tools is None else tools.feed(c.index, c.text, finished)
            if c.token_ids or calls or (tools is not None and text):
                texts = None if c.logprobs is None else [self.engine.token_texts(list(step)) for step in c.logprobs]
                events.append(token_event(run.job.id, run.next_seq + len(events), c.index, list(c.token_ids), text,
                                          c.logprobs, texts, calls))
                emitted[c.index] = emitted.get(c.index, 0) + len(c.token_ids)
                text0 += c.text if c.index == 0 else ""
                new_tokens += len(c.token_ids)
            if finished:
                reasons[c.index] = c.finish_reason if tools is None else tools.finish_reason(c.index, c.finish_reason)
        return events, new_tokens, text0


def _pushed_as(d: Delivery) -> str:
    """The entry its submitter added: the one it was read from, or the one it was first pushed as when
    a worker moved it (into a priority lane, lanes.py; to its session's worker, affinity.py). Its
    time in the queue, and so its queue time, TTFT and e2e latency and its trace's queue.wait, start
    there: the wait before the move is the client's too."""
    return d.origin or d.entry_id


def _usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}
