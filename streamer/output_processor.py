"""The engine's output side: text, stop strings and the deltas handed to callers.

The scheduler's update step reports each sampled token and whether a token rule finished its
sequence; this turns those into `RequestOutput`s, with the text decoded incrementally. A stop
string is found here, so the sequences it ends are handed back to the engine, which finishes
them in the scheduler before the next step (as an abort would be).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamer.detokenizer import IncrementalDetokenizer
from streamer.outputs import CompletionOutput, RequestOutput
from streamer.request import Request, Sequence
from streamer.scheduler_output import BeamResult, SeqUpdate, StepUpdates


@dataclass
class SeqText:
    """The output state of one sample: its text so far and, once it ended, why."""

    detokenizer: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestState:
    request: Request
    samples: dict[int, SeqText]  # by sample index; empty for beam search (its text comes at the end)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # a transformers tokenizer
        self._states: dict[str, RequestState] = {}
        self._aborted: list[RequestOutput] = []

    def add_request(self, request: Request, resumed: list[list[int]]) -> None:
        """Start the text of each sample; `resumed[i]`: tokens sample i already streamed in an
        earlier run, replayed into the text state only."""
        samples: dict[int, SeqText] = {}
        if not request.params.use_beam_search and request.sequences[0].pooling is None:  # an embedding has no text
            for seq in request.sequences:
                detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, request.prompt_token_ids,
                                               request.params)
                for t in resumed[seq.index] if seq.index < len(resumed) else []:
                    detok.append(t, check_stop=False)
                detok.emitted = len(detok.text)
                samples[seq.index] = SeqText(detok)
        self._states[request.request_id] = RequestState(request, samples)

    def abort(self, request: Request, error: str | None = None, error_code: str | None = None) -> None:
        """The final output of an aborted request (failed, with `error`), handed out by the next
        `process`."""
        state = self._states.pop(request.request_id, None)
        if state is None:
            return
        completions = []
        for seq in request.sequences:
            sample = state.samples.get(seq.index)
            if sample is not None and sample.finish_reason is None:
                sample.finish_reason = "abort" if error is None else "error"
            completions.append(CompletionOutput(
                index=seq.index, text=sample.detokenizer.delta(finished=True) if sample else "", token_ids=[],
                finish_reason=sample.finish_reason if sample else "abort" if error is None else "error",
                stop_reason=sample.stop_reason if sample else None,
                logprobs=[] if request.params.logprobs is not None else None))
        output = self._request_output(state, completions, finished=True)
        output.error, output.error_code = error, error_code
        self._aborted.append(output)

    def has_pending(self) -> bool:
        return bool(self._aborted)

    def process(self, core: StepUpdates) -> tuple[list[RequestOutput], list[Sequence]]:
        """Outputs of one step, and the sequences a stop string ended (still to be finished)."""
        outputs, self._aborted = self._aborted, []
        outputs += [self._beam_output(result) for result in core.beam_results]
        for pooled in core.pooled:
            state = self._states.pop(pooled.seq.request_id, None)
            if state is None:  # aborted in the meantime: its final output is out already
                continue
            request = state.request
            outputs.append(RequestOutput(request.request_id, request.prompt_token_ids, [], finished=True,
                                         prompt=request.prompt, metrics=request.metrics,
                                         embedding=pooled.embedding))
        touched: dict[str, list[CompletionOutput]] = {}
        stopped: list[Sequence] = []
        for update in core.updates:
            state = self._states[update.seq.request_id]
            sample = state.samples[update.seq.index]
            if sample.finish_reason is not None:
                continue  # a stop string ended it at an earlier token of this step (kept drafts)
            completion, stop = self._completion(sample, update)
            completions = touched.setdefault(update.seq.request_id, [])
            if completions and completions[-1].index == completion.index:
                _extend(completions[-1], completion)  # several tokens of one sample: one delta
            else:
                completions.append(completion)
            if stop:
                stopped.append(update.seq)
        for request_id, completions in touched.items():
            state = self._states[request_id]
            if state.finished:
                del self._states[request_id]
            outputs.append(self._request_output(state, completions, state.finished))
        return outputs, stopped

    def _completion(self, sample: SeqText, update: SeqUpdate) -> tuple[CompletionOutput, bool]:
        """The delta of one sampled token; True when a stop string ends the sequence here."""
        seq, p = update.seq, update.seq.params
        check_stop = seq.num_output_tokens >= p.min_tokens
        stop_str = sample.detokenizer.append(update.token_id, check_stop)
        reason = (update.finish_reason, update.stop_reason) if update.finish_reason else None
        if stop_str is not None and (reason is None or reason[0] == "length"):
            reason = ("stop", stop_str)  # stop strings outrank only the length limits
        elif reason is not None and stop_str is None:
            # Ending for another reason: text still held back as incomplete UTF-8 may hold a stop string.
            late_stop = sample.detokenizer.flush(check_stop)
            if late_stop is not None:
                reason = ("stop", late_stop)
        if reason is not None:
            sample.finish_reason, sample.stop_reason = reason
        logprobs = None if p.logprobs is None else [update.logprobs] if update.logprobs is not None else []
        completion = CompletionOutput(index=seq.index, text=sample.detokenizer.delta(finished=reason is not None),
                                      token_ids=[update.token_id], finish_reason=sample.finish_reason,
                                      stop_reason=sample.stop_reason, logprobs=logprobs)
        return completion, reason is not None and update.finish_reason is None

    @staticmethod
    def _request_output(state: RequestState, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        request = state.request
        return RequestOutput(request.request_id, request.prompt_token_ids, completions, finished=finished,
                             num_cached_tokens=min(s.num_cached_tokens for s in request.sequences),
                             prompt=request.prompt, metrics=request.metrics)

    def _beam_output(self, result: BeamResult) -> RequestOutput:
        """The k best finished beams, best first."""
        request = result.request
        self._states.pop(request.request_id, None)
        skip = request.params.skip_special_tokens
        outputs = [CompletionOutput(index=i, token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=skip),
                                    finish_reason="stop" if by_eos else "length")
                   for i, (ids, by_eos) in enumerate(zip(result.token_ids, result.finished_by_eos))]
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished=True,
                             prompt=request.prompt, metrics=request.metrics)


def _extend(delta: CompletionOutput, later: CompletionOutput) -> None:
    """Fold the delta of a sample's later token, from the same step, into its earlier one."""
    delta.text += later.text
    delta.token_ids = delta.token_ids + later.token_ids
    delta.finish_reason, delta.stop_reason = later.finish_reason, later.stop_reason
    if delta.logprobs is not None and later.logprobs is not None:
        delta.logprobs = delta.logprobs + later.logprobs
