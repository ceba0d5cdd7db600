"""Keeping one request's failure inside the model step out of everyone else's.

A step that raises is run again in halves (split by request, never inside one request, whose rows
sample together), down to single requests: the requests that still fail alone are the culprits,
everyone else keeps the step they were scheduled for. Running part of a step again is safe: the
forward pass only writes the KV slots of the tokens being computed, which no one has read yet, and a
copy-on-write copy only reads blocks nobody writes before the forward.

When every request fails on its own the fault is not any request's (a broken device, a bug in the
engine): the original error is raised and the engine stops, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from streamer.errors import EngineDeadError, TensorParallelError
from streamer.executor import Executor
from streamer.request import Sequence
from streamer.sampler import SamplerOutput
from streamer.scheduler_output import ScheduledSeq, SchedulerOutput

log = logging.getLogger("streamer.engine")

# Failures that belong to the whole engine: never blamed on a request.
_FATAL = (EngineDeadError, TensorParallelError)
ModelOutput = tuple[list[Sequence], SamplerOutput | None]


@dataclass
class IsolatedStep:
    """What survived a step: the rows that ran (a filtered `SchedulerOutput`), their model output,
    and the requests that failed, with the reason."""

    scheduled: SchedulerOutput
    model_output: ModelOutput
    failed: dict[str, str] = field(default_factory=dict)


def execute_isolated(executor: Executor, out: SchedulerOutput) -> IsolatedStep:
    """Run the step; when it fails, find the requests it fails for and run it without them."""
    if not out.scheduled:
        return IsolatedStep(out, ([], None))
    try:
        return IsolatedStep(out, executor.execute(out.scheduled, out.block_copies))
    except _FATAL:
        raise
    except Exception as error:
        groups = _by_request(out.scheduled)
        if len(groups) > 1:
            log.warning("engine step failed (%r); running its %d requests apart to find the cause",
                        error, len(groups))
        ran: list[tuple[list[ScheduledSeq], ModelOutput]] = []
        failed: dict[str, str] = {}
        _bisect(executor, groups, out.block_copies, ran, failed, error)
        if not ran and len(groups) > 1:
            raise  # every request fails on its own: not theirs
        kept = [item for rows, _ in ran for item in rows]
        scheduled = SchedulerOutput(kept, out.preempted, out.block_copies)
        return IsolatedStep(scheduled, _merge([output for _, output in ran]), failed)


def _by_request(rows: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
    groups: dict[str, list[ScheduledSeq]] = {}
    for row in rows:
        groups.setdefault(row.seq.request_id, []).append(row)
    return list(groups.values())


def _bisect(executor: Executor, groups: list[list[ScheduledSeq]], copies: list[tuple[int, int]],
            ran: list[tuple[list[ScheduledSeq], ModelOutput]], failed: dict[str, str],
            known: BaseException | None) -> None:
    """Run `groups` together (unless `known` already says they fail together), else in halves."""
    rows = [row for group in groups for row in group]
    if known is None:
        try:
            ran.append((rows, executor.execute(rows, copies)))
            return
        except _FATAL:
            raise
        except Exception as error:
            known = error
    if len(groups) == 1:
        request_id = rows[0].seq.request_id
        log.error("request %s fails the engine step: %r", request_id, known, exc_info=known)
        failed[request_id] = f"{type(known).__name__}: {known}"[:500]
        return
    mid = len(groups) // 2
    _bisect(executor, groups[:mid], copies, ran, failed, None)
    _bisect(executor, groups[mid:], copies, ran, failed, None)


def _merge(outputs: list[ModelOutput]) -> ModelOutput:
    """The model outputs of the parts that ran, as if they had run as one step."""
    sampled: list[Sequence] = []
    token_ids: list[int] = []
    logprobs: list[dict[int, float] | None] = []
    beam_logprobs: list = []
    accepted: list[list[int]] = []
    pooled: dict[int, Any] = {}
    for seqs, result in outputs:
        if result is None:
            continue
        sampled += seqs
        token_ids += result.token_ids
        logprobs += result.logprobs
        beam_logprobs += result.beam_logprobs
        accepted += result.accepted or [[] for _ in seqs]
        pooled.update(result.pooled)
    if not sampled and not pooled:
        return sampled, None
    return sampled, SamplerOutput(token_ids, logprobs, beam_logprobs, accepted if any(accepted) else None, pooled)
